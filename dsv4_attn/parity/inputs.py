"""A case's inputs: generated on the CPU from the case's seed, so every machine sees the same bytes.

Random bf16 rows inserted into caches of the case's format through ``common.layout.insert``,
permuted block tables, random q, sinks with +-inf on the edge cases, top-k rows with garbage past
the valid prefix (and, for ``shared`` cases, a second layer's top-k over the same compressed
cache), garbage in every cache slot no row references; the sha256 of all of it
(``CaseInputs.digest``) proves two machines ran the same case.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

import torch

from ..common import layout
from ..common.batch import StepBatch
from ..common.layout import Fp8Dialect, KVFormat, Record
from ..common.spec import HEAD_DIM, ModelSpec, cdiv
from ..testing.steps import cache_to, fill_topk_prefix, flat_bytes
from .matrix import Case

_FILLER_BLOCKS = 2  # physical blocks shared by every logical block no row references
_GARBAGE_PAGES = 3  # distinct garbage pages cycled through the pool blocks


@dataclass
class CaseInputs:
    """One case's tensors (all on one device).

    batch      StepBatch of the case
    q          bf16 [T, held_heads, 512] (padded heads 0)
    swa_cache  cache of the case's format (SWA dialect); comp_cache: the kind's compressed cache or None
    topk       int32 [T, topk] local top-k (top-k kinds only): a valid prefix of distinct visible
               entries, garbage (-1, stale or huge values) after it
    other_topk the top-k of another layer sharing the compressed cache (``shared`` cases), or None
    sink       float32 [held_heads] (padded heads -inf) or None
    digest     sha256 of every input byte (computed on the CPU copy)
    """

    case: Case
    batch: StepBatch
    q: torch.Tensor
    swa_cache: torch.Tensor
    comp_cache: torch.Tensor | None
    topk: torch.Tensor | None
    sink: torch.Tensor | None
    other_topk: torch.Tensor | None = None
    digest: str = ""

    def to(self, device: torch.device) -> CaseInputs:
        if torch.device(device) == self.q.device:
            return self
        batch = self.batch.to(device)

        def move(t):
            return None if t is None else t.to(device)

        return replace(self, batch=batch, q=self.q.to(device), swa_cache=cache_to(self.swa_cache, device),
                       comp_cache=None if self.comp_cache is None else cache_to(self.comp_cache, device),
                       topk=move(self.topk), sink=move(self.sink), other_topk=move(self.other_topk))


def make_inputs(case: Case) -> CaseInputs:
    """Generate a case's inputs on the CPU from its seed (deterministic)."""
    gen = torch.Generator().manual_seed(case.seed)
    spec, T, R = case.spec, case.num_tokens, len(case.query_lens)
    req, pos = _token_positions(case)
    q = torch.randn(T, case.held_heads, HEAD_DIM, generator=gen).bfloat16()
    q[:, case.heads:] = 0  # padded heads are zero-filled, as vLLM does
    sink = _sinks(case, gen)
    topk = _local_topk(case, req, pos, gen) if case.kind.uses_topk else None
    other = _local_topk(case, req, pos, gen) if case.shared else None
    swa_req, swa_pos = _window_refs(case, req, pos)
    swa_table, swa_cache = _scope_cache(case, gen, swa_req, swa_pos, _cols(case.seq_lens, 1, case.swa_block_size),
                                        case.swa_block_size, case.fmt.swa_record, case.swa_dialect)
    comp_tables, comp_cache = {}, None
    if case.kind.has_comp_scope:
        if case.block_size % case.kind.ratio:
            raise ValueError(f"case {case.name}: block_size: got {case.block_size!r}; "
                             f"allowed: a multiple of {case.kind.ratio}")
        bs_c = case.block_size // case.kind.ratio
        readers = [t for t in (topk, other) if t is not None]  # every layer's top-k over this cache
        c_req, c_pos = _comp_refs(case, spec, req, pos, torch.cat(readers, 1) if readers else None)
        table, comp_cache = _scope_cache(case, gen, c_req, c_pos, _cols(case.seq_lens, case.kind.ratio, bs_c), bs_c,
                                         case.fmt.comp_record, case.comp_dialect)
        comp_tables[case.kind.ratio] = table
    qsl = torch.zeros(R + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(case.query_lens, dtype=torch.int32).cumsum(0)
    batch = StepBatch(qsl, torch.tensor(case.seq_lens, dtype=torch.int32), case.num_decode_tokens, swa_table,
                      case.swa_block_size, comp_tables, case.block_size, case.max_model_len, T)
    batch.validate()
    inputs = CaseInputs(case, batch, q, swa_cache, comp_cache, topk, sink, other)
    inputs.digest = _input_digest(inputs)
    return inputs


def _token_positions(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, position) int64 [real tokens] of every real token."""
    req: list[int] = []
    pos: list[int] = []
    for r, (ql, sl) in enumerate(zip(case.query_lens, case.seq_lens)):
        req += [r] * ql
        pos += range(sl - ql, sl)
    return torch.tensor(req, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64)


def _sinks(case: Case, gen: torch.Generator) -> torch.Tensor | None:
    if case.sink == "none":
        return None
    sink = torch.randn(case.held_heads, generator=gen)
    if case.sink == "inf":
        sink[0] = -math.inf
        if case.heads > 1:
            sink[1] = math.inf
    sink[case.heads:] = -math.inf  # padded heads
    return sink


def _local_topk(case: Case, req: torch.Tensor, pos: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """int32 [T, K]: per real token a prefix of min((pos+1)//ratio, K) distinct visible entries in
    random order; every other lane garbage: -1, small values that look valid (stale lanes) or
    values far past what is visible."""
    K, T = case.topk, case.num_tokens
    topk = torch.randint(0, 1 << 20, (T, K), generator=gen, dtype=torch.int64)
    pick = torch.rand(T, K, generator=gen)
    topk = torch.where(pick < 0.3, torch.full_like(topk, -1), topk)
    topk = torch.where(pick > 0.7, topk % 64, topk)
    return fill_topk_prefix(gen, topk, pos, case.kind.ratio).to(torch.int32)


def _window_refs(case: Case, req: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, position) of every SWA key a real token reads."""
    W = case.window
    offs = torch.arange(W)
    keys = pos[:, None] - offs[None, :]
    keep = keys >= 0
    return req[:, None].expand_as(keys)[keep], keys[keep]


def _comp_refs(case: Case, spec: ModelSpec, req: torch.Tensor, pos: torch.Tensor,
               topk: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, compressed entry) of every compressed key a real token reads (``topk``: the local
    top-k rows of every layer reading this cache, side by side, for top-k kinds)."""
    visible = (pos + 1) // case.kind.ratio
    if case.kind.uses_topk:
        if topk is None:
            raise ValueError(f"topk: got None for case {case.name}; allowed: its local top-k ({case.kind.name})")
        local, width = topk[: pos.shape[0]].long(), case.topk
    else:
        width = spec.all_width(case.kind.ratio)
        local = torch.arange(width)[None, :].expand(pos.shape[0], width)
    # column j belongs to the row of layer j // width, whose valid prefix is min(visible, width)
    keep = torch.arange(local.shape[1])[None, :] % width < visible.clamp(max=width)[:, None]
    return req[:, None].expand_as(local)[keep], local[keep]


def _cols(seq_lens, ratio: int, block_size: int) -> list[int]:
    """Block-table columns each request needs: cdiv(seq_len // ratio, block_size)."""
    return [cdiv(s // ratio, block_size) for s in seq_lens]


def _scope_cache(case: Case, gen: torch.Generator, req: torch.Tensor, logical: torch.Tensor, cols: list[int],
                 block_size: int, record: Record, dialect: Fp8Dialect) -> tuple[torch.Tensor, torch.Tensor]:
    """Block table int32 [R, max(cols)] and cache (in ``record``) of one scope whose rows
    ``(req, logical)`` are read.

    Only what is read gets its own physical block: every (request, logical block) some row reads
    maps to a distinct block (a seeded permutation of the pool), every other column to one of a
    few shared filler blocks, so long sequences need few blocks. Pool blocks hold garbage pages
    (no correct backend reads them); each slot that is read holds a fresh random row. With
    ``byte_offset`` the pool starts at the first block past that byte offset (the blocks before
    it stay zero), so slot byte offsets pass 2**31.
    """
    one = layout.new_cache(record, 1, block_size, dialect=dialect)
    stride = one.stride(0) * case.page_stride  # elements
    offset = cdiv(case.byte_offset, stride * one.element_size())
    width = max(max(cols, default=0), 1)
    block = torch.div(logical, block_size, rounding_mode="floor")
    touched = torch.unique(req * width + block)
    n = touched.numel()
    pool = n + _FILLER_BLOCKS
    perm = torch.randperm(pool, generator=gen) + offset
    table = perm[n + torch.randint(_FILLER_BLOCKS, (len(cols), width), generator=gen)]
    table[touched // width, touched % width] = perm[:n]
    slots = torch.unique(table[req, block] * block_size + logical % block_size)
    cache = layout.new_cache(record, offset + pool, block_size, block_stride=stride, dialect=dialect)
    garbage = _garbage_pages(case, gen, block_size, stride, record, dialect)
    flat_bytes(cache).view(offset + pool, -1)[offset:] = garbage[torch.arange(pool) % garbage.shape[0]]
    scale = case.kv_scale if case.fmt is KVFormat.FP8_TENSOR else None
    layout.insert(cache, record, slots, _random_rows(gen, slots.numel()), scale=scale, dialect=dialect)
    return table.to(torch.int32), cache


def _garbage_pages(case: Case, gen: torch.Generator, block_size: int, stride: int, record: Record,
                   dialect: Fp8Dialect) -> torch.Tensor:
    """uint8 [_GARBAGE_PAGES, block bytes]: pages of valid random rows; the bytes past the page
    (other layers' pages when page_stride > 1) are random bytes."""
    n = _GARBAGE_PAGES
    pages = layout.new_cache(record, n, block_size, block_stride=stride, dialect=dialect)
    flat = flat_bytes(pages).view(n, -1)
    flat.copy_(torch.randint(0, 256, flat.shape, generator=gen, dtype=torch.uint8))
    scale = case.kv_scale if case.fmt is KVFormat.FP8_TENSOR else None
    layout.insert(pages, record, torch.arange(n * block_size), _random_rows(gen, n * block_size),
                  scale=scale, dialect=dialect)
    return flat.clone()


def _random_rows(gen: torch.Generator, n: int) -> torch.Tensor:
    """bf16 [n, 512]: N(0, 1) rows times a per-row factor in [0.5, 2] (varied fp8 tile scales)."""
    factor = torch.exp2(torch.rand(n, 1, generator=gen) * 2 - 1)
    return (torch.randn(n, HEAD_DIM, generator=gen) * factor).bfloat16()


def _input_digest(inputs: CaseInputs) -> str:
    h = hashlib.sha256(f"{inputs.case.name}/{inputs.case.seed}".encode())
    b = inputs.batch
    tensors = [b.query_start_loc, b.seq_lens, b.swa_block_table, *[b.comp_block_tables[r] for r in
                                                                   sorted(b.comp_block_tables)],
               inputs.q, inputs.topk, inputs.sink, inputs.other_topk]
    for t in tensors:
        if t is not None:
            h.update(tensor_bytes(t))
    for cache in (inputs.swa_cache, inputs.comp_cache):
        if cache is not None:
            h.update(flat_bytes(cache).numpy().tobytes())
    return h.hexdigest()


def tensor_bytes(t: torch.Tensor):
    """A tensor's elements as a flat uint8 numpy array (on the CPU, in row-major order)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()

