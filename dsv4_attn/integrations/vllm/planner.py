"""The planner: one plan per KV-cache group and step, shared by the layers of the group.

Every layer of one model setup shares a :class:`StepPlanner` (:func:`.sizing.planner_for`);
the plan-buffer reservation at engine start is :class:`.memory.PlanReservation`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...api import SparseMLA
from ...common.batch import StepBatch
from ...common.layout import Fp8Dialect, KVFormat
from ...common.plan import StepPlan
from ...common.spec import LayerKind, ModelSpec
from ..base import StepPlannerBase, describe_backends
from .gates import logger
from .memory import PlanReservation, _buffer_bytes
from .metadata import PlanGroup, has_metadata, metadata_of, plan_groups, step_batch


class StepPlanner(PlanReservation, StepPlannerBase):
    """The StepPlans of every layer of one model setup (spec, token budget, dialect, KV format).

    A step is one forward pass: vLLM's ForwardContext (a new one per forward, holding that
    forward's ``attn_metadata`` dict), weakly referenced, so that no plan -- and none of vLLM's
    buffers a plan's batch points to -- outlives its forward (vLLM's CUDA-graph memory profile
    tears down a throwaway KV cache and its builders, and must get their memory back). Target
    layers: at the step's first layer the layers are split into
    plan groups (:func:`plan_groups`, keyed by the identities of the metadata objects, which
    vLLM builds once per KV-cache group and step); each group's plan is built by its first layer
    and reused by the others. Draft (MTP) layers -- vLLM's ``is_draft_layer`` -- plan at every
    call into a slot of their own: vLLM's speculator updates the draft metadata in place between
    draft steps (``update_draft_decode_metadata``) and records the whole draft loop in one CUDA
    graph, so no Python-visible key changes between draft steps, while each draft forward runs
    one attention layer, so planning every call costs nothing extra.

    Every plan lives in a slot (a SparseMLA with buffers for ``max_tokens`` tokens); the
    profiling run (:meth:`reserve`) allocates all slots a step will use, C128A rows included, so
    vLLM's memory profile counts them before it sizes the KV cache. Target slots whose plans read
    one ratio-128 table (V4: every plan; vLLM puts all compressed caches in one KV-cache group)
    share one C128A row set (``max_tokens x c128a_width`` int32: 256 MiB at 1M context and 8192
    tokens): each plan of the step rewrites the same rows, so whichever plan a step builds first,
    the rows every C128A layer reads are its step's.

    ``block_size()``: the engine's compressed-cache block size, asked only from the profiling run
    on (vLLM resolves it after building the model; steps carry it in their metadata).
    ``decode_tokens``: the most decode tokens of one launch (what the decode backends' scratch is
    reserved for; default ``max_tokens``).
    """

    def __init__(self, spec: ModelSpec, max_tokens: int, max_reqs: int, swa_dialect: Fp8Dialect,
                 fmt: KVFormat = KVFormat.MODEL1_FP8, predict: Callable[[list], list[PlanGroup]] | None = None,
                 *, block_size: Callable[[], int], decode_tokens: int | None = None) -> None:
        self.spec, self.max_tokens, self.max_reqs = spec, max_tokens, max_reqs
        self.decode_tokens = decode_tokens or max_tokens
        self.swa_dialect, self.block_size, self.fmt = swa_dialect, block_size, fmt
        self.predict = predict
        super().__init__()
        self.layers: list = []
        self.slots: list[SparseMLA] = [self._new_slot()]  # backend refusals surface here: engine start
        self.draft_slot: SparseMLA | None = None
        self.reserved_bytes: int | None = None  # set by reserve()
        self._forward: weakref.ref | None = None  # the step's forward pass
        self._step_key: tuple[int, int] | None = None  # (id(attn_metadata), num tokens) within it
        self._layer_plan: dict[str, int] = {}
        self._groups: list[PlanGroup] = []
        self._plans: dict[int, tuple[SparseMLA, StepPlan]] = {}
        self._row_owner: dict[int, int] = {}  # slot -> the slot whose C128A rows it shares (reserve())

    def _new_slot(self) -> SparseMLA:
        return SparseMLA(self.spec, self.fmt, max_tokens=self.max_tokens, max_reqs=self.max_reqs,
                         swa_dialect=self.swa_dialect, comp_dialect=Fp8Dialect.OCP)

    def add_layer(self, layer) -> None:
        self.layers.append(layer)

    # ---- per layer call ------------------------------------------------------------------------
    def attend(self, layer, attn_metadata: dict, q: torch.Tensor, output: torch.Tensor, forward) -> None:
        """One layer's attention for the step ``attn_metadata`` (vLLM's per-layer-name metadata
        dict): q bf16 [T, H, 512] (H may be below output's head count: zero-padded here), output
        bf16 [T, padded_heads, 512] written in place. ``layer``: a layer set up by this planner
        (``prefix``, ``swa_cache_layer``, ``dsv4_kind``, ``dsv4_comp_prefix``, ``dsv4_comp_cache()``,
        ``topk_indices_buffer``, ``attn_sink``, ``is_draft_layer``). ``forward``: a weak-referenceable
        object that lives as long as the forward pass and no longer (vLLM's ForwardContext)."""
        kind = layer.dsv4_kind
        if getattr(layer, "is_draft_layer", False):
            mla, plan = self._draft_plan(layer, attn_metadata, q.shape[0])
        else:
            mla, plan = self._target_plan(layer, attn_metadata, q.shape[0], forward)
        if q.shape[1] < output.shape[1]:  # FlashInfer-SM120 base: q arrives at the live head count
            q = F.pad(q, (0, 0, 0, output.shape[1] - q.shape[1]))
        mla.forward(plan, kind, q, layer.swa_cache_layer.kv_cache,
                    layer.dsv4_comp_cache() if kind.has_comp_scope else None,
                    topk=layer.topk_indices_buffer if kind.uses_topk else None,
                    sink=layer.attn_sink, out=output)

    def _target_plan(self, layer, attn_metadata: dict, num_tokens: int, forward) -> tuple[SparseMLA, StepPlan]:
        metadata_of(attn_metadata, layer.swa_cache_layer.prefix, layer)
        if layer.dsv4_kind.has_comp_scope:
            metadata_of(attn_metadata, layer.dsv4_comp_prefix, layer)
        key = (id(attn_metadata), num_tokens)  # the dict lives while we plan from it: its id is unique
        if self._forward is None or self._forward() is not forward or key != self._step_key:  # a new step
            live = [t for t in self.layers
                    if not getattr(t, "is_draft_layer", False) and has_metadata(t, attn_metadata)]
            self._layer_plan, self._groups = plan_groups(live, lambda prefix: id(attn_metadata[prefix]))
            self._forward, self._step_key, self._plans = weakref.ref(forward, self._forward_ended), key, {}
            self._unshare_other_tables()
        index = self._layer_plan[layer.prefix]
        if index not in self._plans:
            group = self._groups[index]
            comp = {ratio: attn_metadata[prefix] for ratio, prefix in group.comp_prefixes}
            batch = self.step_batch(attn_metadata[group.swa_prefix], comp, num_tokens)
            self._plans[index] = self._plan(self._slot(index, group), batch)
        return self._plans[index]

    def _unshare_other_tables(self) -> None:
        """A slot keeps sharing C128A rows only while its plan and the owner's read one ratio-128
        table this step (as vLLM's grouping predicted at profiling); otherwise it gets rows of its
        own at its next plan (outside vLLM's budget: :meth:`_slot` says so)."""
        groups = self._groups
        for index, owner in list(self._row_owner.items()):
            if max(index, owner) < len(groups) and groups[index].c128a_table == groups[owner].c128a_table:
                continue
            del self._row_owner[index]
            buffers = self.slots[index]._buffers
            if buffers is not None:
                buffers.all_rows.pop(LayerKind.C128A.ratio, None)

    def _forward_ended(self, ref: weakref.ref) -> None:
        """The step's forward pass is gone: drop its plans (they point into vLLM's buffers)."""
        if ref is self._forward:
            self._forward, self._step_key, self._plans = None, None, {}

    def _draft_plan(self, layer, attn_metadata: dict, num_tokens: int) -> tuple[SparseMLA, StepPlan]:
        kind = layer.dsv4_kind
        swa_md = metadata_of(attn_metadata, layer.swa_cache_layer.prefix, layer)
        comp = {kind.ratio: metadata_of(attn_metadata, layer.dsv4_comp_prefix, layer)} if kind.has_comp_scope else {}
        if self.draft_slot is None:
            self._warn_unreserved("the draft (MTP) layers' slot")
            self.draft_slot = self._new_slot()
        # The model's C128A width: vLLM updates the draft metadata in place between draft steps
        # (its lengths grow; its max_seq_len does not).
        return self._plan(self.draft_slot, step_batch(swa_md, comp, num_tokens, self.spec, self.block_size,
                                                      bound_width=False))

    def _slot(self, index: int, group: PlanGroup) -> SparseMLA:
        while len(self.slots) <= index:
            self._warn_unreserved(f"plan slot {len(self.slots)}")
            self.slots.append(self._new_slot())
        mla = self.slots[index]
        if group.has_c128a and self.reserved_bytes is not None and _buffer_bytes(mla, all_rows_only=True) == 0:
            self._warn_unreserved(f"the C128A rows of plan slot {index}")
        return mla

    def _plan(self, mla: SparseMLA, batch: StepBatch) -> tuple[SparseMLA, StepPlan]:
        return mla, self.plan_step(mla, batch)

    def step_batch(self, swa_md, comp_mds: dict, num_tokens: int) -> StepBatch:
        """This model's StepBatch of a step (:func:`.metadata.step_batch`)."""
        return step_batch(swa_md, comp_mds, num_tokens, self.spec, self.block_size)

    def log(self, layer_cls: type) -> None:
        logger.info("dsv4_attn: DeepSeek-V4 attention layers of class %s run on dsv4_attn %s", layer_cls.__name__,
                    describe_backends(self.slots[0]))
