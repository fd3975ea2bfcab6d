"""Memory: the plan buffers reserved in vLLM's profiling run, before vLLM sizes its KV cache.

vLLM sizes the KV cache from what its profiling run leaves free (``v1/worker/gpu_worker.py``
``determine_available_memory``). In that run (``attn_metadata is None``) the planner allocates
every plan buffer later steps use -- every slot vLLM's KV-cache grouping predicts, the C128A
rows where a plan has C128A layers (one row set per ratio-128 table), the draft slot -- and the
decode backends' scratch (``SparseMLA.reserve``), so nothing is allocated after the profile.

And what vLLM would allocate for its own kernels but the plugin never reads is not allocated:
vLLM's DeepSeek-V4 compressed-cache metadata builder (``models/deepseek_v4/sparse_mla.py``
``DeepseekV4SparseMLAMetadataBuilder.__init__``) keeps two C128A row buffers for its FlashMLA
calls, decode global slots and prefill local indices, each ``max_num_batched_tokens x
round_up(cdiv(max_model_len, 128), 128)`` int32 (2 x 256 MiB at vLLM's defaults and 1M context;
its ROCm subclass, ``amd/rocm.py``, a third of the same size for ragged indices), and fills them
at every step (``_build_c128a_metadata``). The plugin builds its own rows (:mod:`.planner`), so
our C128A layers report a builder without them (:func:`without_c128a_rows`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ...api import SparseMLA
from ...common.batch import StepBatch
from ...common.spec import LayerKind, ModelSpec
from ..base import StepPlannerBase
from .gates import logger
from .metadata import PlanGroup


class PlanReservation:
    """The reservation half of :class:`.planner.StepPlanner`, over the planner's state below."""

    spec: ModelSpec
    max_tokens: int
    decode_tokens: int  # the most decode tokens of one launch (the decode backends' scratch)
    block_size: Callable[[], int]
    predict: Callable[[list], list[PlanGroup]] | None
    layers: list
    slots: list[SparseMLA]
    draft_slot: SparseMLA | None
    reserved_bytes: int | None
    _row_owner: dict[int, int]

    def _new_slot(self) -> SparseMLA:
        raise NotImplementedError  # StepPlanner's

    def reserve(self, device: torch.device) -> None:
        """Profiling / dummy run: allocate on ``device`` every plan buffer later steps will use,
        as vLLM's KV-cache grouping predicts them (once; later dummy runs change nothing)."""
        if self.reserved_bytes is not None:
            return
        targets = [t for t in self.layers if not getattr(t, "is_draft_layer", False)]
        drafts = [t for t in self.layers if getattr(t, "is_draft_layer", False)]
        groups = [PlanGroup("")]
        if self.predict is not None and targets:
            try:
                groups = self.predict(targets)
            except Exception as exc:  # noqa: BLE001 -- a prediction: serving goes on, loudly
                logger.warning("dsv4_attn: could not predict vLLM's KV-cache groups (%s: %s); plan buffers beyond "
                               "one slot will be allocated at the first step, outside vLLM's KV-cache budget",
                               type(exc).__name__, exc)
        while len(self.slots) < len(groups):
            self.slots.append(self._new_slot())
        owners: dict[Any, int] = {}  # ratio-128 table -> the slot that allocates its rows
        for index, (mla, group) in enumerate(zip(self.slots, groups)):
            owner = owners.setdefault(group.c128a_table, index) if group.has_c128a else index
            if owner != index:
                rows = self.slots[owner]._ensure_buffers(device).all_rows[LayerKind.C128A.ratio]
                mla._ensure_buffers(device).all_rows[LayerKind.C128A.ratio] = rows
                self._row_owner[index] = owner
            self._allocate(mla, device, group.has_c128a)
        if drafts:
            self.draft_slot = self.draft_slot or self._new_slot()
            self._allocate(self.draft_slot, device, any(t.dsv4_kind is LayerKind.C128A for t in drafts))
        self.reserved_bytes = _buffer_bytes(*self.slots, self.draft_slot)
        logger.info("dsv4_attn: reserved %.1f MiB of plan buffers during vLLM's memory profile (%d plan(s) per "
                    "step%s, %d with C128A rows, %d C128A row set(s); %d tokens)", self.reserved_bytes / 2**20,
                    len(groups), " + 1 per draft step" if drafts else "", sum(g.has_c128a for g in groups),
                    sum(g.has_c128a for g in groups) - len(self._row_owner), self.max_tokens)

    def _allocate(self, mla: SparseMLA, device: torch.device, c128a: bool) -> None:
        """Allocate ``mla``'s plan buffers (and C128A rows) by planning an empty batch."""
        empty = torch.zeros(0, 1, dtype=torch.int32)
        batch = StepBatch.from_lists([], [], empty, 64, comp_block_tables={LayerKind.C128A.ratio: empty} if c128a
                                     else {}, block_size=self.block_size(), max_model_len=self.spec.max_model_len,
                                     num_tokens=0, device=device)
        StepPlannerBase.reserve_buffers(mla, batch, self.decode_tokens)  # and the decode backends' scratch (aiter)

    def _warn_unreserved(self, what: str) -> None:
        if self.reserved_bytes is not None:
            logger.warning("dsv4_attn: allocating %s after vLLM's memory profile: it is outside vLLM's KV-cache "
                           "budget (the KV-cache groups differ from the prediction at profiling)", what)


