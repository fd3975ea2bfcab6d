"""A whole decode step per case (``--mode step``): ``plan()`` once + every attention layer captured
as one graph, for auto, each named backend and FlashMLA driven as vLLM drives it."""

from __future__ import annotations

import torch

from ..testing.errors import error_figures
from .cases import ModelStep
from .configs import STEP_CACHES
from .runners import api_step_runner, flashmla_vllm_step_runner
from .timing import sync, time_callable


def _layers_written(run, outs: list[torch.Tensor], device: torch.device) -> int:
    """Layers whose every output element one more run of ``run`` wrote (NaN-poisoned first)."""
    for out in outs:
        out.fill_(float("nan"))
    run()
    sync(device)
    return sum(not bool(out.isnan().any()) for out in outs)


def _compare_layers(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> dict:
    """The worst layer's differences between two runs' outputs."""
    per_layer = [error_figures(out, ref) for out, ref in zip(outs, refs)]
    return {"max_rel_l2": max(m["rel_l2"] for m in per_layer), "min_cosine": min(m["cosine"] for m in per_layer)}


def run_step_case(case: ModelStep, backends: list[str], args, flush) -> dict:
    """Times the whole step for ``auto`` and every named backend, and FlashMLA driven as vLLM
    drives it (unless --no-flashmla), in one run; per backend µs per step and per layer, the
    layers every element of whose output was written, what auto picked per kind, and the worst
    layer's difference from auto's outputs."""
    device, n = case.batch.device, len(case.layers)
    kinds = [layer.kind for layer in case.layers]
    rows, auto_outs = {}, None
    for name in ["auto"] + [b for b in backends if b != "auto"]:
        run, outs, mla = api_step_runner(case, name)
        timing = time_callable(run, args.reps, flush, not args.no_graph, device)
        rows[name] = {**timing.as_us(), "us_per_layer": timing.median * 1e6 / n,
                      "layers_written": _layers_written(run, outs, device),
                      "picked": {k.name: mla.backend_for(k, "decode", case.num_tokens) for k in dict.fromkeys(kinds)}}
        if auto_outs is None:
            auto_outs = outs
        else:
            rows[name]["vs_auto"] = _compare_layers(outs, auto_outs)
    result = {"case": case.label, "phase": "step", **case.extra, "s_q_per_req": case.s_q,
              "heads": case.spec.num_heads, "tokens": case.num_tokens, "layers": n,
              "layer_kinds": {k.name: kinds.count(k) for k in dict.fromkeys(kinds)}, "caches": STEP_CACHES,
              "backends": rows}
    if not args.no_flashmla:
        run, outs, how = flashmla_vllm_step_runner(case)
        if run is None:
            result["flashmla_vllm"] = {"unavailable": how}
        else:
            try:
                timing = time_callable(run, args.reps, flush, not args.no_graph, device)
                result["flashmla_vllm"] = {**timing.as_us(), "us_per_layer": timing.median * 1e6 / n, "via": how,
                                           "layers_written": _layers_written(run, outs, device),
                                           "vs_auto": _compare_layers(outs, auto_outs) if auto_outs else None}
            except Exception as exc:
                result["flashmla_vllm"] = {"unavailable": f"{type(exc).__name__}: {str(exc)[:200]}"}
    fm = result.get("flashmla_vllm", {}).get("us")
    for r in rows.values():
        if fm:
            r["speedup_vs_flashmla_vllm"] = fm / r["us"]
    return result
