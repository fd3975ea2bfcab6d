"""The V4.1 cache records (MXFP8 528 B, NVFP4 288 B) and the record model of common/layout.py.

Byte-exactness is pinned to tests/data/kv_records_golden.pt: the bytes vLLM 0.33.0's own writers
(``quantize_and_insert_k_cache``, the compressor's ``rope_quant_insert``) and its prefill gather
produced, run under TRITON_INTERPRET=1 by tests/data/make_kv_records_golden.py (its docstring
says which interpreter casts it replaces and why). Hand-derived bytes, round-trip error bounds,
decoding from the bit fields (never through the code under test), the float64 reference on the
new formats (the torch backend against it: tests/test_api.py), and refusals complete the picture.

e2m1 (NVFP4 values): sign bit 3, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 at codes 0..7.
e4m3fn: bias 7, 1.0 = 0x38, 448 = 0x7E, 2**-9 = 0x01 (the smallest subnormal).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn.common import codec, layout, reference
from dsv4_attn.common import registry as backend_mod
from dsv4_attn.common.backend import BackendUnavailableError, Phase
from dsv4_attn.common.layout import Fp8Dialect, KVFormat, Record
from dsv4_attn.common.platform import probe
from dsv4_attn.common.spec import LayerKind

from kit.reference import e4m3_table

GOLDEN = torch.load(Path(__file__).parent / "data" / "kv_records_golden.pt")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
WIDTH = {"v4_fp8": 584, "mxfp8": 528, "nvfp4": 288}


def _case_id(case: dict) -> str:
    ratio = f"-r{case['ratio']}" if "ratio" in case else ""
    return f"{case['writer']}-{case['record']}{ratio}"


def _garbage_cache(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat bytes, cache view) of the golden case's geometry, every byte = the golden's garbage."""
    width, bs, stride = WIDTH[case["record"]], case["block_size"], case["block_stride"]
    flat = torch.full_like(case["raw"], GOLDEN["garbage"])
    return flat, flat.as_strided((flat.numel() // stride, bs, width), (stride, width, 1))


def _token_offsets(record: str, slot: int, bs: int, stride: int) -> tuple[int, int, int, int]:
    """(data offset, data bytes, scale offset, scale bytes) of a slot, from docs/semantics.md:
    V4 pages hold all data rows then all scale rows; V4.1 tokens are data then their scales."""
    block, t = divmod(slot, bs)
    page = block * stride
    if record == "v4_fp8":
        return page + t * 576, 576, page + bs * 576 + t * 8, 8
    width = WIDTH[record]
    data = width - (32 if record == "nvfp4" else 16)
    return page + t * width, data, page + t * width + data, width - data


# ---- byte-exact against vLLM's writers --------------------------------------------------------

SWA_CASES = [c for c in GOLDEN["cases"] if c["writer"] == "quantize_and_insert_k_cache"]
COMPRESSOR_CASES = [c for c in GOLDEN["cases"] if c["writer"] == "rope_quant_insert"]


def test_golden_file_covers_every_packed_record():
    assert GOLDEN["vllm"] == "0.33.0"
    assert {c["record"] for c in SWA_CASES} == {"v4_fp8", "mxfp8"}
    assert {(c["record"], c["ratio"]) for c in COMPRESSOR_CASES} == {
        (r, k) for r in ("v4_fp8", "mxfp8", "nvfp4") for k in (1, 2)}


@pytest.mark.parametrize("case", SWA_CASES, ids=_case_id)
def test_insert_matches_vllm_writer_byte_for_byte(case):
    flat, cache = _garbage_cache(case)
    layout.insert(cache, Record(case["record"]), case["slots"], case["rows"])
    # the whole allocation: written tokens, untouched tokens, page padding, other layers' bytes
    assert torch.equal(flat, case["raw"])


@pytest.mark.parametrize("case", COMPRESSOR_CASES, ids=_case_id)
def test_encode_of_fp32_rows_matches_vllm_compressor_writer(case):
    """The compressor quantizes fp32 RoPE outputs; only group-closing tokens ((pos + 1) % ratio == 0)
    with a slot are written, each at the offsets the record's placement gives."""
    record = Record(case["record"])
    flat, _ = _garbage_cache(case)
    written = (case["slots"] >= 0) & ((case["positions"] + 1) % case["ratio"] == 0)
    assert 0 < int(written.sum()) < written.numel()
    tokens = layout.encode(record, case["rotated"][written])
    assert tokens.shape == (int(written.sum()), WIDTH[case["record"]])
    for slot, tok in zip(case["slots"][written].tolist(), tokens):
        d0, nd, s0, ns = _token_offsets(case["record"], slot, case["block_size"], case["block_stride"])
        flat[d0:d0 + nd], flat[s0:s0 + ns] = tok[:nd], tok[nd:]
    assert torch.equal(flat, case["raw"])


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=_case_id)
def test_gather_matches_vllm_prefill_gather(case):
    """vLLM's gather writes bf16; every slot, the never-written garbage ones included."""
    width, bs, stride = WIDTH[case["record"]], case["block_size"], case["block_stride"]
    cache = case["raw"].as_strided((case["raw"].numel() // stride, bs, width), (stride, width, 1))
    n = cache.shape[0] * bs
    got = layout.gather(cache, Record(case["record"]), torch.arange(n))
    assert torch.equal(got.bfloat16(), case["gathered"])
    assert torch.equal(got.bfloat16().float(), got)  # e4m3 / e2m1 times a scale is exact in bf16 here


def test_fp32_input_is_quantized_without_rounding_to_bf16():
    """The reason encode() takes fp32: rounding the compressor's RoPE output to bf16 first would
    change bytes vLLM writes (V4.1 quantizes the RoPE dims; V4 stores them as bf16)."""
    case = next(c for c in COMPRESSOR_CASES if c["record"] == "mxfp8" and c["ratio"] == 1)
    rotated = case["rotated"][case["positions"] >= 32]  # rows whose RoPE angle is not zero
    assert rotated.shape[0] > 0
    assert not torch.equal(layout.encode("mxfp8", rotated), layout.encode("mxfp8", rotated.bfloat16()))


# ---- hand-derived bytes -----------------------------------------------------------------------

def test_mxfp8_bytes_by_hand():
    row = torch.full((512,), 1.0)
    row[0:32] = 0.0  # zero tile: amax floors at 1e-4 -> e = ceil(log2(1e-4 / 448)) = -22 -> byte 105
    row[32], row[33] = 448.0, 1.0625  # amax 448 -> e = 0 (127); 1.0625 ties between 1.0 and 1.125 -> 0x38
    row[64], row[65] = 56.25, -1.0  # e = -2 (125); 56.25 * 4 = 225 rounds to 224 = 0x76; -4 = 0xC8
    row[480:512] = 2.0**-7  # the RoPE dims are quantized too: amax 2^-7, e = ceil(-15.8) = -15 -> 112, 2^8 -> 0x78
    tok = layout.encode("mxfp8", row.bfloat16()[None])[0]
    assert tok.shape == (528,)
    assert tok[0:32].tolist() == [0] * 32
    assert tok[32:35].tolist() == [0x7E, 0x38, 0x38]
    assert tok[64:67].tolist() == [0x76, 0xC8, 0x48]  # fill 1.0 * 4 = 4.0 = 0x48
    assert tok[480:482].tolist() == [0x78, 0x78]
    assert tok[512:].tolist() == [105, 127, 125] + [119] * 12 + [112]  # tiles of ones: ceil(-8.81) = -8 -> 119


def test_nvfp4_bytes_by_hand():
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.1]
    row = torch.zeros(512)
    row[:16] = torch.tensor(ties)  # amax 6 -> scale e4m3(1.0) = 0x38; every value an e2m1 tie (or -0.1)
    row[16:32] = torch.tensor([3000.0] + [1.0] * 15)  # 3000 / 6 clamps to 448 (0x7E): 6.7 saturates to 6
    row[32:48] = 3.0  # amax 3 -> scale 0.5 (0x30): 3 / 0.5 = 6 -> code 7
    # row[48:64] all zero: scale clamps up to 2^-9 (0x01), codes 0
    tok = layout.encode("nvfp4", row.bfloat16()[None])[0]
    assert tok.shape == (288,)
    # low nibble = even dim. Ties go to the even code: .25 -> 0, .75 -> 1.0 (2), 1.25 -> 1.0 (2),
    # 1.75 -> 2.0 (4), 2.5 -> 2.0 (4), 3.5 -> 4.0 (6), 5 -> 4.0 (6); -0.25 and -0.1 keep the sign (0x8).
    assert tok[0:8].tolist() == [0x07, 0x22, 0x44, 0x66, 0xA8, 0xCA, 0xEC, 0x8E]
    assert tok[8:16].tolist() == [0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00]
    assert tok[16:24].tolist() == [0x77] * 8
    assert tok[24:256].tolist() == [0] * 232
    assert tok[256:260].tolist() == [0x38, 0x7E, 0x30, 0x01] and tok[260:].tolist() == [0x01] * 28


def test_zero_rows_write_the_documented_bytes():
    zero = torch.zeros(2, 512, dtype=torch.bfloat16)
    assert layout.encode("mxfp8", zero)[0].tolist() == [0] * 512 + [105] * 16
    assert layout.encode("nvfp4", zero)[0].tolist() == [0] * 256 + [0x01] * 32
    assert layout.encode("v4_fp8", zero)[0].tolist() == [0] * 576 + [105] * 7 + [0]


# ---- decoding from the bit fields, round-trip bounds -----------------------------------------

def _random_rows(gen, n: int, max_exp: int = 20) -> torch.Tensor:
    """bf16 [n, 512], a different magnitude per 16 dims (2^-20 .. 2^max_exp times N(0, 1))."""
    mags = torch.exp2(torch.randint(-20, max_exp + 1, (n, 32), generator=gen).double()).repeat_interleave(16, dim=1)
    return (torch.randn(n, 512, generator=gen, dtype=torch.float64) * mags).bfloat16()


def _decode_mxfp8_by_hand(tok: torch.Tensor, dialect: str) -> torch.Tensor:
    vals = e4m3_table(dialect)[tok[:, :512].long()].view(-1, 16, 32)
    return (vals * torch.exp2(tok[:, 512:].double() - 127)[..., None]).view(-1, 512)


def _decode_nvfp4_by_hand(tok: torch.Tensor) -> torch.Tensor:
    packed = tok[:, :256].long()
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).view(-1, 512)
    vals = torch.where(codes >= 8, -E2M1[codes & 7], E2M1[codes & 7]).view(-1, 32, 16)
    return (vals * e4m3_table("ocp")[tok[:, 256:].long()][..., None]).view(-1, 512)


@pytest.mark.parametrize("dialect, qmax", [("ocp", 448.0), ("fnuz", 224.0)])
def test_mxfp8_round_trip_within_e4m3_error(gen, dialect, qmax):
    x = _random_rows(gen, 24)
    tok = layout.encode("mxfp8", x, dialect)
    got = _decode_mxfp8_by_hand(tok, dialect)
    assert torch.equal(layout.decode("mxfp8", tok, dialect).double(), got)
    amax = x.double().abs().view(-1, 16, 32).amax(-1).clamp_min(1e-4)
    e = torch.ceil(torch.log2(amax / qmax))  # float64: the exact ceiling for bf16 inputs
    assert torch.equal(tok[:, 512:].double() - 127, e)
    scale = torch.exp2(e).repeat_interleave(32, dim=1)
    y = x.double() / scale
    bound = torch.maximum(y.abs() * 2.0**-4, torch.full_like(y, 2.0**-10)) * scale
    assert ((got - x.double()).abs() <= bound).all()


def test_nvfp4_round_trip_within_e2m1_error(gen):
    x = _random_rows(gen, 24, max_exp=8)  # amax / 6 stays below the 448 clamp (saturation: the hand test)
    tok = layout.encode("nvfp4", x)
    got = _decode_nvfp4_by_hand(tok)
    assert torch.equal(layout.decode("nvfp4", tok).double(), got)
    # the scale is the e4m3 value nearest amax / 6, clamped to [2^-9, 448]
    table = e4m3_table("ocp")
    finite = table[torch.isfinite(table)]
    target = (x.double().abs().view(-1, 32, 16).amax(-1) / 6).clamp(2.0**-9, 448.0)
    scale = table[tok[:, 256:].long()]
    nearest = (finite[None, None, :] - target[..., None]).abs().amin(-1)
    assert ((scale - target).abs() <= nearest * (1 + 1e-12)).all()
    # each value is within half an e2m1 step of x / scale (steps .5, 1, 2 below 2, 4, and 6); above 6
    # it saturates -- which happens when the scale rounded down, most of all among the coarse
    # subnormal e4m3 scales of small tiles (amax / 6 < 2^-6)
    s = scale.repeat_interleave(16, dim=1)
    y = x.double() / s
    half_step = torch.where(y.abs() < 2, 0.25, torch.where(y.abs() < 4, 0.5, 1.0))
    inside = y.abs() <= 6
    assert ((got - x.double()).abs() <= half_step * s)[inside].all()
    assert torch.equal(got[~inside], (torch.sign(y) * 6 * s)[~inside])
    assert (~inside).any() and (~inside).float().mean() < 0.05


def test_one_exponent_rule_for_every_bf16_input():
    """vLLM's V4 SWA writer divides (log2(amax / 448)); its V4.1 and compressor writers multiply by
    fp32(1 / 448). For every positive finite bf16 amax both pick the exact ceil(log2(amax / qmax)),
    so the package uses one rule (the exact ceiling) for all UE8M0 records."""
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)  # every positive finite bf16
    amax = bits.view(torch.bfloat16).float().clamp_min(1e-4)
    for qmax in (448.0, 224.0):
        exact = torch.ceil(torch.log2(amax.double() / qmax))
        divided = torch.ceil(torch.log2(amax / qmax)).double()
        multiplied = torch.ceil(torch.log2(amax * torch.tensor(1 / qmax, dtype=torch.float32))).double()
        assert torch.equal(divided, exact) and torch.equal(multiplied, exact)
        assert torch.equal(codec._ceil_log2(amax * torch.tensor(1 / qmax, dtype=torch.float32)).double(), exact)


