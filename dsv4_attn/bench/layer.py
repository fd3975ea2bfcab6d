"""One layer per case (``--mode decode`` / ``prefill``): every backend timed on the same case, its
work (FLOPs, bytes, keys) against the roofline floor, its per-step cost, FlashMLA beside it, and
``--guard-cost``: the Triton kernels with and without their index range checks."""

from __future__ import annotations

import statistics

import torch

from ..common.layout import KVFormat, Record
from ..testing.errors import error_figures
from .cases import LayerCase, row_bytes
from .runners import _case_mla, _run_layer, api_runner, backend_mode, flashmla_runners, register_variant
from .timing import host_us, sync, time_callable


def per_step_us(case: LayerCase, backend: str, layer_us: float, reps: int, flush, graph: bool) -> tuple[float, float]:
    """(the backend's own per-step work in us, the index front end's plan() in us): a fresh step
    of one layer (plan() + the layer; Backend.prepare and its first-call work included) timed
    against plan() alone and the layer alone (``layer_us``: the step's work already done). What
    a step pays once per backend and layer shape however many layers share it (choices.py)."""
    mla = _case_mla(case, backend)
    out = torch.empty_like(case.q)
    step_s = time_callable(lambda: _run_layer(mla, mla.plan(case.batch), case, out), reps, flush, graph,
                           case.q.device).median
    plan_s = time_callable(lambda: mla.plan(case.batch), reps, flush, graph, case.q.device).median
    return max(0.0, (step_s - plan_s) * 1e6 - layer_us), plan_s * 1e6


