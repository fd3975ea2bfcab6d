"""Steps and rows poisoned with every class of garbage index, and their clean twins.

The contract (docs/bad-input.md): an index, slot or block id outside ``[0, capacity)`` is skipped
exactly like -1, without being read. So the expected answer of a garbage step is the answer of
its CLEAN twin, the same step with every garbage entry replaced by -1 -- computed by the float64
reference on rows built from the clean inputs, never by the code under test on the garbage.

Garbage classes (``count`` = the capacity of the entry: the cache's num_blocks for block ids, its
num_blocks * block_size for slots, the token's visible-entry count for local top-k entries):

    minus_one        -1 between valid entries
    below_minus_one  -123456
    int32_min        -2**31
    at_count         count itself
    past_count       count + 114514
    int32_max        2**31 - 1
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dsv4_attn.common import reference
from dsv4_attn.common.spec import V4_KINDS
from dsv4_attn.testing.steps import StepCase, filled_cache, make_step

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
CLASSES = ("minus_one", "below_minus_one", "int32_min", "at_count", "past_count", "int32_max")

# a step with decode tokens (two single-token requests, an MTP pair, one more single token), two
# prefill chunks (one crossing the window start), and two padding tokens; every request has at
# least one compressed entry of ratio 128 and a non-empty top-k prefix
QUERY_LENS = [1, 1, 2, 1, 9, 5]
SEQ_LENS = [300, 700, 131, 1000, 600, 260]
NUM_DECODE_TOKENS = 5
NUM_TOKENS = sum(QUERY_LENS) + 2


def garbage_value(cls: str, count: int) -> int:
    """The entry of class ``cls`` for an index whose capacity is ``count``."""
    return {"minus_one": -1, "below_minus_one": -123456, "int32_min": INT32_MIN, "at_count": count,
            "past_count": min(count + 114514, INT32_MAX - 1), "int32_max": INT32_MAX}[cls]


@dataclass
class GarbageStep:
    """``case`` holds the garbage (block tables and top-k rows), ``clean`` its twin with -1 in
    every poisoned entry (same caches, q, sink); ``hits`` lists (where, class) of each injection."""

    case: StepCase
    clean: StepCase
    hits: list


def _last_tokens(batch) -> list[int]:
    """Index of the last token of each request."""
    qsl = batch.query_start_loc.cpu()
    return [int(qsl[r + 1]) - 1 for r in range(batch.num_reqs)]


def garbage_step(gen, classes=CLASSES, *, kinds=V4_KINDS, heads=16, fmt="fp8_ds_mla", topk=32,
                 device="cpu") -> GarbageStep:
    """A random step (``dsv4_attn.testing.steps.make_step``) poisoned with ``classes`` in every block table (the
    SWA table and each compressed ratio's) and every top-k row, each class at its own entry, in
    entries some token reads; built on the CPU, then moved to ``device``."""
    case = make_step(gen, QUERY_LENS, SEQ_LENS, kinds=kinds, heads=heads, fmt=fmt, topk=topk,
                     max_model_len=4096, pad_tokens=NUM_TOKENS - sum(QUERY_LENS), num_decode_tokens=NUM_DECODE_TOKENS)
    batch = case.batch
    pos = batch.positions
    last = _last_tokens(batch)
    tables = {"swa": (batch.swa_block_table, batch.swa_block_size, case.caches["swa"].shape[0])}
    for kind in case.spec.kinds:
        if kind.has_comp_scope:
            tables[kind.ratio] = (batch.comp_block_tables[kind.ratio], batch.block_size // kind.ratio,
                                  case.caches[kind].shape[0])
    clean_tables = {name: t.clone() for name, (t, _, _) in tables.items()}
    clean_topk = {k: t.clone() for k, t in case.topks.items()}
    hits = []
    R = batch.num_reqs
    assert len(classes) <= R, "one request per class"
    for i, cls in enumerate(classes):
        r = (i * 5) % R  # one request per class, spread over decode and prefill requests
        t = last[r]
        for name, (table, bs, num_blocks) in tables.items():
            if name == "swa":  # the block of the token's own position
                col = int(pos[t]) // bs
            else:
                col = 0  # the first compressed entries: every "all" layer reads them
                topk_kinds = [k for k in clean_topk if k.ratio == name]
                if topk_kinds:  # the block of an entry the token's top-k selects
                    col = int(clean_topk[topk_kinds[0]][t, 0]) // bs
            table[r, col] = garbage_value(cls, num_blocks)
            clean_tables[name][r, col] = -1
            hits.append((f"block table {name}, request {r}, column {col}", cls))
        for kind, local in case.topks.items():  # lane 1 of a prefix of >= 2 entries: between valid ones
            tok = [u for u in range(len(pos)) if min((int(pos[u]) + 1) // kind.ratio, topk) >= 2]
            u = tok[i * len(tok) // len(classes)]
            local[u, 1] = garbage_value(cls, (int(pos[u]) + 1) // kind.ratio)
            clean_topk[kind][u, 1] = -1
            hits.append((f"top-k {kind.name}, token {u}, lane 1", cls))
    clean_batch = type(batch)(batch.query_start_loc, batch.seq_lens, batch.num_decode_tokens, clean_tables["swa"],
                              batch.swa_block_size, {r: t for r, t in clean_tables.items() if r != "swa"},
                              batch.block_size, batch.max_model_len, batch.num_tokens)
    clean = replace(case, batch=clean_batch, topks=clean_topk)
    return GarbageStep(case.to(device), clean.to(device), hits)


def garbage_rows(gen, rows: torch.Tensor, lens: torch.Tensor, count: int, classes=CLASSES) -> torch.Tensor:
    """A copy of global-slot rows int32 [T, K] with each class written at a random column inside
    some token's first ``lens`` entries (``count`` = the cache's slots)."""
    rows = rows.clone()
    T = rows.shape[0]
    for i, cls in enumerate(classes):
        t = i % T
        n = int(lens[t])
        if n:
            rows[t, int(torch.randint(0, n, (1,), generator=gen))] = garbage_value(cls, count)
    return rows


def clean_rows(rows: torch.Tensor, count: int) -> torch.Tensor:
    """Rows with every entry outside ``[0, count)`` replaced by -1 (the definition of skipping)."""
    return torch.where((rows >= 0) & (rows < count), rows, torch.full_like(rows, -1))


@dataclass
class RawRowsCase:
    """The kernel entry's inputs with garbage global-slot rows and lengths outside [0, width]:
    caches (on the device), rows / lengths / q / sink (CPU), and the clean twin's float64 answer
    ``want`` [T, H, 512] and natural-log ``want_lse`` [T, H] (CPU)."""

    swa: torch.Tensor
    comp: torch.Tensor
    rows: torch.Tensor
    lens: torch.Tensor
    comp_rows: torch.Tensor
    comp_lens: torch.Tensor
    q: torch.Tensor
    sink: torch.Tensor
    want: torch.Tensor
    want_lse: torch.Tensor


def raw_rows_case(heads: int, device, classes=CLASSES) -> RawRowsCase:
    """6 tokens of 24 SWA rows into 96 slots and 40 compressed rows into 80 slots, each class of
    ``classes`` planted in both, lengths past the row, negative and int32 extremes."""
    gen = torch.Generator().manual_seed(20)
    T, W, K = 6, 24, 40
    swa = filled_cache("fp8_ds_mla", 6, 16, gen, device=device)
    comp = filled_cache("fp8_ds_mla", 5, 16, gen, device=device)
    rows = torch.randint(0, 96, (T, W), generator=gen).int()
    crows = torch.randint(0, 80, (T, K), generator=gen).int()
    lens = torch.tensor([24, 7, 1000, -5, 24, INT32_MAX], dtype=torch.int32)
    clens = torch.tensor([40, INT32_MIN, 13, 40, 99, 0], dtype=torch.int32)
    bad = garbage_rows(gen, rows, lens.clamp(0, W), 96, classes)
    cbad = garbage_rows(gen, crows, clens.clamp(0, K), 80, classes)
    q = torch.randn(T, heads, 512, generator=gen).bfloat16()
    sink = torch.randn(heads, generator=gen)
    want, want_lse = reference.sparse_mla(q, swa.cpu(), clean_rows(bad, 96), lens.clamp(0, W), comp.cpu(),
                                          clean_rows(cbad, 80), clens.clamp(0, K), sink, 512**-0.5, "fp8_ds_mla")
    return RawRowsCase(swa, comp, bad, lens, cbad, clens, q, sink, want, want_lse)
