"""A stand-in for FlashMLA's two ops (``sparse_decode_fwd``, ``sparse_prefill_fwd``): the documented
argument contract, checked (dtypes, shapes, strides, top-k granularity, index validity, the
scheduler-metadata reuse rule; on SM100 the V4.1 records), and the documented math in float64.
Used by tests/test_flashmla.py and tests/test_bench.py (the FlashMLA-as-vLLM runner on CPU)."""

from __future__ import annotations

import math

import torch

from dsv4_attn.common import layout
from dsv4_attn.common.layout import Record
from dsv4_attn.cuda import flashmla


# ---------------------------------------------------------------------------------------------
# A stand-in for FlashMLA's ops: the documented contract, checked, and the documented math.
# ---------------------------------------------------------------------------------------------
class Op:
    def __init__(self, fn, schema: str):
        self._fn, self.default = fn, type("Overload", (), {"_schema": torch._C.parse_schema(schema)})()

    def __call__(self, *args):
        return self._fn(*args)


def _need(cond, what):
    if not cond:
        raise AssertionError(f"FlashMLA contract violated: {what}")


def _attend(q, keys, valid, sink, scale):
    """q [n, h, 512], keys [n, k, 512], valid [n, k] -> out float64 [n, h, 512] (lonely rows 0)."""
    s = scale * torch.einsum("nhd,nkd->nhk", q.double(), keys.double())
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    has = torch.isfinite(lse)
    p = torch.exp(s - torch.where(has, lse, torch.zeros_like(lse))[..., None])
    o = torch.einsum("nhk,nkd->nhd", p, keys.double())
    if sink is not None:
        o = o * torch.sigmoid(lse - sink.double())[..., None]
    return torch.where(has[..., None], o, torch.zeros_like(o)), torch.where(has, lse, torch.full_like(lse, math.inf))


# bytes per token -> record, as FlashMLA detects the format (flash_mla_interface.py in vLLM 0.33)
_RECORDS = {584: Record.V4_FP8, 528: Record.MXFP8, 288: Record.NVFP4}


