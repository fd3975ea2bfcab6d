"""The AITER emulator against AITER's own torch references (tests/data/aiter_reference.py, ported
from ROCm/aiter e4048607) on shared random inputs laid out as AITER's op_tests lay them out.

What agrees, and where the two differ on purpose (docs/rocm.md, "The emulator against AITER's
references"):
* split mode (bf16) and persistent mode (fp8, probabilities rounded to fp8 before P·V, one work
  item per row) match test_mla_persistent.py's reference to bf16 output rounding, LSE included;
* the v4 nm kernel matches test_mla_v4_nm.py's dequantizing golden, sink included; the adapter's
  packing (MODEL1 quantizer + repack) writes the same bytes as AITER's own packing;
* FP8 split mode rounds each split's probabilities against the split's own maximum (a kernel
  runs its softmax per split); the reference rounds once per row, so they differ by fp8 rounding.
EMULATED: this pins the emulator to AITER's reading of its kernels, not to the hardware.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest
import torch

from dsv4_attn.common import layout
from dsv4_attn.emulation import AiterEmulator
from dsv4_attn.emulation.releases import ROW
from dsv4_attn.rocm.aiter_paths import nm_pack

_spec = importlib.util.spec_from_file_location("aiter_reference",
                                               pathlib.Path(__file__).parent / "data" / "aiter_reference.py")
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

I32 = dict(dtype=torch.int32)


def _batch(gen, lens):
    """AITER's decode layout: page size 1, ragged kv_indptr over shuffled pages, one query a row."""
    indptr = torch.zeros(len(lens) + 1, **I32)
    indptr[1:] = torch.tensor(lens).cumsum(0)
    pages = int(indptr[-1]) + 7
    return indptr, torch.randperm(pages, generator=gen)[: int(indptr[-1])].int(), pages


