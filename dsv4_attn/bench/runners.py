"""What the bench runs: one layer or one whole step through the public API (``SparseMLA``), and
FlashMLA beside it three ways (through its adapter, its raw op on the plan's rows, and a whole
decode step driven the way vLLM 0.33 drives it); the raw op's library is loaded once."""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..common.layout import KVFormat
from ..common.spec import HEAD_DIM, LayerKind
from .cases import LayerCase, ModelStep


def _needed(t: torch.Tensor | None, what: str) -> torch.Tensor:
    """``t``, which the case's layer kind has (a compressed cache, its rows, a top-k)."""
    if t is None:
        raise ValueError(f"{what}: got None; allowed: a tensor (the layer kind has a compressed scope)")
    return t


BATCH_INVARIANT = "+batch-invariant"  # a bench row: the backend under SparseMLA(batch_invariant=True)


def backend_mode(name: str) -> tuple[str, bool]:
    """(the registered backend, batch-invariant mode?) of a bench row name such as
    ``triton+batch-invariant`` (``--batch-invariant``)."""
    return (name[:-len(BATCH_INVARIANT)], True) if name.endswith(BATCH_INVARIANT) else (name, False)


def _case_mla(case: LayerCase, backend: str):
    """A SparseMLA for ``case`` on ``backend`` (a bench row name), sized for its tokens and requests."""
    from ..api import SparseMLA

    name, batch_invariant = backend_mode(backend)
    return SparseMLA(case.spec, case.fmt, backend=name, device=case.q.device, batch_invariant=batch_invariant,
                     max_tokens=max(case.q.shape[0], 1), max_reqs=max(case.num_reqs, 1))


def _run_layer(mla, plan, case: LayerCase, out: torch.Tensor) -> None:
    mla.forward(plan, case.kind, case.q, case.swa_cache, case.comp_cache, topk=case.topk, sink=case.sink, out=out)


def api_runner(case: LayerCase, backend: str):
    """A callable running one layer through the public API, and its SparseMLA + plan."""
    mla = _case_mla(case, backend)
    plan = mla.plan(case.batch)
    out = torch.empty_like(case.q)
    return functools.partial(_run_layer, mla, plan, case, out), out, plan


NO_RAW_FLASHMLA = "no FlashMLA library with vLLM 0.33's op schemas (dsv4-attn probe says which were tried)"


def flashmla_lib() -> str | None:
    """The FlashMLA library file named by ``DSV4_ATTN_FLASHMLA_LIB`` (the run's facts), or None."""
    from .. import envs

    return envs.FLASHMLA_LIB.get() or None


def raw_flashmla_ops():
    """FlashMLA's raw op namespace as vLLM calls it (``Backend.raw_ops`` of the flashmla backend:
    the library it loaded, from a package or ``DSV4_ATTN_FLASHMLA_LIB``), or None."""
    from ..common.registry import get_backend

    flashmla = get_backend("flashmla")
    return flashmla.raw_ops() if flashmla is not None else None


def flashmla_runners(case: LayerCase, plan) -> dict:
    """{'api': (callable, out, how) or (None, None, reason), 'raw': ...} for FlashMLA."""
    return {"api": flashmla_api_runner(case), "raw": flashmla_raw_runner(case, plan)}


def flashmla_api_runner(case: LayerCase):
    """FlashMLA through ``SparseMLA(backend="flashmla")`` (adapter included), or (None, None, why)."""
    try:
        from ..common import registry
        from ..common.backend import Phase
        from ..common.platform import probe

        reasons = registry.reasons_for("flashmla", probe(), case.spec, case.fmt, case.kind, Phase(case.phase))
    except Exception as exc:
        reasons = [f"{type(exc).__name__}: {exc}"]
    if not reasons:
        try:
            run, out, _ = api_runner(case, "flashmla")
            return run, out, "api"
        except Exception as exc:
            reasons = [f"{type(exc).__name__}: {exc}"]
    return None, None, "; ".join(reasons)


