"""Random DeepSeek-V4 / V4.1 steps: the one step builder of the tests (and the pieces the parity
matrix and the bench draw with).

A step has shuffled block tables, an SWA cache and one compressed cache per compression ratio of
the model (kinds of one ratio share it) filled with random rows, one local top-k row per top-k
kind whose valid prefix holds visible entries and whose other lanes hold garbage (stale,
negative or huge local positions), random q and sinks. The random draws come in a fixed order
(tables, top-k rows, caches, q, sink; kinds in the model's order), so one seed gives one step
whatever the caller's other arguments -- and V4's kinds give the same draws as before V4.1 kinds
existed.

Two ways to draw, one argument (``fast``):

- ``fast=False`` (small steps, every CPU test): each top-k prefix holds DISTINCT entries; every
  block of a cache holds random rows; everything is drawn on the CPU, then moved to ``device``.
- ``fast=True`` (large GPU steps: 32k-token prefills, block ids near 2**31): each top-k prefix
  is drawn in one vectorized call (repeats allowed); a cache holds ``block_base`` + the table's
  blocks, rows only in the blocks its table uses; q and rows are drawn on ``device``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from ..common import layout
from ..common.batch import StepBatch
from ..common.layout import Fp8Dialect, KVFormat, Record
from ..common.spec import HEAD_DIM, V4_KINDS, LayerKind, ModelSpec, cdiv


@dataclass
class StepCase:
    """One random step of a model.

    spec, batch   the model and the step (``batch.num_tokens`` = T, padding tokens included)
    caches        "swa" -> the SWA cache; each compressed kind -> its ratio's cache (kinds of one
                  ratio share one cache object)
    topks         each top-k kind -> int32 [T, K] local top-k
    q             bf16 [T, heads, 512]
    sink          float32 [heads]
    fmt           the KV format the caches are stored in (as given to ``make_step``)
    kv_scale      the per-tensor scale of fp8_e4m3 caches (1.0 for other formats)
    swa_dialect / comp_dialect   the FP8 dialects the caches were written in
    """

    spec: ModelSpec
    batch: StepBatch
    caches: dict
    topks: dict
    q: torch.Tensor
    sink: torch.Tensor
    fmt: KVFormat | str = "fp8_ds_mla"
    kv_scale: float = 1.0
    swa_dialect: Fp8Dialect | str = "ocp"
    comp_dialect: Fp8Dialect | str = "ocp"

    def topk_for(self, kind: LayerKind) -> torch.Tensor | None:
        """The top-k rows of ``kind`` (None for kinds without top-k)."""
        return self.topks.get(kind)

    def comp_cache(self, kind: LayerKind) -> torch.Tensor | None:
        """The compressed cache ``kind`` reads (None for window-only kinds)."""
        return self.caches.get(kind) if kind.has_comp_scope else None

    def v4_inputs(self) -> tuple:
        """``(spec, batch, caches, C4A top-k, q, sink)``: a V4 step as the V4 tests unpack it."""
        return self.spec, self.batch, self.caches, self.topks[LayerKind.C4A], self.q, self.sink

    def to(self, device) -> StepCase:
        """This step on ``device`` (caches keep their strides: ``cache_to``)."""
        if torch.device(device) == self.q.device:
            return self
        moved = {id(c): cache_to(c, device) for c in self.caches.values()}  # shared caches stay shared
        return replace(self, batch=self.batch.to(device), caches={k: moved[id(c)] for k, c in self.caches.items()},
                       topks={k: t.to(device) for k, t in self.topks.items()}, q=self.q.to(device),
                       sink=self.sink.to(device))


def make_step(gen: torch.Generator, query_lens: Sequence[int], seq_lens: Sequence[int], *,
              kinds: Iterable = V4_KINDS, heads: int = 16, fmt: KVFormat | str = "fp8_ds_mla", topk: int = 64,
              max_model_len: int = 40960, window: int = 128, swa_bs: int = 64, block_size: int = 256,
              pad_tokens: int | None = None, num_decode_tokens: int | None = None,
              swa_dialect: str = "ocp", comp_dialect: str = "ocp", kv_scale: float | None = None,
              swa_block_stride: int | None = None, comp_block_stride: int | None = None, block_base: int = 0,
              empty_topk_tokens: Sequence[int] = (), sink_shift: float = 0.0, edge_sinks: bool = False,
              fast: bool = False, device="cpu") -> StepCase:
    """A random step of a model whose layers are ``kinds`` (LayerKinds or names), its caches in the
    records of ``fmt``, everything on ``device``; ``gen`` a CPU generator.

    pad_tokens         None: the batch derives its token count from its requests (re-read by every
                       plan); a number: the batch is given T = its tokens + ``pad_tokens`` padding tokens
    num_decode_tokens  default: the leading requests of query length 1 (may cover padding tokens)
    kv_scale           fp8_e4m3 caches are written with this scale (``StepCase.kv_scale``: 1.0 if None)
    *_block_stride     elements between blocks of the SWA / compressed caches (foreign pages between)
    block_base         every SWA block id is offset by this (huge slots; ``fast`` only)
    empty_topk_tokens  tokens whose top-k row is all -1 in every top-k kind
    sink_shift         added to every sink; ``edge_sinks``: head 0's sink +inf, the last head's -inf
    fast               the draws for large GPU steps (module docstring)

    A compressed ratio r gets a cache only when ``block_size % r == 0`` (V4's C128A needs 128 | block_size).
    """
    if block_base and not fast:
        raise ValueError(f"block_base: got {block_base}; allowed: 0 unless fast=True (a full cache of that many "
                         "blocks would be drawn)")
    R, longest = len(query_lens), max(seq_lens)
    spec = ModelSpec(num_heads=heads, topk=topk, max_model_len=max_model_len, window=window, layers=kinds)
    swa_table = _table(gen, R, cdiv(longest, swa_bs), block_base)
    comp_tables = {r: _table(gen, R, cdiv(longest // r, block_size // r) + 1, 0) for r in spec.comp_ratios
                   if block_size % r == 0}
    num_tokens = None if pad_tokens is None else sum(query_lens) + pad_tokens
    batch = StepBatch.from_lists(list(query_lens), list(seq_lens), swa_table, swa_bs, comp_tables, block_size,
                                 max_model_len, num_decode_tokens=num_decode_tokens, num_tokens=num_tokens,
                                 device=device)
    positions = batch.positions.cpu()
    topks = {}
    for kind in (k for k in spec.kinds if k.uses_topk):
        garbage = torch.randint(-5, 10**6, (positions.shape[0], topk), generator=gen).int()
        local = (_repeats_prefix(gen, garbage, positions, kind.ratio) if fast
                 else fill_topk_prefix(gen, garbage, positions, kind.ratio))
        local[list(empty_topk_tokens)] = -1
        topks[kind] = local.to(device)
    records = KVFormat.parse(fmt)  # nvfp4_ds_mla stores the two caches in different records
    put = _rows_where_read if fast else _rows_everywhere
    caches: dict[str | LayerKind, torch.Tensor] = {
        "swa": put(gen, records.swa_record, swa_table, swa_bs, block_base, swa_dialect, swa_block_stride, kv_scale,
                   device)}
    by_ratio = {r: put(gen, records.comp_record, table, block_size // r, 0, comp_dialect, comp_block_stride,
                       kv_scale, device) for r, table in comp_tables.items()}
    caches.update({k: by_ratio[k.ratio] for k in spec.kinds if k.ratio in by_ratio})
    q = (_randn((batch.checked_num_tokens, heads, HEAD_DIM), gen, device) if fast
         else torch.randn(batch.checked_num_tokens, heads, HEAD_DIM, generator=gen)).bfloat16().to(device)
    sink = torch.randn(heads, generator=gen) + sink_shift
    if edge_sinks:
        sink[0], sink[-1] = math.inf, -math.inf
    return StepCase(spec, batch, caches, topks, q, sink.to(device), fmt, 1.0 if kv_scale is None else kv_scale,
                    swa_dialect, comp_dialect)


def filled_cache(fmt, num_blocks: int, block_size: int, gen: torch.Generator, *, dialect="ocp",
                 block_stride: int | None = None, scale: float | None = None, device="cpu") -> torch.Tensor:
    """A cache of ``num_blocks`` blocks whose every row holds random bf16 data (N(0, 4)) stored in
    ``fmt`` (a record or format); built on the CPU, then copied to ``device`` byte for byte with its
    strides (``cache_to``: the same layout on every device, page padding included)."""
    cache = layout.new_cache(fmt, num_blocks, block_size, dialect=dialect, block_stride=block_stride)
    n = num_blocks * block_size
    kv = (torch.randn(n, HEAD_DIM, generator=gen) * 2).bfloat16()
    layout.insert(cache, fmt, torch.arange(n, dtype=torch.int32), kv, dialect=dialect, scale=scale)
    return cache_to(cache, device)


def cache_to(cache: torch.Tensor, device) -> torch.Tensor:
    """Copy a cache to ``device`` keeping its strides (``Tensor.to`` would compact the gaps between
    pages: a V4 page's alignment padding, other layers' pages)."""
    if torch.device(device) == cache.device:
        return cache
    flat = torch.empty(cache.untyped_storage().nbytes(), dtype=torch.uint8, device=device)
    flat.copy_(flat_bytes(cache))
    return flat.view(cache.dtype).as_strided(cache.shape, cache.stride(), cache.storage_offset())


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a tensor's whole storage (caches are as_strided views with page gaps)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def fill_topk_prefix(gen: torch.Generator, topk: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """``topk`` (int [T, K], its garbage lanes drawn) with row t's first min(visible, K) lanes
    replaced, in place, by distinct random visible entries (visible = (positions[t] + 1) // ratio),
    for the first len(positions) rows; returns ``topk``. One randperm per row, in row order."""
    K = topk.shape[1]
    for t, p in enumerate(positions.tolist()):
        n = (int(p) + 1) // ratio
        topk[t, :min(n, K)] = torch.randperm(n, generator=gen)[:K].to(topk.dtype)
    return topk


def _table(gen: torch.Generator, reqs: int, blocks: int, base: int) -> torch.Tensor:
    """int32 [reqs, blocks]: a permutation of base .. base + reqs * blocks - 1."""
    return (torch.randperm(reqs * blocks, generator=gen).int() + base).view(reqs, blocks)


def _repeats_prefix(gen: torch.Generator, topk: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """``topk`` with each row's valid prefix drawn in one call: visible entries, repeats allowed."""
    K = topk.shape[1]
    visible = (positions + 1) // ratio
    picks = (torch.rand(topk.shape, generator=gen) * visible[:, None]).long().int()
    prefix = torch.arange(K)[None, :] < visible[:, None].clamp(max=K)
    return torch.where(prefix, picks, topk)


def _randn(shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    """Seeded normal samples made on ``device`` (large GPU steps skip a host round trip)."""
    if torch.device(device).type == "cpu":
        return torch.randn(shape, generator=gen)
    seed = int(torch.randint(2**62, (1,), generator=gen))
    return torch.randn(shape, generator=torch.Generator(device).manual_seed(seed), device=device)


def _scale_for(record: Record, kv_scale: float | None) -> float | None:
    return kv_scale if record is Record.FP8_TENSOR else None


def _rows_everywhere(gen, record: Record, table: torch.Tensor, block_size: int, base: int, dialect, stride,
                     kv_scale, device) -> torch.Tensor:
    """A cache of table.numel() blocks, every row random (drawn and written on the CPU)."""
    return filled_cache(record, table.numel(), block_size, gen, dialect=dialect, block_stride=stride,
                        scale=_scale_for(record, kv_scale), device=device)


def _rows_where_read(gen, record: Record, table: torch.Tensor, block_size: int, base: int, dialect, stride,
                     kv_scale, device) -> torch.Tensor:
    """A cache of ``base`` + table.numel() blocks on ``device``, random rows in the blocks the table uses."""
    cache = layout.new_cache(record, base + table.numel(), block_size, device, block_stride=stride, dialect=dialect)
    slots = (table.long().reshape(-1, 1) * block_size + torch.arange(block_size)).reshape(-1)
    kv = (_randn((slots.numel(), HEAD_DIM), gen, device) * 2).bfloat16()
    layout.insert(cache, record, slots.to(device), kv, scale=_scale_for(record, kv_scale), dialect=dialect)
    return cache


def redrawn_topk(gen: torch.Generator, case: StepCase, kind: LayerKind) -> torch.Tensor:
    """Another layer's top-k for ``kind``: ``case``'s rows with their valid prefix redrawn (other
    visible entries, repeats allowed), their garbage lanes kept."""
    local = case.topks[kind].cpu().clone()
    visible = (case.batch.positions.cpu() + 1) // kind.ratio
    picks = (torch.rand(local.shape, generator=gen) * visible[:, None]).long().int()
    prefix = torch.arange(local.shape[1])[None, :] < visible[:, None].clamp(max=local.shape[1])
    return torch.where(prefix & (local >= 0), picks, local).to(case.topks[kind].device)
