#!/usr/bin/env bash
# The package as a user gets it: build the sdist and, from the unpacked sdist, the wheel
# (python -m build); check what each carries; install the wheel (not editable) with its test
# extra into a brand-new venv; run `dsv4-attn probe` and a short parity subset from it, outside
# this checkout; run the sdist's own tests that read its data files against the installed wheel.
#
# The new venv imports torch from the Python that runs this script (ci/link_torch.py links it
# and what it needs; the build is the user's choice): pip installs everything else the wheel
# declares fresh from the indexes.
#
#   bash ci/wheel-check.sh             # from the environment the README's install command made
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d "${TMPDIR:-/tmp}/dsv4-wheel-check.XXXXXX")
trap 'rm -rf "$work"' EXIT

python -m build --outdir "$work/dist" . > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/*.whl)
sdist=$(ls "$work"/dist/*.tar.gz)
echo "built $(basename "$sdist") $(basename "$wheel")"
python ci/check_dist_contents.py "$wheel" "$sdist"

python -m venv "$work/venv"
python ci/link_torch.py "$work/torch-link"
venv_site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$work/torch-link" > "$venv_site/torch-link.pth"
"$work/venv/bin/python" -m pip install -q "$wheel[test]"

cd "$work"  # away from the checkout: nothing below can import its sources
bin=$work/venv/bin
"$bin/python" - "$work/venv" <<'EOF'
import importlib.metadata as md
import importlib.resources
import sys
from pathlib import Path

import dsv4_attn
import torch

venv = Path(sys.argv[1]).resolve()
where = Path(dsv4_attn.__file__).resolve()
assert venv in where.parents and "site-packages" in where.parts, f"dsv4_attn imported from {where}, not the wheel"
assert Path(torch.__file__).parent.parent.name == "torch-link", torch.__file__
for dist in ("numpy", "pyyaml", "triton", "pytest"):  # what the wheel declares came fresh into the venv
    assert venv in Path(str(md.distribution(dist).locate_file(""))).resolve().parents, dist
pkg = importlib.resources.files("dsv4_attn")
assert (pkg / "data" / "parity.yaml").is_file() and (pkg / "py.typed").is_file()
assert md.metadata("dsv4-attn")["License-Expression"] == "Apache-2.0"
print(f"wheel installed: dsv4_attn {dsv4_attn.__version__} from {where.parent}")
EOF
"$bin/dsv4-attn" probe > probe.txt || { cat probe.txt; exit 1; }
echo "dsv4-attn probe: exit 0 ($(wc -l < probe.txt) lines)"
"$bin/dsv4-attn" parity --no-progress --device cpu --backends torch --out parity \
  --cases 'core.*.h16.*.mixed.short,core.c4a.h16.fp8_ds_mla.mixed.edge' > parity.md || { cat parity.md; exit 1; }
"$bin/python" -c "
import glob, json; (path,) = glob.glob('parity/*.json'); s = json.load(open(path))['summary']
assert s == {'torch': {'pass': 10, 'fail': 0, 'error': 0, 'skip': 0}}, s
print('dsv4-attn parity (10 cases):', s)"

mkdir sdist && tar -xzf "$sdist" -C sdist && cd sdist/*/
# the pytest script, not `python -m pytest`: the unpacked sources must not shadow the wheel
"$bin/pytest" -q -p no:cacheprovider tests/test_golden.py tests/test_parity.py tests/test_readme.py