# ---- placement, strides, allocation -----------------------------------------------------------

@pytest.mark.parametrize("record", ["mxfp8", "nvfp4"])
def test_insert_places_interleaved_tokens_and_touches_nothing_else(gen, record):
    width = WIDTH[record]
    bs, stride = 4, 4 * width + 96  # 96 bytes of another layer after each page
    cache = layout.new_cache(record, 3, bs, block_stride=stride)
    assert cache.stride() == (stride, width, 1) and cache.shape == (3, 4, width)
    flat = cache.as_strided((3 * stride,), (1,))
    flat.fill_(0xAB)
    kv = _random_rows(gen, 3)
    layout.insert(cache, record, torch.tensor([9, -1, 2], dtype=torch.int32), kv)
    expect = torch.full_like(flat, 0xAB)
    tok = layout.encode(record, kv[[0, 2]])
    expect[2 * stride + 1 * width: 2 * stride + 2 * width] = tok[0]  # slot 9 = block 2, t = 1
    expect[2 * width: 3 * width] = tok[1]  # slot 2 = block 0, t = 2
    assert torch.equal(flat, expect)
    view = cache[2:]  # an engine-style view starting at block 2: slot 1 there is slot 9 here
    assert torch.equal(layout.gather(view, record, torch.tensor([1])), layout.gather(cache, record, torch.tensor([9])))


