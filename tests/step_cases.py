"""Random DeepSeek-V4 / V4.1 steps for the SparseMLA round-trip tests (tests/test_api.py on the
torch backend, tests/test_triton_kernels.py through the Triton kernels, tests/test_v41.py).

A case is a step with shuffled block tables, an SWA cache and one compressed cache per compression
ratio of the model, filled with random rows; top-k rows (one per top-k kind) whose valid prefix
holds distinct visible entries and whose other lanes hold garbage (stale, negative or huge local
positions); random q and sinks. The random draws come in a fixed order (tables, top-k rows,
caches, q, sink; kinds in the model's order), so one seed gives one case whatever the caller's
defaults -- and V4's kinds give the same draws as before V4.1 kinds existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import dsv4_attn as dsv4
from dsv4_attn.common import layout
from dsv4_attn.common.spec import V4_KINDS, LayerKind


def filled_cache(fmt, num_blocks, block_size, gen, *, dialect="ocp", block_stride=None, scale=None, device="cpu"):
    """A cache of ``num_blocks`` blocks whose every row holds random bf16 data (N(0, 4)) stored in
    ``fmt``; built on the CPU, then moved to ``device``."""
    cache = layout.new_cache(fmt, num_blocks, block_size, dialect=dialect, block_stride=block_stride)
    n = num_blocks * block_size
    kv = (torch.randn(n, 512, generator=gen) * 2).bfloat16()
    layout.insert(cache, fmt, torch.arange(n, dtype=torch.int32), kv, dialect=dialect, scale=scale)
    return cache if torch.device(device).type == "cpu" else cache.to(device)


@dataclass
class StepCase:
    """spec, batch; ``caches``: "swa" and each compressed kind -> its cache (kinds of one ratio
    share one cache object); ``topk``: each top-k kind -> int32 [T, K] local positions; ``q`` bf16
    [T, heads, 512]; ``sink`` float32 [heads]."""

    spec: dsv4.ModelSpec
    batch: dsv4.StepBatch
    caches: dict
    topk: dict
    q: torch.Tensor
    sink: torch.Tensor

    def topk_for(self, kind: LayerKind) -> torch.Tensor | None:
        return self.topk.get(kind)


def _local_topk(gen, positions: torch.Tensor, ratio: int, K: int) -> torch.Tensor:
    """int32 [T, K]: garbage everywhere, then a valid prefix of distinct visible entries."""
    T = positions.shape[0]
    visible = (positions.cpu() + 1) // ratio
    topk_local = torch.randint(-5, 10**6, (T, K), generator=gen).int()
    for t in range(T):
        k = min(int(visible[t]), K)
        topk_local[t, :k] = torch.randperm(int(visible[t]), generator=gen)[:k].int()
    return topk_local


def make_step(gen, query_lens, seq_lens, *, kinds=V4_KINDS, heads=16, fmt="fp8_ds_mla", topk=64,
              max_model_len=40960, swa_bs=64, block_size=256, num_tokens=None, swa_dialect="ocp", kv_scale=None,
              device="cpu") -> StepCase:
    """A random step of a model whose layers are ``kinds`` (LayerKinds or names), its caches in the
    records of ``fmt``; everything on ``device``. ``num_tokens`` > the batch's tokens appends
    padding tokens."""
    R = len(query_lens)
    spec = dsv4.ModelSpec(num_heads=heads, topk=topk, max_model_len=max_model_len, layers=kinds)
    swa_blocks = -(-max(seq_lens) // swa_bs)
    blocks = {r: -(-(max(seq_lens) // r) // (block_size // r)) + 1 for r in spec.comp_ratios}
    tables = {"swa": torch.randperm(R * swa_blocks, generator=gen).int().view(R, swa_blocks)}
    tables.update({r: torch.randperm(R * n, generator=gen).int().view(R, n) for r, n in blocks.items()})
    batch = dsv4.StepBatch.from_lists(query_lens, seq_lens, tables["swa"], swa_bs,
                                      {r: tables[r] for r in blocks}, block_size, max_model_len,
                                      num_tokens=num_tokens, device=device)
    local = {k: _local_topk(gen, batch.positions, k.ratio, topk) for k in spec.kinds if k.uses_topk}
    on = dict(scale=kv_scale, device=device)
    fmt = layout.KVFormat.parse(fmt)  # nvfp4_ds_mla stores the two caches in different records
    caches = {"swa": filled_cache(fmt.swa_record, R * swa_blocks, swa_bs, gen, dialect=swa_dialect, **on)}
    by_ratio = {r: filled_cache(fmt.comp_record, R * n, block_size // r, gen, **on) for r, n in blocks.items()}
    caches.update({k: by_ratio[k.ratio] for k in spec.kinds if k.has_comp_scope})
    q = torch.randn(batch.num_tokens, heads, 512, generator=gen).bfloat16().to(device)
    sink = torch.randn(heads, generator=gen).to(device)
    return StepCase(spec, batch, caches, {k: t.to(device) for k, t in local.items()}, q, sink)


def make_case(gen, query_lens, seq_lens, **kwargs):
    """V4's ``(spec, batch, caches, topk, q, sink)`` (:func:`make_step` with SWA, C4A, C128A):
    ``topk`` is the C4A layer's int32 ``[T, topk]``."""
    case = make_step(gen, query_lens, seq_lens, kinds=V4_KINDS, **kwargs)
    return case.spec, case.batch, case.caches, case.topk[LayerKind.C4A], case.q, case.sink
