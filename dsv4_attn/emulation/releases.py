"""What each emulated AITER release ships: versions, flavors, the code objects asm_mla.cu launches
and what their disassembly shows (docs/rocm.md "Evidence"), the constants of the rows they read."""

from __future__ import annotations

from dataclasses import dataclass

ARCHS = ("gfx942", "gfx950")
FLAVORS = ("0.1.7", "0.1.17", "0.1.18", "0.1.19", "0.1.20", "sparse")
AITER_COMMIT = "e4048607a535ace3a2b51ded31b1c8c2d45c0879"  # main of 2026-08-22 == v0.1.20.post1 for MLA
VERSIONS = {"0.1.7": "0.1.7.post2.dev18", "0.1.17": "0.1.17", "0.1.18": "0.1.18", "0.1.19": "0.1.19.post2",
             "0.1.20": "0.1.20.post1", "sparse": "0.1.20.post1 + sparse_mla_fwd (vLLM 0.33 keywords)"}
# What changed between the releases, read from each tag's aiter/mla.py, csrc/py_itfs_cu/asm_mla.cu
# and hsa/*/mla/mla_asm.csv:
# * mla_decode_fwd_v4_nm: 0.1.17 / 0.1.18 take ``kv_last_page_lens`` as the 9th POSITIONAL
#   parameter (required); from 0.1.19 it is a trailing keyword (optional). 0.1.17 predates
#   #4117 (empty splits of short rows merged) and #4245 (out-of-range page ids fold to row 0).
# * asm_mla.cu ``lse_flag = lse != nullptr`` up to 0.1.18, ``&& persistent`` from 0.1.19: before,
#   a split-mode call with return_lse=True finds no code object and raises.
# * gfx942's native 64-head FP8 persistent objects (#3188, needing kv_granularity 32) from 0.1.18.
POSITIONAL_NM_LAST_PAGE = ("0.1.17", "0.1.18")
SPLIT_LSE_RAISES = ("0.1.17", "0.1.18")
NO_GFX942_QH64 = ("0.1.17",)
CU_NUM = {"gfx942": 304, "gfx950": 256}  # MI300X, MI355X
ROW = 576  # elements per q head / KV row the mla_decode_fwd code objects read
V_DIM = 512
NM_ROW_BYTES = 512  # v4 nm packed row: 448 e4m3 NoPE, 14 e8m0 bytes, 50 pad
NM_ROPE = 64
DSV4_ROW_BYTES = 584
STALE = 0.0  # what "unwritten" memory reads as here (AITER allocates it with torch.empty)
CHUNK_ELEMS = 1 << 22  # bounds the [keys, heads, 512] temporaries of one chunk


@dataclass(frozen=True)
class CodeObject:
    """One shipped code object and what its disassembly shows."""

    name: str
    writes_lse: bool  # loads the final-LSE pointer (kernarg 0x130)
    wide: bool  # 64-bit row addressing; else 24-bit rows and 32-bit byte offsets
    kv_granularity: int = 16  # persistent: every work but a row's last covers whole passes of this many keys


def _co(name: str, lse: bool = False, wide: bool = False, gran: int = 16) -> CodeObject:
    return CodeObject(name + ".co", lse, wide, gran)


# What asm_mla.cu (v0.1.20) launches for one query token, by (persistent, q/kv fp8, heads, lse).
# Persistent heads not listed here are folded into 16-head pseudo-batches by aiter/mla.py.
STAGE1 = {
    "gfx950": {
        (False, False, 16, False): _co("mla_dec_stage1_bf16_a16w16_subQ16_mqa16"),
        (False, False, 128, False): _co("mla_dec_stage1_bf16_a16w16_subQ128_mqa128"),
        (False, True, 16, False): _co("mla_a8w8_qh16_qseqlen1_gqaratio16", wide=True),
        (False, True, 128, False): _co("mla_a8w8_qh128_m32x4_n16x2_msk1"),
        (True, True, 16, True): _co("mla_a8w8_qh16_qseqlen1_gqaratio16_lse_ps", True, True),
        (True, True, 32, True): _co("mla_a8w8_qh32_qseqlen1_gqaratio32_lse_ps"),  # no LSE store
        (True, True, 64, True): _co("mla_a8w8_qh16_qseqlen4_gqaratio16_lse_v3_ps", True, True),
        (True, True, 128, True): _co("mla_a8w8_qh32_qseqlen4_gqaratio32_lse_ps", True, True),
        (True, True, 16, False): _co("mla_a8w8_qh16_qseqlen1_gqaratio16_ps", wide=True),
        (True, True, 32, False): _co("mla_a8w8_qh32_qseqlen1_gqaratio32_ps"),
        (True, True, 64, False): _co("mla_a8w8_qh16_qseqlen4_gqaratio16_v3_ps", wide=True),
        (True, True, 128, False): _co("mla_a8w8_qh32_qseqlen4_gqaratio32_ps", wide=True),
    },
    "gfx942": {
        (False, False, 16, False): _co("mla_dec_stage1_bf16_a16w16_subQ16_mqa16"),
        (False, False, 128, False): _co("mla_dec_stage1_bf16_a16w16_subQ128_mqa128"),
        (False, True, 16, False): _co("mla_a8w8_qh16_qseqlen1_gqaratio16"),
        (False, True, 128, False): _co("mla_a8w8_qh128_m32x4_n16x2_msk1"),
        # SUB_KV = 32 partial producers (#3188: "requires SUB_KV=32 partial granularity")
        (True, True, 64, True): _co("mla_a8w8_qh64_qseqlen1_gqaratio64_lse_v3_ps", True, gran=32),
        (True, True, 16, False): _co("mla_a8w8_qh16_qseqlen1_gqaratio16_ps"),
        (True, True, 64, False): _co("mla_a8w8_qh64_qseqlen1_gqaratio64_v3_ps", gran=32),
        (True, True, 128, False): _co("mla_a8w8_qh128_m32x4_n16x2_msk0_ps"),
    },
}
NATIVE_PERSISTENT = {"gfx950": (16, 32, 64, 128), "gfx942": (16, 64, 128)}
V4_NM_OBJECT = "mla_a8w8_qh64_qseqlen1_gqaratio64_nm.co"  # hsa/gfx950/mla_v4 only
V4_NM_HEADS = (16, 32, 64, 128)
# 0.1.7 wheel listing (aiter_meta/hsa/<arch>/mla): no LSE object
ASM_017 = ("mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_ps.co", "mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps.co",
            "mla_a8w8_qh128_m32x4_n16x2_msk1.co", "mla_a8w8_qh16_qseqlen1_gqaratio16.co",
            "mla_a8w8_qh16_qseqlen1_gqaratio16_ps.co", "mla_dec_stage1_bf16_a16w16_subQ128_mqa128.co",
            "mla_dec_stage1_bf16_a16w16_subQ16_mqa16.co")
FP8_BLOCK = {8: 64, 16: 128, 24: 128, 32: 128, 48: 64, 64: 64, 128: 32}  # get_meta_param's get_block_n_fp8

