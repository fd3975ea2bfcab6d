"""Compile every variant of the portable Triton kernels the package launches on AMD (gfx942,
gfx950) offline with PyPI Triton's AMD backend and print, per variant, LDS bytes, VGPRs (arch +
AGPRs), SGPRs, VGPR / SGPR spills, scratch bytes per lane, ISA instructions per key of the
key-tile loop, and whether it meets the bar: compiled, LDS within the arch's limit, no VGPR spill,
no scratch (so no SGPR spilled to memory either).

    python tests/gpu_scripts/triton_amd.py                   # every variant, markdown table
    python tests/gpu_scripts/triton_amd.py --quick --json    # the CI subset (tests/test_amd_compile.py)

The variants are what ``ops.sparse_mla_fwd`` launches: the tile ``KernelConfig.tile(arch, heads)``
picks for any head count 1..MAX_HEADS, each KV format x layer kind (SWA, every-entry, top-k) it
serves (on gfx942 with OCP and FNUZ caches), one launch and split launches, and the split's
combine kernel. No GPU needed; run it without TRITON_INTERPRET. ``--quick`` keeps, per tile, the
top-k walk with its LSE in the records with the most registers live (V4, bf16; the worst in the
full run of the earlier 16-key tile), in mxfp8_ds_mla's and nvfp4_ds_mla's records, on gfx942
V4 and MXFP8 in FNUZ bytes too, and the split epilogue.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import portable_build as pb  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from dsv4_attn.common.layout import KVFormat  # noqa: E402
from dsv4_attn.common.spec import MAX_HEADS  # noqa: E402
from dsv4_attn.portable.kernels import attention as K  # noqa: E402
from dsv4_attn.portable.kernels import ops  # noqa: E402

ARCHS = ("gfx942", "gfx950")
KINDS = {"SWA": K.COMP_NONE, "all": K.COMP_GLOBAL, "top-k": K.COMP_C4A_LOCAL}


@dataclass(frozen=True)
class Variant:
    arch: str
    kernel: str  # "attention" | "combine"
    tile: ops.Tile | None = None
    fmt: KVFormat | None = None
    kind: str = ""
    split: int = 1
    fnuz: bool = False  # the SWA cache in FNUZ e4m3 bytes (gfx942's dialect)

    def label(self, kind: bool = True) -> str:
        """'arch tile format [kind [split]]' (``kind`` False: the row of ``--summary``)."""
        if self.kernel == "combine":
            return f"{self.arch} combine (split merge)"
        t = self.tile
        head = f"{self.arch} {t.block_h}h x {t.block_n}k {t.num_warps}w{' P scratch' if t.p_scratch else ''} "
        return (head + self.fmt.value + (" FNUZ" if self.fnuz else "")
                + (f" {self.kind}{' split' if self.split > 1 else ''}" if kind else ""))


def picked_tiles(arch: str, heads: range = range(1, MAX_HEADS + 1)) -> list[ops.Tile]:
    """Every tile the default config picks on ``arch`` for these head counts."""
    return sorted({ops.DEFAULT_CONFIG.tile(arch, h) for h in heads}, key=lambda t: (t.block_h, t.block_n))


def variants(arch: str, quick: bool, tiles_of: str | None = None,
             heads: range = range(1, MAX_HEADS + 1), like_vllm: bool = False) -> list[Variant]:
    """What runs on ``arch``: the combine kernel and the attention kernel in the tiles picked
    there for ``heads`` (or, ``tiles_of``, on another arch: to see them fail). ``like_vllm``: only
    the variants that read what vLLM's gfx950 sparse-MLA kernel reads (V4 records, one launch,
    on gfx942 an FNUZ SWA cache as vLLM's there; tests/gpu_scripts/vllm_amd_isa.py): global slots
    in both scopes (vLLM's kernel), and local top-k entries translated in the loop (which vLLM
    does in a kernel of its own)."""
    tiles = picked_tiles(tiles_of or arch, heads)
    if like_vllm:
        return [Variant(arch, "attention", t, KVFormat.MODEL1_FP8, kind, fnuz=arch == "gfx942")
                for kind in ("all", "top-k") for t in tiles]
    fnuz = arch == "gfx942"  # gfx942's caches hold FNUZ bytes: their fix-up compiled too
    if quick:
        cases = [(fmt, "top-k", split, f) for fmt, split, f in (
            (KVFormat.MODEL1_FP8, 1, False), (KVFormat.BF16, 1, False), (KVFormat.NVFP4, 1, False),
            (KVFormat.MODEL1_FP8, 2, False), (KVFormat.MODEL1_FP8, 1, fnuz), (KVFormat.MXFP8, 1, fnuz))]
    else:
        cases = [(fmt, kind, split, f) for fmt in KVFormat for kind in KINDS for split in (1, 2)
                 for f in {False, fnuz and fmt is not KVFormat.BF16}]
    out = [Variant(arch, "combine")]
    seen = set()
    for fmt, kind, split, f in cases:
        for tile in tiles:
            const = pb.variant(fmt, KINDS[kind], tile, split, fnuz=f)
            key = (tile, const["FMT_A"], const["FMT_B"], KINDS[kind], split, f)
            if key not in seen:  # an SWA layer of nvfp4_ds_mla is mxfp8_ds_mla's
                seen.add(key)
                out.append(Variant(arch, "attention", tile, fmt, kind, split, f))
    return out


def measure(v: Variant) -> dict:
    target = GPUTarget("hip", v.arch, 64)
    if v.kernel == "combine":
        kernel = pb.compile_combine(target)
    else:
        kernel = pb.compile_portable(target, pb.variant(v.fmt, KINDS[v.kind], v.tile, v.split, fnuz=v.fnuz),
                                     ops.launch_options(v.tile))
    res = pb.amd_resources(kernel)
    res["ok"] = (res["lds"] <= pb.LDS_LIMIT[v.arch] and res["vgpr_spills"] == 0 and res["scratch"] == 0)
    # ISA instructions of the key-tile loop per key it walks (the combine kernel has no key loop)
    res["per_key"] = round(res["loop_instructions"] / v.tile.block_n, 1) if v.tile else 0.0
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", choices=ARCHS, action="append", help="default: both")
    p.add_argument("--quick", action="store_true", help="the worst variants per tile only (CI)")
    p.add_argument("--json", action="store_true", help="one JSON list on stdout instead of the table")
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    p.add_argument("--summary", action="store_true",
                   help="one row per arch x tile x format: the most over its layer kinds and splits")
    p.add_argument("--tiles-of", metavar="ARCH", help="compile the tiles picked on ARCH (e.g. sm90) instead")
    p.add_argument("--heads", type=int, help="only the tile picked for this many heads (default: 1..128)")
    p.add_argument("--like-vllm", action="store_true", help="only the variant vLLM's kernel compares with")
    args = p.parse_args()
    heads = range(args.heads, args.heads + 1) if args.heads else range(1, MAX_HEADS + 1)
    todo = [v for arch in args.arch or ARCHS for v in variants(arch, args.quick, args.tiles_of, heads, args.like_vllm)]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(measure, todo))
    rows = [{"label": v.label(), "arch": v.arch, "kernel": v.kernel, "tile": asdict(v.tile) if v.tile else None,
             "fmt": v.fmt.value if v.fmt else None, "kind": v.kind, "fnuz": v.fnuz, **res}
            for v, res in zip(todo, results)]
    if args.json:
        json.dump(rows, sys.stdout)
        return
    print("| variant | LDS B | VGPRs (of them AGPRs) | SGPRs | VGPR spills | SGPR spills | scratch B | "
          "instructions / key | ok |\n|---|---|---|---|---|---|---|---|---|")
    groups: dict[str, list[tuple[Variant, dict]]] = {}
    for v, res in zip(todo, results):
        groups.setdefault(v.label(not args.summary), []).append((v, res))
    for key, members in groups.items():
        top = {k: max(r[k] for _, r in members) for k in ("lds", "vgprs", "agprs", "sgprs", "vgpr_spills",
                                                            "sgpr_spills", "scratch", "per_key")}
        ok = all(r["ok"] for _, r in members)
        kinds = f" ({len(members)} variants)" if len(members) > 1 else ""
        print(f"| {key}{kinds} | {top['lds']} | {top['vgprs']} ({top['agprs']}) | {top['sgprs']} | "
              f"{top['vgpr_spills']} | {top['sgpr_spills']} | {top['scratch']} | {top['per_key'] or '-'} | "
              f"{'yes' if ok else 'NO'} |")


if __name__ == "__main__":
    main()
