"""`dsv4-attn probe | parity | bench` (also `python -m dsv4_attn`), and the argument checks the
subcommands share.

Every subcommand exits 0 on success, 1 when what it checked failed (a parity cell, a bench case)
and 2 for bad arguments or environment variables, reported before any long work starts.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch

# name -> (module whose main(argv) runs it, one line for `dsv4-attn --help`)
COMMANDS = {
    "probe": ("dsv4_attn.probe_cli", "what this machine offers: platform, libraries, vendor binaries, environment "
                                     "variables, and which backend runs each layer kind and why"),
    "parity": ("dsv4_attn.parity", "every backend against the float64 reference on named, seeded cases; --merge "
                                   "runs of several machines into one cross-vendor table"),
    "bench": ("dsv4_attn.bench", "decode / prefill timings (min, median, p90) beside the roofline floor and FlashMLA; "
                                 "GPU, or --device cpu to try the tool on the torch backend"),
}


def parse_device(text: str) -> torch.device:
    """``--device``'s value as a torch device this machine has (``common.checks.parse_device``:
    the rule ``SparseMLA(device=)`` follows; never a silent fallback to the CPU)."""
    from .common.checks import parse_device as parse

    return parse(text, "--device")


def check_environment() -> None:
    """ValueError listing every DSV4_ATTN_* variable set to a value it does not allow (a mistyped
    variable must not pass unnoticed: a command checks them before its work)."""
    from . import envs
    from .common import registry

    bad = [row["error"] for row in envs.table() if row["error"]]
    try:
        registry.env_backend()  # DSV4_ATTN_BACKEND against the registry (envs cannot import it)
    except ValueError as exc:
        bad.append(str(exc))
    if bad:
        raise ValueError("; ".join(bad))


def check_output(path: str | Path, name: str, directory: bool = False) -> Path:
    """``path`` (the value of option ``name``) can be written: a directory (``directory``; created
    here, as the run would) or a file whose directory exists. Checked before the work, so a typo
    costs no run."""
    path = Path(path)
    if directory:
        if path.exists() and not path.is_dir():
            raise ValueError(f"{name}: got {str(path)!r}, which is a file; allowed: a directory to write into")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"{name}: got {str(path)!r}, which cannot be created ({exc.strerror}); allowed: a "
                             "writable directory") from None
        where = path
    else:
        if path.is_dir():
            raise ValueError(f"{name}: got {str(path)!r}, which is a directory; allowed: a file path")
        where = path.parent if str(path.parent) else Path(".")
        if not where.is_dir():
            raise ValueError(f"{name}: got {str(path)!r}, but {str(where)!r} is not a directory; allowed: a file "
                             "in an existing directory")
    if not os.access(where, os.W_OK):
        raise ValueError(f"{name}: got {str(path)!r}, but {str(where)!r} is not writable; allowed: a writable place")
    return path


def check_count(value: int | None, name: str, lowest: int = 1) -> None:
    """An integer option (None: not given) is at least ``lowest``."""
    if value is not None and value < lowest:
        raise ValueError(f"{name}: got {value}; allowed: an int >= {lowest}")


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="dsv4-attn", description="DeepSeek-V4 sparse MLA attention on every vendor: check this machine, "
        "compare the backends with the float64 reference, time them.",
        epilog="`dsv4-attn COMMAND --help` gives a command's options. Exit status: 0 ok, 1 a check failed, "
               "2 bad arguments.")
    parser.add_argument("--version", action="version", version=f"dsv4-attn {__version__} (torch {torch.__version__}, "
                                                               f"python {sys.version.split()[0]})")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, (_, summary) in COMMANDS.items():
        commands.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
    parser = _parser()
    parser.parse_args(argv)  # --help, --version, or a usage error (exit 2) for anything else
    parser.error("a command is required")
    return 2


if __name__ == "__main__":
    sys.exit(main())
