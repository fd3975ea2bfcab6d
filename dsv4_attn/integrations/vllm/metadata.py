"""Metadata mapping: vLLM's per-step attention metadata -> the StepBatch of each plan.

vLLM metadata -> StepBatch (per step; vLLM orders the batch decodes first):

=============================  ==============================================================
StepBatch                      vLLM 0.33
=============================  ==============================================================
query_start_loc int32 [R+1]    ``DeepseekSparseSWAMetadata.query_start_loc`` (padded requests
                               repeat the last offset; tokens past it are CUDA-graph padding)
seq_lens int32 [R]             ``.seq_lens`` (include this step's tokens)
num_decode_tokens              ``.num_decode_tokens`` (split at 1 + speculative tokens)
swa_block_table / size         ``.block_table`` (this layer's SWA-cache group) / ``.block_size``
                               (64 tokens per block)
comp_block_tables[ratio]       ``DeepseekV4FlashMLAMetadata.block_table`` of the compressed-cache
                               group of each ratio among the plan's layers (none for a plan of
                               SWA-only layers); V4.1: the metadata of the layer's KV source
                               (``compressed_cache_prefix``), whose cache tensor it reads
block_size                     ``DeepseekV4FlashMLAMetadata.block_size`` (in UNCOMPRESSED tokens;
                               ratio-r blocks hold block_size // r entries): V4 256; V4.1 64 on
                               SM90, 128 on SM100
swa_start                      ``DeepseekSparseSWAMetadata.replay_start`` (V4.1 SWA bounded
                               replay; None otherwise)
max_seq_len                    ``DeepseekV4FlashMLAMetadata.max_seq_len`` (a host bound of the
                               lengths: the C128A rows' width; None in draft steps)
num_tokens                     ``q.shape[0]`` (padded token count)
topk (top-k layers)            the model's shared ``topk_indices_buffer`` [max_tokens, index_topk]
                               of LOCAL compressed positions, last written by the layer's indexer
                               (V4 C4A) or by its index source (V4.1 C1A / C2A)
=============================  ==============================================================

Positions are derived from query_start_loc/seq_lens on the device (they equal vLLM's
``positions``); nothing in a plan reads a device value on the host, so a plan built inside a
captured CUDA graph is rebuilt from vLLM's persistent buffers at every replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...common.batch import StepBatch
from ...common.spec import LayerKind, ModelSpec


def step_batch(swa_md, comp_mds: dict, num_tokens: int, spec: ModelSpec, block_size: Callable[[], int],
               bound_width: bool = True) -> StepBatch:
    """vLLM's DeepseekSparseSWAMetadata and the step's DeepseekV4FlashMLAMetadata per ratio
    -> StepBatch (device tensors and host ints vLLM already holds: no sync). vLLM's SWA
    builder hands V4.1 steps a ``replay_start`` (zeros when nothing replays). ``block_size()``:
    the engine's compressed-cache block size, for a plan of window-only layers.
    ``bound_width``: hand over the compressed metadata's ``max_seq_len`` (the longest request,
    an upper bound vLLM also sizes its own C128A rows by; ``max_model_len`` when vLLM captures a
    CUDA graph) so the C128A rows are as wide as the step needs (StepBatch.max_seq_len)."""
    bounds = [getattr(md, "max_seq_len", None) for md in comp_mds.values()]
    known = [int(b) for b in bounds if b is not None]
    block_sizes = {md.block_size for md in comp_mds.values()}
    if len(block_sizes) > 1:
        raise ValueError(f"attn_metadata: got compressed-cache block sizes {sorted(block_sizes)}; allowed: one "
                         "block size (in uncompressed tokens) for every compressed cache of a step")
    return StepBatch(
        query_start_loc=swa_md.query_start_loc,
        seq_lens=swa_md.seq_lens,
        num_decode_tokens=swa_md.num_decode_tokens,
        swa_block_table=swa_md.block_table,
        swa_block_size=swa_md.block_size,
        comp_block_tables={ratio: md.block_table for ratio, md in comp_mds.items()},
        block_size=block_sizes.pop() if block_sizes else block_size(),
        max_model_len=spec.max_model_len,
        num_tokens=num_tokens,
        swa_start=getattr(swa_md, "replay_start", None),  # V4.1 SWA bounded replay
        max_seq_len=max(known) if bound_width and known and len(known) == len(bounds) else None,
    )


def has_metadata(layer, attn_metadata: dict) -> bool:
    return layer.swa_cache_layer.prefix in attn_metadata and (
        not layer.dsv4_kind.has_comp_scope or layer.dsv4_comp_prefix in attn_metadata)


def metadata_of(attn_metadata: dict, prefix: str, layer):
    if prefix not in attn_metadata:
        raise ValueError(f"attn_metadata: has no entry for {prefix}; allowed: the step's metadata of every "
                         f"cache of {layer.prefix} ({layer.dsv4_kind.name} layer)")
    return attn_metadata[prefix]


# ---- which layers share a plan --------------------------------------------------------------
@dataclass(frozen=True)
class PlanGroup:
    """The caches whose block tables one StepPlan is built from: an SWA cache and at most one
    compressed cache per ratio, each named by a layer prefix (the key of its metadata in vLLM's
    ``attn_metadata``)."""

    swa_prefix: str
    comp_prefixes: tuple[tuple[int, str], ...] = ()
    # The KV-cache group of its ratio-128 cache (``group_of``'s name for it; None without one):
    # plans of a step with the same one build the same C128A rows, so they share one row set.
    c128a_table: Any = field(default=None, compare=False)

    @property
    def has_c128a(self) -> bool:
        return any(ratio == LayerKind.C128A.ratio for ratio, _ in self.comp_prefixes)


def plan_groups(layers, group_of: Callable[[str], Any]) -> tuple[dict[str, int], list[PlanGroup]]:
    """Which layers can share one StepPlan: ({layer prefix: plan index}, [PlanGroup per plan]).

    A plan holds the SWA rows of one SWA-cache block table and the C128A rows of one ratio-128
    table, and C4A layers translate their top-k through the ratio-4 table in the plan's batch.
    So layers share a plan when their SWA caches are in one KV-cache group and, per ratio,
    their compressed caches are too: per SWA group, one plan per distinct compressed group of
    each ratio (one in vLLM 0.33's DeepSeek-V4 grouping, see docs/vllm.md). ``group_of(prefix)``
    names the KV-cache group of a cache (its metadata object at run time, vLLM's group index
    when predicting); ``layers`` have ``prefix``, ``swa_cache_layer.prefix``, ``dsv4_kind`` and
    ``dsv4_comp_prefix`` (the layer owning its compressed cache: itself, or V4.1's KV source).
    """
    per_swa: dict[Any, tuple[str, dict[int, list[tuple[Any, str]]]]] = {}  # SWA group -> ratio -> comp groups
    for layer in layers:
        swa_prefix = layer.swa_cache_layer.prefix
        _, comps = per_swa.setdefault(group_of(swa_prefix), (swa_prefix, {}))
        if layer.dsv4_kind.has_comp_scope:
            seen = comps.setdefault(layer.dsv4_kind.ratio, [])
            if all(gid != group_of(layer.dsv4_comp_prefix) for gid, _ in seen):
                seen.append((group_of(layer.dsv4_comp_prefix), layer.dsv4_comp_prefix))
    groups: list[PlanGroup] = []
    first: dict[Any, int] = {}
    for swa_gid, (swa_prefix, comps) in per_swa.items():
        first[swa_gid] = len(groups)
        for j in range(max([1] + [len(c) for c in comps.values()])):
            c128a = comps.get(LayerKind.C128A.ratio, [])
            groups.append(PlanGroup(swa_prefix, tuple((r, c[j][1]) for r, c in comps.items() if j < len(c)),
                                    c128a[j][0] if j < len(c128a) else None))
    index = {}
    for layer in layers:
        swa_gid, j = group_of(layer.swa_cache_layer.prefix), 0
        if layer.dsv4_kind.has_comp_scope:
            j = [gid for gid, _ in per_swa[swa_gid][1][layer.dsv4_kind.ratio]].index(group_of(layer.dsv4_comp_prefix))
        index[layer.prefix] = first[swa_gid] + j
    return index, groups


def predicted_plan_groups(vllm_config, layers) -> list[PlanGroup]:
    """The plans a step will need, from vLLM's own KV-cache grouping of this worker's layers
    (what its engine core computes after the memory profile). Raises what vLLM raises."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    kv_groups = get_global_kv_cache_groups(vllm_config, [get_kv_cache_spec(vllm_config)])
    group_index = {name: i for i, group in enumerate(kv_groups) for name in group.layer_names}
    return plan_groups(layers, group_index.__getitem__)[1]
