"""Read AITER's MLA decode code objects the way docs/rocm.md "Evidence" does (no GPU needed).

For each code object the `aiter` backend can reach (and its non-LSE twin), disassemble it with
LLVM's llvm-objdump (``--mcpu=gfx90a`` decodes the gfx942/gfx950 instructions these kernels use;
unknown gfx950 encodings print as ``.long``) and print:

    lse     the final-LSE pointer (kernarg 0x130, ``ptr_LSEP`` in csrc/py_itfs_cu/asm_mla.cu) is loaded
    rows    KV row addressing: "64-bit" (v_mul_lo/hi_u32 of the row number and the page stride,
            kernarg 0xb0) or "24-bit" (v_mul_u32_u24: row numbers wrap at 2^24, 32-bit offsets)
    q576    the constant 576 elements as a per-head q stride (0x240 fp8 / 0x480 bf16 bytes)
    twin    for *_lse_* objects: whether .text equals the non-LSE object's byte for byte

    python tests/gpu_scripts/aiter_co_audit.py AITER_GIT_DIR [COMMIT]

AITER_GIT_DIR: a clone (or bare mirror) of ROCm/aiter; COMMIT defaults to e4048607.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

# hsa/<arch>/mla/<name>.co (the v4 nm object has another kernarg layout: asm_mla_v4.cu)
OBJECTS = {
    "gfx950": ["mla_dec_stage1_bf16_a16w16_subQ16_mqa16", "mla_dec_stage1_bf16_a16w16_subQ128_mqa128",
               "mla_a8w8_qh16_qseqlen1_gqaratio16", "mla_a8w8_qh128_m32x4_n16x2_msk1",
               "mla_a8w8_qh16_qseqlen1_gqaratio16_lse_ps", "mla_a8w8_qh32_qseqlen1_gqaratio32_lse_ps",
               "mla_a8w8_qh16_qseqlen4_gqaratio16_lse_v3_ps", "mla_a8w8_qh32_qseqlen4_gqaratio32_lse_ps"],
    "gfx942": ["mla_dec_stage1_bf16_a16w16_subQ16_mqa16", "mla_dec_stage1_bf16_a16w16_subQ128_mqa128",
               "mla_a8w8_qh16_qseqlen1_gqaratio16", "mla_a8w8_qh128_m32x4_n16x2_msk1",
               "mla_a8w8_qh64_qseqlen1_gqaratio64_lse_v3_ps"],
}
TWINS = {"_lse_v3_ps": "_v3_ps", "_lse_ps": "_ps"}


def _git_bytes(repo: Path, commit: str, path: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], check=True,
                          capture_output=True).stdout


def _text(blob: bytes, tmp: Path) -> tuple[str, bytes]:
    co = tmp / "k.co"
    co.write_bytes(blob)
    asm = subprocess.run(["llvm-objdump", "-d", "--triple=amdgcn-amd-amdhsa", "--mcpu=gfx90a", str(co)],
                         check=True, capture_output=True, text=True).stdout
    raw = tmp / "k.text"
    subprocess.run(["llvm-objcopy", "-O", "binary", "--only-section=.text", str(co), str(raw)], check=True)
    return asm, raw.read_bytes()


def audit(asm: str) -> dict:
    loads = dict(re.findall(r"s_load_dword(?:x\d)? (s\d+|s\[\d+:\d+\]), s\[0:1\], (0x[0-9a-f]+)", asm))
    by_offset = {off: reg for reg, off in loads.items()}
    stride = by_offset.get("0xb0", "")
    wide = bool(stride) and re.search(rf"v_mul_hi_u32 v\d+, v\d+, {stride}\b", asm) is not None
    narrow = bool(stride) and re.search(rf"v_mul_u32_u24\w* v\d+, v\d+, (v\d+|{stride})\b", asm) is not None
    return {"lse": "0x130" in by_offset, "rows": "64-bit" if wide else ("24-bit" if narrow else "?"),
            "q576": re.search(r"\b0x(240|480)\b", asm) is not None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("repo", type=Path)
    p.add_argument("commit", nargs="?", default="e4048607a535ace3a2b51ded31b1c8c2d45c0879")
    args = p.parse_args()
    print("| arch | code object | LSE store | KV rows | q stride 576 | .text == non-LSE twin |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for arch, names in OBJECTS.items():
            for name in names:
                asm, text = _text(_git_bytes(args.repo, args.commit, f"hsa/{arch}/mla/{name}.co"), Path(tmp))
                facts = audit(asm)
                twin = ""
                for lse, plain in TWINS.items():
                    if name.endswith(lse):
                        other = name[: -len(lse)] + plain
                        _, other_text = _text(_git_bytes(args.repo, args.commit, f"hsa/{arch}/mla/{other}.co"),
                                              Path(tmp))
                        twin = "IDENTICAL" if other_text == text else "differs"
                        break
                print(f"| {arch} | {name} | {'yes' if facts['lse'] else 'no'} | {facts['rows']} | "
                      f"{'yes' if facts['q576'] else 'no'} | {twin} |")


if __name__ == "__main__":
    main()