def raw_decode(ops, q, swa_kv, swa_idx, swa_lens, sink, sched: list, comp, scale: float, out) -> None:
    """One ``sparse_decode_fwd`` call as vLLM 0.33 makes it (models/deepseek_v4/nvidia/flashmla.py):
    q bf16 [T, 1, H, 512], swa_kv uint8 [nb, bs, 1, 584], swa_idx int32 [T, 1, W], swa_lens int32
    [T], sink float32 [H]; ``comp`` None (window-only layer) or the extra scope (kv, rows int32
    [T, 1, K], lens int32 [T]); ``sched`` [tile_scheduler_metadata, num_splits]: [None, None]
    makes this call plan them, kept in ``sched`` for the next calls of the same launch shape;
    out bf16 [T, 1, H, 512], written."""
    comp_kv, comp_idx, comp_lens = comp or (None, None, None)
    res = ops.sparse_decode_fwd(q, swa_kv, swa_idx, swa_lens, sink, sched[0], sched[1], comp_kv, comp_idx, comp_lens,
                                512, scale, out, False)  # False: split-KV allowed (enable_batch_invariant)
    sched[0], sched[1] = res[2], res[3]


def vllm_padded(q: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q bf16 [T, H, 512] and sink float32 [H] as vLLM's attention layer holds them for FlashMLA
    (models/deepseek_v4/attention.py): q zero-filled and the sink -inf on the padding heads, up to the
    64 or 128 heads FlashMLA's kernels take (vLLM's ``get_padded_num_q_heads`` in
    models/deepseek_v4/nvidia/flashmla.py, the adapter's ``flashmla.padded_heads``). Built once,
    outside the timed calls: vLLM's q producer writes its padded buffer, and the sink is a padded
    parameter."""
    from ..cuda.flashmla import padded_heads

    T, H, D = q.shape
    heads = padded_heads(H)
    if heads == H:
        return q, sink
    q_pad = torch.zeros(T, heads, D, dtype=q.dtype, device=q.device)
    q_pad[:, :H] = q
    sink_pad = torch.full((heads,), float("-inf"), dtype=sink.dtype, device=sink.device)
    sink_pad[:H] = sink
    return q_pad, sink_pad


def flashmla_raw_runner(case: LayerCase, plan):
    """The raw FlashMLA op on the plan's rows (vLLM's call; decode with fewer than 64 heads padded to
    64 as vLLM pads them), or (None, None, why)."""
    ops = raw_flashmla_ops()
    if ops is None or case.fmt is not KVFormat.MODEL1_FP8:
        return None, None, NO_RAW_FLASHMLA if ops is None else \
            f"raw FlashMLA reads MODEL1 caches only, not {case.fmt.value}"
    T, H, D = case.q.shape
    if H > 128 or (case.phase != "decode" and H not in (64, 128)):
        return None, None, f"FlashMLA needs 64 or 128 heads, got {H}"
    scale = case.spec.scale
    comp_rows, comp_lens = plan.comp_scope(case.kind, case.topk)
    if case.phase == "decode":
        swa_kv = case.swa_cache.unsqueeze(2)
        comp = None if comp_rows is None else (_needed(case.comp_cache, "comp_cache").unsqueeze(2),
                                               comp_rows.view(T, 1, -1), comp_lens)
        q_pad, sink = vllm_padded(case.q, case.sink)
        Hp = q_pad.shape[1]
        idx = plan.swa_rows.view(T, 1, -1)
        out = torch.empty_like(q_pad)
        sched: list = [None, None]

        def run_decode():
            raw_decode(ops, q_pad.view(T, 1, Hp, D), swa_kv, idx, plan.swa_lens, sink, sched, comp, scale,
                       out.view(T, 1, Hp, D))

        run_decode()  # plans FlashMLA's tile scheduler once; the timed calls reuse it (as vLLM's later layers)
        how = "raw op (scheduler planned once, reused)" + (f"; {H} heads padded to {Hp} as vLLM" if Hp != H else "")
        return run_decode, out[:, :H], how
    # prefill: kernel only, on a ready bf16 workspace holding the token's keys (dequantized rows)
    from ..common.layout import gather

    comp_rows, lens_c = _needed(comp_rows, "comp rows"), _needed(comp_lens, "comp lens")
    rows = torch.cat([comp_rows, plan.swa_rows], dim=1)
    valid_c = torch.arange(comp_rows.shape[1], device=rows.device)[None, :] < lens_c[:, None]
    uniq_swa = torch.unique(plan.swa_rows[plan.swa_rows >= 0])
    uniq_comp = torch.unique(comp_rows[(comp_rows >= 0) & valid_c])
    kv = torch.cat([gather(_needed(case.comp_cache, "comp_cache"), case.fmt, uniq_comp),
                    gather(case.swa_cache, case.fmt, uniq_swa)])
    kv = kv.to(torch.bfloat16).view(-1, 1, D)
    comp_map = torch.full((int(comp_rows.max()) + 1,), -1, dtype=torch.int64, device=rows.device)
    comp_map[uniq_comp] = torch.arange(uniq_comp.numel(), device=rows.device)
    swa_map = torch.full((int(plan.swa_rows.max()) + 1,), -1, dtype=torch.int64, device=rows.device)
    swa_map[uniq_swa] = torch.arange(uniq_swa.numel(), device=rows.device) + uniq_comp.numel()
    ci = torch.where((comp_rows >= 0) & valid_c, comp_map[comp_rows.clamp(min=0).long()], -1)
    si = torch.where(plan.swa_rows >= 0, swa_map[plan.swa_rows.clamp(min=0).long()], -1)
    width = -(-(ci.shape[1] + si.shape[1]) // 128) * 128
    idx = torch.full((T, width), -1, dtype=torch.int32, device=rows.device)
    # compressed first, then SWA (vLLM's combine order), valid entries packed to the left
    packed = torch.cat([ci, si], dim=1)
    order = torch.argsort((packed < 0).to(torch.int8), dim=1, stable=True)
    packed = torch.gather(packed, 1, order)
    idx[:, : packed.shape[1]] = packed.to(torch.int32)
    topk_len = (packed >= 0).sum(1).to(torch.int32)
    out = torch.empty_like(case.q)

    def run_prefill():
        ops.sparse_prefill_fwd(case.q, kv, idx.view(T, 1, width), scale, 512, case.sink, topk_len, out)

    return run_prefill, out, "raw op (kernel only, bf16 workspace ready)"


VARIANT_PREFIX = "t:"  # the names of --variant backends, registered in the bench's process only


def register_variant(spec_str: str) -> str:
    """Register a TritonBackend with a KernelConfig under 't:<label>'; returns the name."""
    from ..common.registry import register_backend
    from ..portable.kernels.ops import KernelConfig
    from ..portable.triton_backend import TritonBackend

    label, _, body = spec_str.partition("=")
    kw: dict[str, Any] = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        kw[key] = value if key in ("dot_dtype", "impl") else int(value)
    name = f"{VARIANT_PREFIX}{label}"
    register_backend(name, TritonBackend(KernelConfig(**kw)))
    return name


# ---- whole decode steps -------------------------------------------------------------------------


def api_step_runner(case: ModelStep, backend: str):
    """(callable, outs, SparseMLA): one step through the public API, ``plan()`` once and then
    ``forward()`` of every layer into ``outs`` (bf16 [T, H, 512] per layer)."""
    from ..api import SparseMLA

    mla = SparseMLA(case.spec, case.fmt, backend=backend, device=case.batch.device, max_tokens=case.num_tokens,
                    max_reqs=case.num_reqs)
    outs = [torch.empty_like(layer.q) for layer in case.layers]

    def run():
        plan = mla.plan(case.batch)
        for layer, out in zip(case.layers, outs):
            mla.forward(plan, layer.kind, layer.q, layer.swa_cache, layer.comp_cache, topk=layer.topk,
                        sink=layer.sink, out=out)

    return run, outs, mla


def vllm_c128a_width(max_seq_len: int, model_width: int) -> int:
    """The C128A row width vLLM 0.33 builds per step (models/deepseek_v4/sparse_mla.py
    ``_build_c128a_metadata``): the next power of two >= the longest request's entries, at least
    128, at most the model's width (``ModelSpec.all_width(128)``)."""
    entries = max(max_seq_len // 128, 1)
    return min(max(1 << (entries - 1).bit_length(), 128), model_width)


def flashmla_vllm_step_runner(case: ModelStep):
    """FlashMLA driven the way vLLM 0.33 drives a decode step, or (None, None, why).

    Per step (vLLM: v1/attention/backends/mla/sparse_swa.py ``build`` and
    models/deepseek_v4/sparse_mla.py ``_build_c128a_metadata``): token -> request, token
    validity, the SWA rows and lengths, the C128A global rows at vLLM's width
    (``vllm_c128a_width``) and one empty scheduler holder per layer kind. Here ONE launch of this
    package's step kernel computes them, where vLLM spends several: a lower bound on vLLM's
    metadata work. Per layer (models/deepseek_v4/nvidia/flashmla.py ``_forward_decode``): a C4A
    layer translates its local top-k into global rows in one launch (vLLM's
    ``compute_global_topk_indices_and_lens``; here the front end's equivalent kernel), then
    ``sparse_decode_fwd``; the first layer of each kind plans the tile scheduler for the others."""
    ops = raw_flashmla_ops()
    if ops is None:
        return None, None, NO_RAW_FLASHMLA
    if case.fmt is not KVFormat.MODEL1_FP8:
        return None, None, f"vLLM runs FlashMLA on fp8_ds_mla caches, not {case.fmt.value}"
    T, H = case.num_tokens, case.spec.num_heads
    if H > 128:
        return None, None, f"FlashMLA needs 64 or 128 heads, got {H}"
    from ..common.indices import Tokens
    from ..portable.kernels.indices import build_step_rows, topk_rows

    batch, dev = case.batch, case.batch.device
    i32: dict[str, Any] = dict(dtype=torch.int32, device=dev)
    facts = Tokens(torch.zeros(T, dtype=torch.int64, device=dev), torch.zeros(T, **i32),
                   torch.zeros(T, dtype=torch.bool, device=dev))
    swa_rows, swa_lens = torch.empty(T, case.spec.window, **i32), torch.empty(T, **i32)
    c128 = LayerKind.C128A
    has_c128 = c128.ratio in batch.comp_block_tables
    width = vllm_c128a_width(int(batch.seq_lens.max()), case.spec.all_width(c128.ratio))
    # -1 past each length (lengths 0 at first): the step kernel then writes each row only as far as
    # needed (build_step_rows), never leaving a stale column
    c128_rows, c128_lens = torch.full((T, width), -1, **i32), torch.zeros(T, **i32)
    padded = [vllm_padded(layer.q, layer.sink) for layer in case.layers]  # fewer than 64 heads: padded as vLLM
    Hp = padded[0][0].shape[1]
    outs = [torch.empty_like(q) for q, _ in padded]

    def run():
        build_step_rows(batch.query_start_loc, batch.seq_lens, T, batch.swa_block_table, batch.swa_block_size,
                        case.spec.window, *facts, swa_rows, swa_lens,
                        batch.comp_block_tables.get(c128.ratio), batch.comp_block_size(c128) if has_c128 else 1,
                        c128_rows if has_c128 else None, c128_lens if has_c128 else None, c128.ratio)
        sched: dict = {}
        for layer, (q, sink), out in zip(case.layers, padded, outs):
            comp = None
            if layer.kind.uses_topk:
                rows, lens = topk_rows(facts, layer.kind.ratio, batch.comp_block_table(layer.kind),
                                       batch.comp_block_size(layer.kind), _needed(layer.topk, "topk"))
                comp = (_needed(layer.comp_cache, "comp_cache").unsqueeze(2), rows.view(T, 1, -1), lens)
            elif layer.kind.has_comp_scope:
                comp = (_needed(layer.comp_cache, "comp_cache").unsqueeze(2), c128_rows.view(T, 1, -1), c128_lens)
            raw_decode(ops, q.view(T, 1, Hp, HEAD_DIM), layer.swa_cache.unsqueeze(2), swa_rows.view(T, 1, -1),
                       swa_lens, sink, sched.setdefault(layer.kind, [None, None]), comp, case.spec.scale,
                       out.view(T, 1, Hp, HEAD_DIM))

    pad = f"; {H} heads padded to {Hp} as vLLM" if Hp != H else ""
    return run, [out[:, :H] for out in outs], f"vLLM 0.33's decode step: metadata once + per layer (C4A: " \
                                              f"translation) + raw op; C128A rows {width} wide{pad}"
