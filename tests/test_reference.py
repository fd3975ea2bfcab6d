"""common/reference.py against a dense softmax built another way.

The dense model never gathers: it decodes EVERY slot of the caches from their raw bytes by
hand (e4m3 bit fields, exponent bytes, little-endian bf16 RoPE at the documented offsets), counts
how often each slot occurs among a token's valid entries (no dedup: a slot listed twice, or in
both scopes, counts twice), and computes

    out = Σ_s n_s exp(s_s) k_s / (Σ_s n_s exp(s_s) + exp(sink)),   lse = log Σ_s n_s exp(s_s)

over all slots in float64. Empty rows -> 0 and -inf.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_attn.common import layout, reference
from dsv4_attn.common.layout import KVFormat

from kit.compare import compare
from kit.reference import e4m3_table


def _decode_model1(cache: torch.Tensor, dialect: str) -> torch.Tensor:
    """float64 [num_slots, 512] of a MODEL1 cache, from its bytes at the documented offsets."""
    nb, bs, _ = cache.shape
    stride = cache.stride(0)
    raw = cache.view(torch.uint8).as_strided((nb * stride,), (1,), cache.storage_offset())
    lut = e4m3_table(dialect)
    out = torch.empty(nb * bs, 512, dtype=torch.float64)
    for b in range(nb):
        for t in range(bs):
            data = raw[b * stride + t * 576: b * stride + (t + 1) * 576]
            exps = raw[b * stride + bs * 576 + t * 8: b * stride + bs * 576 + t * 8 + 7].double() - 127
            nope = lut[data[:448].long()].view(7, 64) * torch.exp2(exps)[:, None]
            lo, hi = data[448::2].long(), data[449::2].long()  # little-endian bf16
            bits = (hi << 8 | lo).int() << 16  # bf16 bits are the top half of a float32
            out[b * bs + t] = torch.cat([nope.flatten(), bits.view(torch.float32).double()])
    return out


def _decode_plain(cache: torch.Tensor, fmt: KVFormat, dialect: str, kv_scale: float) -> torch.Tensor:
    nb, bs, _ = cache.shape
    if fmt is KVFormat.BF16:
        return cache.reshape(nb * bs, 512).double()
    return e4m3_table(dialect)[cache.reshape(nb * bs, 512).view(torch.uint8).long()] * kv_scale


def _dense(q, keys_s, keys_c, rows_s, lens_s, rows_c, lens_c, sink, scale):
    """Dense attention over every slot with per-token multiplicities (see module docstring)."""
    T, H, _ = q.shape
    keys = keys_s if keys_c is None else torch.cat([keys_s, keys_c])
    offset = keys_s.shape[0]
    count = torch.zeros(T, keys.shape[0], dtype=torch.float64)
    for t in range(T):
        for j in range(int(lens_s[t])):
            if rows_s[t, j] >= 0:
                count[t, rows_s[t, j]] += 1
        if keys_c is not None:
            for j in range(int(lens_c[t])):
                if rows_c[t, j] >= 0:
                    count[t, offset + rows_c[t, j]] += 1
    w = count[:, None, :] * torch.exp(scale * torch.einsum("thd,sd->ths", q.double(), keys))
    mass = w.sum(-1)
    sink_w = torch.zeros(H, dtype=torch.float64) if sink is None else torch.exp(sink.double())
    denom = (mass + sink_w)[..., None]
    out = torch.where(mass[..., None] > 0, torch.einsum("ths,sd->thd", w, keys) / denom, 0.0)
    return torch.nan_to_num(out, nan=0.0), torch.log(mass)


def _rows(gen, T, K, num_slots, lens):
    """Random slots with duplicates and -1 holes inside lens, garbage (even out of range) after."""
    rows = torch.randint(0, num_slots, (T, K), generator=gen).int()
    rows[torch.rand(T, K, generator=gen) < 0.15] = -1
    col = torch.arange(K)[None, :]
    garbage = torch.randint(-7, 10**7, (T, K), generator=gen).int()
    return torch.where(col < lens[:, None], rows, garbage)


def _filled(gen, fmt, nb, bs, dialect, kv_scale=None, block_stride=None):
    cache = layout.new_cache(fmt, nb, bs, dialect=dialect, block_stride=block_stride)
    n = nb * bs
    kv = (torch.randn(n, 512, generator=gen) * torch.rand(n, 1, generator=gen) * 3).bfloat16()
    layout.insert(cache, fmt, torch.arange(n), kv, scale=kv_scale, dialect=dialect)
    return cache


CASES = [  # fmt, swa dialect, comp dialect, kv_scale
    (KVFormat.MODEL1_FP8, "ocp", "ocp", None),
    (KVFormat.MODEL1_FP8, "fnuz", "ocp", None),  # gfx942: SWA cache FNUZ, compressed cache OCP
    (KVFormat.BF16, "ocp", "ocp", None),
    (KVFormat.FP8_TENSOR, "ocp", "ocp", 0.5),
]


@pytest.mark.parametrize("fmt, swa_dialect, comp_dialect, kv_scale", CASES)
@pytest.mark.parametrize("two_scopes", [True, False])
def test_reference_matches_dense_softmax(gen, fmt, swa_dialect, comp_dialect, kv_scale, two_scopes):
    T, H, W, K = 9, 6, 12, 10
    swa = _filled(gen, fmt, 3, 4, swa_dialect, kv_scale, block_stride=4 * fmt.row_elems + 600)
    comp = _filled(gen, fmt, 5, 2, comp_dialect, kv_scale)
    lens_s = torch.randint(0, W + 1, (T,), generator=gen).int()
    lens_c = torch.randint(0, K + 1, (T,), generator=gen).int()
    lens_s[0], lens_c[0] = 0, 0  # an empty row
    lens_s[1:3], lens_c[1] = W, K  # full rows
    rows_s, rows_c = _rows(gen, T, W, 12, lens_s), _rows(gen, T, K, 10, lens_c)
    rows_s[2, :3] = 5  # duplicates on purpose
    q = torch.randn(T, H, 512, generator=gen).bfloat16()
    sink = torch.randn(H, generator=gen)
    sink[-2:] = -math.inf  # padded heads
    scale = 512**-0.5
    out, lse = reference.sparse_mla(q, swa, rows_s, lens_s, comp if two_scopes else None,
                                    rows_c if two_scopes else None, lens_c if two_scopes else None, sink,
                                    scale, fmt, kv_scale=kv_scale, swa_dialect=swa_dialect,
                                    comp_dialect=comp_dialect)
    assert out.dtype == torch.float64 and out.shape == (T, H, 512) and lse.shape == (T, H)
    if fmt is KVFormat.MODEL1_FP8:
        keys_s, keys_c = _decode_model1(swa, swa_dialect), _decode_model1(comp, comp_dialect)
    else:
        keys_s = _decode_plain(swa, fmt, swa_dialect, kv_scale or 1.0)
        keys_c = _decode_plain(comp, fmt, comp_dialect, kv_scale or 1.0)
    ref, ref_lse = _dense(q, keys_s, keys_c if two_scopes else None, rows_s, lens_s, rows_c, lens_c, sink, scale)
    err = compare(out, ref)
    assert err["max_abs"] < 1e-12 and err["cosine"] > 1 - 1e-12, err
    assert torch.equal(out[0], torch.zeros(H, 512)) and (lse[0] == -math.inf).all()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-12


def test_infinite_sinks_and_no_sink(gen):
    T, H = 4, 4
    cache = _filled(gen, "bf16", 2, 4, "ocp")
    rows = torch.tensor([[0, 1, 2], [7, -1, 3], [5, 5, 5], [-1, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([3, 3, 2, 3], dtype=torch.int32)
    q = torch.randn(T, H, 512, generator=gen).bfloat16()
    keys = cache.reshape(8, 512).double()
    sink = torch.tensor([math.inf, -math.inf, 0.25, math.inf])
    out, lse = reference.sparse_mla(q, cache, rows, lens, None, None, None, sink, 0.05, "bf16")
    assert not out.isnan().any()
    assert torch.equal(out[:, [0, 3]], torch.zeros(T, 2, 512))  # +inf sink: zero output
    nosink, lse2 = reference.sparse_mla(q, cache, rows, lens, None, None, None, None, 0.05, "bf16")
    assert torch.equal(lse, lse2)  # lse never includes the sink
    ref, ref_lse = _dense(q, keys, None, rows, lens, None, None, None, 0.05)
    assert compare(nosink, ref)["max_abs"] < 1e-12
    assert compare(out[:, 1], ref[:, 1])["max_abs"] < 1e-12  # -inf sink: no effect
    assert torch.equal(out[3], torch.zeros(H, 512)) and (lse[3] == -math.inf).all()  # all -1: empty


def test_float32_and_token_chunks(gen):
    T, H, W = 70, 2, 8  # more tokens than the reference's internal chunk of 64
    cache = _filled(gen, "fp8_ds_mla", 4, 4, "ocp")
    lens = torch.randint(0, W + 1, (T,), generator=gen).int()
    rows = _rows(gen, T, W, 16, lens)
    q = torch.randn(T, H, 512, generator=gen).bfloat16()
    sink = torch.randn(H, generator=gen)
    out64, lse64 = reference.sparse_mla(q, cache, rows, lens, None, None, None, sink, 0.04, "fp8_ds_mla")
    out32, lse32 = reference.sparse_mla(q, cache, rows, lens, None, None, None, sink, 0.04, "fp8_ds_mla",
                                        dtype=torch.float32)
    assert out32.dtype == torch.float32
    assert compare(out32, out64)["rel_l2"] < 1e-6
    ref, _ = _dense(q, _decode_model1(cache, "ocp"), None, rows, lens, None, None, sink, 0.04)
    assert compare(out64, ref)["max_abs"] < 1e-12
    assert torch.equal(torch.isfinite(lse32), torch.isfinite(lse64))


# ---- bad input ------------------------------------------------------------------------------

def _args(**over):
    cache = layout.new_cache("bf16", 2, 4)
    args = dict(q=torch.ones(3, 2, 512, dtype=torch.bfloat16), swa_cache=cache,
                swa_rows=torch.zeros(3, 4, dtype=torch.int32), swa_lens=torch.ones(3, dtype=torch.int32),
                comp_cache=cache, comp_rows=torch.zeros(3, 5, dtype=torch.int32),
                comp_lens=torch.ones(3, dtype=torch.int32), sink=torch.zeros(2), scale=0.1, fmt="bf16")
    args.update(over)
    return args


@pytest.mark.parametrize("over, name", [
    (dict(q=torch.ones(3, 2, 448, dtype=torch.bfloat16)), "q"),
    (dict(q=torch.ones(3, 512, dtype=torch.bfloat16)), "q"),
    (dict(q=torch.ones(3, 2, 512, dtype=torch.int32)), "q"),
    (dict(swa_cache=torch.zeros(2, 4, 512)), "swa_cache"),
    (dict(comp_cache=layout.new_cache("fp8_ds_mla", 2, 4)), "comp_cache"),
    (dict(swa_rows=torch.zeros(2, 4, dtype=torch.int32)), "swa_rows"),
    (dict(swa_rows=torch.zeros(3, 4)), "swa_rows"),
    (dict(swa_lens=torch.ones(4, dtype=torch.int32)), "swa_lens"),
    (dict(comp_rows=None), "comp_rows"),
    (dict(comp_lens=torch.ones(3, 1, dtype=torch.int32)), "comp_lens"),
    (dict(swa_rows=torch.full((3, 4), 8, dtype=torch.int32)), "swa_rows"),  # slot 8 of an 8-slot cache
    (dict(comp_rows=torch.full((3, 5), -2, dtype=torch.int32)), "comp_rows"),
    (dict(sink=torch.zeros(3)), "sink"),
    (dict(scale=0.0), "scale"),
    (dict(fmt="fp16"), "fmt"),
])
def test_bad_input_raises_value_error_naming_the_argument(over, name):
    with pytest.raises(ValueError, match=rf"^{name}: got .*allowed"):
        reference.sparse_mla(**_args(**over))


def test_garbage_after_lens_is_never_read(gen):
    args = _args(swa_rows=torch.tensor([[1, 10**9, -5, 7]] * 3, dtype=torch.int32),
                 swa_lens=torch.tensor([1, 1, 0], dtype=torch.int32))
    out, lse = reference.sparse_mla(**args)
    assert torch.isfinite(out).all() and torch.isfinite(lse[:2]).all()
