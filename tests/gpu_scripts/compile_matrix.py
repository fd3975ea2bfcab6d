"""Compile every Triton kernel the package launches, offline, for every target it serves, with the
Triton this process imports (put a side Triton first on PYTHONPATH to try another version), and
print registers, spills and scratch per variant. No GPU needed; run it without TRITON_INTERPRET.

    PYTHONPATH=TRITON_DIR:. python tests/gpu_scripts/compile_matrix.py [--full | --quick] [--jobs 2] [--json F]

Kernels x targets (what ``ops.sparse_mla_fwd`` and the index front end launch):

* ``hopper``: the Gluon Hopper kernels, sm_90a, the V4 ones with the griddepcontrol of their
  programmatic launches (``ops.pdl_launches``' auto): the top-k walk with its LSE, split, split with
  the in-kernel merge, SWA alone, the heads-on-N kernel's split merge, alone and with token pairs,
  its 16-head top-k split for the combine launch, with PDL and without (``ops.one_program_per_sm``),
  and the key-tile ping-pong prefill kernel's top-k walk with its LSE (``--full``: 26 variants: SWA
  / every-entry / top-k, each alone, with the LSE, split, and split merging in the kernel; top-k
  with non-power-of-two cache blocks and without range checks; the heads-on-N kernel's top-k split
  merge (8 heads), top-k split (16 heads) and every-entry walk with its LSE (16 heads), its 8-head
  split merge without PDL; its token pairs' every-entry split merge and SWA walk with its LSE; the
  ping-pong kernel on every kind, with and without the LSE); and the V4.1 records' kernel
  (``hopper_records``) for every record pair selection gives it (``gluon_record_layers``: MXFP8,
  MXFP8 SWA + NVFP4 compressed) in the top-k walk with its LSE and the split merged in the kernel
  (``--full``: SWA alone and the every-entry split too);
* ``attention``: the portable kernel in every tile ``KernelConfig.tile`` picks for 1 - 128 heads,
  on sm_80 (bf16 caches only: the fp8 formats need sm_89), sm_90, sm_100, gfx942, gfx950, for the
  formats selection runs on it there (``portable_formats``: on sm_90 every format, the V4 record
  when the Gluon kernel cannot take it). On sm_90, gfx942 and gfx950 every format of each tile in
  the top-k walk with its LSE (the kind whose code holds the others': both scopes and the
  block-table translation) and the tile's split epilogue; on sm_80 / sm_100 the V4 walk (bf16 on
  sm_80) and its split, ``--quick``: in the smallest tile only; ``--full``: every record x layer
  kind x split everywhere;
* ``combine`` (split merge) and ``step_rows`` / ``topk_rows`` (the index front end) on every target.

Fails (exit 1) on a compile error, on an NVIDIA kernel whose parameters ``driver_launch`` would
not pack (a replay would take Triton's launcher: the PTX entry's parameters differ from the packing
of its signature, or a type it does not pack), or on AMD scratch (registers spilled to memory) or LDS past
the arch's limit, or on a Gluon kernel with more than ``LOOP_SPILL_LIMIT`` spill instructions in its
key loop (``loop_spills``: its SASS between the first and the last HGMMA, Triton's bundled nvdisasm);
AMD VGPR spills that stay in registers (into AGPRs, no scratch: Triton 3.6's gfx950 64-key tile
spills 2) and SGPR spills (into VGPR lanes) are reported, not failed; NVIDIA spill bytes are
reported, not failed (ptxas' own log: ``TRITON_DUMP_PTXAS_LOG``, so the figures are those of the
Triton's own ptxas and flags).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import itertools
import json
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas -v's report on stdout, captured per compile
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # a cached binary would print no report
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import portable_build as pb  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dsv4_attn.common.layout import Fp8Dialect, KVFormat  # noqa: E402
from dsv4_attn.common.spec import MAX_HEADS  # noqa: E402
from dsv4_attn.portable.kernels import attention as K  # noqa: E402
from dsv4_attn.portable.kernels import driver_launch, indices, ops  # noqa: E402

TARGETS = {"sm80": GPUTarget("cuda", 80, 32), "sm90": GPUTarget("cuda", 90, 32),
           "sm100": GPUTarget("cuda", 100, 32), "gfx942": GPUTarget("hip", "gfx942", 64),
           "gfx950": GPUTarget("hip", "gfx950", 64)}
KINDS = {"SWA": K.COMP_NONE, "all": K.COMP_GLOBAL, "top-k": K.COMP_C4A_LOCAL}
# (COMP, split, write_lse, shifts, range_checks, merge in the kernel, heads on N): what the launcher
# compiles of the Gluon kernels (heads on N 8 / 16: hopper_heads, 0: the 64-head kernel)
HOPPER_VARIANTS = ([(comp, False, lse, (6, 6), True, False, 0) for comp in (0, 1, 2) for lse in (True, False)]
                   + [(comp, True, False, (6, 6), True, False, 0) for comp in (0, 1, 2)]
                   + [(comp, True, True, (6, 6), True, True, 0) for comp in (0, 1, 2)]
                   + [(2, False, True, (-1, -1), True, False, 0), (2, False, True, (6, 6), False, False, 0)]
                   + [(2, True, True, (6, 6), True, True, 8), (1, False, True, (6, 6), True, False, 16),
                      (2, True, False, (6, 6), True, False, 16)])
# the key-tile ping-pong kernel (``ops.pingpong``: unsplit 64-head launches of prefill chunks), per
# layer kind, with and without the LSE (quick: the top-k walk with its LSE)
PINGPONG_VARIANTS = [(comp, False, lse, (6, 6), True, False, 0) for comp in (2, 1, 0) for lse in (True, False)]
# the heads-on-N kernel's split launches without PDL (``ops.one_program_per_sm``): its 16-head top-k
# split (combine launch; quick) and its 8-head split merge
ONE_PER_SM_VARIANTS = [(2, True, False, (6, 6), True, False, 16), (2, True, True, (6, 6), True, True, 8)]
# the heads-on-N kernel with token pairs (``ops.pair_tokens``: window and C128A layers)
PAIR_VARIANTS = [(1, True, True, (6, 6), True, True, 16), (0, False, True, (6, 6), True, False, 16)]
# without --full: the top-k walk with its LSE, split and in-kernel merge (every Gluon builtin the
# kernel calls), SWA alone, the heads-on-N kernel's split merge, alone and with token pairs (C128A),
# and its 16-head split for the combine launch (a V4-Pro -tp 8 rank's: its spills once cost 10 %)
HOPPER_QUICK = [(2, False, True, (6, 6), True, False, 0), (2, True, False, (6, 6), True, False, 0),
                (2, True, True, (6, 6), True, True, 0), (0, False, True, (6, 6), True, False, 0),
                (2, True, True, (6, 6), True, True, 8), (2, True, False, (6, 6), True, False, 16)]
# the V4.1 records' kernel, per record pair: the top-k walk with its LSE and the split merged in the
# kernel (quick); SWA alone and the every-entry split (full)
RECORDS_QUICK = [(2, False, True, (6, 6), True, False, 0), (2, True, True, (6, 6), True, True, 0)]
RECORDS_FULL = RECORDS_QUICK + [(0, False, True, (6, 6), True, False, 0), (1, True, False, (-1, -1), True, False, 0)]


def gluon_record_layers() -> list[tuple[int, tuple[int, int]]]:
    """(COMP, (SWA, compressed) V4.1 record codes) of every layer kind and format for which
    selection gives a layer on sm_90 a Gluon kernel (``ops.kernel_choice`` in OCP e4m3): what the
    records kernel is compiled for (an SWA layer of nvfp4_ds_mla reads its MXFP8 cache only)."""
    layers = set()
    for fmt in KVFormat:
        for comp in KINDS.values():
            records = pb.layer_records(fmt, comp)
            codes = ops.v41_codes(records)
            if codes and ops.kernel_choice("sm90", records, (Fp8Dialect.OCP,) * len(records))[0] == "gluon":
                layers.add((comp, codes))
    return sorted(layers)


@dataclass(frozen=True)
class Job:
    target: str
    kernel: str  # hopper | attention | combine | step_rows | topk_rows
    label: str
    args: tuple = ()


# the targets whose quick matrix holds every tile and record pair selection launches there (the
# GPUs the package is run on: H100 / H200, MI300X, MI355X); sm_80 and sm_100 keep the smallest tile
SERVED = ("sm90", "gfx942", "gfx950")


def portable_formats(target: str) -> list[KVFormat]:
    """The KV formats a layer on ``target`` runs on the portable kernel for, as selection decides:
    ``ops.kernel_choice`` gives it the portable kernel in some FP8 dialect its records are written
    in (on sm_90 the Gluon kernel takes the V4 record in OCP e4m3: the portable kernel gets it in
    FNUZ, and for caches whose blocks are not 16-byte aligned), and the triton backend serves the
    fp8 formats from sm_89 only (``TritonBackend.extra_reasons``)."""
    out = []
    for fmt in KVFormat:
        if fmt.uses_fp8 and target.startswith("sm") and int(target[2:]) < 89:
            continue
        records = (fmt.swa_record, fmt.comp_record)
        dialects = itertools.product(*(r.layout.dialects for r in records))
        if any(ops.kernel_choice(target, records, d)[0] == "portable" for d in dialects):
            out.append(fmt)
    return out


def _attention_jobs(target: str, full: bool) -> list[Job]:
    fmts = portable_formats(target)
    arch = target if target.startswith("gfx") else "sm90"  # NVIDIA archs share the tile choice
    tiles = sorted({ops.DEFAULT_CONFIG.tile(arch, h) for h in range(1, MAX_HEADS + 1)},
                   key=lambda t: (t.block_h, t.block_n))
    jobs = []
    for tile in tiles:
        name = f"{tile.block_h}h x {tile.block_n}k {tile.num_warps}w"
        if full:
            cases = [(fmt, kind, split) for fmt in fmts for kind in KINDS for split in (1, 2)]
        elif target in SERVED:
            # every format of this tile in the top-k walk (its code holds the other kinds': the SWA
            # scope, the compressed scope and the block-table translation), and the split epilogue
            cases = [(fmt, "top-k", 1) for fmt in fmts] + [(fmts[0], "top-k", 2)] if fmts else []
        else:
            cases = [(fmts[0], "top-k", 1), (fmts[0], "top-k", 2)]  # the V4 walk and its split (bf16 on sm_80)
        seen = set()
        for fmt, kind, split in cases:
            const = pb.variant(fmt, KINDS[kind], tile, split)
            key = (const["FMT_A"], const["FMT_B"], KINDS[kind], split)
            if key not in seen:  # an SWA layer of nvfp4_ds_mla is mxfp8_ds_mla's
                seen.add(key)
                jobs.append(Job(target, "attention", f"{name} {fmt.value} {kind}{' split' if split > 1 else ''}",
                                (tile, fmt, kind, split)))
    return jobs


def jobs_for(targets: list[str], kernels: list[str], full: bool) -> list[Job]:
    out = []
    for target in targets:
        if "hopper" in kernels and target == "sm90":
            for v in HOPPER_VARIANTS if full else [v for v in HOPPER_VARIANTS if v in HOPPER_QUICK]:
                comp, split, lse, shifts, checks, merge, heads_n = v
                label = (f"{list(KINDS)[comp]}{' split' if split else ''}{' merge' if merge else ''}"
                         f"{' lse' if lse else ''}{f' heads-on-N {heads_n}' if heads_n else ''}"
                         f"{' bs!=2^n' if shifts[0] < 0 else ''}{' no range checks' if not checks else ''}")
                out.append(Job(target, "hopper", label, (*v, None, False, False, False)))
            for v in ONE_PER_SM_VARIANTS if full else ONE_PER_SM_VARIANTS[:1]:
                comp, split, lse, shifts, checks, merge, heads_n = v
                label = (f"{list(KINDS)[comp]} split{' merge' if merge else ''}{' lse' if lse else ''} "
                         f"heads-on-N {heads_n} no PDL")
                out.append(Job(target, "hopper", label, (*v, None, False, False, True)))
            for v in PINGPONG_VARIANTS if full else PINGPONG_VARIANTS[:1]:
                comp, lse = v[0], v[2]
                out.append(Job(target, "hopper", f"{list(KINDS)[comp]}{' lse' if lse else ''} ping-pong (prefill)",
                               (*v, None, False, True, False)))
            for v in PAIR_VARIANTS if full else PAIR_VARIANTS[:1]:
                comp, split, lse, shifts, checks, merge, heads_n = v
                label = (f"{list(KINDS)[comp]}{' split' if split else ''}{' merge' if merge else ''}"
                         f"{' lse' if lse else ''} heads-on-N {heads_n} token pairs")
                out.append(Job(target, "hopper", label, (*v, None, True, False, False)))
            names = {K.FMT_MXFP8: "mxfp8", K.FMT_NVFP4: "nvfp4"}
            layers = gluon_record_layers()
            for pair in sorted({codes for _, codes in layers}):
                for v in RECORDS_FULL if full else RECORDS_QUICK:
                    comp, split, lse, shifts, checks, merge, _ = v
                    if (comp, pair) not in layers:
                        continue
                    label = (f"records {names[pair[0]]}/{names[pair[1]]} {list(KINDS)[comp]}{' split' if split else ''}"
                             f"{' merge' if merge else ''}{' lse' if lse else ''}{' bs!=2^n' if shifts[0] < 0 else ''}")
                    out.append(Job(target, "hopper", label, (*v, pair, False, False, False)))
        if "attention" in kernels:
            out += _attention_jobs(target, full)
        if "combine" in kernels:
            out.append(Job(target, "combine", "split 304"))
        if "indices" in kernels:
            out += [Job(target, "step_rows", "window 128 + C128A"), Job(target, "topk_rows", "ratio 4, 512 wide")]
    return out


def _compile_indices(job: Job, target: GPUTarget):
    if job.kernel == "step_rows":
        fn = indices._step_rows_kernel
        const = dict(WINDOW=128, W_P2=128, HAS_START=True, HAS_C128=True, C_RATIO=128, BLOCK_R=64, BLOCK_C=512)
        ptrs = {"QSL": "*i32", "SEQ": "*i32", "SWA_START": "*i32", "POS": "*i64", "TOK2REQ": "*i32", "VALID": "*i1",
                "SWA_TABLE": "*i32", "SWA_ROWS": "*i32", "SWA_LENS": "*i32", "C_TABLE": "*i32", "C_ROWS": "*i32",
                "C_LENS": "*i32"}
    else:
        fn = indices._topk_rows_kernel
        const = dict(RATIO=4, BLOCK_K=512)
        ptrs = {"LOCAL": "*i32", "POS": "*i64", "TOK2REQ": "*i32", "VALID": "*i1", "TABLE": "*i32", "ROWS": "*i32",
                "LENS": "*i32"}
    sig = {p.name: ptrs.get(p.name) or ("constexpr" if p.name in const else "i32") for p in fn.params}
    return triton.compile(ASTSource(fn, sig, const), target=target, options=dict(num_warps=4))


def _compile(job: Job):
    target = TARGETS[job.target]
    if job.kernel == "hopper":
        comp, split, lse, shifts, checks, merge, heads_n, records, pair, pingpong, pdl_off = job.args
        # with the griddepcontrol auto launches the V4 kernels with (ops.pdl_launches), but where it
        # launches them without (ops.one_program_per_sm)
        return pb.compile_hopper(pb.hopper_constexprs(comp, split, lse, shifts, checks, merge, heads_n, pair, records,
                                                      pingpong, pdl=records is None and not pingpong and not pdl_off))
    if job.kernel == "attention":
        tile, fmt, kind, split = job.args
        return pb.compile_portable(target, pb.variant(fmt, KINDS[kind], tile, split), ops.launch_options(tile))
    if job.kernel == "combine":
        return pb.compile_combine(target)
    return _compile_indices(job, target)


def _ptxas_figures(log: str) -> dict:
    """Registers, spill store / load bytes and stack frame of ptxas -v's report (the kernel's own
    line: Triton compiles one entry per module)."""
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not regs or not spill:
        raise ValueError(f"no register / spill line in ptxas' report: {log[-500:]!r}")
    frame, stores, loads = (int(x) for x in spill[-1])
    return {"regs": int(regs[-1]), "spill_stores": stores, "spill_loads": loads, "scratch": frame}


# Spill instructions a Gluon kernel may have inside its key loop (``loop_spills``). Today's most,
# offline: 5 (Triton 3.9, the records kernel's NVFP4 split merge; 1 in two other 3.9 variants, 0
# under 3.6). The regression this catches had 35: Triton 3.9 hoisted the heads-on-N kernel's
# loop-invariant wgmma descriptors and ptxas spilled them, reloaded every key tile (1.12-1.26x
# slower, notes/perf-gather.md, session 39).
LOOP_SPILL_LIMIT = 8


def loop_spills(kernel) -> int:
    """Spill instructions (``LDL`` / ``STL``) between the first and the last ``HGMMA`` of a Gluon
    kernel's SASS (Triton's bundled nvdisasm): spill traffic inside the consumer's key loop, paid
    every key tile."""
    lines = pb.sass(kernel).splitlines()
    mma = [i for i, line in enumerate(lines) if "HGMMA" in line]
    if not mma:
        return 0
    return sum(1 for line in lines[mma[0]:mma[-1]] if re.search(r"\b(LDL|STL)\b", line))


def measure(job: Job) -> dict:
    row = {"triton": triton.__version__, "target": job.target, "kernel": job.kernel, "label": job.label}
    start = time.perf_counter()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            kernel = _compile(job)
    except Exception as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-1500:]}", trace=traceback.format_exc()[-3000:])
        return row
    row["seconds"] = round(time.perf_counter() - start, 1)
    if job.target.startswith("gfx"):
        res = pb.amd_resources(kernel)
        row.update(regs=res["vgprs"], agprs=res["agprs"], sgprs=res["sgprs"], vgpr_spills=res["vgpr_spills"],
                   sgpr_spills=res["sgpr_spills"], scratch=res["scratch"], lds=res["lds"])
        row["ok"] = res["scratch"] == 0 and res["lds"] <= pb.LDS_LIMIT[job.target]
        if not row["ok"]:
            row["error"] = "AMD scratch (spills to memory) / LDS past the limit"
    else:
        # a replay launches it through the driver only where its parameters pack as its PTX declares them
        direct = driver_launch.kernel_layout(kernel) is not None
        row.update(_ptxas_figures(log.getvalue()), shared=kernel.metadata.shared, direct_launch=direct, ok=direct)
        if not direct:
            row["error"] = "driver_launch.kernel_layout declines it: a replay would take Triton's launcher"
        if job.kernel == "hopper":
            row["loop_spills"] = loop_spills(kernel)
            if row["loop_spills"] > LOOP_SPILL_LIMIT:
                row.update(ok=False, error=f"{row['loop_spills']} spill instructions in the key loop (at most "
                                           f"{LOOP_SPILL_LIMIT}): loop-invariant values hoisted and spilled")
    return row


def _most(rows: list[dict], key: str) -> str:
    vals = [r[key] for r in rows if key in r]
    return str(max(vals)) if vals else "-"


def markdown(rows: list[dict]) -> str:
    """One line per Triton x target x kernel (x tile): the most over its variants."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        tile = r["label"].split(" ", 4)[:4] if r["kernel"] == "attention" else []
        groups.setdefault((r["triton"], r["target"], r["kernel"], " ".join(tile)), []).append(r)
    out = ["| Triton | target | kernel | variants | registers (max) | NVIDIA spill stores B / AMD SGPR spills (max) "
           "| scratch B (max) | compiled |", "|---|---|---|---|---|---|---|---|"]
    for (version, target, kernel, tile), members in groups.items():
        spills = _most(members, "sgpr_spills" if target.startswith("gfx") else "spill_stores")
        bad = sum(not r["ok"] for r in members)
        compiled = "yes" if not bad else f"NO ({bad} failed)"
        out.append(f"| {version} | {target} | {kernel}{' ' + tile if tile else ''} | {len(members)} "
                   f"| {_most(members, 'regs')} | {spills} | {_most(members, 'scratch')} | {compiled} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    p.add_argument("--kernels", nargs="+", choices=["hopper", "attention", "combine", "indices"],
                   default=["hopper", "attention", "combine", "indices"])
    p.add_argument("--full", action="store_true", help="every record x layer kind x split of the portable kernel")
    p.add_argument("--quick", action="store_true",
                   help="on sm_80 / sm_100 the portable kernel in its smallest tile only (CI time; the other tiles "
                        "differ in BLOCK_H); sm_90, gfx942 and gfx950 keep every tile")
    p.add_argument("--only", nargs="+", metavar="LABEL", help="only the variants of these labels")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", metavar="FILE", help="also write every row (with errors) as JSON")
    p.add_argument("--list", action="store_true", help="print the variants (JSON: target, kernel, label) and exit")
    args = p.parse_args()
    todo = [j for j in jobs_for(args.targets, args.kernels, args.full) if not args.only or j.label in args.only]
    if args.quick:  # sm_80 / sm_100: the portable kernel in its smallest tile only
        todo = [j for j in todo if j.kernel != "attention" or j.target in SERVED or j.args[0].block_h == min(
            k.args[0].block_h for k in todo if k.kernel == "attention" and k.target == j.target)]
    if args.list:
        print(json.dumps([{"target": j.target, "kernel": j.kernel, "label": j.label} for j in todo]))
        return
    start = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(measure, job) for job in todo]
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            r = future.result()
            figures = ", ".join(f"{k} {r[k]}" for k in ("regs", "spill_stores", "loop_spills", "sgpr_spills",
                                                          "vgpr_spills", "scratch", "seconds") if k in r)
            print(f"[{done}/{len(todo)}] {r['target']} {r['kernel']} {r['label']}: "
                  f"{figures if r['ok'] else 'FAILED ' + r['error'][:200]}", file=sys.stderr, flush=True)
        rows = [f.result() for f in futures]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(markdown(rows))
    failed = [r for r in rows if not r["ok"]]
    for r in failed:
        print(f"FAILED Triton {r['triton']} {r['target']} {r['kernel']} {r['label']}: {r['error']}", file=sys.stderr)
    print(f"Triton {triton.__version__}: {len(rows)} compiles, {len(failed)} failed, "
          f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