class FakeFlashMLA:
    """The vLLM-build ops (``torch.ops._flashmla_C``) as a CPU double on an SM90 or SM100 GPU."""

    def __init__(self, arch="sm90"):
        self.arch = arch
        self.sparse_decode_fwd = Op(self._decode, flashmla._VLLM_DECODE)
        self.sparse_prefill_fwd = Op(self._prefill, flashmla._VLLM_PREFILL)
        self.fused_norm_rope_attn_rope_cast_decode = None  # present in the 2026-09-30 release; never called here
        self.decode_calls, self.prefill_calls = [], []
        self._plans = {}  # id(tile) -> (config, lens values) recorded when planned

    def _kv_rows(self, kv, idx, lens):
        """Dequantized keys [b, k, 512], validity [b, k] and the record of a paged cache: only -1
        is invalid in decode, and every other entry inside the length must be a slot of the cache
        (else: an IMA). SM100: the kernels address the cache as rows of 576 B (V4: its data rows)
        or of a whole token (V4.1's interleaved records) with int32 TMA coordinates."""
        _need(kv.dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn), f"kv dtype {kv.dtype}")
        _need(kv.dim() == 4 and kv.shape[2] == 1 and kv.shape[3] in _RECORDS,
              f"Unsupported bytes_per_token for d_qk=512: kv shape {tuple(kv.shape)}")
        record, tb = _RECORDS[kv.shape[3]], kv.shape[3]
        _need(record is Record.V4_FP8 or self.arch == "sm100", f"{tb}-byte (V4.1) records are read on SM100 only")
        _need(kv.stride(1) == tb and kv.stride(3) == 1, f"kv strides {kv.stride()} (block must be contiguous)")
        if self.arch == "sm100":
            row = 576 if record is Record.V4_FP8 else tb
            _need(kv.data_ptr() % 16 == 0, "The base address of kv must be 16B aligned")
            _need(kv.stride(0) % row == 0, f"kv.stride(0) ({kv.stride(0)}) must be a multiple of {row}")
            _need(kv.shape[0] * (kv.stride(0) // row) <= 2**31 - 1, "too many rows for the int32 TMA coordinates")
        cache = kv[:, :, 0, :]
        geo = layout.check_cache(cache, record, "kv")
        col = torch.arange(idx.shape[-1])[None, :]
        live = col < lens[:, None].long()
        rows = idx[:, 0, :]
        _need(bool(((rows == -1) | ((rows >= 0) & (rows < geo.num_slots)) | ~live).all()),
              "an index inside topk_length is neither -1 nor a slot of the cache")
        valid = live & (rows != -1)
        slots = torch.where(valid, rows, torch.full_like(rows, -1))
        return layout.gather_rows(cache, record, geo, slots), valid, record

    @staticmethod
    def _check_idx(idx, lens, b, block, name):
        _need(idx.dtype == torch.int32 and idx.dim() == 3 and idx.shape[:2] == (b, 1) and idx.stride(-1) == 1,
              f"{name} {idx.dtype} {tuple(idx.shape)} {idx.stride()}")
        _need(idx.shape[-1] % block == 0, f"{name} topk {idx.shape[-1]} % {block}")
        _need(lens.dtype == torch.int32 and lens.shape == (b,) and lens.is_contiguous(), f"{name} lengths")
        _need(bool(((lens >= 0) & (lens <= idx.shape[-1])).all()), f"{name} lengths out of range")

    def _decode(self, q, kv, idx, lens, sink, tile, splits, extra_kv, extra_idx, extra_lens, d_v, scale, out,
                batch_invariant):
        b, s_q, h, d = q.shape
        _need(q.dtype == torch.bfloat16 and d == 512 and q.stride(-1) == 1, "q bf16 [b, s_q, h, 512]")
        _need(s_q == 1, "s_q == 1 (one topk_length per row: tokens are flattened)")
        _need(h in (64, 128), f"Unsupported h_q {h}")
        # B_TOPK: 64 in the V4 kernels; the V4.1 SM100 kernel's is not published: its largest tile assumed
        block = 64 if kv.shape[-1] == 584 else 128
        self._check_idx(idx, lens, b, block, "indices")
        _need((extra_kv is None) == (extra_idx is None) == (extra_lens is None), "extra_* come together")
        if extra_kv is not None:
            self._check_idx(extra_idx, extra_lens, b, block, "extra_indices")
        _need(sink is None or (sink.dtype == torch.float32 and sink.shape == (h,) and sink.is_contiguous()), "sink")
        _need(d_v == 512 and isinstance(scale, float) and batch_invariant is False, "d_v / sm_scale / batch_inv")
        _need(out.dtype == torch.bfloat16 and out.shape == q.shape and out.is_contiguous(), "out")
        config = (b, s_q, h, kv.shape[1], idx.shape[-1], None if extra_kv is None else extra_kv.shape[1],
                  None if extra_kv is None else extra_idx.shape[-1])
        values = (lens.clone(), None if extra_lens is None else extra_lens.clone())
        if tile is None:
            _need(splits is None, "tile metadata and num_splits come together")
            tile, splits = torch.zeros(4, 8, dtype=torch.int32), torch.zeros(b + 1, dtype=torch.int32)
            self._plans[id(tile)] = (config, values)
        else:
            planned = self._plans.get(id(tile))
            _need(planned is not None, "reused scheduler metadata was not returned by this library")
            _need(planned[0] == config, f"sched meta reused with another shape {config} vs {planned[0]}")
            _need(all(a is None and b_ is None or torch.equal(a, b_) for a, b_ in zip(planned[1], values)),
                  "sched meta reused with other topk_length values (FlashMLA's reuse rule)")
        keys, valid, record = self._kv_rows(kv, idx, lens)
        _need(record is not Record.NVFP4, "The fp4 KV cache is only supported as extra_kv")
        extra_record = None
        if extra_kv is not None:
            k2, v2, extra_record = self._kv_rows(extra_kv, extra_idx, extra_lens)
            _need(extra_record is record or (record, extra_record) == (Record.MXFP8, Record.NVFP4),
                  "extra_kv must have the format of kv, or the V4.1 fp4 format when kv has the V4.1 format")
            keys, valid = torch.cat([keys, k2], 1), torch.cat([valid, v2], 1)
        self.decode_calls.append(dict(tile=tile, config=config, h=h, records=(record, extra_record)))
        o, lse = _attend(q[:, 0], keys, valid, sink, scale)
        out[:, 0] = o.to(out.dtype)
        return out, lse[:, :, None], tile, splits

    def _prefill(self, q, kv, idx, scale, d_v, sink, topk_length, out):
        s, h, d = q.shape
        _need(q.dtype == torch.bfloat16 and d == 512 and q.is_contiguous(), "q bf16 [s_q, h, 512]")
        _need(h in (64, 128), f"Unsupported h_q {h}")
        _need(kv.dtype == torch.bfloat16 and kv.dim() == 3 and kv.shape[1:] == (1, 512) and kv.is_contiguous(),
              f"kv bf16 [s_kv, 1, 512], got {kv.dtype} {tuple(kv.shape)}")
        _need(idx.dtype == torch.int32 and idx.shape[:2] == (s, 1) and idx.stride(-1) == 1, "indices")
        _need(idx.shape[-1] % 128 == 0, f"prefill topk {idx.shape[-1]} % 128")
        _need(topk_length is None or (topk_length.dtype == torch.int32 and topk_length.shape == (s,)), "topk_length")
        _need(sink is None or (sink.dtype == torch.float32 and sink.shape == (h,) and sink.is_contiguous()), "sink")
        _need(d_v == 512 and isinstance(scale, float), "d_v / sm_scale")
        _need(out.dtype == torch.bfloat16 and out.shape == q.shape and out.is_contiguous(), "out")
        self.prefill_calls.append(dict(kv=kv.clone(), idx=idx.clone(), s=s))
        rows = idx[:, 0, :].long()
        valid = (rows >= 0) & (rows < kv.shape[0])  # prefill masks any out-of-range index
        keys = kv[:, 0][torch.where(valid, rows, torch.zeros_like(rows))].float()
        o, lse = _attend(q, keys, valid, sink, scale)
        out.copy_(o.to(out.dtype))
        return [out, lse, lse]
