"""common/layout.py: cache formats byte by byte, round trips, strides, dialects, bad input.

Expected bytes are derived by hand in the comments (docs/semantics.md "V4 FP8 record"):
per 64-wide NoPE tile, amax = max(max|x|, 1e-4), e = ceil(log2(amax / 448)), stored exponent
byte e + 127, q = e4m3(x / 2^e) rounded to nearest even. e4m3fn: bias 7, 1.0 = 0x38, 448 = 0x7E.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_attn.common import layout
from dsv4_attn.common.layout import Fp8Dialect, KVFormat

from kit.reference import e4m3_table

MODEL1 = KVFormat.MODEL1_FP8


def _raw_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The whole backing allocation of a cache as a flat uint8 tensor (pages + padding)."""
    stride0 = cache.stride(0)
    n = cache.shape[0] * stride0 * cache.element_size()
    return cache.view(torch.uint8).as_strided((n,), (1,), cache.storage_offset() * cache.element_size())


def _tile(values: list[float], fill: float) -> list[float]:
    return values + [fill] * (64 - len(values))


# One hand-derived row: (NoPE values per tile, expected e4m3 bytes per tile, expected exponent byte).
_HAND_TILES = [
    # amax = 56 = 448 * 2^-3 exactly: boundary, e = -3 exactly -> byte 124; x / 2^-3:
    # 56 -> 448 = 0x7E, -56 -> 0xFE, 0.125 -> 1.0 = 0x38, -0.125 -> 0xB8, 0.1875 -> 1.5 = 0x3C,
    # 2^-12 -> 2^-9 (smallest subnormal) = 0x01, fill 0.25 -> 2.0 = 0x40.
    (_tile([56.0, -56.0, 0.125, -0.125, 0.1875, 2.0**-12], 0.25), [0x7E, 0xFE, 0x38, 0xB8, 0x3C, 0x01], 0x40, 124),
    # amax = 448 exactly: e = 0 -> byte 127 (scale 2^0). 1.0 -> 0x38; 1.0625 is halfway between
    # 1.0 and 1.125 -> even mantissa 1.0 = 0x38; 1.1875 halfway 1.125/1.25 -> 1.25 = 0x3A;
    # -3.0 = -1.5 * 2 -> 0xC4; fill 0.5 -> 0x30.
    (_tile([448.0, 1.0, 1.0625, 1.1875, -3.0], 0.5), [0x7E, 0x38, 0x38, 0x3A, 0xC4], 0x30, 127),
    # all |x| < 1e-4: amax clamps to 1e-4, e = ceil(log2(1e-4 / 448)) = ceil(-22.09) = -22 -> 105.
    # 2^-15 -> 2^7 = 0x70, -3 * 2^-16 -> -192 = 0xF4, fill 2^-16 -> 64 = 0x68.
    (_tile([2.0**-15, -3 * 2.0**-16], 2.0**-16), [0x70, 0xF4], 0x68, 105),
    # amax = 56.25, just above the boundary 56: e = -2 -> 125; 56.25 / 0.25 = 225 rounds to 224
    # (0x76); fill 1.0 -> 4.0 = 0x48.
    (_tile([56.25], 1.0), [0x76], 0x48, 125),
    # amax = 3 * 2^20: log2(3 * 2^20 / 448) = 12.78 -> e = 13 -> 140; 3 * 2^7 = 384 = 0x7C;
    # fill 2^13 -> 1.0 = 0x38.
    (_tile([3 * 2.0**20], 2.0**13), [0x7C], 0x38, 140),
    # amax = 3.5 = 448 * 2^-7: e = -7 -> 120; 3.5 -> 0x7E, 2^-7 -> 1.0 = 0x38, fill -2^-6 -> -2 = 0xC0.
    (_tile([3.5, 2.0**-7], -(2.0**-6)), [0x7E, 0x38], 0xC0, 120),
    # amax = 14336 = 448 * 2^5: e = 5 -> 132; -14336 -> 0xFE, fill 32 -> 1.0 = 0x38.
    (_tile([-14336.0], 32.0), [0xFE], 0x38, 132),
]
# RoPE dims stay bf16, little-endian: 1.0 = 0x3F80, -2.0 = 0xC000, 0.15625 = 0x3E20, fill 3.0 = 0x4040.
_HAND_ROPE = ([1.0, -2.0, 0.15625] + [3.0] * 61, [0x80, 0x3F, 0x00, 0xC0, 0x20, 0x3E] + [0x40, 0x40] * 61)


