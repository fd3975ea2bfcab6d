"""StepPlan: the per-step metadata, built ONCE per engine step and shared by every layer.

``SparseMLA.plan(batch)`` writes the per-token facts, the SWA rows and the rows of every
"all" layer kind (C128A) the batch has a block table for into buffers preallocated for the
maximum batch, and returns a StepPlan whose tensors are views of those buffers. A step handed
over as ready-made rows (:class:`~dsv4_attn.common.rows.StepRows`) takes the same path, but its
rows are viewed, not copied (only the per-token facts go into the buffers). Consequences:

* a decode step can be captured in a CUDA/HIP graph and replayed after ``plan()`` rewrote the
  buffers with the next step's contents (same num_tokens);
* a plan is valid until the next successful ``plan()`` call of the same SparseMLA: using an
  older plan raises (its buffers now hold another step). A refused ``plan()`` writes nothing
  (``common.checks.check_step`` runs first).

Backends keep per-step metadata in the plan through ``Backend.meta(plan, layer.shape)``: the
typed result of their ``prepare`` (FlashMLA's tile-scheduler metadata, AITER work buffers,
FlashInfer merged rows), built once per plan and layer shape.
Phase sub-plans (``plan.phase_plan(Phase.DECODE)``) view a token range of the same buffers
for backends that split decode and prefill launches.

The rows themselves come from a ``FrontEnd``: :class:`TorchFrontEnd` here (vectorized torch, any
device), or the Triton one in ``dsv4_attn.portable.kernels.indices`` that ``SparseMLA`` picks on
GPUs (one launch per step, one per top-k layer). Both write the same values and neither syncs
with the host, so both are safe inside a captured graph.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .batch import StepBatch
from .indices import IndexPair, Tokens, bounded_rows, check_local_topk, comp_rows_for, swa_rows_for
from .rows import GlobalRows, StepRows
from .spec import ALL_WIDTH_MULTIPLE, LayerKind, ModelSpec


class Phase(str, enum.Enum):
    """Which tokens of a step: the decode tokens (first) or the prefill tokens (after them)."""

    DECODE = "decode"
    PREFILL = "prefill"


@dataclass
class PlanBuffers:
    """Index buffers for up to ``max_tokens`` tokens (allocated once per SparseMLA).

    The rows are allocated by the first plan that builds them: the SWA rows (``max_tokens x W``
    int32, 512 B per token) by the first StepBatch plan, so a SparseMLA planning only StepRows
    (whose rows are the engine's, viewed) never pays for them; the rows of an "all" kind of
    ratio r (``max_tokens x spec.all_width(r)`` int32; C128A at 1M context and 8k tokens:
    256 MiB) by the first plan whose batch has a ratio-r block table, so plans for window-only
    KV-cache groups never pay for them. Do that first plan before a CUDA-graph capture.

    Invariant of the rows of an "all" kind: every column at or past a row's length (its entry in
    the lens buffer, as the last plan left it) is -1, over the buffer's whole width, whatever
    width a plan views. Readers may read a whole row; the front ends keep it cheaply: a row's
    previous length bounds its stale columns, so the Triton builder writes a row only up to the
    larger of its new and previous length (a CUDA graph captured at the model's width then writes
    what the step's requests need at every replay, not the width: ``_step_rows_kernel``).
    """

    spec: ModelSpec
    positions: torch.Tensor  # int64 [max_tokens]
    token_to_req: torch.Tensor  # int32 [max_tokens]
    token_valid: torch.Tensor  # bool [max_tokens]
    window: IndexPair | None = None  # SWA rows int32 [max_tokens, W], lens int32 [max_tokens] (window_rows())
    all_rows: dict[int, IndexPair] = field(default_factory=dict)  # ratio -> int32 [max_tokens, width], [max_tokens]

    @classmethod
    def allocate(cls, spec: ModelSpec, max_tokens: int, device: torch.device) -> PlanBuffers:
        return cls(
            spec=spec,
            positions=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            token_to_req=torch.zeros(max_tokens, dtype=torch.int32, device=device),
            token_valid=torch.zeros(max_tokens, dtype=torch.bool, device=device),
        )

    def window_rows(self) -> IndexPair:
        """The SWA row buffers (a StepBatch plan's), allocated on first use."""
        if self.window is None:
            dev = self.positions.device
            self.window = (torch.full((self.max_tokens, self.spec.window), -1, dtype=torch.int32, device=dev),
                           torch.zeros(self.max_tokens, dtype=torch.int32, device=dev))
        return self.window

    @property
    def max_tokens(self) -> int:
        return self.positions.shape[0]

    def all_kinds(self, batch: StepBatch) -> list[LayerKind]:
        """The model's "all" kinds whose block table the batch carries (their rows are built)."""
        return [k for k in self.spec.kinds if k.attends_all and k.ratio in batch.comp_block_tables]

    def rows_of(self, kind: LayerKind, batch: StepBatch) -> IndexPair:
        """The row buffers of an "all" kind (allocated on first use, at the model's width), their
        columns cut to what ``batch`` needs (:func:`active_width`)."""
        if kind.ratio not in self.all_rows:
            dev = self.positions.device
            self.all_rows[kind.ratio] = (
                torch.full((self.max_tokens, self.spec.all_width(kind.ratio)), -1, dtype=torch.int32, device=dev),
                torch.zeros(self.max_tokens, dtype=torch.int32, device=dev))
        rows, lens = self.all_rows[kind.ratio]
        return rows[:, : active_width(self.spec, batch, kind)], lens


def active_width(spec: ModelSpec, batch: StepBatch, kind: LayerKind) -> int:
    """Columns of an "all" kind's rows for ``batch``: the model's width, or with the batch's
    ``max_seq_len`` the next power of two >= its entries (at least ALL_WIDTH_MULTIPLE), as vLLM
    sizes its own C128A rows (models/deepseek_v4/sparse_mla.py ``_build_c128a_metadata``). Inside
    a CUDA-graph capture always the model's width: the kernels captured with it are replayed for
    every later step, whatever its lengths (a few widths overall: one compile of the row kernel
    each)."""
    full = spec.all_width(kind.ratio)
    bound = batch.max_seq_len
    if bound is None or capturing(batch.device):
        return full
    entries = max(bound // kind.ratio, 1)
    return min(max(1 << (entries - 1).bit_length(), ALL_WIDTH_MULTIPLE), full)


def torch_all_rows(tokens: Tokens, kind: LayerKind, batch: StepBatch, buffers: PlanBuffers) -> None:
    """Write the rows of "all" kind ``kind`` for ``tokens`` with torch ops: the columns the batch
    views, and -1 over the rest of each row of the buffer (PlanBuffers' invariant)."""
    rows, lens = buffers.rows_of(kind, batch)
    T = tokens.positions.shape[0]
    comp_rows_for(tokens, kind, batch.comp_block_table(kind), batch.comp_block_size(kind), rows.shape[1],
                  out=(rows[:T], lens[:T]))
    whole = buffers.all_rows[kind.ratio][0]
    if rows.shape[1] < whole.shape[1]:
        whole[:T, rows.shape[1]:].fill_(-1)


def capturing(device: torch.device) -> bool:
    """A CUDA / HIP graph capture is in progress on ``device``'s current stream."""
    return device.type == "cuda" and stream_capturing()


def stream_capturing() -> bool:
    """A CUDA / HIP graph capture is in progress on the current stream: torch's own query, without
    ``torch.cuda``'s wrapper (asked at layer calls); False on a torch without a GPU."""
    return _capture_query()()


@functools.cache
def _capture_query() -> Callable[[], bool]:
    query = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    return query if query is not None and torch.cuda.is_available() else (lambda: False)


_MISSING = object()


class FrontEnd(Protocol):
    """Builds a step's index rows (same values as ``dsv4_attn.common.indices``)."""

    name: str

    def step_rows(self, batch: StepBatch, buffers: PlanBuffers, num_tokens: int) -> None:
        """Write positions, token_to_req, token_valid, the SWA rows and the rows of every kind of
        ``buffers.all_kinds(batch)`` for tokens [0, num_tokens) into ``buffers``."""

    def warm(self, buffers: PlanBuffers, step_rows: bool = True) -> None:
        """Engine start: compile whatever ``topk_rows`` and (with ``step_rows``: steps given as a
        StepBatch) ``step_rows`` launch for ``buffers``' model (a no-op where nothing compiles),
        so that no step compiles."""

    def topk_rows(self, tokens: Tokens, kind: LayerKind, table: torch.Tensor, comp_block_size: int,
                  local_topk: torch.Tensor, num_slots: int | None = None, multiple: int = 1) -> IndexPair:
        """Rows int32 [T, round_up(K, multiple)] and lens int32 [T] of a top-k layer from its local
        top-k int32/int64 [T, K] (entries visible while ``< (pos+1) // kind.ratio``). With
        ``num_slots`` (the slots of the cache the rows index) every slot outside the cache is -1
        too, and columns past K are -1 padding (``indices.bounded_rows``): rows for a kernel that
        reads every entry but -1 (FlashMLA's decode)."""


class TorchFrontEnd:
    """Vectorized torch front end (any device): a few dozen small ops per step."""

    name = "torch"

    def step_rows(self, batch: StepBatch, buffers: PlanBuffers, num_tokens: int) -> None:
        T = num_tokens
        for buf, fact in zip((buffers.positions, buffers.token_to_req, buffers.token_valid), batch.token_facts()):
            buf[:T].copy_(fact)
        tokens = Tokens(buffers.positions[:T], buffers.token_to_req[:T], buffers.token_valid[:T])
        swa_rows, swa_lens = buffers.window_rows()
        swa_rows_for(tokens, batch.swa_block_table, batch.swa_block_size, buffers.spec.window,
                     out=(swa_rows[:T], swa_lens[:T]),
                     starts=batch.window_starts(tokens.token_to_req))
        for kind in buffers.all_kinds(batch):
            torch_all_rows(tokens, kind, batch, buffers)

    def warm(self, buffers: PlanBuffers, step_rows: bool = True) -> None:
        pass  # torch ops: nothing to compile

    def topk_rows(self, tokens: Tokens, kind: LayerKind, table: torch.Tensor, comp_block_size: int,
                  local_topk: torch.Tensor, num_slots: int | None = None, multiple: int = 1) -> IndexPair:
        rows, lens = comp_rows_for(tokens, kind, table, comp_block_size, local_topk)
        if num_slots is None and multiple == 1:
            return rows, lens
        return bounded_rows(rows, num_slots, multiple=multiple), lens


@dataclass
class StepPlan:
    """One step's shared metadata (views of PlanBuffers, or of a StepRows' tensors). Token range
    [token_start, token_start + T) of the step; ``num_decode_tokens`` counts the decode tokens
    inside that range.

    batch     the step as handed over: a StepBatch, or a StepRows (ready-made rows)
    positions int64 [T]; token_to_req int32 [T] (-1 padding); token_valid bool [T];
    swa_rows int32 [T, W] / swa_lens int32 [T] (W = spec.window for a StepBatch, the given
    width <= spec.window for a StepRows);
    comp_rows {ratio: (rows int32 [T, width], lens int32 [T])}: the global rows of the compressed
    scopes that need no per-layer input: the "all" kinds (C128A) a StepBatch carries a block
    table for, or every ratio a StepRows gives as GlobalRows (top-k ratios included: their
    rows are read when a layer runs). Other top-k ratios translate the layer's local top-k.
    """

    spec: ModelSpec
    batch: StepBatch | StepRows
    owner: Any
    generation: int
    token_start: int
    num_tokens: int
    num_decode_tokens: int
    positions: torch.Tensor
    token_to_req: torch.Tensor
    token_valid: torch.Tensor
    swa_rows: torch.Tensor
    swa_lens: torch.Tensor
    comp_rows: dict[int, IndexPair] = field(default_factory=dict)
    front_end: FrontEnd = field(default_factory=TorchFrontEnd, repr=False)
    batch_invariant: bool = False  # SparseMLA(batch_invariant=True): backends fix their work split
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def tokens(self) -> Tokens:
        return Tokens(self.positions, self.token_to_req, self.token_valid)

    def cached(self, key, builder: Callable[[], Any]) -> Any:
        """``builder()`` once per plan and key (per-step metadata shared by all layers)."""
        found = self._cache.get(key, _MISSING)  # one lookup: every layer call of a step asks
        if found is _MISSING:
            found = self._cache[key] = builder()
        return found

    def translates_topk(self, kind: LayerKind) -> bool:
        """True when ``kind``'s compressed scope comes from the layer's local top-k (through a
        block table), False when the plan holds its rows (``comp_rows``) or it has none."""
        kind = LayerKind.parse(kind)
        return kind.uses_topk and kind.ratio not in self.comp_rows

    def comp_scope(self, kind: LayerKind, topk: torch.Tensor | None = None, num_slots: int | None = None,
                   multiple: int = 1) -> IndexPair | tuple[None, None]:
        """(rows, lens) of the compressed scope of ``kind``: global slots, -1 unused.
        Window-only -> (None, None); a ratio in ``comp_rows`` -> those rows ("all" kinds, and
        every ratio a StepRows gives as GlobalRows); other top-k kinds (C4A, C1A, C2A) ->
        translated from ``topk`` (local positions ``[T, K]``) through the block table of the
        kind's ratio by the plan's front end (``num_slots`` / ``multiple``: bounded to the cache
        and padded in the same pass, ``FrontEnd.topk_rows``)."""
        kind = LayerKind.parse(kind)
        if not kind.has_comp_scope:
            return None, None
        if kind.ratio in self.comp_rows:
            return self.comp_rows[kind.ratio]
        if kind.attends_all:
            what = "StepRows has no GlobalRows" if isinstance(self.batch, StepRows) else "batch has no table"
            raise ValueError(f"comp: the step's {what} for ratio {kind.ratio}; allowed: provide ratio "
                             f"{kind.ratio} (comp_block_tables / StepRows.comp) to run {kind.name} layers")
        topk = check_local_topk(topk, self.num_tokens, self.device, width=self.spec.comp_width(kind))
        table = self.batch.comp_block_table(kind)
        block_size = self.batch.comp_block_size(kind)
        assert block_size is not None  # comp_block_table raised unless the ratio has a block table
        return self.front_end.topk_rows(self.tokens, kind, table, block_size, topk[: self.num_tokens], num_slots,
                                        multiple)

    def phase_plan(self, phase) -> StepPlan:
        """Sub-plan of the decode tokens [0, num_decode_tokens) or the rest (prefill + padding)."""
        phase = Phase(phase)
        start, stop = (0, self.num_decode_tokens) if phase is Phase.DECODE else (self.num_decode_tokens,
                                                                                 self.num_tokens)
        return self.cached(("phase", phase), lambda: self._slice(start, stop, phase is Phase.DECODE))

    def _slice(self, start: int, stop: int, decode: bool) -> StepPlan:
        return StepPlan(self.spec, self.batch, self.owner, self.generation, self.token_start + start,
                        stop - start, (stop - start) if decode else 0, self.positions[start:stop],
                        self.token_to_req[start:stop], self.token_valid[start:stop], self.swa_rows[start:stop],
                        self.swa_lens[start:stop],
                        {r: (rows[start:stop], lens[start:stop]) for r, (rows, lens) in self.comp_rows.items()},
                        self.front_end, self.batch_invariant)


def build_plan(spec: ModelSpec, batch: StepBatch | StepRows, buffers: PlanBuffers, owner: Any, generation: int,
               front_end: FrontEnd | None = None, batch_invariant: bool = False) -> StepPlan:
    """The plan of a step that passed ``common.checks.check_step`` (no host sync given its
    num_tokens). A StepBatch: ``front_end`` (default torch) writes the per-token facts and the rows
    into ``buffers``, and the plan views them. A StepRows: the per-token facts are copied into
    ``buffers`` (positions cast to int64; a few bytes per token), the rows are views of the
    caller's tensors (no copy)."""
    front_end = front_end or TorchFrontEnd()
    T = batch.checked_num_tokens
    comp: dict[int, IndexPair] = {}
    if isinstance(batch, StepRows):
        for buf, fact in zip((buffers.positions, buffers.token_to_req, buffers.token_valid), batch.token_facts()):
            buf[:T].copy_(fact)
        swa_rows, swa_lens = batch.swa_rows, batch.swa_lens
        comp = {r: (e.rows[:T], e.lens[:T]) for r, e in batch.comp.items() if isinstance(e, GlobalRows)}
    else:
        front_end.step_rows(batch, buffers, T)
        swa_rows, swa_lens = buffers.window_rows()
        for kind in buffers.all_kinds(batch):
            rows, lens = buffers.rows_of(kind, batch)
            comp[kind.ratio] = (rows[:T], lens[:T])
    return StepPlan(spec, batch, owner, generation, 0, T, batch.num_decode_tokens, buffers.positions[:T],
                    buffers.token_to_req[:T], buffers.token_valid[:T], swa_rows[:T], swa_lens[:T], comp, front_end,
                    batch_invariant)
