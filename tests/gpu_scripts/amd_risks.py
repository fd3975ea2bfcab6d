"""The risks of issue 28 / issue 24 item 3 on a ROCm GPU with real AITER (no emulator); prints one
verdict line per risk and a last line to paste into an issue. Run by tests/gpu_scripts/amd_run.sh:

    python tests/gpu_scripts/amd_risks.py [--json OUT.json]

1. persistent   T = 1, 512 C4A keys, 64 heads, FP8 persistent (opt-in): the work plan's kv
                granularity (gfx942's 64-head object takes whole 32-key passes), through the backend
2. split-sweep  AITER's mla_decode_fwd in bf16 split mode called directly: ragged rows of
                L = 1..2100 keys, S in {2, 3, 5, 8, 16} splits, 16 / 128 heads, output and LSE vs
                float64 (does stage 2 merge what stage 1 wrote for short rows? the adapter pads its
                rows either way), then the same sweep through the backend
3. capacity     1024 sequences x (1 + 2) MTP tokens = 3072 decode tokens in one step after
                reserve() (engine start): right, on aiter, and no allocation after reserve
4. scratch      bytes reserve() allocated and the step's peak above it

Nothing here is emulated: every number is the hardware's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/: the case builders

import dsv4_attn as dsv4  # noqa: E402
from dsv4_attn.common.registry import register_backend, unregister_backend  # noqa: E402
from dsv4_attn.common.spec import LayerKind  # noqa: E402
from dsv4_attn.rocm.aiter import AiterBackend  # noqa: E402
from dsv4_attn.rocm.aiter_api import load_aiter  # noqa: E402

from kit.compare import compare  # noqa: E402
from kit.layers import forward_poisoned, reference_out  # noqa: E402
from kit.steps import aiter_step  # noqa: E402

DEV = torch.device("cuda")
BF16_CONTRACT, FP8_LABEL = 5e-3, 5e-2


def _register(name="aiter-risk", **kwargs) -> str:
    register_backend(name, AiterBackend(name=name, **kwargs))
    return name


def persistent(gen) -> tuple[bool, str]:
    arch = load_aiter().arch
    dialect = "fnuz" if arch == "gfx942" else "ocp"
    case = aiter_step(gen, "fp8_e4m3", 64, query_lens=(1,), seq_lens=(4000,), num_pad=0, topk=512, device=DEV,
                      swa_dialect=dialect, comp_dialect=dialect, kv_scale=0.5)
    name = _register(path="mla_decode_fwd", fp8_compute=True, max_decode_tokens=64)
    try:
        mla = dsv4.SparseMLA(case.spec, "fp8_e4m3", backend=name, swa_dialect=dialect, comp_dialect=dialect)
        plan = mla.plan(case.batch)
        out = forward_poisoned(mla, plan, case, LayerKind.C4A)
        err = compare(out, reference_out(plan, case, LayerKind.C4A))
    finally:
        unregister_backend(name)
    ok = bool(torch.isfinite(out).all()) and err["rel_l2"] <= FP8_LABEL
    return ok, f"T=1 512 keys 64 heads fp8 persistent on {arch}: rel L2 {err['rel_l2']:.2e} (label {FP8_LABEL})"


def _raw_split(aiter_mla, heads: int, splits: int, lens: list[int], gen) -> tuple[float, float]:
    """Worst per-row rel L2 and |LSE error| of AITER's bf16 split decode over rows of ``lens`` keys."""
    B, n = len(lens), sum(lens)
    kv = (torch.randn(n + 1, 576, generator=gen) * 2).bfloat16().to(DEV)
    q = torch.randn(B, heads, 576, generator=gen).bfloat16().to(DEV)
    indptr = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    indices = torch.randperm(n, generator=gen).int().to(DEV)
    o = torch.full((B, heads, 512), math.nan, dtype=torch.bfloat16, device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    scale = 576 ** -0.5
    _, lse = aiter_mla(q, kv.view(-1, 1, 1, 576), o, torch.arange(B + 1, **i32), indptr, indices,
                       torch.ones(B, **i32), 1, sm_scale=scale, num_kv_splits=splits,
                       num_kv_splits_indptr=torch.arange(0, (B + 1) * splits, splits, **i32), return_lse=True)
    worst_rel, worst_lse = 0.0, 0.0
    for b, (lo, hi) in enumerate(zip(indptr[:-1].tolist(), indptr[1:].tolist())):
        k = kv[indices[lo:hi].long()].double()
        s = q[b].double() @ k.T * scale
        ref_lse = torch.logsumexp(s, dim=1)
        ref = torch.softmax(s, dim=1) @ k[:, :512]
        got = o[b].double()
        rel = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
        worst_rel = max(worst_rel, rel if math.isfinite(rel) else math.inf)
        worst_lse = max(worst_lse, float((lse[b].double() - ref_lse).abs().max()))
    return worst_rel, worst_lse


def split_sweep(gen) -> tuple[bool, str]:
    api = load_aiter()
    lens = list(range(1, 2101, 7)) + [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 2100]
    raw, notes = True, []
    for heads in (16, 128):
        for splits in (2, 3, 5, 8, 16):
            rel, dlse = _raw_split(api.mla_decode_fwd, heads, splits, lens, gen)
            good = rel <= BF16_CONTRACT and dlse <= 1e-2
            raw &= good
            if not good:
                notes.append(f"raw H{heads} S{splits}: rel L2 {rel:.2e}, LSE err {dlse:.2e}")
    case_lens = tuple(lens[::4])
    worst = 0.0
    for heads in (16, 128):
        case = aiter_step(gen, "bfloat16", heads, query_lens=(1,) * len(case_lens), seq_lens=case_lens, device=DEV)
        name = _register(max_decode_tokens=len(case_lens) + 1)
        try:
            mla = dsv4.SparseMLA(case.spec, "bfloat16", backend=name)
            plan = mla.plan(case.batch)
            for kind in (LayerKind.SWA, LayerKind.C4A, LayerKind.C128A):
                err = compare(forward_poisoned(mla, plan, case, kind), reference_out(plan, case, kind))
                worst = max(worst, err["rel_l2"])
        finally:
            unregister_backend(name)
    adapter = worst <= BF16_CONTRACT
    text = (f"raw AITER split (unpadded rows, L 1..2100 x S 2/3/5/8/16 x H 16/128): {'right' if raw else 'WRONG'}"
            f"{' (' + '; '.join(notes[:4]) + ')' if notes else ''}; backend (padded rows): worst rel L2 {worst:.2e}")
    return adapter, text  # the raw result informs docs/rocm.md (is the padding needed); the backend must pass


def capacity(gen) -> tuple[bool, str]:
    lens = tuple(int(n) for n in torch.randint(4, 4000, (1024,), generator=gen))
    case = aiter_step(gen, "fp8_ds_mla", 64, query_lens=(3,) * 1024, seq_lens=lens, num_pad=0, device=DEV, topk=512,
                      max_model_len=8192)
    T = case.q.shape[0]
    name = _register()
    try:
        mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend=name, max_tokens=T, max_reqs=1024)
        before = torch.cuda.memory_allocated()
        mla.reserve(mla.plan(case.batch), decode_tokens=T)
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_allocated() - before
        backend = mla._backend(name)
        pointers = {k: s.pointers() for k, s in backend._scratch.items()}
        plan = mla.plan(case.batch)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        worst = 0.0
        for kind in (LayerKind.SWA, LayerKind.C4A, LayerKind.C128A):
            out = forward_poisoned(mla, plan, case, kind)
            sub = torch.arange(0, T, 97, device=DEV)
            ref = reference_out(plan, case, kind)
            worst = max(worst, compare(out[sub], ref[sub])["rel_l2"])
        peak = torch.cuda.max_memory_allocated() - base
        moved = {k: s.pointers() for k, s in backend._scratch.items()} != pointers
    finally:
        unregister_backend(name)
    ok = worst <= BF16_CONTRACT and not moved and backend.max_decode_tokens >= T
    return ok, (f"3072 decode tokens (1024 seqs x MTP 2) after reserve(): rel L2 {worst:.2e}, capacity "
                f"{backend.max_decode_tokens}, scratch {'MOVED' if moved else 'kept'}; reserved {reserved / 2**20:.0f} "
                f"MiB, step peak above it {peak / 2**20:.0f} MiB (per-call temporaries)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the verdicts here")
    args = parser.parse_args()
    api = load_aiter()
    if api.error or api.emulated:
        print(f"amd_risks: needs real AITER on a ROCm GPU ({api.error or 'the emulator is on'})")
        return 2
    gen = torch.Generator().manual_seed(28)
    results = {}
    for name, check in (("persistent", persistent), ("split-sweep", split_sweep), ("capacity", capacity)):
        try:
            results[name] = check(gen)
        except Exception as exc:  # a risk that raises is a failed risk, reported
            results[name] = (False, f"raised {type(exc).__name__}: {exc}")
        print(f"{name:<12} {'PASS' if results[name][0] else 'FAIL'}  {results[name][1]}", flush=True)
    ok = all(r[0] for r in results.values())
    parts = ", ".join(f"{k} {'pass' if v[0] else 'FAIL'}" for k, v in results.items())
    print(f"VERDICT dsv4_attn amd_risks {api.arch} AITER {api.version} torch {torch.__version__}: "
          f"{'PASS' if ok else 'FAIL'} ({parts})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {"ok": v[0], "detail": v[1]} for k, v in results.items()}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