def _valid_slots(rows: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The slots a launch attends (int32 [T, W] rows, their first ``lens`` entries that are >= 0),
    flattened: one entry per (token, key)."""
    col = torch.arange(rows.shape[1], device=rows.device)[None, :]
    return rows[(rows >= 0) & (col < lens[:, None])]


def _scopes(case: LayerCase, plan) -> list[tuple[torch.Tensor, Record]]:
    """Per scope of the case (the SWA scope first): (the valid slots its launch attends, one per
    (token, key), the scope cache's record)."""
    scopes = [(_valid_slots(plan.swa_rows, plan.swa_lens), case.fmt.swa_record)]
    if case.kind.has_comp_scope:
        rows, lens = plan.comp_scope(case.kind, case.topk)
        scopes.append((_valid_slots(rows, lens), case.fmt.comp_record))
    return scopes


def distinct_rows(case: LayerCase, plan) -> list[tuple[torch.Tensor, Record]]:
    """Per scope of the case (the SWA scope first): (the distinct global slots its launch attends,
    int64 [N], the scope cache's record)."""
    return [(torch.unique(slots).long(), record) for slots, record in _scopes(case, plan)]


def case_work(case: LayerCase, plan) -> tuple[float, float, int]:
    """(flops, bytes, valid keys) of a case from the plan's rows: FLOPs per (token, key) pair;
    bytes: each DISTINCT key row once at its cache record's size (tokens of one request share
    most rows: MTP tokens nearly all, prefill tokens their window and many top-k rows, so counting
    pairs would put the floor above what a kernel reading each row once needs), + q and out."""
    scopes = _scopes(case, plan)
    T, H, D = case.q.shape
    keys = sum(slots.numel() for slots, _ in scopes)
    flops = 4.0 * H * D * keys
    kv_bytes = sum(torch.unique(slots).numel() * row_bytes(record) for slots, record in scopes)
    nbytes = kv_bytes + 2 * T * H * D * 2
    return flops, nbytes, keys


def gather_ceiling_us(case: LayerCase, plan, reps: int, flush, graph: bool) -> tuple[float, str]:
    """(µs, launch shape) of the fastest ``bench.gather`` launch shape reading the case's distinct
    rows (its ``gather_us``)."""
    from . import gather

    gathers = gather.case_gathers(case, distinct_rows(case, plan))
    times = {f"{rows} rows x {warps} warps": time_callable(gather.gather_runner(gathers, rows, warps), reps, flush,
                                                          graph, case.q.device).median
             for rows, warps in gather.SHAPES}
    best = min(times, key=times.__getitem__)
    return times[best] * 1e6, best


def uncapturable(backend: str, case: LayerCase, plan) -> str | None:
    """Why ``backend`` (a name, or "auto": what it picks for the case) cannot run the case's phase
    inside a CUDA-graph capture (Backend.uncapturable), or None."""
    from ..common.backend import Phase
    from ..common.registry import get_backend

    name = plan.owner.backend_for(case.kind, case.phase, case.q.shape[0]) if backend == "auto" \
        else backend_mode(backend)[0]
    impl = get_backend(name)
    why = impl.uncapturable.get(Phase(case.phase)) if impl is not None else None
    return f"{name} {case.phase} cannot be graph-captured: {why}" if why else None


def run_case(case: LayerCase, backends: list[str], args, ceilings: dict, flush) -> dict:
    rows = {}
    ref_out = None
    plan0 = None
    for name in backends:
        run, out, plan = api_runner(case, name)
        plan0 = plan0 or plan
        timing = time_callable(run, args.reps, flush, not args.no_graph, case.q.device,
                               uncapturable(name, case, plan))
        run()
        sync(case.q.device)
        rows[name] = {**timing.as_us(), "host_us": host_us(run, case.q.device)}
        if name == "auto":
            rows[name]["picked"] = plan.owner.backend_for(case.kind, case.phase, case.q.shape[0])
        elif case.phase == "decode":
            rows[name]["per_step_us"], rows[name]["plan_us"] = per_step_us(case, name, rows[name]["us"], args.reps,
                                                                          flush, not args.no_graph)
        if ref_out is None:
            ref_out = out.clone()
        else:
            rows[name]["vs_first"] = error_figures(out, ref_out)
    flops, nbytes, keys = case_work(case, plan0)
    floor = max(nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["bf16_flops_per_s"])
    result = {"case": case.label, "phase": case.phase, "kind": case.kind.name, **case.extra, "s_q_per_req": case.s_q,
              "heads": case.q.shape[1], "tokens": case.q.shape[0], "valid_keys": keys, "flops": flops,
              "bytes": nbytes, "floor_us": floor * 1e6, "backends": rows}
    if case.phase == "decode" and case.q.device.type == "cuda" \
            and all(record.layout.packed for record in (case.fmt.swa_record, case.fmt.comp_record)):
        result["gather_us"], result["gather_shape"] = gather_ceiling_us(case, plan0, args.reps, flush,
                                                                        not args.no_graph)
    if not args.no_flashmla:
        for key, (run, out, how) in flashmla_runners(case, plan0).items():
            label = "flashmla" if key == "api" else "flashmla_raw"
            if run is None:
                result[label] = {"unavailable": how}
                continue
            try:
                timing = time_callable(run, args.reps, flush, not args.no_graph,
                                       uncapturable=uncapturable("flashmla", case, plan0) if key == "api" else None)
                run()
                torch.cuda.synchronize()
                vs_ours = error_figures(ref_out, out) if ref_out is not None else None
                result[label] = {**timing.as_us(), "via": how, "vs_ours": vs_ours}
            except Exception as exc:
                result[label] = {"unavailable": f"{type(exc).__name__}: {str(exc)[:200]}"}
    for r in rows.values():
        s = r["us"] * 1e-6
        r["tflops"] = flops / s / 1e12
        r["gbps"] = nbytes / s / 1e9
        r["x_floor"] = s / floor
        if "gather_us" in result:
            r["x_gather"] = r["us"] / result["gather_us"]
        for label in ("flashmla", "flashmla_raw"):
            fm = result.get(label, {}).get("us")
            if fm:
                r[f"speedup_vs_{label}"] = fm / r["us"]
    return result


def guard_variants(fmt: KVFormat) -> dict[str, tuple[str, str]]:
    """{kernel: (backend with range checks, backend without)} for every Triton kernel this GPU
    runs on ``fmt`` (registered as bench variants)."""
    impls = ["triton"]
    # the Gluon kernels' formats on sm_90 (hopper.py: the V4 record; hopper_records.py: V4.1's)
    if fmt in (KVFormat.MODEL1_FP8, KVFormat.MXFP8, KVFormat.NVFP4) and torch.cuda.get_device_capability() == (9, 0):
        impls.insert(0, "gluon")
    return {impl: (register_variant(f"{impl}-checked=impl={impl}"),
                   register_variant(f"{impl}-unchecked=impl={impl},range_checks=0")) for impl in impls}


def guard_cost(case: LayerCase, variants: dict[str, tuple[str, str]], args, flush) -> dict:
    """Per kernel: median µs with and without the range checks, timed A-B-B-A on ``case``, the
    checks' cost in percent, and whether both builds wrote the same bits."""
    res = {}
    for impl, (checked, unchecked) in variants.items():
        runs = {name: api_runner(case, name) for name in (checked, unchecked)}
        times: dict[str, list[float]] = {checked: [], unchecked: []}
        for name in (checked, unchecked, unchecked, checked):
            times[name].append(time_callable(runs[name][0], args.reps, flush, not args.no_graph).median)
        for run, _, _ in runs.values():
            run()
        torch.cuda.synchronize()
        with_us, without_us = (statistics.mean(times[n]) * 1e6 for n in (checked, unchecked))
        res[impl] = {"us_checked": with_us, "us_unchecked": without_us, "cost_pct": (with_us / without_us - 1) * 100,
                     "same_bits": bool(torch.equal(runs[checked][1], runs[unchecked][1]))}
    return res
