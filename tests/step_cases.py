"""Random DSv4 steps for the SparseMLA round-trip tests (tests/test_api.py on the torch backend,
tests/test_triton_kernels.py through the Triton kernels).

A case is a step with shuffled block tables, an SWA cache and both compressed caches filled with
random rows, C4A top-k rows whose valid prefix holds distinct visible entries and whose other
lanes hold garbage (stale, negative or huge local positions), random q and sinks. The random
draws come in a fixed order, so one seed gives one case whatever the caller's defaults.
"""

from __future__ import annotations

import torch

import dsv4_attn as dsv4
from dsv4_attn.common import layout
from dsv4_attn.common.spec import LayerKind


def filled_cache(fmt, num_blocks, block_size, gen, *, dialect="ocp", block_stride=None, scale=None, device="cpu"):
    """A cache of ``num_blocks`` blocks whose every row holds random bf16 data (N(0, 4)) stored in
    ``fmt``; built on the CPU, then moved to ``device``."""
    cache = layout.new_cache(fmt, num_blocks, block_size, dialect=dialect, block_stride=block_stride)
    n = num_blocks * block_size
    kv = (torch.randn(n, 512, generator=gen) * 2).bfloat16()
    layout.insert(cache, fmt, torch.arange(n, dtype=torch.int32), kv, dialect=dialect, scale=scale)
    return cache if torch.device(device).type == "cpu" else cache.to(device)


def make_case(gen, query_lens, seq_lens, *, heads=16, fmt="fp8_ds_mla", topk=64, max_model_len=40960, swa_bs=64,
              block_size=256, num_tokens=None, swa_dialect="ocp", kv_scale=None, device="cpu"):
    """``(spec, batch, caches, topk, q, sink)``: ``caches`` maps "swa", LayerKind.C4A and
    LayerKind.C128A to caches in ``fmt`` (the SWA one in ``swa_dialect``); ``topk`` is int32
    ``[T, topk]`` local C4A positions; ``q`` bf16 ``[T, heads, 512]``; ``sink`` float32 ``[heads]``;
    everything on ``device``. ``num_tokens`` > the batch's tokens appends padding tokens."""
    R = len(query_lens)
    spec = dsv4.ModelSpec(num_heads=heads, c4a_topk=topk, max_model_len=max_model_len)
    swa_blocks = -(-max(seq_lens) // swa_bs)
    c4_bs, c128_bs = block_size // 4, block_size // 128
    c4_blocks = -(-(max(seq_lens) // 4) // c4_bs) + 1
    c128_blocks = -(-(max(seq_lens) // 128) // c128_bs) + 1
    tables = {
        "swa": torch.randperm(R * swa_blocks, generator=gen).int().view(R, swa_blocks),
        4: torch.randperm(R * c4_blocks, generator=gen).int().view(R, c4_blocks),
        128: torch.randperm(R * c128_blocks, generator=gen).int().view(R, c128_blocks),
    }
    batch = dsv4.StepBatch.from_lists(query_lens, seq_lens, tables["swa"], swa_bs, {4: tables[4], 128: tables[128]},
                                      block_size, max_model_len, num_tokens=num_tokens, device=device)
    T = batch.num_tokens
    n4 = (batch.positions.cpu() + 1) // 4
    topk_local = torch.randint(-5, 10**6, (T, topk), generator=gen).int()  # garbage everywhere
    for t in range(T):  # a valid prefix of distinct visible entries
        k = min(int(n4[t]), topk)
        topk_local[t, :k] = torch.randperm(int(n4[t]), generator=gen)[:k].int()
    on = dict(scale=kv_scale, device=device)
    caches = {
        "swa": filled_cache(fmt, R * swa_blocks, swa_bs, gen, dialect=swa_dialect, **on),
        LayerKind.C4A: filled_cache(fmt, R * c4_blocks, c4_bs, gen, **on),
        LayerKind.C128A: filled_cache(fmt, R * c128_blocks, c128_bs, gen, **on),
    }
    q = torch.randn(T, heads, 512, generator=gen).bfloat16().to(device)
    sink = torch.randn(heads, generator=gen).to(device)
    return spec, batch, caches, topk_local.to(device), q, sink
