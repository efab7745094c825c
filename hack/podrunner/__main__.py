"""`python -m hack.podrunner --kubeconfig PATH --log-dir DIR [--images]` — started by
hack/devcluster. With --images, containers of kvpilot's images run from the filesystems of the
OCI layouts `make images` cached (hack/podrunner/images.py), not from the host's venv."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

from kubernetes import config

from hack.images import checkout
from hack.images.spec import IMAGES
from hack.podrunner.images import ImageRef
from hack.podrunner.imagestore import ImageNotReadyError, ImageStore
from hack.podrunner.runner import PodRunner

UNPACK_DIR_ENV = "KVPILOT_IMAGES_UNPACK_DIR"


def default_unpack_dir() -> Path:
    """Where images are unpacked, once per manifest digest: beside the build cache's layouts."""
    return Path(os.environ.get(UNPACK_DIR_ENV) or checkout.cache_dir() / "images-unpacked")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hack.podrunner")
    parser.add_argument("--kubeconfig", required=True, type=Path)
    parser.add_argument("--log-dir", required=True, type=Path)
    parser.add_argument(
        "--images",
        action="store_true",
        help="run containers of kvpilot's images (ghcr.io/kvpilot/runtime, .../operator) from"
        " the images `make images` cached, not from the host's venv",
    )
    parser.add_argument("--images-dir", type=Path, default=checkout.cache_dir() / "images",
                        help="make images' layouts: <dir>/<version>/<image>")  # fmt: skip
    parser.add_argument("--unpack-dir", type=Path, default=None,
                        help=f"unpacked images (default: ${UNPACK_DIR_ENV}, else beside the"
                        " build cache's layouts)")  # fmt: skip
    parser.add_argument("--node-path", type=Path, action="append", default=[],
                        help="images mode: a host directory every container sees read-only at"
                        " the same path (repeatable)")  # fmt: skip
    parser.add_argument("--pre-pull", action="append", default=[], choices=sorted(IMAGES),
                        help="images mode: an image to unpack first, as a node pre-pulls what"
                        " it will run (repeatable; default: every cached image)")  # fmt: skip
    return parser.parse_args(argv)


def image_store(args: argparse.Namespace) -> ImageStore | None:
    """The store of images mode, already unpacking the cached images (as a node pre-pulls)."""
    if not args.images:
        return None
    store = ImageStore(args.images_dir, args.unpack_dir or default_unpack_dir())
    for name in args.pre_pull or IMAGES:  # one at a time: the first pods wait on the first
        # unpacking, or not cached: a pod that names it says so in its status
        with contextlib.suppress(ImageNotReadyError, ValueError):
            store.get(ImageRef(name, checkout.version(), None), name)
    return store


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    api = config.new_client_from_config(config_file=str(args.kubeconfig))
    store = image_store(args)
    # The runtime's console scripts live beside this interpreter (the project's venv).
    runner = PodRunner(
        api,
        args.log_dir,
        [Path(sys.executable).parent],
        image_store=store,
        node_paths=tuple(args.node_path),
    )
    mode = f", kvpilot's images from {args.images_dir}" if store else ""
    print(f"podrunner: running pods of nodes labelled kvpilot.dev/local-execution=true{mode}",
          flush=True)  # fmt: skip
    try:
        runner.run(stop)
    finally:
        if store is not None:
            store.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
