"""The portable kernel's record loads and in-register decoders (``attention._load_kv_raw`` +
``_dequant``) on 16 random records, compiled for the GPU, against ``layout.decode`` (the exact
torch decoder): every dim of each record stored as decoded (chunks in the pair order of V4.1
records, ``_chunk_dims``), with the keys scaled in the dot dtype and in fp32 (``F32_DECODE``,
gfx950's choice), and the first chunk's decoded values fed to a score dot (q @ Kᵀ) as the kernel
feeds them. The interpreter runs the same code with
numpy semantics; this shows what the compiled kernel does.

Run: ``PYTHONPATH=. python tests/gpu_scripts/decode_check.py`` (one line per record x dot dtype;
exit 1 on any mismatch). On a CPU-only machine it runs fp32 under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from dsv4_attn.common import layout
from dsv4_attn.portable.kernels import attention as K

N = 16


@triton.jit
def _decode_rows(src, src16, q, out, scores, stride0, FMT: tl.constexpr, DT: tl.constexpr,
                 F32_DECODE: tl.constexpr):
    """Records 0..15 of ``src`` (one token per block; ``src16`` its 2-byte view): decoded dims ->
    out fp32 [16, 512]; chunk 0's scores (the even dims of [0, 256)) q [16, 128] @ Kᵀ -> scores
    fp32 [16, 16]."""
    n = tl.arange(0, 16)
    a, b, c, r, ea, eb, ec, er = K._load_kv_raw(src, src16, stride0, 1, n, n >= 0, FMT, 16, 0)
    ka = K._dequant(a, ea, 1.0, 0, FMT, DT, True, False, F32_DECODE, False)
    kb = K._dequant(b, eb, 1.0, 0, FMT, DT, True, False, F32_DECODE, True)
    kc = K._dequant(c, ec, 1.0, 0, FMT, DT, True, False, F32_DECODE, False)
    kr = K._dequant(r, er, 1.0, 0, FMT, DT, True, False, F32_DECODE, True)
    rows = out + n[:, None] * 512
    tl.store(rows + K._chunk_dims(0, True)[None, :], ka.to(tl.float32))
    tl.store(rows + K._chunk_dims(1, True)[None, :], kb.to(tl.float32))
    tl.store(rows + K._chunk_dims(2, True)[None, :], kc.to(tl.float32))
    tl.store(rows + K._chunk_dims(3, True)[None, :], kr.to(tl.float32))
    qa = tl.load(q + n[:, None] * 128 + tl.arange(0, 128)[None, :]).to(DT)
    tl.store(scores + n[:, None] * 16 + n[None, :], tl.dot(qa, tl.trans(ka)))


def _records(record: layout.Record, gen) -> torch.Tensor:
    lay = record.layout
    tokens = torch.randint(0, 256, (N, lay.token_bytes), generator=gen, dtype=torch.uint8)
    scales = tokens[:, lay.data_bytes:lay.data_bytes + lay.num_scales]
    if lay.values == "e2m1":
        tokens[:, :256] = torch.arange(N * 256).remainder(256).to(torch.uint8).view(N, 256)  # every byte
        scales.copy_(torch.randint(1, 0x7F, scales.shape, generator=gen).to(torch.uint8))  # finite e4m3
    else:
        scales.copy_(torch.randint(120, 135, scales.shape, generator=gen).to(torch.uint8))  # 2^+-7: fits fp16
        data = tokens[:, :512]
        data.copy_(torch.where((data & 0x7F) == 0x7F, 0, data))  # no OCP NaN bytes
    return tokens


def check(record: layout.Record, dt, f32_decode: bool, gen) -> int:
    tokens = _records(record, gen)
    want = layout.decode(record, tokens)
    q = torch.randn(N, 128, generator=gen)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: under TRITON_INTERPRET=1
    out = torch.full((N, 512), float("nan"), device=device)
    scores = torch.full((N, 16), float("nan"), device=device)
    fmt = K.FMT_NVFP4 if record is layout.Record.NVFP4 else K.FMT_MXFP8
    src = tokens.to(device)
    _decode_rows[(1,)](src, src.view(torch.bfloat16), q.to(device), out, scores, record.layout.token_bytes, FMT=fmt,
                       DT=dt, F32_DECODE=f32_decode)
    got = out.cpu()
    tol = 0 if dt == tl.float32 else 2**-8
    bad = ~((got - want).abs() <= tol * want.abs())
    want_s = q.to(_TORCH[dt]).double() @ want[:, 0:256:2].to(_TORCH[dt]).double().T
    s_err = float((scores.cpu().double() - want_s).norm() / want_s.norm())
    s_bad = not s_err < 1e-2
    print(f"{record.value:<6} DT={dt} F32_DECODE={f32_decode}: values {int(bad.sum())} of {bad.numel()} wrong, "
          f"scores rel_l2 {s_err:.2e}", end="")
    if bad.any():
        i, j = bad.nonzero()[0].tolist()
        print(f"; first at [{i}, {j}]: got {float(got[i, j])}, want {float(want[i, j])}", end="")
    print()
    return int(bad.sum()) + int(s_bad)


_TORCH = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    bad = 0
    for record in (layout.Record.MXFP8, layout.Record.NVFP4):
        # the interpreter computes bf16 / fp16 with numpy stand-ins: fp32 only there
        for dt in (tl.float32, tl.bfloat16, tl.float16) if torch.cuda.is_available() else (tl.float32,):
            for f32_decode in (False, True):
                bad += check(record, dt, f32_decode, gen)
    print(f"decode mismatches: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
