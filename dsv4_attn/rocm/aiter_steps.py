"""What a step of the `aiter` backend keeps: per-shape metadata, scratch buffers sized once, the
compacted index lists and persistent work plans built once per step, kernels warmed before a capture."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..common.backend import (
    LayerInputs,
)
from ..common.layout import CacheGeometry
from ..common.plan import StepPlan, stream_capturing
from .aiter_api import AiterAPI, call_by_keyword
from .aiter_features import PLAN_GRANULARITY, SINK_MAX, split_mgc
from .scratch import AiterScratch, ScopeBuffers, ScratchKey, compact, write_indices


class Scope(NamedTuple):
    """One scope of a layer as the entry points read it.

    name   "swa" or the compressed kind's name ("c4a", ...)
    rows   int32 [T, K] cache slots (-1 or past ``lens``: not a key)
    lens   int32 [T] valid entries per token
    cache  the scope's cache; geo its geometry
    """

    name: str
    rows: torch.Tensor
    lens: torch.Tensor
    cache: torch.Tensor
    geo: CacheGeometry


@dataclass(frozen=True)
class AiterMeta:
    """Per-step metadata of one layer shape (``AiterBackend.prepare``).

    path     the AITER entry point that runs the shape (one of PATHS)
    scratch  its buffers (the backend instance's: the same in every step)
    shared   the scopes whose indices every layer of the shape reads, by scope name, built by the
             first layer that reads them: the window (the window-only shape's, when it runs on the
             same scratch) and an "all" kind's rows. Top-k scopes are rebuilt per layer.
    """

    path: str
    scratch: AiterScratch
    shared: dict[str, ScopeBuffers]



class AiterSteps:
    """The per-step machinery the three entry points share (scratch, indices, warm-up)."""

    max_decode_tokens: int
    max_splits: int
    persistent_max_batch: int
    fp8_compute: bool
    _scratch: dict[ScratchKey, AiterScratch]
    _warmed: set[tuple]

    def _get_scratch(self, api: AiterAPI, key: ScratchKey) -> AiterScratch:
        if key not in self._scratch:
            def info() -> tuple:
                return call_by_keyword(api.function("get_mla_metadata_info_v1"), batch_size=key.max_tokens,
                                       max_seqlen_qo=1, num_head_qo=key.heads, q_dtype=key.q_dtype,
                                       kv_dtype=key.kv_dtype, is_sparse=True, fast_mode=True,
                                       num_kv_splits=key.max_splits, max_split_per_batch=key.max_splits)

            self._scratch[key] = AiterScratch.allocate(key, info if key.persistent else None)
        return self._scratch[key]

    def _scopes(self, plan: StepPlan, layer: LayerInputs) -> list[Scope]:
        """(scope name, rows, lens, cache, geometry) of the layer's scopes, SWA first."""
        scopes = [Scope("swa", plan.swa_rows, plan.swa_lens, layer.swa_cache, layer.swa_geo)]
        if layer.kind.has_comp_scope:
            comp = layer.compressed(plan)
            scopes.append(Scope(layer.kind.name.lower(), comp.rows, comp.lens, comp.cache, comp.geo))
        return scopes

    def _indices(self, plan: StepPlan, meta: AiterMeta, name: str, parts, per_layer: bool,
                 api: AiterAPI) -> ScopeBuffers:
        """Build a scope's compacted indices and persistent work plan once per step (kept in
        ``meta.shared``), or every call for top-k kinds (``per_layer``): their rows, and so their
        key counts (holes are dropped), differ per layer. ``parts``: (rows, lens, capacity) per
        cache the scope reads."""
        if not per_layer and name in meta.shared:
            return meta.shared[name]
        scr = meta.scratch
        sb = scr.scopes[name]
        keep, pos, counts = compact(list(parts), sb.width)
        unit = 0
        if scr.key.layout == "padded":
            unit = self._split_count(plan.num_tokens, sb.width, scr.key.heads) * split_mgc(scr.key.heads)
        write_indices(sb, keep, pos, counts, torch.cat([p[0] for p in parts], dim=1), scr.key.layout, unit,
                      scr.rows.shape[0] - 1)  # -1: nothing gathered
        if scr.key.persistent:  # the plan bakes in each token's key range
            self._fill_work_plan(api, scr, sb, plan.num_tokens)
        if not per_layer:
            meta.shared[name] = sb
        return sb

    @staticmethod
    def _fill_work_plan(api: AiterAPI, scr: AiterScratch, sb: ScopeBuffers, T: int) -> None:
        k = scr.key
        wmd, wi, wis, ri, rfm, rpm = sb.meta
        call_by_keyword(api.function("get_mla_metadata_v1"), seqlens_qo_indptr=scr.qo_indptr[: T + 1],
                        seqlens_kv_indptr=sb.kv_indptr[: T + 1], kv_last_page_lens=scr.last_page[:T],
                        num_heads_per_head_k=k.heads, num_heads_k=1, is_causal=True, work_metadata_ptrs=wmd,
                        work_info_set=wis, work_indptr=wi, reduce_indptr=ri, reduce_final_map=rfm,
                        reduce_partial_map=rpm, page_size=1, kv_granularity=PLAN_GRANULARITY.get(k.heads, 16),
                        max_seqlen_qo=1, uni_seqlen_qo=1, fast_mode=True, topk=sb.width,
                        max_split_per_batch=k.max_splits, dtype_q=k.q_dtype, dtype_kv=k.kv_dtype)

    def _warm(self, key: tuple, runs: list[Callable[[], Any]]) -> None:
        """Run every kernel variant of a layer configuration once, eagerly, before its first use
        (AITER loads modules and compiles Triton kernels then, which a graph capture cannot do)."""
        if key in self._warmed:
            return
        if stream_capturing():
            raise ValueError(f"aiter: first decode of {key} inside a graph capture; allowed: one eager decode step "
                             "of every layer configuration before capturing (AITER loads kernels on first use)")
        for run in runs:
            run()
        self._warmed.add(key)


    @staticmethod
    def _stage_sink(scr: AiterScratch, sink: torch.Tensor | None, H: int) -> torch.Tensor:
        """The sink as the kernels take it: padded heads -inf, +inf (output 0) as SINK_MAX."""
        if sink is None:
            scr.sink.fill_(-math.inf)
        else:
            torch.clamp(sink.float(), max=SINK_MAX, out=scr.sink[:H])
        return scr.sink


    def _split_count(self, T: int, width: int, heads: int) -> int:
        """Splits per row in split mode: >= 2 (the LSE comes from the stage-2 reduce), more for
        small batches, at most one per ``mgc`` keys of the scope's width (every row's range is
        padded to ``splits * mgc`` sentinel-filled entries: scratch.py, layout "padded")."""
        return min(self.max_splits, max(2, math.ceil(512 / T)), max(2, math.ceil(width / split_mgc(heads))))

