"""Device script: the Triton kernels' LSE against a float32 reference on the same bf16 inputs, at
FlashMLA's own tolerance (per element |err| < 1e-6 or |err| / (|ref| + 1e-6) < 8/65536).

Cases: FlashMLA-test-like decode steps (q in [-1, 1], keys ~ N(0, 0.01) clipped, scale 512^-0.55,
top-k lengths from 0 to the full row, with and without a second scope: small scores, so the 1e-6
absolute bound rules wherever one key dominates) and the bench's production decode configs
(RMS-normed q, production-like caches). Each through the portable kernel and, on sm_90, the
Gluon kernel, unsplit and split. Prints per kernel: elements, failures, worst absolute error.

    PYTHONPATH=. python tests/gpu_scripts/lse_check.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsv4_attn import bench  # noqa: E402
from dsv4_attn.common import layout, reference  # noqa: E402
from dsv4_attn.portable.kernels.ops import KernelConfig, sparse_mla_fwd  # noqa: E402

from kit.reference import within_flashmla_lse_tolerance  # noqa: E402


def flashmla_like(seed: int, T: int, H: int, two_scopes: bool, dev: torch.device):
    """(q, scale, swa, rows, lens, comp, crows, clens) in the style of FlashMLA's sparse decode test."""
    gen = torch.Generator().manual_seed(seed)
    bs, nb, W, K = 64, 64, 128, 512

    def cache():
        c = layout.new_cache("fp8_ds_mla", nb, bs)
        kv = (torch.randn(nb * bs, 512, generator=gen) / 10).clamp(-1, 1).bfloat16()
        layout.insert(c, "fp8_ds_mla", torch.arange(nb * bs, dtype=torch.int32), kv)
        return c.to(dev)

    swa = cache()
    rows = torch.stack([torch.randperm(nb * bs, generator=gen)[:W] for _ in range(T)]).int()
    lens = torch.randint(0, W + 1, (T,), generator=gen).int()
    lens[: min(T, 4)] = torch.tensor([1, 2, 0, W], dtype=torch.int32)[: min(T, 4)]
    comp = crows = clens = None
    if two_scopes:
        comp = cache()
        crows = torch.stack([torch.randperm(nb * bs, generator=gen)[:K] for _ in range(T)]).int().to(dev)
        clens = torch.randint(0, K + 1, (T,), generator=gen).int().to(dev)
    q = torch.randn(T, H, 512, generator=gen).clamp(-1, 1).bfloat16().to(dev)
    return q, 512**-0.55, swa, rows.to(dev), lens.to(dev), comp, crows, clens


def production(cfg: str, b: int, dev: torch.device):
    """A bench decode case as global rows (the plan's SWA and compressed rows)."""
    case = bench.make_decode_case(bench.DECODE_CONFIGS[cfg], b, 1, dev, seed=b)
    _, _, plan = bench.runners.api_runner(case, "torch")
    crows, clens = plan.comp_scope(case.kind, case.topk)
    return case.q, case.spec.scale, case.swa_cache, plan.swa_rows, plan.swa_lens, case.comp_cache, crows, clens


def main() -> int:
    dev = torch.device("cuda")
    # gluon-n: the heads-on-N kernel (hopper_heads), forced; it runs the cases of <= 16 heads
    impls = ["triton"] + (["gluon", "gluon-n"] if torch.cuda.get_device_capability() == (9, 0) else [])
    cases = [(f"flashmla-like T=64 H={h} {'two scopes' if two else 'one scope'}",
              lambda h=h, two=two, s=s: flashmla_like(s, 64, h, two, dev))
             for s, (h, two) in enumerate([(64, False), (64, True), (128, True), (8, True), (16, False), (12, True)])]
    cases += [(f"{cfg} b={b}", lambda cfg=cfg, b=b: production(cfg, b, dev))
              for cfg, b in (("h64-c4a512", 8), ("h128-c4a1024", 4), ("h64-c128a", 8))]
    stats = {impl: [0, 0, 0.0] for impl in impls}  # elements, failures, worst abs error
    for label, make in cases:
        q, scale, swa, rows, lens, comp, crows, clens = make()
        _, want = reference.sparse_mla(q, swa, rows, lens, comp, crows, clens, None, scale, "fp8_ds_mla",
                                       dtype=torch.float32)
        for impl in impls:
            if impl == "gluon-n" and q.shape[1] > 16:
                continue
            # split 4 merged by the combine launch and, on the Gluon kernels, inside the kernel
            for split, merge in ((1, -1), (4, 0)) + (((4, 1),) if impl != "triton" else ()):
                lse = torch.full(q.shape[:2], float("nan"), device=dev)
                config = KernelConfig(impl="gluon" if impl.startswith("gluon") else impl, split=split,
                                      merge_in_kernel=merge, heads_on_n=1 if impl == "gluon-n" else 0)
                sparse_mla_fwd(q, torch.empty_like(q), "fp8_ds_mla", swa, rows, lens, comp, crows, clens, scale=scale,
                               lse=lse, config=config)
                torch.cuda.synchronize()
                ok = within_flashmla_lse_tolerance(lse, want)
                fin = torch.isfinite(want).cpu()
                worst = float((lse.double().cpu() - want.double().cpu())[fin].abs().max())
                st = stats[impl]
                st[0], st[1], st[2] = st[0] + ok.numel(), st[1] + int((~ok).sum()), max(st[2], worst)
                name = "portable" if impl == "triton" else impl
                print(f"{'OK ' if ok.all() else 'BAD'} {name:<8} split {split}{' merged here' if merge == 1 else ''} "
                      f"{label:<40} fails {int((~ok).sum()):5d} "
                      f"worst |err| {worst:.2e}", flush=True)
    for impl, (n, bad, worst) in stats.items():
        print(f"{'portable' if impl == 'triton' else impl}: {n} LSE elements, {bad} outside FlashMLA's tolerance, "
              f"worst |err| {worst:.2e}")
    return 1 if any(st[1] for st in stats.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
