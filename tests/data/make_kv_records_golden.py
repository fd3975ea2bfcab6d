"""Record the bytes vLLM 0.33.0's own cache writers produce into tests/data/kv_records_golden.pt.

Every byte in the output comes from vLLM's Triton kernels run on the CPU under
``TRITON_INTERPRET=1``; nothing here is computed by ``dsv4_attn``. Writers and readers used
(``vllm/models/deepseek_v41/common/ops/``):

* ``cache_utils.quantize_and_insert_k_cache`` -- bf16 rows into the V4 record (584 B,
  ``quantize_and_insert_k_kernel``) and the V4.1 MXFP8 record (528 B,
  ``_quantize_and_insert_k_mxfp8_kernel``), OCP (the interpreter has no FNUZ fp8 conversion);
* ``fused_compress_quant_cache.rope_quant_insert`` -- the compressor's writer: RoPE in fp32 at
  the group's first position, then the V4 (``_rope_quant_insert_kernel``), MXFP8
  (``_rope_quant_insert_mxfp8_kernel``) or NVFP4 (``_rope_quant_insert_nvfp4_kernel``) record,
  compress ratios 1 and 2;
* ``cache_utils.dequantize_and_gather_k_cache_triton`` -- the prefill gather (bf16 out) of each
  record.

Two pieces of Triton 3.6's interpreter do not compute what the GPU does, so they are replaced:

* its fp32 -> fp8 / bf16 casts (``_convert_float``) round half up on the first cut-off bit,
  let that carry corrupt the exponent field (fp32 0.12109375 -> e4m3 0x18, i.e. 0.0625) and, for
  ``.to(tl.bfloat16)``, truncate. On the GPU both casts round to nearest even (Triton's default
  ``fp_downcast_rounding``; ``cvt.rn.satfinite.e4m3x2.f32`` / ``cvt.rn.bf16.f32``), so
  ``_convert_float_rne`` below does these two downcasts with torch's round-to-nearest-even casts;
* the NVFP4 writer packs with the PTX instruction
``cvt.rn.satfinite.e2m1x2.f32`` (inline asm). It is replaced by ``_e2m1x2_rn_satfinite`` below,
written from the PTX semantics (round to nearest even, saturate to +-6, the sign kept on values
that round to zero); the script then checks the NVFP4 bytes against SGLang 0.5.23's independent
oracle (``test/kernels/deepseek_v4/dsv41_kv_quant_reference.py``) and fails on any difference.
It also reports where SGLang's MXFP8 oracle differs from vLLM (it floors amax / 448 at 1e-4
instead of amax at 1e-4), which docs/semantics.md records.

Set-up (a scratch environment; vLLM's wheel metadata pins a CUDA torch, hence --no-deps):
    python -m venv /tmp/rec-venv   # plus torch 2.13 CPU and triton 3.6
    pip install -r tests/vllm_env/requirements.txt pillow && pip install --no-deps vllm==0.33.0
Run from the repository root (CUDA_VISIBLE_DEVICES= lets vLLM accept Triton with no active GPU
driver; the package is imported only for its patch of Triton 3.6's interpreter under NumPy 2.4):
    CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 PYTHONPATH=. python tests/data/make_kv_records_golden.py \
        --sglang /path/to/sglang-0.5.23    # the unpacked SGLang 0.5.23 wheel
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

OUT = Path(__file__).parent / "kv_records_golden.pt"
GARBAGE = 0xA5  # every cache starts as this byte: a writer must touch only its own bytes
BLOCK_SIZE = 4
NUM_BLOCKS = 3
STRIDE_PAD = 64  # bytes of "other layers' pages" after each block


def _patch_interpreter_casts() -> None:
    from triton.runtime import interpreter

    torch_of = {tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn}
    original = interpreter._convert_float

    def _convert_float_rne(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype != tl.float32 or output_dtype not in torch_of:
            return original(values, input_dtype, output_dtype, rounding_mode)
        x = torch.from_numpy(np.ascontiguousarray(values).view(np.float32).copy())
        out = x.to(torch_of[output_dtype])
        return out.view(torch.int16 if output_dtype == tl.bfloat16 else torch.uint8).numpy().view(
            np.uint16 if output_dtype == tl.bfloat16 else np.uint8).reshape(values.shape)

    interpreter._convert_float = _convert_float_rne


@triton.jit
def _e2m1_code(x):
    """cvt.rn.satfinite to e2m1: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 at codes 0..7, ties to the
    even code, |x| > 6 -> 6, sign bit 8 kept (also for values rounding to zero)."""
    a = tl.abs(x)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << 3)


@triton.jit
def _e2m1x2_rn_satfinite(x_lo, x_hi):
    return (_e2m1_code(x_lo) | (_e2m1_code(x_hi) << 4)).to(tl.uint8)


def _rows(gen: torch.Generator, n: int) -> torch.Tensor:
    """bf16 [n, 512]: random rows with a different magnitude per 16 dims, plus edge rows."""
    mags = torch.exp2(torch.randint(-30, 31, (n, 32), generator=gen).double()).repeat_interleave(16, dim=1)
    rows = (torch.randn(n, 512, generator=gen, dtype=torch.float64) * mags).bfloat16()
    rows[0] = 0.0  # a zero row
    rows[1] = (torch.randn(512, generator=gen) * 1e-6).bfloat16()  # every tile below the 1e-4 floor
    rows[2] = (torch.randn(512, generator=gen) * 1e37).bfloat16()  # near the top of bf16
    # e2m1 ties: with amax 6 the NVFP4 scale is 1.0 and these land exactly between two codes
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
                         -5.0, -0.1])
    rows[3] = ties.repeat(32).bfloat16()
    rows[4, :16] = torch.tensor([3000.0] + [1.0] * 15)  # NVFP4 scale clamps at 448: saturates to 6
    return rows


def _cache(width: int) -> torch.Tensor:
    """uint8 [NUM_BLOCKS, BLOCK_SIZE, width] view with stride(0) = BLOCK_SIZE * width + pad."""
    stride = BLOCK_SIZE * width + STRIDE_PAD
    flat = torch.full((NUM_BLOCKS * stride,), GARBAGE, dtype=torch.uint8)
    return flat.as_strided((NUM_BLOCKS, BLOCK_SIZE, width), (stride, width, 1))


def _raw(cache: torch.Tensor) -> torch.Tensor:
    return cache.as_strided((cache.shape[0] * cache.stride(0),), (1,)).clone()


def _gather(cache_utils, cache: torch.Tensor) -> torch.Tensor:
    """vLLM's prefill gather of every slot of ``cache`` (one request, block table 0..n-1)."""
    n = NUM_BLOCKS * BLOCK_SIZE
    out = torch.full((1, n, 512), float("nan"), dtype=torch.bfloat16)
    cache_utils.dequantize_and_gather_k_cache_triton(
        out, cache, seq_lens=torch.tensor([n], dtype=torch.int32), gather_lens=None,
        block_table=torch.arange(NUM_BLOCKS, dtype=torch.int32)[None], block_size=BLOCK_SIZE, offset=0)
    return out[0]


