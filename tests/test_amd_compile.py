"""The portable Triton kernels compile for AMD (gfx942, gfx950) without VGPR spills or scratch,
in every tile the package picks there, checked offline with PyPI Triton's AMD backend (no GPU).

tests/gpu_scripts/triton_amd.py compiles them in a child process (this process runs Triton's
interpreter): per arch the split-merge kernel and, per picked tile, the attention kernel's
top-k walk with its LSE in the records with the most registers live (V4, bf16), in nvfp4_ds_mla's
two records, and its split epilogue. The full sweep (every record x layer kind x split)
is the table in docs/rocm.md. Triton's kernel cache makes reruns fast.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton.backends.amd") is None,
                                reason="this Triton has no AMD backend")

from dsv4_attn.common.spec import MAX_HEADS  # noqa: E402
from dsv4_attn.portable.kernels import ops  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "gpu_scripts", "triton_amd.py")
ARCHS = ("gfx942", "gfx950")
LDS_LIMIT = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}


def _compile(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, SCRIPT, "--json", "--jobs", "2", *args], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout)


def _tile(row: dict) -> ops.Tile:
    t = row["tile"]
    return ops.Tile(**{**t, "options": tuple(tuple(o) for o in t["options"])})


def _meets_bar(row: dict) -> bool:
    return row["lds"] <= LDS_LIMIT[row["arch"]] and row["vgpr_spills"] == 0 and row["scratch"] == 0


@pytest.fixture(scope="module")
def picked() -> list[dict]:
    return _compile("--quick")


def test_every_picked_amd_tile_compiles_without_spills(picked):
    for arch in ARCHS:
        rows = [r for r in picked if r["arch"] == arch]
        tiles = {ops.DEFAULT_CONFIG.tile(arch, h) for h in range(1, MAX_HEADS + 1)}
        assert {_tile(r) for r in rows if r["kernel"] == "attention"} == tiles
        assert any(r["kernel"] == "combine" for r in rows)
        for r in rows:
            assert r["vgprs"] > 0 and r["sgprs"] > 0, r  # read from the code object, not defaulted
            assert _meets_bar(r), f"{r['label']}: {r}"
            assert r["ok"] == _meets_bar(r)


def test_a_spilling_tile_is_never_picked_on_amd(picked):
    # the check has teeth: NVIDIA's tile for 64 heads (64 keys, 8 warps) spills on gfx942 ...
    nvidia = _compile("--quick", "--arch", "gfx942", "--tiles-of", "sm90", "--heads", "64")
    big = [r for r in nvidia if r["kernel"] == "attention"]
    assert big and all(not _meets_bar(r) and r["vgpr_spills"] > 0 for r in big), big
    # ... and no head count gets a tile on an AMD arch that failed there
    failing = {(r["arch"], _tile(r)) for r in nvidia + picked if r["kernel"] == "attention" and not _meets_bar(r)}
    for arch in ARCHS:
        for heads in range(1, MAX_HEADS + 1):
            assert (arch, ops.DEFAULT_CONFIG.tile(arch, heads)) not in failing
