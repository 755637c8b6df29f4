"""The `controlplane` command line. Keep torch out of module scope: argument parsing must be instant."""

from __future__ import annotations

import argparse
import sys


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from controlplane.engine.demo_model import write_demo_model

    path = write_demo_model(args.dir, size=args.size)
    print(f"wrote {args.size} demo model to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="controlplane", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo-model", help="write a deterministic random-weight Llama checkpoint")
    demo.add_argument("dir", help="output directory (created if missing)")
    demo.add_argument("--size", choices=["tiny", "small"], default="small")
    demo.set_defaults(func=_cmd_demo_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
