"""Device script: every kernel on small steps poisoned with each class of garbage index, meant to
run under ``compute-sanitizer --tool memcheck`` (a clean run = no out-of-bounds access).

Per garbage class (tests/kit/garbage.py: -1 between valid entries, -123456, -2**31, the
capacity, past it, 2**31 - 1), written into every scope at once (the SWA and compressed block
tables, the top-k rows), it runs and checks against the float64 reference of the step's clean
twin (garbage replaced by -1):

  front-end   the Triton index kernels (step rows, top-k translation) = the torch front end's rows
  portable    the portable Triton attention kernel: decode tokens alone (split-KV + combine),
              prefill tokens alone, and global slot rows with out-of-range slots and lens
  gluon       the Hopper kernel (sm_90 only), the same launches
  torch       the torch backend on the GPU (its gathers)
  flashmla    the flashmla backend when FlashMLA loads (its index preparation)

for each layer kind (SWA, C4A, C128A). Prints one line per check and a summary by class; exits 1
on any mismatch. Without a GPU it runs what the CPU can (front ends, portable kernel under
TRITON_INTERPRET=1, torch backend) as a dry run of the script itself.

    PYTHONPATH=. python tests/gpu_scripts/sanitize.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python tests/gpu_scripts/sanitize.py --quick        # or --classes past_count ...

(Without torch's caching allocator every tensor is its own allocation, so memcheck sees a read
past a tensor even where the pool would have had memory there.)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined
IS_SM90 = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dsv4_attn as dsv4  # noqa: E402
from dsv4_attn.common import reference  # noqa: E402
from dsv4_attn.common import registry as backend_mod  # noqa: E402
from dsv4_attn.common.backend import Phase  # noqa: E402
from dsv4_attn.portable.kernels.ops import KernelConfig, sparse_mla_fwd  # noqa: E402
from dsv4_attn.portable.triton_backend import TritonBackend  # noqa: E402

from kit.garbage import CLASSES, garbage_step, raw_rows_case  # noqa: E402

RESULTS: Counter = Counter()
FAILED: list[str] = []


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, str]:
    out, ref = out.double().cpu(), ref.double().cpu()
    if out.isnan().any():
        return False, f"{int(out.isnan().sum())} NaN"
    diff = (out - ref).norm() / ref.norm().clamp_min(1e-30)
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
    ok = bool(diff < 1e-2 and (cos > 0.9999 or ref.abs().max() == 0))
    return ok, f"rel_l2 {float(diff):.1e}"


def record(cls: str, what: str, ok: bool, note: str = "") -> None:
    RESULTS[(cls, ok)] += 1
    line = f"{'OK ' if ok else 'BAD'} {cls:<16} {what:<44} {note}"
    print(line, flush=True)
    if not ok:
        FAILED.append(line)


def clean_reference(step, kind):
    clean = step.clean
    plan = dsv4.SparseMLA(clean.spec, "fp8_ds_mla", backend="torch", front_end="torch", device=DEVICE,
                          max_tokens=clean.batch.num_tokens).plan(clean.batch)
    rows, lens = plan.comp_scope(kind, clean.topk_for(kind))
    swa = torch.where(plan.swa_rows >= 0, plan.swa_rows, -1)
    rows = None if rows is None else torch.where(rows >= 0, rows, -1)
    return reference.sparse_mla(clean.q, clean.caches["swa"], swa, plan.swa_lens, clean.caches.get(kind), rows, lens,
                                clean.sink, clean.spec.scale, "fp8_ds_mla")[0]


def backends() -> dict[str, str]:
    names = {}
    for impl, cfg in (("portable", KernelConfig(impl="triton")), ("gluon", KernelConfig(impl="gluon"))):
        if impl == "gluon" and not IS_SM90:
            continue
        backend_mod.register_backend(f"sanitize-{impl}", TritonBackend(cfg))
        names[impl] = f"sanitize-{impl}"
    names["torch"] = "torch"
    if DEVICE == "cuda" and not backend_mod.reasons_for("flashmla", dsv4.probe(), dsv4.ModelSpec(num_heads=64),
                                                       dsv4.KVFormat.MODEL1_FP8, dsv4.LayerKind.C4A, Phase.DECODE):
        names["flashmla"] = "flashmla"
    return names


def check_step(cls: str, names: dict[str, str]) -> None:
    step = garbage_step(torch.Generator().manual_seed(19), classes=(cls,), heads=64, device=DEVICE)
    case = step.case
    rows_by_front_end = {}
    for front_end in ("torch", "triton"):
        mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch", front_end=front_end, device=DEVICE,
                             max_tokens=case.batch.num_tokens)
        plan = mla.plan(case.batch)
        rows_by_front_end[front_end] = [plan.swa_rows.clone(), *plan.comp_scope("c128a"),
                                        *plan.comp_scope("c4a", case.topk_for(dsv4.LayerKind.C4A))]
        sync()
    same = all(torch.equal(a, b) for a, b in zip(*rows_by_front_end.values()))
    record(cls, "front-end index kernels", same)
    nd = case.batch.num_decode_tokens
    for kind in case.spec.kinds:
        want = clean_reference(step, kind)
        for impl, name in names.items():
            mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend=name, device=DEVICE,
                                 max_tokens=case.batch.num_tokens)
            plan = mla.plan(case.batch)
            layer = mla.layer_inputs(plan, kind, case.q, case.caches["swa"], case.caches.get(kind),
                                     case.topk_for(kind), case.sink)
            backend = backend_mod.get_backend(name)
            out = torch.full_like(case.q, float("nan"))
            for phase, a, b in ((Phase.DECODE, 0, nd), (Phase.PREFILL, nd, case.batch.num_tokens)):
                backend.forward(plan.phase_plan(phase), layer.token_slice(a, b), out[a:b])
                sync()
                ok, note = compare(out[a:b], want[a:b])
                record(cls, f"{impl} {kind.name} {phase.value}", ok, note)


def check_raw_rows(cls: str) -> None:
    """Global slot rows (SWA and compressed) with out-of-range slots, lens past the row."""
    case = raw_rows_case(64, DEVICE, (cls,))
    on = [x.to(DEVICE) for x in (case.q, case.rows, case.lens, case.comp_rows, case.comp_lens, case.sink)]
    for impl in ["triton"] + (["gluon"] if IS_SM90 else []):
        for split in (1, 3):
            out = torch.full_like(on[0], float("nan"))
            sparse_mla_fwd(on[0], out, "fp8_ds_mla", case.swa, on[1], on[2], case.comp, on[3], on[4], sink=on[5],
                           config=KernelConfig(impl=impl, split=split))
            sync()
            ok, note = compare(out, case.want)
            record(cls, f"{'portable' if impl == 'triton' else impl} global rows, split {split}", ok, note)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="the classes int32_min, at_count and int32_max only")
    p.add_argument("--classes", nargs="*", choices=CLASSES, help=f"these classes only (default all: {CLASSES})")
    args = p.parse_args()
    classes = args.classes or (("int32_min", "at_count", "int32_max") if args.quick else CLASSES)
    names = backends()
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (dry run: Triton interpreter)"
    print(f"{where}: kernels {sorted(names)}; classes {classes}")
    for cls in classes:
        check_step(cls, names)
        check_raw_rows(cls)
    print("\nsummary by class (checks passed / failed):")
    for cls in classes:
        print(f"  {cls:<16} {RESULTS[(cls, True)]:4d} / {RESULTS[(cls, False)]}")
    print(f"crashes: 0 (this line is reached); mismatches: {len(FAILED)}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
