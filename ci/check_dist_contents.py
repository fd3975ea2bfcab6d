"""What the wheel and the sdist must carry; run by ci/wheel-check.sh on freshly built ones.

    python ci/check_dist_contents.py dist/dsv4_attn-0.1.0-py3-none-any.whl dist/dsv4_attn-0.1.0.tar.gz

The wheel: the package with its parity matrix, the C replay's source (built at first use) and the
``py.typed`` marker, the Apache-2.0 license text and its SPDX expression in the metadata, and
nothing from tests/. The sdist: every file git
tracks under tests/, ci/, .ci/ and examples/ (conftest, recorded data, the CI matrix, the example
the README runs), so its tests run.
Exit status 1 with the list of what is missing.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL_FILES = ("dsv4_attn/__init__.py", "dsv4_attn/parity/__init__.py", "dsv4_attn/data/parity.yaml",
               "dsv4_attn/py.typed", "dsv4_attn/portable/kernels/native_replay.c")
SDIST_FILES = ("LICENSE", "README.md", "pyproject.toml", "examples/run_step.py", "tests/conftest.py",
               "tests/data/flashmla_golden_small.pt", "ci/parity.yaml", ".ci/run")
LICENSE_MARKS = ("Apache License", "Version 2.0, January 2004")


def wheel_problems(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as whl:
        names = set(whl.namelist())
        problems = [f"wheel lacks {f}" for f in WHEEL_FILES if f not in names]
        licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        if not licenses:
            problems.append("wheel lacks <dist-info>/licenses/LICENSE")
        elif not all(m in whl.read(licenses[0]).decode() for m in LICENSE_MARKS):
            problems.append("wheel's LICENSE is not the Apache-2.0 text")
        metadata = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    wanted = ("License-Expression: Apache-2.0", "License-File: LICENSE")
    problems += [f"wheel METADATA lacks {line!r}" for line in wanted if line not in metadata.splitlines()]
    problems += [f"wheel carries a test file: {n}" for n in sorted(names) if n.startswith("tests/")]
    return problems


def tracked_files() -> list[str]:
    """Files git tracks under tests/, ci/, .ci/ and examples/ ([] outside a git checkout, e.g. in an sdist)."""
    try:
        out = subprocess.run(["git", "ls-files", "tests", "ci", ".ci", "examples"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return out.split()


def sdist_problems(path: Path) -> list[str]:
    with tarfile.open(path) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    need = dict.fromkeys([*SDIST_FILES, *tracked_files()])
    return [f"sdist lacks {f}" for f in need if f not in names] + (
        [] if top.startswith("dsv4_attn-") else [f"sdist's top directory is {top!r}"])


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    wheel, sdist = map(Path, argv)
    problems = wheel_problems(wheel) + sdist_problems(sdist)
    for p in problems:
        print(f"check_dist_contents: {p}", file=sys.stderr)
    if not problems:
        print(f"contents ok: {wheel.name} (matrix, C replay source, py.typed, Apache-2.0 license), {sdist.name} "
              "(tests and their data)")
    return int(bool(problems))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