def without_c128a_rows(backend: Any) -> type:
    """``backend`` (vLLM's DeepSeek-V4 compressed-cache backend class of a C128A layer) with a
    metadata builder that neither allocates nor builds vLLM's C128A rows: the metadata's
    ``c128a_*`` fields stay None (only vLLM's own attention kernels read them). Everything else
    of the builder -- block table, slot mapping, compressed slot mapping, request map -- is
    vLLM's. One class per ``backend`` (vLLM groups layers by the backend's class name)."""
    builder = _builder_without_c128a_rows(backend.get_builder_cls())
    return _backend_with_builder(backend, builder)


@functools.cache
def _backend_with_builder(backend: type, builder: type) -> type:
    return type(backend.__name__, (backend,), {
        "__module__": __name__, "get_builder_cls": staticmethod(lambda: builder),
        "__doc__": f"{backend.__name__} whose builder leaves vLLM's C128A rows out (dsv4_attn reads its own)."})


@functools.cache
def _builder_without_c128a_rows(builder: type) -> type:
    """``builder`` with :class:`_NoC128ARows` after it in the MRO, so that its own ``__init__``
    (ROCm's allocates ragged C128A indices ``max_tokens x c128a_max_compressed``: 0 here) runs
    on top of the one without the rows."""
    return type(builder.__name__, (builder, _no_c128a_rows_base()), {"__module__": __name__,
                                                                      "vllm_builder": builder})


@functools.cache
def _no_c128a_rows_base() -> type:
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4SparseMLAMetadataBuilder
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    class _NoC128ARows(DeepseekV4SparseMLAMetadataBuilder):
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
            # vLLM 0.33's DeepseekV4SparseMLAMetadataBuilder.__init__ without its C128A row buffers
            # (test_vllm_shim checks that every other attribute is there).
            AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)
            self.model_config = vllm_config.model_config
            self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
            self.topk_tokens = self.model_config.hf_config.index_topk
            max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
            self.req_id_per_token_buffer = torch.empty((max_tokens,), dtype=torch.int32, device=device)
            self.compress_ratio = int(kv_cache_spec.tokens_per_state)
            if self.compress_ratio > 1:
                self.compressed_slot_mapping_buffer = torch.empty(max_tokens, dtype=torch.int64, device=device)
            self.c128a_max_compressed = 0

        def _build_c128a_metadata(self, cm, req_id_per_token) -> dict:
            return {}

    return _NoC128ARows


def _buffer_bytes(*mlas: SparseMLA | None, all_rows_only: bool = False) -> int:
    """Bytes of the plan buffers of ``mlas`` (None or not yet planned: nothing), a tensor shared
    by several (C128A rows) once; ``all_rows_only``: just the rows of "all" kinds (C128A)."""
    tensors: dict[int, torch.Tensor] = {}
    for mla in mlas:
        buffers = mla._buffers if mla is not None else None
        if buffers is None:
            continue
        own = [t for pair in buffers.all_rows.values() for t in pair]
        if not all_rows_only:
            own += [buffers.positions, buffers.token_to_req, buffers.token_valid, *(buffers.window or ())]
        tensors.update((id(t), t) for t in own)
    return sum(t.numel() * t.element_size() for t in tensors.values())