@pytest.mark.parametrize("record", ["v4_fp8", "bf16", "fp8_tensor", "mxfp8", "nvfp4"])
def test_gather_rows_reads_nothing_for_out_of_range_slots(gen, record):
    cache = _filled(gen, record, 2, 4)  # 8 slots
    geo = layout.check_cache(cache, record, "c")
    slots = torch.tensor([[3, -1, 8, -2], [2**31 - 1, -(2**31), 7, 0]])
    got = layout.gather_rows(cache, record, geo, slots)
    want = layout.gather(cache, record, torch.where((slots >= 0) & (slots < 8), slots, -1))
    assert torch.equal(got, want) and got[0, 2].abs().sum() == 0 and got[0, 0].abs().sum() > 0


@pytest.mark.parametrize("record, block_size, stride", [
    ("mxfp8", 32, 16896), ("mxfp8", 64, 33792), ("mxfp8", 16, 8704), ("mxfp8", 1, 1024),
    ("nvfp4", 64, 18432), ("nvfp4", 2, 1024), ("v4_fp8", 64, 37440),
])
def test_new_cache_default_stride_is_a_512_or_576_aligned_page(record, block_size, stride):
    # vLLM pads V4.1 pages to 512 B (16 * 528 = 8448 -> 8704) and V4 pages to 576 B
    cache = layout.new_cache(record, 2, block_size)
    assert cache.dtype == torch.uint8 and cache.stride(0) == stride
    assert layout.default_block_stride(record, block_size) == stride
    assert layout.check_cache(cache, record, "c") == layout.CacheGeometry(2, block_size, stride)


