"""`python -m hack.devcluster up|down|status|env|build` — the Makefile's cluster-up/cluster-down."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from hack.devcluster import build, imagesmode
from hack.devcluster.cluster import DevCluster
from hack.devcluster.errors import DevClusterError
from hack.devcluster.versions import COMPONENTS, bin_path_entries


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hack.devcluster")
    parser.add_argument("command", choices=["up", "down", "status", "env", "build"])
    parser.add_argument("--state-dir", type=Path, help="default: .devcluster in the repo root")
    parser.add_argument("--apiserver-port", type=int, help="default: a free port")
    parser.add_argument(
        "--images",
        action="store_true",
        help="up: the local pool runs pods of kvpilot's images from the images `make images`"
        " cached (their filesystems, users, entrypoints), not from the host's venv",
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    cluster = DevCluster(args.state_dir, args.apiserver_port, images=args.images)
    if args.command == "build":
        build.ensure_all(COMPONENTS)
    elif args.command == "up":
        cluster.up()
    elif args.command == "down":
        cluster.down()
        print("==> dev cluster down")
    elif args.command == "status":
        status = cluster.status()
        for name, running in status.items():
            print(f"{name:<24} {'running' if running else 'stopped'}")
        return 0 if all(status.values()) else 1
    else:
        path = ":".join(str(p) for p in bin_path_entries())
        print(f"export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}")
        print(f'export PATH={shlex.quote(path)}:"$PATH"')
        # images mode: KVPILOT_RUNTIME_IMAGE, for an operator run from this shell
        exported = {**cluster.client_env(), **imagesmode.operator_env(cluster.state_dir)}
        for key, value in exported.items():
            print(f"export {key}={shlex.quote(value)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except DevClusterError as err:
        print(f"devcluster: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
