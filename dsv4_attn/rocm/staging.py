"""This step's selected cache rows, decoded into the AITER scratch a chunk of rows at a time.

The gathered paths (``mla_decode_fwd``, ``mla_decode_fwd_v4_nm``) hand AITER rows it cannot read
in place. Staging them through whole-step temporaries (fp32 ``[T·W, 512]`` rows, then a copy in
the kernel's dtype) moved 5-10x the bytes the attention then reads, and at 1024 decode tokens
held GBs of temporaries per call. Here each chunk of at most ``chunk_rows`` rows is decoded in
bf16 where that is exact (bf16 rows; V4 records: e4m3 times a power of two fits bf16), in fp32
only for fp8 per-tensor records (e4m3 times a float scale, rounded once), and copied to its
gather positions, so a step's temporaries are bounded by the chunk, not by T·W. Device ops only,
fixed shapes for a given T: graph-capturable.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..common.layout import CacheGeometry, Fp8Dialect, KVFormat, Record, record_parts
from ..common.spec import HEAD_DIM, NOPE_DIM, NUM_QUANT_TILES, QUANT_TILE

ROWS_PER_CHUNK = 1 << 16  # a chunk of rows is 64 MiB in bf16, 128 MiB in fp32 (fp8 per-tensor caches)


def chunks(n: int, chunk_rows: int) -> Iterator[slice]:
    """Slices of ``[0, n)`` of at most ``chunk_rows`` entries."""
    for start in range(0, n, chunk_rows):
        yield slice(start, min(n, start + chunk_rows))


def decode_rows(cache: torch.Tensor, fmt: KVFormat, geo: CacheGeometry, slots: torch.Tensor, kv_scale: float,
                dialect: Fp8Dialect) -> torch.Tensor:
    """Cache rows at int32 ``slots`` [N] (-1: zeros) -> [N, 512], the values of
    ``layout.gather_rows`` exactly: bf16 for bf16 caches (copied as they are) and V4 records
    (decoded in bf16), fp32 for fp8 per-tensor caches (e4m3 times a float scale)."""
    if fmt is KVFormat.MODEL1_FP8:
        return _v4_bf16(*record_parts(cache, Record.V4_FP8, geo, slots), dialect)
    valid = (slots >= 0) & (slots < geo.num_slots)
    safe = torch.where(valid, slots, torch.zeros_like(slots)).long()
    rows = cache[safe // geo.block_size, safe % geo.block_size]
    if fmt is KVFormat.FP8_TENSOR:  # e4m3 times a float scale: rounded once, in fp32
        rows = rows.float().mul_(kv_scale)
    return rows.masked_fill_(~valid[:, None], 0)


def _v4_bf16(data: torch.Tensor, scales: torch.Tensor, dialect: Fp8Dialect) -> torch.Tensor:
    """V4 records (data uint8 [N, 576], scales uint8 [N, 8]) -> bf16 [N, 512]: e4m3 NoPE times
    its tile's UE8M0 power of two (exact in bf16), then the bf16 RoPE dims as they are."""
    n = data.shape[0]
    out = torch.empty(n, HEAD_DIM, dtype=torch.bfloat16, device=data.device)
    nope = data[:, :NOPE_DIM].view(dialect.torch_dtype).to(torch.bfloat16).view(n, NUM_QUANT_TILES, QUANT_TILE)
    scale = torch.exp2(scales[:, :NUM_QUANT_TILES].float() - 127.0).to(torch.bfloat16)
    torch.mul(nope, scale[..., None], out=out[:, :NOPE_DIM].view(n, NUM_QUANT_TILES, QUANT_TILE))
    out[:, NOPE_DIM:].copy_(data[:, NOPE_DIM:].view(torch.bfloat16))
    return out
