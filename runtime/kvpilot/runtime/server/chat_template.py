"""Render a model's chat template the way transformers' `apply_chat_template` does.

Chat templates ship with checkpoints, so they are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment` with the same options and helpers HF provides (`trim_blocks`,
`lstrip_blocks`, `raise_exception`, `strftime_now`, a non-escaping `tojson`, loop controls), so a
template renders here exactly as it does in transformers and in vLLM.

jinja2 is imported at the first chat request, not with the server: every replica's start waits for
its modules (30 ms of the imports on 2 cores under load), and no request needs them before Ready.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2


class ChatTemplateError(ValueError):
    """The template is missing, does not compile, or refused the conversation."""


def _raise_exception(message: str) -> None:
    import jinja2  # loaded: it runs inside a template

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes (<, >, &), which would change what the model sees
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    import jinja2.ext  # at the first chat request (the module's docstring)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """The prompt text for `messages`; ChatTemplateError when the template cannot produce one."""
    if not template:
        raise ChatTemplateError("this model has no chat template; use /v1/completions")
    # Keys set to None are dropped, as transformers does: templates test `is defined`, not None.
    clean = [{k: v for k, v in message.items() if v is not None} for message in messages]
    import jinja2  # at the first chat request (the module's docstring)

    try:
        return compile_template(template).render(
            messages=clean,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **extra,
        )
    except jinja2.TemplateError as exc:  # raise_exception, sandbox violations, undefined calls
        raise ChatTemplateError(f"chat template rejected the conversation: {exc}") from exc
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError) as exc:
        raise ChatTemplateError(f"chat template failed on the conversation: {exc}") from exc