@pytest.mark.parametrize("heads", [16, 128])
def test_split_mode_matches_aiter_reference(gen, heads):
    em = AiterEmulator("gfx950")
    lens = [1, 77, 300, 64]
    indptr, indices, pages = _batch(gen, lens)
    B = len(lens)
    q = torch.randn(B, heads, ROW, generator=gen).bfloat16()
    kv = torch.randn(pages, 1, 1, ROW, generator=gen).bfloat16()
    sm_scale = ROW**-0.5
    o = torch.empty(B, heads, 512, dtype=torch.bfloat16)
    qo = torch.arange(B + 1, **I32)
    _, lse = em.mla_decode_fwd(q, kv, o, qo, indptr, indices, torch.ones(B, **I32), 1, sm_scale=sm_scale,
                               num_kv_splits=4, num_kv_splits_indptr=qo * 4, return_lse=True)
    want, want_lse = ref.torch_mla_extend(q, kv, qo, indptr, indices, torch.ones(B, **I32), sm_scale, 512, 64,
                                          torch.bfloat16, is_causal=False)
    assert (o.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max() + 1e-3
    assert (lse - want_lse).abs().max() < 1e-4


@pytest.mark.parametrize("arch,heads", [("gfx950", 16), ("gfx950", 64), ("gfx950", 128), ("gfx942", 64)])
def test_persistent_fp8_matches_aiter_reference(gen, arch, heads):
    em = AiterEmulator(arch)
    lens = [5, 130, 700]
    indptr, indices, pages = _batch(gen, lens)
    B = len(lens)
    q = (torch.randn(B, heads, ROW, generator=gen) * 2).to(em.fp8)
    kv = (torch.randn(pages, 1, 1, ROW, generator=gen) * 2).to(em.fp8)
    q_scale, kv_scale = torch.tensor([0.5]), torch.tensor([0.25])
    sm_scale = ROW**-0.5
    qo, last = torch.arange(B + 1, **I32), torch.ones(B, **I32)
    meta = [torch.empty(s, dtype=d) for s, d in em.get_mla_metadata_info_v1(B, 1, heads, em.fp8, em.fp8, True)]
    em.get_mla_metadata_v1(qo, indptr, last, heads, 1, True, meta[0], meta[2], meta[1], *meta[3:])
    names = ("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
             "reduce_partial_map")
    o = torch.empty(B, heads, 512, dtype=torch.bfloat16)
    _, lse = em.mla_decode_fwd(q, kv, o, qo, indptr, indices, last, 1, sm_scale=sm_scale, q_scale=q_scale,
                               kv_scale=kv_scale, return_lse=True, **dict(zip(names, [meta[0], meta[1], meta[2],
                                                                                     *meta[3:]])))
    want, want_lse = ref.torch_mla_extend(q, kv, qo, indptr, indices, last, sm_scale, 512, 64, torch.bfloat16,
                                          is_causal=False, q_scale=float(q_scale), kv_scale=float(kv_scale),
                                          fp8=em.fp8)
    assert (o.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max() + 1e-3
    assert (lse - want_lse).abs().max() < 1e-4


def test_fp8_split_mode_rounds_per_split(gen):
    """Where they differ: split mode rounds P against each split's own maximum."""
    em = AiterEmulator("gfx950")
    lens = [600]
    indptr, indices, pages = _batch(gen, lens)
    q = (torch.randn(1, 16, ROW, generator=gen) * 2).to(em.fp8)
    kv = (torch.randn(pages, 1, 1, ROW, generator=gen) * 2).to(em.fp8)
    one, qo = torch.ones(1), torch.arange(2, **I32)
    outs = []
    for splits in (1, 4):
        o = torch.empty(1, 16, 512, dtype=torch.bfloat16)
        em.mla_decode_fwd(q, kv, o, qo, indptr, indices, torch.ones(1, **I32), 1, sm_scale=ROW**-0.5,
                          num_kv_splits=splits, num_kv_splits_indptr=qo * splits, q_scale=one, kv_scale=one)
        outs.append(o.float())
    want, _ = ref.torch_mla_extend(q, kv, qo, indptr, indices, torch.ones(1, **I32), ROW**-0.5, 512, 64,
                                   torch.bfloat16, is_causal=False, q_scale=1.0, kv_scale=1.0, fp8=em.fp8)
    assert (outs[0] - want.float()).abs().max() <= 2**-7 * want.float().abs().max() + 1e-3  # one split: the same
    rel = (outs[1] - want.float()).norm() / want.float().norm()
    assert 1e-4 < rel < 5e-2, rel  # four splits: fp8 rounding apart, no more


@pytest.mark.parametrize("heads,splits", [(16, None), (64, 1), (128, 3)])
def test_v4_nm_matches_aiter_golden_and_packing(gen, heads, splits):
    em = AiterEmulator("gfx950")
    lens = [516, 300, 130, 64]  # AITER's ragged varlen case
    B = len(lens)
    indptr, indices, pages = _batch(gen, lens)
    q_bf = torch.randn(B, heads, 512, generator=gen).bfloat16()
    kv_bf = torch.randn(pages, 1, 1, 512, generator=gen).bfloat16()
    sink = torch.randn(heads, generator=gen) * 10.0  # AITER's scale: the sink moves the output well past noise
    qp, qr = ref.native_to_2buff_for_asm(q_bf)
    kp, kr = ref.native_to_2buff_for_asm(kv_bf)
    # the adapter's packing (MODEL1 quantizer, tile scales written twice) is AITER's, byte for byte
    for packed, rope, rows in ((qp, qr, q_bf), (kp, kr, kv_bf)):
        mine, mine_rope = nm_pack(layout.quantize_model1(rows.reshape(-1, 512)))
        assert torch.equal(mine, packed.view(torch.uint8).reshape(-1, 512))
        assert torch.equal(mine_rope, rope.reshape(-1, 64))
    qo, last = torch.arange(B + 1, **I32), torch.ones(B, **I32)
    out = torch.full((B, heads, 512), math.nan, dtype=torch.bfloat16)
    em.mla_decode_fwd_v4_nm(qp, qr.contiguous(), kp, kr.contiguous(), out, qo, indptr, indices, 1, sink=sink,
                            num_kv_splits=splits)
    want, _ = ref.torch_attn_decode_fp8_dequant_ref(qp, qr, kp, kr, qo, indptr, indices, last, 512**-0.5,
                                                    attn_sink=sink)
    assert (out.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max() + 1e-3
