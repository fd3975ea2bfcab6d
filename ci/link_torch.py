"""Link this environment's torch, and every package it needs, into one directory.

    python ci/link_torch.py DIR

A new venv whose site-packages holds a .pth file naming DIR imports that torch and sees it as
installed, so pip installs everything else fresh but keeps the torch build the user chose (a
CUDA build with its libraries is GBs to fetch again, a CPU build comes from an index of its own).
ci/wheel-check.sh uses it for the venv the wheel goes into.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement


def requirement_closure(root: str) -> list[md.Distribution]:
    """``root`` and every installed distribution its requirements reach (extras and markers that
    do not apply here left out)."""
    seen: dict[str, md.Distribution] = {}
    todo = [root]
    while todo:
        dist = md.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def link(dists: list[md.Distribution], target: Path) -> int:
    """Symlink each distribution's top-level entries (packages, modules, .dist-info) into
    ``target``; scripts installed outside site-packages and bytecode caches are left out.
    Returns the count."""
    target.mkdir(parents=True, exist_ok=True)
    count = 0
    for dist in dists:
        if not dist.files:
            raise SystemExit(f"link_torch: {dist.metadata['Name']} lists no files (no RECORD); cannot link it")
        for top in sorted({f.parts[0] for f in dist.files} - {"..", "__pycache__"}):
            dest = target / top
            if not dest.exists():
                dest.symlink_to(Path(str(dist.locate_file(top))).resolve())
                count += 1
    return count


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    dists = requirement_closure("torch")
    count = link(dists, Path(argv[0]))
    print(f"linked torch {md.version('torch')} and {len(dists) - 1} packages it needs ({count} entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
