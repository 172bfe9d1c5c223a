"""The containers batchbench launches: remove leftovers, pull and list the pinned images.

``python -m batchbench.adapters.launch cleanup [--run-id ID]`` removes the
containers a killed run left behind (by their ``batchbench.run`` label);
``pull [ENGINE ...]`` pulls the pinned images the Docker host lacks;
``images`` lists them.
"""

from __future__ import annotations

import argparse
import logging
import sys

from batchbench.adapters.base import EngineError, EngineUnreachable
from batchbench.adapters.launch.docker import DockerLaunch, cleanup_leftovers, connect
from batchbench.adapters.launch.images import load_specs


def _cmd_cleanup(args: argparse.Namespace) -> int:
    try:
        client = connect("docker", args.docker_host, None, 60.0)
    except EngineUnreachable as exc:
        print(f"batchbench cleanup: {exc.detail}", file=sys.stderr)
        return 1
    try:
        removed = cleanup_leftovers(client, args.run_id)
    finally:
        client.close()
    scope = f"run {args.run_id}" if args.run_id else "all runs"
    print(f"removed {len(removed)} batchbench container(s) of {scope}" + (f": {', '.join(removed)}" if removed else ""))
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    specs = load_specs(args.images)
    engines = args.engines or sorted(specs)
    status = 0
    for engine in engines:
        if engine not in specs:
            print(f"unknown engine {engine!r} (known: {', '.join(sorted(specs))})", file=sys.stderr)
            status = 2
            continue
        launch = DockerLaunch(engine, specs[engine], base_url=args.docker_host)
        try:
            client = launch._ensure_client()
            launch._ensure_image(client)
        except EngineError as exc:
            print(f"{engine}: {exc.detail}", file=sys.stderr)
            status = 1
            continue
        finally:
            launch._close_client()
        how = f"pulled in {launch.pull_s:.0f}s" if launch.pulled else "already present"
        print(f"{engine}: {launch.spec.image} {how} ({', '.join(launch.image_digests) or launch.image_id})")
    return status


def _cmd_images(args: argparse.Namespace) -> int:
    for engine, spec in sorted(load_specs(args.images).items()):
        cpu = f"\tcpu image {spec.cpu_image}" if spec.cpu_image else ""
        print(f"{engine}\t{spec.image}\tport {spec.port}\t{' '.join(spec.program) or '(image entrypoint)'}{cpu}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchbench.adapters.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--docker-host", default=None, help="Docker Engine URL (default: DOCKER_HOST or the local socket)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("cleanup", help="remove leftover batchbench containers")
    p.add_argument("--run-id", default=None, help="only this run's containers (default: every batchbench container)")
    p.set_defaults(func=_cmd_cleanup)
    p = sub.add_parser("pull", help="pull the pinned images that the docker host lacks")
    p.add_argument("engines", nargs="*", help="engines to pull (default: all in images.toml)")
    p.add_argument("--images", default=None, help="images.toml to read")
    p.set_defaults(func=_cmd_pull)
    p = sub.add_parser("images", help="list the pinned images")
    p.add_argument("--images", default=None, help="images.toml to read")
    p.set_defaults(func=_cmd_images)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