def _hand_row() -> tuple[torch.Tensor, list[int], list[int]]:
    """bf16 [512] row, its 576 expected data bytes, its 8 expected scale bytes."""
    values, data, scales = [], [], []
    for tile, head_bytes, fill_byte, exp_byte in _HAND_TILES:
        values += tile
        data += head_bytes + [fill_byte] * (64 - len(head_bytes))
        scales.append(exp_byte)
    values += _HAND_ROPE[0]
    data += _HAND_ROPE[1]
    row = torch.tensor(values, dtype=torch.float64).bfloat16()
    assert row.double().tolist() == values, "hand values must be exact in bf16"
    return row, data, scales + [0]  # pad byte 0


def test_quantize_model1_bytes_by_hand():
    row, data, scales = _hand_row()
    packed = layout.quantize_model1(row[None])
    assert packed.dtype == torch.uint8 and packed.shape == (1, 584)
    assert packed[0, :576].tolist() == data
    assert packed[0, 576:].tolist() == scales


def test_insert_places_data_and_scale_rows_inside_the_block_with_a_large_stride():
    bs, stride = 4, 3456  # default stride would be round_up(4 * 584, 576) = 2880
    cache = layout.new_cache(MODEL1, num_blocks=3, block_size=bs, block_stride=stride)
    assert cache.stride(0) == stride and cache.shape == (3, 4, 584)
    raw = _raw_bytes(cache)
    raw.fill_(0xAB)  # garbage everywhere: every byte the insert does not own must stay 0xAB
    row, data, scales = _hand_row()
    other = (torch.randn(1, 512, generator=torch.Generator().manual_seed(3)) * 5).bfloat16()
    kv = torch.cat([row[None], other, other, other])
    layout.insert(cache, MODEL1, torch.tensor([11, -1, 4, -1], dtype=torch.int32), kv)

    expect = torch.full_like(raw, 0xAB)
    # slot 11 = block 2, t = 3: data at 2*stride + 3*576, scales at 2*stride + bs*576 + 3*8
    expect[2 * stride + 3 * 576: 2 * stride + 4 * 576] = torch.tensor(data, dtype=torch.uint8)
    expect[2 * stride + bs * 576 + 24: 2 * stride + bs * 576 + 32] = torch.tensor(scales, dtype=torch.uint8)
    # slot 4 = block 1, t = 0 (its bytes: checked through quantize_model1, pinned above)
    packed = layout.quantize_model1(other)[0]
    expect[stride: stride + 576] = packed[:576]
    expect[stride + bs * 576: stride + bs * 576 + 8] = packed[576:]
    assert packed[583] == 0
    assert torch.equal(raw, expect)


def test_insert_skips_minus_one_and_gather_of_minus_one_is_zero(gen):
    cache = layout.new_cache(MODEL1, 2, 2)
    raw = _raw_bytes(cache)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    before = raw.clone()
    kv = torch.randn(3, 512, generator=gen).bfloat16()
    layout.insert(cache, MODEL1, torch.full((3,), -1, dtype=torch.int64), kv)
    assert torch.equal(raw, before)
    layout.insert(cache, MODEL1, torch.tensor([-1, 2, -1], dtype=torch.int32), kv)
    got = layout.gather(cache, MODEL1, torch.tensor([[-1, 2], [2, -1]], dtype=torch.int32))
    assert got.shape == (2, 2, 512) and got.dtype == torch.float32
    assert torch.equal(got[0, 0], torch.zeros(512)) and torch.equal(got[1, 1], torch.zeros(512))
    assert torch.equal(got[0, 1], got[1, 0]) and got[0, 1].abs().sum() > 0


@pytest.mark.parametrize("block_size, stride", [(1, 1152), (2, 1728), (64, 37440), (256, 149760)])
def test_new_cache_model1_default_stride(block_size, stride):
    # round_up(bs * 584, 576): 584 -> 1152, 1168 -> 1728, 37376 -> 37440, 149504 -> 149760
    cache = layout.new_cache("fp8_ds_mla", 3, block_size)
    assert cache.dtype == torch.uint8 and cache.shape == (3, block_size, 584)
    assert cache.stride() == (stride, 584, 1)
    assert layout.check_cache(cache, MODEL1, "cache") == layout.CacheGeometry(3, block_size, stride)


