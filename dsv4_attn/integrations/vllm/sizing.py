"""Engine start: what vLLM's config lets dsv4_attn serve, and the limits sized from it.

Everything that can refuse refuses here, while vLLM builds the model (docs/vllm.md): the
reasons a layer cannot be served, and the planner's limits -- tokens per step, requests,
decode tokens per launch, block size as vLLM will resolve it -- taken from vLLM's own config.
"""

from __future__ import annotations

import functools

from ...common.platform import probe
from ...common.spec import ModelSpec, model_layer_kinds
from ..base import decode_launch_bound, reason
from .metadata import predicted_plan_groups
from .planner import StepPlanner


def unsupported_reasons(layer, vllm_config) -> list[str]:
    """Why dsv4_attn cannot serve this vLLM layer / configuration ([] = it can).

    The KV-cache dtype needs no check here: the layer classes this plugin accepts use vLLM's
    fp8_ds_mla layout, whose ``__init__`` maps every fp8 dtype to fp8_ds_mla and raises for the
    others before this runs (``_resolve_dsv4_kv_cache_dtype``).
    """
    reasons = []
    ratio = layer.compress_ratio
    block_size = resolved_block_size(layer, vllm_config)
    if ratio > 1 and block_size % ratio:
        reasons.append(f"--block-size: got {block_size}; allowed: a multiple of {ratio} (the ratio-{ratio} "
                       f"cache holds block_size // {ratio} entries per block); or leave --block-size unset "
                       "(vLLM then picks its compressed kernel's block size)")
    if getattr(layer, "max_image_tokens", 0):  # V4 only: V4.1 image tokens keep the causal window
        reasons.append("vision variant (vision_max_n_token > 0): in-image bidirectional SWA windows are "
                       "not modelled by dsv4_attn")
    spec = vllm_config.speculative_config
    if spec is not None and spec.use_dspark():
        reasons.append("DSpark speculative decoding: non-causal draft windows are not modelled by dsv4_attn")
    parallel = vllm_config.parallel_config
    if parallel.use_ubatching:
        reasons.append(
            f"micro-batching (--ubatch-size {parallel.ubatch_size}, --enable-dbo {parallel.enable_dbo}): "
            "vLLM runs the micro-batches' forwards interleaved, each with its own metadata, and they would "
            "overwrite each other's plan buffers; allowed: --ubatch-size 0 or 1 without --enable-dbo")
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            reasons.append(reason(name, getattr(parallel, name), "1",
                                  "context-parallel KV sharding is not modelled by dsv4_attn"))
    extra = vllm_config.additional_config
    if isinstance(extra, dict) and extra.get("decode_backend", "auto") != "auto":
        reasons.append(f"additional_config decode_backend={extra['decode_backend']!r}: DeepSeek-V4.1's specialized "
                       "decode runs FULL-graph decode steps on its own attention kernels, which never reach this "
                       "layer's, so dsv4_attn would be bypassed; allowed: decode_backend 'auto'")
    if getattr(vllm_config.kernel_config, "monokernel", False):
        reasons.append("--monokernel: decode steps of the eligible layers run vLLM's mono decode kernel and "
                       "never reach this layer's attention, so dsv4_attn would be bypassed; drop --monokernel")
    return reasons


def resolved_block_size(layer, vllm_config) -> int:
    """The KV-cache block size (uncompressed tokens) vLLM will run ``layer`` with. vLLM builds the
    model while ``cache_config.block_size`` still holds its placeholder default (16) and resolves
    it only after ``load_model`` (``v1/executor/multiproc_executor.py`` ->
    ``platforms/interface.py`` ``update_block_size_for_backend``): ``--block-size`` when given,
    else a size every layer's attention backend supports -- a multiple of the compressed
    backend's kernel block (DeepSeek-V4: 256; V4.1: 64 on SM90, 128 on SM100), the size
    predicted here."""
    cache = vllm_config.cache_config
    if cache.user_specified_block_size:
        return cache.block_size
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):  # V4.1's backend reads the device through it
        return layer.get_attn_backend().get_preferred_block_size(cache.DEFAULT_BLOCK_SIZE)


_planners: dict[tuple, StepPlanner] = {}


def decode_tokens(vllm_config) -> int:
    """The most decode tokens one launch can hold: ``--max-num-seqs`` requests, each decoding 1 +
    ``num_speculative_tokens`` tokens (vLLM splits decodes at that query length,
    ``reorder_batch_threshold``), within ``--max-num-batched-tokens``. Prefill tokens are the
    other phase's launch, never a decode backend's, so the decode scratch (aiter) is sized by
    this, not by the step's token budget (up to ~4 GiB of AITER scratch at long context)."""
    sched, spec = vllm_config.scheduler_config, vllm_config.speculative_config
    per_request = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    return decode_launch_bound(sched.max_num_seqs, per_request, sched.max_num_batched_tokens)


def planner_for(layer, vllm_config) -> StepPlanner:
    """The planner shared by every layer with the same setup (created, and logged, once)."""
    topk = layer.topk_indices_buffer
    spec = ModelSpec(
        num_heads=layer.n_local_heads,
        topk=topk.shape[-1] if topk is not None else vllm_config.model_config.hf_config.index_topk,
        max_model_len=layer.max_model_len,
        window=layer.window_size,
        softmax_scale=layer.scale,
        layers=model_layer_kinds(vllm_config.model_config.hf_config, layer.dsv4_model_kinds(vllm_config)),
    )
    sched = vllm_config.scheduler_config
    max_tokens = sched.max_num_batched_tokens
    # gfx942 writes the SWA cache in FNUZ fp8 and the compressed cache in OCP (docs/rocm.md).
    # No block size in the key: vLLM has not resolved it yet (resolved_block_size); steps carry it.
    key = (spec, max_tokens, max(sched.max_num_seqs, max_tokens), probe().fp8_dialect, layer.dsv4_kv_format())
    if key not in _planners:
        planner = StepPlanner(*key, predict=functools.partial(predicted_plan_groups, vllm_config),
                              block_size=lambda: vllm_config.cache_config.block_size,
                              decode_tokens=decode_tokens(vllm_config))
        planner.log(type(layer))
        _planners[key] = planner
    return _planners[key]