def _swa_cases(cache_utils, gen) -> list[dict]:
    """bf16 rows through quantize_and_insert_k_cache into the V4 and MXFP8 records (OCP: the
    interpreter cannot convert to FNUZ fp8, ``fp8e4b8``)."""
    cases = []
    for width, record in ((584, "v4_fp8"), (528, "mxfp8")):
        rows = _rows(gen, 10)
        slots = torch.tensor([5, -1, 0, 11, 3, 6, -1, 9, 2, 7])
        cache = _cache(width)
        cache_utils.quantize_and_insert_k_cache(rows, cache, slots, block_size=BLOCK_SIZE, bytes_per_token=width)
        cases.append(dict(writer="quantize_and_insert_k_cache", record=record, dialect="ocp", rows=rows,
                          slots=slots, block_size=BLOCK_SIZE, block_stride=cache.stride(0), raw=_raw(cache),
                          gathered=_gather(cache_utils, cache)))
    return cases


def _rotate_like_the_kernel(latent: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                            ratio: int) -> torch.Tensor:
    """The fp32 row the compressor writers quantize: GPT-J RoPE on dims 448..511 at the group's first
    position, each product and sum rounded to fp32 as the kernel's separate operations are."""
    x = latent.float()
    even, odd = x[:, 0::2].clone(), x[:, 1::2].clone()
    base = (positions // ratio * ratio).long()
    c, s = cos_sin[base, :32], cos_sin[base, 32:]
    e, o = even[:, 224:], odd[:, 224:]
    even[:, 224:], odd[:, 224:] = e * c - o * s, o * c + e * s
    return torch.stack([even, odd], dim=-1).reshape(x.shape)


def _cos_sin(gen) -> torch.Tensor:
    """fp32 [64, 64] RoPE table (cols 0..31 cos, 32..63 sin); positions below 32 are not rotated, so
    their rows stay bf16 (the SGLang oracle takes bf16)."""
    angles = torch.rand(64, 32, generator=gen, dtype=torch.float64) * 6.3
    angles[:32] = 0.0
    return torch.cat([angles.cos(), angles.sin()], dim=1).float()


def _compressor_cases(fused, cos_sin, gen) -> list[dict]:
    """bf16 latents through rope_quant_insert into each record, ratios 1 and 2."""
    fused._fp32x2_to_fp4x2 = _e2m1x2_rn_satfinite
    cases = []
    max_pos = cos_sin.shape[0]
    for width, record in ((584, "v4_fp8"), (528, "mxfp8"), (288, "nvfp4")):
        for ratio in (1, 2):
            latent = _rows(gen, 10)
            positions = torch.randint(0, max_pos, (10,), generator=gen)
            positions[:6] = torch.tensor([7, 9, 1, 13, 21, 40])  # the edge rows unrotated; 40: even, ratio 2 skips it
            slots = torch.tensor([5, 0, -1, 11, 3, 6, 1, 9, 2, 7])
            cache = _cache(width)
            fused.rope_quant_insert(latent, positions, cos_sin, cache, slots, ratio)
            cases.append(dict(writer="rope_quant_insert", record=record, dialect="ocp", ratio=ratio,
                              latent=latent, positions=positions, slots=slots,
                              rotated=_rotate_like_the_kernel(latent, positions, cos_sin, ratio),
                              block_size=BLOCK_SIZE, block_stride=cache.stride(0), raw=_raw(cache)))
    return cases


def _check_against_sglang(sglang_root: Path, cases: list[dict]) -> None:
    """SGLang's oracle quantizes bf16 rows; compare on the compressor cases' NoPE-exact inputs."""
    sys.path.insert(0, str(sglang_root))
    sys.path.insert(0, str(sglang_root / "sglang" / "test" / "kernels" / "deepseek_v4"))
    import dsv41_kv_quant_reference as sg

    for case in cases:
        if case["record"] == "v4_fp8":
            continue
        width = 288 if case["record"] == "nvfp4" else 528
        written = [i for i, (p, s) in enumerate(zip(case["positions"].tolist(), case["slots"].tolist()))
                   if s >= 0 and (p + 1) % case["ratio"] == 0]
        rows = case["rotated"][written]
        exact = rows.bfloat16().float().eq(rows).all(dim=1)  # the oracle takes bf16 input
        rows = rows[exact].bfloat16()
        quant = sg.quantize_k_cache_v41_fp4 if width == 288 else sg.quantize_k_cache_v41
        data = 256 if width == 288 else 512
        theirs = sg.interleave_pages(quant(rows[None]), rows.shape[0], data, width - data).view(-1, width)
        raw, stride = case["raw"], case["block_stride"]
        ours = torch.stack([raw[(s // BLOCK_SIZE) * stride + (s % BLOCK_SIZE) * width:][:width]
                            for s in case["slots"][written][exact].tolist()])
        diff = theirs != ours
        print(f"SGLang oracle vs vLLM, {case['record']} ratio {case['ratio']}: {int(diff.any(1).sum())} of "
              f"{rows.shape[0]} rows differ")
        if width == 288 and diff.any():
            raise SystemExit("NVFP4: the e2m1 emulation disagrees with SGLang's oracle")
        if width == 528:  # only tiles with amax / 448 < 1e-4 may differ (the two floors differ there)
            small = rows.float().abs().reshape(-1, 16, 32).amax(-1) / 448 < 1e-4
            if (diff & ~torch.cat([small.repeat_interleave(32, 1), small], 1)).any():
                raise SystemExit("MXFP8: SGLang's oracle differs beyond the amax floor")
            print(f"  {int(diff.any(1).sum())} rows differ, only in their {int(small.sum())} tiles with "
                  "amax / 448 < 1e-4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sglang", type=Path, required=True,
                        help="unpacked SGLang 0.5.23 (its test/ oracle is cross-checked)")
    args = parser.parse_args()
    if not args.sglang.is_dir():
        parser.error(f"--sglang: got {args.sglang}; allowed: the directory of the unpacked SGLang 0.5.23 wheel")

    import dsv4_attn.portable.kernels  # noqa: F401  (only its interpreter patch: loops over tensor bounds)
    _patch_interpreter_casts()
    import vllm
    from vllm.models.deepseek_v41.common.ops import cache_utils
    from vllm.models.deepseek_v41.common.ops import fused_compress_quant_cache as fused

    if vllm.__version__ != "0.33.0":
        raise SystemExit(f"needs vLLM 0.33.0, found {vllm.__version__}")
    gen = torch.Generator().manual_seed(20261124)
    cos_sin = _cos_sin(gen)
    cases = _swa_cases(cache_utils, gen) + _compressor_cases(fused, cos_sin, gen)
    for case in cases:  # the gather of what the compressor wrote (OCP only there)
        if case["writer"] == "rope_quant_insert":
            width = {"v4_fp8": 584, "mxfp8": 528, "nvfp4": 288}[case["record"]]
            cache = case["raw"].as_strided((NUM_BLOCKS, BLOCK_SIZE, width), (case["block_stride"], width, 1))
            case["gathered"] = _gather(cache_utils, cache)
    _check_against_sglang(args.sglang, [c for c in cases if c["writer"] == "rope_quant_insert"])
    torch.save(dict(vllm=vllm.__version__, garbage=GARBAGE, cos_sin=cos_sin, cases=cases), OUT)
    print(f"wrote {len(cases)} cases to {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
