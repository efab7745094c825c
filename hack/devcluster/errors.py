"""The one error the dev cluster raises: a single line saying what failed and where to look."""


class DevClusterError(RuntimeError):
    """Printed as one line by the CLI; carries the log path when there is one."""

    def __init__(self, what: str, log: object | None = None) -> None:
        self.what = what
        self.log = log
        super().__init__(f"{what} (log: {log})" if log else what)