@pytest.mark.parametrize("fmt, dialect, dtype", [
    ("bfloat16", "ocp", torch.bfloat16), ("fp8_e4m3", "ocp", torch.float8_e4m3fn),
    ("fp8_e4m3", "fnuz", torch.float8_e4m3fnuz),
])
def test_new_cache_plain_rows(fmt, dialect, dtype):
    cache = layout.new_cache(fmt, 2, 64, dialect=dialect)
    assert cache.dtype == dtype and cache.shape == (2, 64, 512) and cache.stride() == (64 * 512, 512, 1)
    wide = layout.new_cache(fmt, 2, 64, dialect=dialect, block_stride=64 * 512 + 100)
    assert wide.stride(0) == 64 * 512 + 100


def _tile_exponents(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """e = ceil(log2(amax / qmax)) per tile, in float64, for rows [N, 512] -> [N, 7]."""
    amax = x[:, :448].double().abs().reshape(-1, 7, 64).amax(-1).clamp_min(1e-4)
    return torch.ceil(torch.log2(amax / qmax))


def _random_rows(gen, n: int) -> torch.Tensor:
    """bf16 [n, 512] with a different magnitude per tile (2^-24 .. 2^20), never zeros."""
    mags = torch.exp2(torch.randint(-24, 21, (n, 8), generator=gen).double()).repeat_interleave(64, dim=1)
    return (torch.randn(n, 512, generator=gen, dtype=torch.float64) * mags).bfloat16()


@pytest.mark.parametrize("dialect, qmax", [("ocp", 448.0), ("fnuz", 224.0)])
@pytest.mark.parametrize("block_size, block_stride", [(1, None), (2, 5000), (64, None), (256, 150336)])
def test_model1_round_trip_within_e4m3_error(gen, dialect, qmax, block_size, block_stride):
    nb = 3
    cache = layout.new_cache(MODEL1, nb, block_size, block_stride=block_stride, dialect=dialect)
    n = nb * block_size
    kv = _random_rows(gen, n)
    slots = torch.randperm(n, generator=gen)
    layout.insert(cache, MODEL1, slots, kv, dialect=dialect)
    got = layout.gather(cache, MODEL1, slots, dialect=dialect).double()
    x = kv.double()
    assert torch.equal(got[:, 448:], x[:, 448:])  # RoPE exact
    e = _tile_exponents(kv, qmax)
    scale = torch.exp2(e).repeat_interleave(64, dim=1)
    y = x[:, :448] / scale  # in [-qmax, qmax]; rounding error <= max(|y| 2^-4, 2^-10) (subnormals)
    bound = torch.maximum(y.abs() * 2.0**-4, torch.full_like(y, 2.0**-10)) * scale
    assert ((got[:, :448] - x[:, :448]).abs() <= bound).all()
    # rounding the scale UP uses the range: the tile's amax lands in (qmax/2, qmax]
    amax_q = (got[:, :448] / scale).abs().reshape(n, 7, 64).amax(-1)
    big = x[:, :448].abs().reshape(n, 7, 64).amax(-1) > 1e-4
    assert ((amax_q[big] > qmax / 2 * 0.99) & (amax_q[big] <= qmax)).all()
    # bytes: exponent byte e + 127 and pad 0; dequantized value = hand-decoded e4m3 * 2^e exactly
    geo = layout.check_cache(cache, MODEL1, "cache")
    raw = _raw_bytes(cache)
    s = slots.long()
    base = (s // block_size) * geo.block_stride
    t = s % block_size
    data = raw[(base + t * 576)[:, None] + torch.arange(448)]
    scales = raw[(base + block_size * 576 + t * 8)[:, None] + torch.arange(8)]
    assert torch.equal(scales[:, :7].double() - 127, e) and (scales[:, 7] == 0).all()
    decoded = e4m3_table(dialect)[data.long()] * scale
    assert torch.equal(decoded, got[:, :448])


def test_fnuz_dialect_bytes_by_hand():
    # FNUZ e4m3 (bias 8) clamps at 224. Tile 0: amax 224 -> e = 0 (byte 127): 1.0 = 0x40, 224 = 0x7E.
    # Tile 1: amax 448 -> e = 1 (byte 128): 448 / 2 = 224 = 0x7E, 1.0 / 2 = 0.5 = 0x38.
    row = torch.full((512,), 1.0, dtype=torch.bfloat16)
    row[0], row[64] = 224.0, 448.0
    packed = layout.quantize_model1(row[None], Fp8Dialect.FNUZ)[0]
    assert packed[:3].tolist() == [0x7E, 0x40, 0x40]
    assert packed[64:67].tolist() == [0x7E, 0x38, 0x38]
    assert packed[576:578].tolist() == [127, 128]
    # the same bytes read as OCP mean twice the value: the dialect must be honoured by gather
    cache = layout.new_cache(MODEL1, 1, 1, dialect="fnuz")
    layout.insert(cache, MODEL1, torch.tensor([0]), row[None], dialect="fnuz")
    fnuz = layout.gather(cache, MODEL1, torch.tensor([0]), dialect="fnuz")[0]
    ocp = layout.gather(cache, MODEL1, torch.tensor([0]), dialect="ocp")[0]
    assert fnuz[:2].tolist() == [224.0, 1.0] and fnuz[64:66].tolist() == [448.0, 1.0]
    assert ocp[:2].tolist() == [448.0, 2.0]


def test_bf16_cache_round_trip_is_exact(gen):
    cache = layout.new_cache("bf16", 4, 2, block_stride=2 * 512 + 64)
    kv = torch.randn(8, 512, generator=gen).bfloat16()
    slots = torch.randperm(8, generator=gen).int()
    layout.insert(cache, "bf16", slots, kv)
    assert torch.equal(layout.gather(cache, "bf16", slots), kv.float())
    # placement: slot s lives at (s // 2) * stride + (s % 2) * 512 elements of the allocation
    flat = cache.as_strided((4 * (2 * 512 + 64),), (1,), cache.storage_offset())
    s = int(slots[5])
    assert torch.equal(flat[(s // 2) * 1088 + (s % 2) * 512:][:512], kv[5])


@pytest.mark.parametrize("dialect", ["ocp", "fnuz"])
def test_fp8_tensor_cache_bytes_and_scale(gen, dialect):
    cache = layout.new_cache("fp8_e4m3", 1, 4, dialect=dialect)
    kv = torch.tensor([[1.0] * 512, [1000.0] * 512, [-1000.0] * 512, [0.75] * 512]).bfloat16()
    layout.insert(cache, "fp8_e4m3", torch.arange(4), kv, scale=0.5, dialect=dialect)
    b = cache.view(torch.uint8)[0, :, 0].tolist()
    if dialect == "ocp":  # 1/0.5 = 2 -> 0x40; 2000 clamps to 448 = 0x7E; 1.5 -> 0x3C
        assert b == [0x40, 0x7E, 0xFE, 0x3C]
    else:  # FNUZ (bias 8): 2 -> 0x48; clamp 224 -> 0x7E; 1.5 -> 0x44
        assert b == [0x48, 0x7E, 0xFE, 0x44]
    got = layout.gather(cache, "fp8_e4m3", torch.tensor([0, 1, 2, 3, -1]), scale=0.5, dialect=dialect)
    qmax = 448.0 if dialect == "ocp" else 224.0
    assert got[:, 0].tolist() == [1.0, qmax * 0.5, -qmax * 0.5, 0.75, 0.0]
    # random rows: error within e4m3 rounding of x / scale
    x = torch.randn(4, 512, generator=gen).bfloat16()
    layout.insert(cache, "fp8_e4m3", torch.arange(4), x, scale=torch.tensor(0.25), dialect=dialect)
    y = layout.gather(cache, "fp8_e4m3", torch.arange(4), scale=0.25, dialect=dialect).double()
    bound = torch.maximum(x.double().abs() * 2.0**-4, torch.full_like(y, 0.25 * 2.0**-10))
    assert ((y - x.double()).abs() <= bound).all()


def test_check_cache_reads_block_stride_from_views():
    cache = layout.new_cache(MODEL1, 5, 64)
    view = cache[1:4]
    assert layout.check_cache(view, MODEL1, "c") == layout.CacheGeometry(3, 64, 37440)
    # FlashMLA also takes int8 / float8_e4m3fn views of the same bytes
    assert layout.check_cache(cache.view(torch.int8), MODEL1, "c").block_stride == 37440
    one = layout.new_cache(MODEL1, 1, 2)
    assert layout.check_cache(one, MODEL1, "c") == layout.CacheGeometry(1, 2, 1728)


def test_insert_and_gather_through_a_view_write_the_right_block(gen):
    cache = layout.new_cache(MODEL1, 4, 2)
    view = cache[2:]  # engine-style view starting at block 2
    kv = torch.randn(1, 512, generator=gen).bfloat16()
    layout.insert(view, MODEL1, torch.tensor([1]), kv)  # view slot 1 = block 2 of the full cache, t = 1
    assert torch.equal(layout.gather(cache, MODEL1, torch.tensor([5])), layout.gather(view, MODEL1, torch.tensor([1])))
    assert layout.gather(cache, MODEL1, torch.tensor([1]))[0].abs().sum() == 0


# ---- bad input ------------------------------------------------------------------------------

def _model1_cache():
    return layout.new_cache(MODEL1, 2, 4)


_BF16_ROWS = torch.ones(2, 512, dtype=torch.bfloat16)
_SLOTS = torch.tensor([0, 1], dtype=torch.int32)


@pytest.mark.parametrize("call, name", [
    (lambda: layout.new_cache("fp16", 1, 1), "fmt"),
    (lambda: layout.new_cache(MODEL1, 0, 1), "num_blocks"),
    (lambda: layout.new_cache(MODEL1, 1, 0), "block_size"),
    (lambda: layout.new_cache(MODEL1, 1, 2, block_stride=1167), "block_stride"),
    (lambda: layout.new_cache(MODEL1, 1, 2, dialect="e5m2"), "dialect"),
    (lambda: layout.insert(torch.zeros(2, 4, 584), MODEL1, _SLOTS, _BF16_ROWS), "cache"),
    (lambda: layout.insert(torch.zeros(2, 4, 576, dtype=torch.uint8), MODEL1, _SLOTS, _BF16_ROWS), "cache"),
    (lambda: layout.insert(torch.zeros(4, 2, 584, dtype=torch.uint8).transpose(0, 1), MODEL1, _SLOTS,
                           _BF16_ROWS), "cache"),
    (lambda: layout.insert(_model1_cache(), MODEL1, _SLOTS, _BF16_ROWS.float()), "kv"),
    (lambda: layout.insert(_model1_cache(), MODEL1, _SLOTS, _BF16_ROWS[:, :448]), "kv"),
    (lambda: layout.insert(_model1_cache(), MODEL1, _SLOTS, _BF16_ROWS.to("meta")), "kv"),
    (lambda: layout.insert(_model1_cache(), MODEL1, _SLOTS.float(), _BF16_ROWS), "slots"),
    (lambda: layout.insert(_model1_cache(), MODEL1, _SLOTS[:1], _BF16_ROWS), "slots"),
    (lambda: layout.insert(_model1_cache(), MODEL1, torch.tensor([0, 8]), _BF16_ROWS), "slots"),
    (lambda: layout.insert(_model1_cache(), MODEL1, torch.tensor([0, -2]), _BF16_ROWS), "slots"),
    (lambda: layout.insert(_model1_cache(), MODEL1, _SLOTS.to("meta"), _BF16_ROWS), "slots"),
    (lambda: layout.insert(_model1_cache(), MODEL1, _SLOTS, _BF16_ROWS, scale=2.0), "scale"),
    (lambda: layout.insert(layout.new_cache("fp8", 1, 2), "fp8", _SLOTS, _BF16_ROWS, scale=0.0), "scale"),
    (lambda: layout.insert(layout.new_cache("fp8", 1, 2), "fp8", _SLOTS, _BF16_ROWS, scale=math.nan), "scale"),
    (lambda: layout.insert(layout.new_cache("fp8", 1, 2), "fp8", _SLOTS, _BF16_ROWS, dialect="fnuz"), "cache"),
    (lambda: layout.gather(_model1_cache(), MODEL1, torch.tensor([[9]])), "slots"),
    (lambda: layout.gather(_model1_cache(), "bf16", _SLOTS), "cache"),
    (lambda: layout.check_cache([1, 2], MODEL1, "swa_cache"), "swa_cache"),
    (lambda: layout.quantize_model1(torch.ones(2, 448, dtype=torch.bfloat16)), "kv"),
    (lambda: layout.quantize_model1(torch.ones(2, 512)), "kv"),
    (lambda: layout.dequantize_model1(torch.ones(2, 576, dtype=torch.uint8)), "rows"),
    (lambda: layout.dequantize_model1(torch.ones(2, 584, dtype=torch.int32)), "rows"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}: got .*allowed"):
        call()
