"""The `kog` command line."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    from kog.info import backend_info, format_backend_info

    info = backend_info()
    print(json.dumps(info, indent=2) if args.json else format_backend_info(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kog", description="Kog: LLM inference for AI agents")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="show the native backend, devices and versions")
    p_info.add_argument("--json", action="store_true", help="print JSON instead of text")
    p_info.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