def test_formats_name_the_record_of_each_cache():
    assert KVFormat.parse("nvfp4_ds_mla").swa_record is Record.MXFP8
    assert KVFormat.parse("nvfp4_ds_mla").comp_record is Record.NVFP4
    assert KVFormat.parse("mxfp8_ds_mla").record is Record.MXFP8
    for name, record in (("fp8_ds_mla", Record.V4_FP8), ("bfloat16", Record.BF16), ("fp8_e4m3", Record.FP8_TENSOR)):
        fmt = KVFormat.parse(name)
        assert fmt.swa_record is fmt.comp_record is record
    assert KVFormat.MODEL1_FP8.row_elems == 584 and KVFormat.MXFP8.row_elems == 528
    lay = Record.NVFP4.layout
    assert (lay.token_bytes, lay.data_bytes, lay.group, lay.scale, lay.split_pages) == (288, 256, 16, "e4m3", False)
    assert (Record.MXFP8.layout.token_bytes, Record.V4_FP8.layout.token_bytes) == (528, 584)


# ---- the float64 reference on the V4.1 records (the torch backend: tests/test_api.py) -----------

def _filled(gen, record, nb, bs, dialect="ocp"):
    cache = layout.new_cache(record, nb, bs, dialect=dialect)
    n = nb * bs
    layout.insert(cache, record, torch.arange(n), (torch.randn(n, 512, generator=gen) * 2).bfloat16(), dialect=dialect)
    return cache


