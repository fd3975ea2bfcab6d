"""`dsv4-attn probe | parity | bench` (also `python -m dsv4_attn`)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="dsv4-attn", description=__doc__)
    parser.add_argument("command", choices=["probe", "parity", "bench"])
    args, rest = parser.parse_known_args(argv[:1])
    if args.command == "bench":
        from . import bench

        return bench.main(argv[1:])
    if args.command == "parity":
        from . import parity

        return parity.main(argv[1:])
    from . import probe_cli

    return probe_cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
