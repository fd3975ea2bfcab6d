"""One layer of a ``StepCase`` through a SparseMLA against the float64 reference: the output
NaN-poisoned before the call, the reference computed on the plan's own rows."""

from __future__ import annotations

import dataclasses
import math

import torch

import dsv4_attn as dsv4
from dsv4_attn.common import reference
from dsv4_attn.common.spec import LayerKind
from dsv4_attn.parity.matrix import Tolerance
from dsv4_attn.testing.steps import StepCase

from kit.compare import assert_close, compare, metrics


def reference_out(plan, case: StepCase, kind: LayerKind, q=None, sink="case",
                  tokens: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [n, H, 512]: the reference on the plan's own rows for ``tokens`` (default all), in
    the case's format, scale and dialects; ``q`` / ``sink`` replace the case's."""
    q = case.q if q is None else q
    sink = case.sink if sink == "case" else sink
    rows, lens = plan.comp_scope(kind, case.topk_for(kind))
    sel = slice(None) if tokens is None else tokens
    ref, _ = reference.sparse_mla(q[sel], case.caches["swa"], plan.swa_rows[sel], plan.swa_lens[sel],
                                  case.comp_cache(kind), None if rows is None else rows[sel],
                                  None if lens is None else lens[sel], sink, plan.spec.scale, case.fmt,
                                  kv_scale=case.kv_scale, swa_dialect=case.swa_dialect,
                                  comp_dialect=case.comp_dialect)
    return ref


def forward_poisoned(mla: dsv4.SparseMLA, plan, case: StepCase, kind: LayerKind, q=None, sink="case", *,
                     out: torch.Tensor | None = None, validate: bool = False) -> torch.Tensor:
    """One layer's output into ``out`` (default a new tensor), NaN-filled before the call when new."""
    q = case.q if q is None else q
    sink = case.sink if sink == "case" else sink
    if out is None:
        out = torch.full_like(q, math.nan)
    mla.forward(plan, kind, q, case.caches["swa"], case.comp_cache(kind), topk=case.topk_for(kind), sink=sink,
                out=out, kv_scale=case.kv_scale, validate=validate)
    return out


def run_layer(mla: dsv4.SparseMLA, plan, case: StepCase, kind, q=None, sink="case") -> dict:
    """``metrics`` of forward_poisoned (inputs validated) vs reference_out on every token."""
    kind = LayerKind.parse(kind)
    out = forward_poisoned(mla, plan, case, kind, q, sink, validate=True)
    return metrics(out, reference_out(plan, case, kind, q, sink))


def assert_layer_close(out: torch.Tensor, plan, case: StepCase, kind: LayerKind, tol: Tolerance) -> dict:
    """``out`` finite everywhere and within ``tol`` of reference_out (rel_l2 and cosine); its figures."""
    assert torch.isfinite(out).all(), f"{kind.name}: unwritten or non-finite output"
    err = compare(out, reference_out(plan, case, kind))
    assert_close(err, tol, max_abs=False, what=kind.name)
    return err


def eager_then_replays(run, out: torch.Tensor, check, replays: int = 3) -> None:
    """``run()`` once eagerly, then captured in a CUDA graph (``bench.timing.capture_graph``) and
    replayed ``replays`` times; ``out`` is NaN-poisoned before each, ``check(what)`` runs after each
    ("eager", "replay 0", ...). GPU only."""
    from dsv4_attn.bench.timing import capture_graph

    out.fill_(float("nan"))
    run()
    check("eager")
    graph = capture_graph(run)
    for replay in range(replays):
        out.fill_(float("nan"))
        graph.replay()
        check(f"replay {replay}")


def check_config_against_reference(config, name: str, cfg: str, heads: int, batch: int, mtp: int, edit=None,
                                   seed: int | None = None):
    """The `triton` backend under ``config`` (a ``KernelConfig``; sm_90 GPU tests), registered as
    ``name``, on a fresh decode case of ``cfg`` (``heads`` heads, ``batch`` requests of ``mtp``
    tokens) against the float64 reference, eagerly and across three NaN-poisoned graph replays;
    ``edit(plan)`` may change the plan's rows and lengths in place first (the reference reads the
    same rows); ``seed`` draws the case (default ``batch * 3 + heads``)."""
    from dsv4_attn import SparseMLA, bench
    from dsv4_attn.common.registry import register_backend
    from dsv4_attn.portable.triton_backend import TritonBackend

    register_backend(name, TritonBackend(config))
    case_config = dataclasses.replace(bench.DECODE_CONFIGS[cfg], heads=heads)
    case = bench.make_decode_case(case_config, batch, mtp, torch.device("cuda"),
                                  seed=batch * 3 + heads if seed is None else seed)
    case.sink[0], case.sink[1] = math.inf, -math.inf  # head 0: all the weight on the sink, output 0
    mla = SparseMLA(case.spec, case.fmt, backend=name, max_tokens=case.q.shape[0])
    plan = mla.plan(case.batch)
    if edit is not None:
        edit(plan)
    out = torch.empty_like(case.q)

    def run():
        mla.forward(plan, case.kind, case.q, case.swa_cache, case.comp_cache, topk=case.topk, sink=case.sink, out=out)

    want = case.reference(plan)

    def check(what):
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"{what}: {int(out.isnan().sum())} output elements not written"
        err = metrics(out, want)
        assert_close(err, max_abs=False, what=f"{what} {cfg} H={heads} b={batch}")
        # bf16 output: one rounding of |out| (2^-8 relative) plus accumulation noise
        assert err["max_abs"] <= 1e-2 + 2**-7 * float(want.abs().max()), err
        assert float(out[:, 0].abs().max()) == 0.0

    eager_then_replays(run, out, check)


def assert_plan_freed_without_collection(mla: dsv4.SparseMLA, case: StepCase, kinds) -> None:
    """A step's plan, after every layer of ``kinds`` ran on it twice (the second call takes the
    bound or relocated path where a backend binds), is freed when its last reference goes, with the
    garbage collector off: nothing it caches (routes, backends' per-step metadata) refers back to
    it, so its per-step tensors are not held until a collection (an engine plans every step)."""
    import gc
    import weakref

    gc.disable()
    try:
        plan = mla.plan(case.batch)
        for _ in range(2):
            for kind in kinds:
                forward_poisoned(mla, plan, case, LayerKind.parse(kind))
        freed = weakref.ref(plan)
        del plan
        assert freed() is None, f"the plan is held: {[type(r).__name__ for r in gc.get_referrers(freed())]}"
    finally:
        gc.enable()