@pytest.mark.parametrize("fmt, swa_dialect", [("mxfp8_ds_mla", "ocp"), ("mxfp8_ds_mla", "fnuz"),
                                              ("nvfp4_ds_mla", "ocp")])
def test_reference_reads_each_cache_in_its_record(gen, fmt, swa_dialect):
    """Keys decoded by hand from the bytes; the reference's softmax over them, written out here."""
    fmt = KVFormat.parse(fmt)
    swa = _filled(gen, fmt.swa_record, 3, 4, swa_dialect)
    comp = _filled(gen, fmt.comp_record, 4, 2)
    T, H = 5, 4
    rows_s = torch.randint(-1, 12, (T, 6), generator=gen).int()
    rows_c = torch.randint(-1, 8, (T, 5), generator=gen).int()
    lens_s, lens_c = torch.tensor([6, 3, 0, 6, 1]).int(), torch.tensor([5, 0, 0, 2, 5]).int()
    q = torch.randn(T, H, 512, generator=gen).bfloat16()
    sink = torch.randn(H, generator=gen)
    out, lse = reference.sparse_mla(q, swa, rows_s, lens_s, comp, rows_c, lens_c, sink, 0.05, fmt,
                                    swa_dialect=swa_dialect)

    def hand(cache, record, dialect):
        tok = cache.reshape(-1, WIDTH[record.value])
        return _decode_nvfp4_by_hand(tok) if record is Record.NVFP4 else _decode_mxfp8_by_hand(tok, dialect)

    keys_s, keys_c = hand(swa, fmt.swa_record, swa_dialect), hand(comp, fmt.comp_record, "ocp")
    for t in range(T):
        keys = [keys_s[r] for r in rows_s[t, :lens_s[t]].tolist() if r >= 0]
        keys += [keys_c[r] for r in rows_c[t, :lens_c[t]].tolist() if r >= 0]
        if not keys:
            assert torch.equal(out[t], torch.zeros(H, 512, dtype=torch.float64)) and (lse[t] == -math.inf).all()
            continue
        k = torch.stack(keys)
        s = 0.05 * q[t].double() @ k.T
        want_lse = torch.logsumexp(s, -1)
        want = torch.softmax(s, -1) @ k * torch.sigmoid(want_lse - sink.double())[:, None]
        assert (out[t] - want).abs().max() < 1e-12 and (lse[t] - want_lse).abs().max() < 1e-12


# ---- refusals ---------------------------------------------------------------------------------

# flashmla declares them (SM100 only: tests/test_flashmla.py checks its SM90 refusal)
@pytest.mark.parametrize("backend", ["flashinfer-trtllm", "aiter"])
@pytest.mark.parametrize("fmt", [KVFormat.MXFP8, KVFormat.NVFP4])
def test_backends_that_do_not_declare_the_v41_records_refuse_them(backend, fmt):
    reasons = backend_mod.reasons_for(backend, probe(), dsv4.ModelSpec(num_heads=64), fmt, LayerKind.C4A,
                                      Phase.DECODE)
    declared = backend_mod.get_backend(backend).capabilities.formats
    assert fmt not in declared
    # the declared formats refuse it (besides any platform reason: every refusal is listed)
    assert f"reads {'/'.join(f.value for f in declared)} caches only (not {fmt.value})" in reasons
    with pytest.raises(BackendUnavailableError, match=rf"(?s)forced by argument.*not {fmt.value}"):
        dsv4.SparseMLA(dsv4.ModelSpec(num_heads=64), fmt, backend=backend)


_ROWS = torch.ones(2, 512, dtype=torch.bfloat16)


@pytest.mark.parametrize("call, name", [
    # a cache that does not match the declared record
    (lambda: layout.check_cache(layout.new_cache("mxfp8", 1, 4), "fp8_ds_mla", "swa_cache"), "swa_cache"),
    (lambda: layout.check_cache(layout.new_cache("nvfp4", 1, 4), KVFormat.MXFP8, "comp_cache"), "comp_cache"),
    (lambda: layout.check_cache(layout.new_cache("mxfp8", 1, 4).view(torch.int16), "mxfp8", "c"), "c"),
    (lambda: layout.check_cache(layout.new_cache("nvfp4", 1, 4), "nvfp4", "comp_cache", Fp8Dialect.FNUZ),
     "comp_cache"),
    # a format with two records where one cache is meant
    (lambda: layout.new_cache("nvfp4_ds_mla", 1, 4), "fmt"),
    (lambda: layout.insert(layout.new_cache("nvfp4", 1, 4), KVFormat.NVFP4, torch.tensor([0, 1]), _ROWS), "fmt"),
    (lambda: KVFormat.NVFP4.record, "fmt"),
    (lambda: layout.new_cache("nvfp5", 1, 4), "fmt"),
    (lambda: layout.new_cache("nvfp4", 1, 4, dialect="fnuz"), "dialect"),
    (lambda: layout.new_cache("mxfp8", 1, 4, block_stride=4 * 528 - 1), "block_stride"),
    (lambda: layout.encode("bf16", _ROWS), "record"),
    (lambda: layout.encode("mxfp8", _ROWS[:, :448]), "rows"),
    (lambda: layout.encode("mxfp8", _ROWS.double()), "rows"),
    (lambda: layout.decode("nvfp4", torch.zeros(2, 528, dtype=torch.uint8)), "tokens"),
    (lambda: layout.insert(layout.new_cache("mxfp8", 1, 2), "mxfp8", torch.tensor([0, 1]), _ROWS.float()), "kv"),
    (lambda: layout.insert(layout.new_cache("mxfp8", 1, 2), "mxfp8", torch.tensor([0, 2]), _ROWS), "slots"),
    (lambda: layout.insert(layout.new_cache("mxfp8", 1, 2), "mxfp8", torch.tensor([0, 1]), _ROWS, scale=2.0),
     "scale"),
    (lambda: reference.sparse_mla(torch.ones(1, 1, 512), layout.new_cache("mxfp8", 1, 2), torch.zeros(1, 1).int(),
                                  torch.ones(1).int(), layout.new_cache("mxfp8", 1, 2), torch.zeros(1, 1).int(),
                                  torch.ones(1).int(), None, 0.1, "nvfp4_ds_mla"), "comp_cache"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}: got .*allowed"):
        call()


# ---- on a GPU: the casts the golden generator had to replace in Triton's interpreter ------------

if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _casts_kernel(x_ptr, fp8_ptr, bf16_ptr, exp_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n)
        tl.store(fp8_ptr + i, tl.clamp(x, -448.0, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=i < n)
        tl.store(bf16_ptr + i, x.to(tl.bfloat16), mask=i < n)
        # the exponent rule of vLLM's V4.1 writers, on |x| floored at 1e-4
        tl.store(exp_ptr + i, tl.ceil(tl.log2(tl.maximum(tl.abs(x), 1e-4) * (1.0 / 448.0))), mask=i < n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a CUDA GPU and Triton")
def test_gpu_triton_casts_and_exponent_rule_match_the_package(gen):
    """On the GPU, Triton's fp32 -> e4m3 / bf16 casts round to nearest even (what
    make_kv_records_golden.py substitutes for the interpreter's casts) and vLLM's fp32
    ceil(log2(amax * (1/448))) equals the package's exact exponent for every bf16 amax. fp32 inputs
    just above a power of two may differ (documented): their count is printed."""
    bf16_all = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    mags = torch.exp2(torch.randint(-30, 9, (1 << 16,), generator=gen).float())
    rand = torch.randn(1 << 16, generator=gen) * mags
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)].sort().values
    ties = (e4m3[1:] + e4m3[:-1]) / 2  # exact midpoints between neighbouring e4m3 values
    edge = torch.exp2(torch.arange(-20, 8).float()) * 448 * (1 + torch.tensor(2.0**-23))  # fp32 just above
    x = torch.cat([bf16_all, -bf16_all, rand, ties, -ties, edge])
    n = x.numel()
    dev = torch.device("cuda")
    fp8 = torch.empty(n, dtype=torch.uint8, device=dev)
    bf16 = torch.empty(n, dtype=torch.bfloat16, device=dev)
    exp = torch.empty(n, dtype=torch.float32, device=dev)
    _casts_kernel[(triton.cdiv(n, 1024),)](x.to(dev), fp8, bf16, exp, n, BLOCK=1024)
    assert torch.equal(fp8.cpu(), x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(bf16.cpu(), x.bfloat16())
    exact = codec._ceil_log2(x.abs().clamp_min(1e-4) * torch.tensor(1 / 448, dtype=torch.float32))
    nb = 2 * bf16_all.numel()
    assert torch.equal(exp.cpu()[:nb], exact[:nb])
    differ = exp.cpu() != exact
    print(f"fp32 inputs whose GPU exponent differs from the exact one: {int(differ.sum())} of {n - nb} "
          f"(of them just above a power of two: {int(differ[-edge.numel():].sum())})")
