"""Python launchers of the Triton kernels (no validation here: the backend validates first).

Which kernel runs (``kernel_choice``: the Gluon Hopper kernel or the portable one) and with which
tile (``KernelConfig.tile``) follow from the GPU's arch, the caches' records, the head count and the
config alone,
so ``TritonBackend.choice`` (``SparseMLA.explain()``) and the offline compile checks
(tests/test_amd_compile.py, docs/rocm.md) see exactly what a launch does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ...common.layout import Fp8Dialect, KVFormat, Record
from ...common.platform import triton_interpreting
from ...common.spec import LayerKind
from . import attention as K
from . import build, launch

LOG2E = 1.4426950408889634


# plain-int twins of triton.cdiv / next_power_of_2 (Triton 3.8 made those constexpr functions,
# a few us per call on the host)
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _num_sms(_index(device))


@functools.lru_cache(maxsize=8)
def _device_arch(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        return props.gcnArchName.split(":")[0]
    return f"sm{props.major}{props.minor}"


def device_arch(device: torch.device) -> str:
    """The arch the kernels are compiled for, named as ``Platform.arch`` names it ('sm90',
    'gfx942', ...); 'cpu' under Triton's CPU interpreter."""
    if triton_interpreting() or device.type != "cuda":
        return "cpu"
    return _device_arch(_index(device))


@dataclass(frozen=True)
class Tile:
    """How the portable kernel is launched: query heads and keys per program, warps, stages, P and
    alpha through a per-program scratch (``attention._attend_tile``), backend options, and whether
    e4m3 keys are scaled in fp32 (``attention._dequant``'s ``F32_DECODE``)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    p_scratch: bool
    options: tuple[tuple[str, int], ...] = ()
    f32_decode: bool = False


# AMD CDNA (gfx942 / gfx950): blocks of 16 heads, 64 keys per tile, 4 waves per workgroup, P and
# alpha through the per-program scratch. 16 heads are ONE MFMA tile high, and Triton's AMD backend
# gives the first dot of a chained pair (Q·Kᵀ feeding P·V) all its waves along M: with P in
# registers every wave computed the whole score tile (4x the Q·Kᵀ work). Through the scratch
# the chain is broken: Q·Kᵀ is split over the waves (16 keys each), P·V over the 512 dims
# (128 each). 4 waves: each SIMD runs one, which may then use 512 VGPRs (256 arch + 256 AGPRs).
# 128 keys spill VGPRs; 32 keys need 2 waves (half the SIMDs). Measured offline, with the
# launcher's specialization of its integer arguments, in the heaviest variants (top-k V4, bf16,
# mxfp8_ds_mla, nvfp4_ds_mla, FNUZ caches, split; docs/rocm.md "Triton kernels on AMD";
# tests/test_amd_compile.py holds it). Every record runs in it (V4.1 records in the pair order of
# their bytes, attention._chunk_dims).
AMD_TILE = Tile(16, 64, 4, 1, True, (("matrix_instr_nonkdim", 16),))


@dataclass(frozen=True)
class KernelConfig:
    """Kernel choice and launch knobs. ``block_h`` / ``block_n`` / ``num_warps`` / ``p_scratch``
    None: the tile of the GPU's arch (``tile``); ``split`` 0: chosen from the grid size."""

    block_h: int | None = None  # query heads per program: 16, 32 or 64
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int = 1
    split: int = 0
    dot_dtype: str = "auto"  # auto | fp16 | bf16 | fp32
    p_scratch: int | None = None  # 1: P/alpha round-trip through a per-program scratch (see attention.py)
    f32_decode: int | None = None  # 1: e4m3 keys scaled in fp32, rounded to the dot dtype once (Tile.f32_decode)
    impl: str = "auto"  # auto | gluon (Hopper kernels: V4 record, V4.1 records) | triton (portable kernel)
    g_block_n: int = 64  # Gluon kernel: keys per tile
    # split merge (Gluon kernel): -1 auto (``merge_in_kernel``), 0 the combine launch, 1 inside
    # the attention kernel (the last split program of a token merges)
    merge_in_kernel: int = -1
    # the combine launch's tile, heads x dims per program (grid T x H/heads x 512/dims); None:
    # ``combine_tile``'s
    combine_heads: int | None = None
    combine_dims: int | None = None
    # the combine launch's splits per load round trip (``combine_chunk``); None: auto
    combine_chunk: int | None = None
    # Gluon kernel with few heads: -1 auto (``heads_on_n``), 0 the 64-head kernel (heads on wgmma's M),
    # 1 the heads-on-N kernel (hopper_heads) wherever the head count allows it (<= 16)
    heads_on_n: int = -1
    # Gluon kernel, MTP / verify steps: -1 auto (``pair_tokens``), 0 one token per program, 1 two
    # consecutive tokens per program (the heads-on-N kernel; window and C128A layers of <= 8 heads)
    pair_tokens: int = -1
    # programmatic dependent launch (Hopper, ``pdl_launches``): -1 auto, 0 off, 1 the Gluon kernel's
    # launch, 2 that and the combine launch after it
    pdl: int = -1
    # Gluon kernel, unsplit 64-head launches: -1 auto (``pingpong``), 0 the 64-head kernel, 1 the
    # key-tile ping-pong kernel (hopper_prefill: the two consumer warpgroups on different key tiles)
    pingpong: int = -1
    # 0 compiles the kernels WITHOUT their index range checks, so out-of-range entries are read
    # out of bounds: only for measuring the checks' cost (dsv4-attn bench --guard-cost)
    range_checks: int = 1

    def __post_init__(self) -> None:
        if self.block_h not in (None, 16, 32, 64):
            raise ValueError(f"block_h: got {self.block_h!r}; allowed: None (the arch's), 16, 32 or 64")
        if self.heads_on_n not in (-1, 0, 1):
            raise ValueError(f"heads_on_n: got {self.heads_on_n!r}; allowed: -1 (auto), 0 or 1")
        if self.pair_tokens not in (-1, 0, 1):
            raise ValueError(f"pair_tokens: got {self.pair_tokens!r}; allowed: -1 (auto), 0 or 1")
        if self.pdl not in (-1, 0, 1, 2):
            raise ValueError(f"pdl: got {self.pdl!r}; allowed: -1 (auto), 0 (off), 1 (the Gluon kernel's launch) or "
                             "2 (the Gluon kernel's and the combine launch)")
        if self.pingpong not in (-1, 0, 1):
            raise ValueError(f"pingpong: got {self.pingpong!r}; allowed: -1 (auto), 0 or 1")
        if self.merge_in_kernel not in (-1, 0, 1):
            raise ValueError(f"merge_in_kernel: got {self.merge_in_kernel!r}; allowed: -1 (auto), 0 or 1")
        if self.combine_chunk not in (None, 1, 4):
            raise ValueError(f"combine_chunk: got {self.combine_chunk!r}; allowed: None (auto), 1 or 4")
        if self.combine_heads not in (None, 4, 8, 16) or self.combine_dims not in (None, 32, 64, 128):
            raise ValueError(f"combine_heads / combine_dims: got {self.combine_heads!r} / {self.combine_dims!r}; "
                             "allowed: None, 4, 8 or 16 / None, 32, 64 or 128")

    def dt(self):
        name = self.dot_dtype
        if name == "auto":
            name = "fp32" if triton_interpreting() else "bf16"
        return {"fp16": K.tl.float16, "bf16": K.tl.bfloat16, "fp32": K.tl.float32}[name]

    def tile(self, arch: str, num_heads: int) -> Tile:
        """The portable kernel's tile for ``num_heads`` query heads on ``arch`` ('cpu': the
        interpreter), this config's fields overriding the arch's choice. Every record runs in the
        arch's one tile (V4.1 records in pair order, ``attention._chunk_dims``)."""
        if arch.startswith("gfx"):
            # gfx950 converts e4m3 -> fp32 -> bf16 in hardware (gfx942 in software: there the
            # bf16 product is shorter): V4 top-k 51.0 -> 36.4 instructions per key on gfx950
            base = replace(AMD_TILE, f32_decode=arch == "gfx950")
        else:
            base = Tile(64 if num_heads >= 64 else max(16, _next_power_of_2(num_heads)), 64, 8, 1, True)
        return replace(base, block_h=self.block_h or base.block_h, block_n=self.block_n or base.block_n,
                       num_warps=self.num_warps or base.num_warps, num_stages=self.num_stages,
                       p_scratch=base.p_scratch if self.p_scratch is None else bool(self.p_scratch),
                       f32_decode=base.f32_decode if self.f32_decode is None else bool(self.f32_decode))


DEFAULT_CONFIG = KernelConfig()
_TORCH_DT = {K.tl.float16: torch.float16, K.tl.bfloat16: torch.bfloat16, K.tl.float32: torch.float32}
# the kernels' code of each record (attention.FMT_*)
RECORD_CODE = {Record.V4_FP8: K.FMT_MODEL1, Record.BF16: K.FMT_BF16, Record.FP8_TENSOR: K.FMT_FP8,
               Record.MXFP8: K.FMT_MXFP8, Record.NVFP4: K.FMT_NVFP4}


def _cache_views(cache: torch.Tensor, fmt_code: int) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """(byte view, 16-bit view, block stride in the kernel's element unit, block size, blocks)."""
    nb, bs, row = cache.shape
    stride0 = cache.stride(0) if nb > 1 else max(cache.stride(0), bs * row)
    if fmt_code == K.FMT_BF16:
        return cache, cache, stride0, bs, nb
    u8 = cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)
    if fmt_code in (K.FMT_MODEL1, K.FMT_MXFP8):
        # same bytes seen as bf16: the V4 record's RoPE part, MXFP8 values read as 16-bit words in
        # nvfp4_ds_mla layers (byte offsets used there are even)
        b16 = u8.view(torch.bfloat16)
        return u8, b16, stride0, bs, nb
    return u8, u8, stride0, bs, nb


def _log2_or_minus1(block_size: int) -> int:
    """log2 of a power-of-two cache block size (the Gluon kernel then splits slots with shifts),
    else -1 (integer division)."""
    return block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else -1


@functools.lru_cache(maxsize=8)
def _gluon_importable() -> bool:
    try:
        from . import hopper  # noqa: F401
    except Exception:
        return False
    return True


def _aligned(cache: torch.Tensor | None) -> bool:
    """Rows 16-byte aligned: what the Gluon kernel's cp.async copies assume."""
    if cache is None:
        return True
    stride0 = cache.stride(0) * cache.element_size() if cache.shape[0] > 1 else 16
    return stride0 % 16 == 0 and cache.data_ptr() % 16 == 0


def kernel_choice(arch: str, records: tuple[Record, ...], dialects: tuple[Fp8Dialect, ...],
                  config: KernelConfig = DEFAULT_CONFIG) -> tuple[str, str]:
    """('gluon' | 'portable', why) for a layer whose caches hold ``records`` in FP8 ``dialects``
    on ``arch``, before the run-time conditions ``use_gluon`` adds (Gluon importable, 16-byte
    aligned caches)."""
    if config.impl == "triton":
        return "portable", "KernelConfig(impl='triton')"
    if arch == "cpu":
        return "portable", "Triton's CPU interpreter"
    if arch != "sm90":
        return "portable", f"the Gluon kernel is sm_90 only, this is {arch}"
    v41 = v41_codes(records) is not None
    other = sorted({r.value for r in records if r is not Record.V4_FP8})
    if other and not v41:
        return "portable", f"the Gluon kernels read the V4 record (v4_fp8) or the V4.1 records (mxfp8, nvfp4), " \
                           f"not {'/'.join(other)}"
    if Fp8Dialect.FNUZ in dialects:
        # FNUZ 0x7F / 0xFF (±240) are NaN to its OCP conversion; the portable kernel decodes them
        return "portable", "the Gluon kernel reads OCP e4m3 only, not FNUZ"
    if v41:
        return "gluon", f"sm_90, V4.1 records ({'/'.join(other)}) in OCP e4m3: hopper_records"
    return "gluon", "sm_90, V4 records in OCP e4m3"


def v41_codes(records: tuple[Record, ...]) -> tuple[int, int] | None:
    """The (SWA, compressed) record codes (``attention.FMT_*``) of a layer reading only V4.1 records
    (MXFP8, NVFP4: the Gluon ``hopper_records`` kernel's), else None (the V4 record's kernels)."""
    if not records or any(r not in (Record.MXFP8, Record.NVFP4) for r in records):
        return None
    return RECORD_CODE[records[0]], RECORD_CODE[records[-1]]


def comp_mode_of(kind: LayerKind) -> int:
    """The kernels' COMP constexpr of a layer kind (top-k kinds: local entries translated inside)."""
    if not kind.has_comp_scope:
        return K.COMP_NONE
    return K.COMP_C4A_LOCAL if kind.uses_topk else K.COMP_GLOBAL


def compile_reason(arch: str, impl: str, records: tuple[Record, ...], comp_mode: int, num_heads: int,
                   config: KernelConfig = DEFAULT_CONFIG) -> str:
    """'' when kernel ``impl`` ('gluon' | 'portable') of a layer reading ``records`` compiles for
    ``arch`` with the installed Triton, else the compile error (``build.compile_error``: one
    non-split variant with the LSE and a sink, compiled once per process)."""
    if impl == "gluon":
        variant = build.hopper_constexprs(comp_mode, write_lse=True, records=v41_codes(records))
        return build.compile_error(arch, "gluon", tuple(sorted(variant.items())))
    tile = config.tile(arch, num_heads)
    codes = (RECORD_CODE[records[0]], RECORD_CODE[records[-1]])
    const = portable_constexprs(codes, comp_mode, 4, True, True, 1, tile, config.dt(), bool(config.range_checks))
    return build.compile_error(arch, "portable", tuple(sorted(const.items())),
                               tuple(sorted(launch_options(tile).items())))


def resolved_kernel(arch: str, records: tuple[Record, ...], dialects: tuple[Fp8Dialect, ...], comp_mode: int,
                    num_heads: int, config: KernelConfig = DEFAULT_CONFIG) -> tuple[str, str]:
    """``kernel_choice`` after asking the compiler: the Gluon kernel only where it is importable and
    compiles for ``arch`` with this Triton, else the portable kernel, the reason saying why."""
    impl, why = kernel_choice(arch, records, dialects, config)
    if impl != "gluon":
        return impl, why
    if not _gluon_importable():
        return "portable", "the Gluon kernel does not import with this Triton"
    error = compile_reason(arch, "gluon", records, comp_mode, num_heads, config)
    return ("portable", error) if error else (impl, why)


def use_gluon(device: torch.device, records: tuple[Record, ...], dialects: tuple[Fp8Dialect, ...],
              config: KernelConfig, caches=(), comp_mode: int = K.COMP_NONE, num_heads: int = 64) -> bool:
    impl, why = resolved_kernel(device_arch(device), records, dialects, comp_mode, num_heads, config)
    ok = impl == "gluon" and all(_aligned(c) for c in caches)
    if config.impl == "gluon" and not ok:
        raise ValueError("config.impl: got 'gluon'; allowed only on an sm_90 GPU with Triton's Gluon (compiling "
                         "with this Triton), the fp8_ds_mla, mxfp8_ds_mla or nvfp4_ds_mla format in OCP e4m3 "
                         f"and 16-byte aligned cache blocks; here: {why}")
    return ok


def choose_split(num_programs: int, max_tiles: int, device: torch.device, requested: int = 0,
                 ctas_per_sm: int = 1) -> int:
    """Key splits per program: enough programs to fill the SMs once (``ctas_per_sm`` programs
    each, for a kernel that fits several), at most one tile per split."""
    if requested > 0:
        return max(1, min(requested, max_tiles))
    slots = num_sms(device) * ctas_per_sm
    if num_programs >= slots or max_tiles <= 1:
        return 1
    return max(1, min(max_tiles, slots // num_programs))


# Rows of at most SHORT_ROWS_MAX_TILES key tiles (window-only layers: 128 keys, two 64-key tiles) on the
# Gluon kernels: a split halves a chain of two tiles but writes and reads back fp32 partials of
# 2 x T x H x 2 KiB and adds the combine launch. H200, 2026-11-27 (notes/perf-h200.md, `bench
# --configs h8-swa .. h128-swa --variant nosplit=split=1`): splitting wins 0.7-1.6 us only where a
# launch holds at most SHORT_ROWS_SPLIT_MAX_TOKEN_HEADS token-heads (2-4 tokens at 32-64 heads; a
# tie at 128 heads x 2 tokens); at 64 tokens x 64 heads the split launch took 23.5 us against 17.1
# unsplit (32 heads: 17.2 / 15.8), and up to 16 heads the heads-on-N kernel unsplit beat the split
# 64-head launch at every batch up to 128 (8 heads: 10.8 / 13.8 us at 2 tokens, 12.2 / 15.4 at 64).
SHORT_ROWS_MAX_TILES = 2
SHORT_ROWS_SPLIT_MAX_TOKEN_HEADS = 256


# Heads-on-N launches of few programs, one per SM: the kernel fits two programs per SM, and its split
# is sized for that (two per SM: ``build.ctas_per_sm``). Where a launch's programs fill at most
# half the SMs and number at least ONE_PER_SM_MIN_PROGRAMS (per heads per program), auto instead
# takes the heads-on-N kernel on every row length, sizes the split for ONE program per SM and
# launches it without programmatic dependent launch (its combine too). Measured on the H100 (torch
# 2.11, Triton 3.6, whole decode steps in one graph; notes/perf-gather.md), against the rules
# before: V4-Flash -tp 8 1.04x / 1.09x / 1.04x at b = 8 / 32 / 64 (535.5 -> 514.1, 783.0 -> 718.8,
# 1073.8 -> 1028.5 us), 1.03-1.04x at b = 4 / 6; V4-Pro -tp 8 1.13x / 1.08x / 1.08x at b = 8 / 32 /
# 64; at s_q = 2 b = 16 / 32 1.08x / 1.02x (Flash) and 1.08x / 1.05x (Pro); b = 64 at s_q = 2 and b =
# 128 do not take it (within 0.3 %). Below the floors it lost: 8 heads per program 2 % at 3
# programs and 8-10 % at 2; 16 heads per program 10 % at 3-4 programs (the 64-head kernel's split
# with PDL is better there), 2 % at 6. With PDL the same split was 0.75-0.92x (the next layer's
# programs, launched early, wait on the free second slot of every SM). Not token pairs (tuned at
# 64+ pairs with two per SM).
ONE_PER_SM_MIN_PROGRAMS = {8: 4, 16: 8}


def one_program_per_sm(config: KernelConfig, heads_n: int, pair: bool, programs: int, device: torch.device) -> bool:
    """Whether a Gluon launch of ``programs`` programs of the heads-on-N kernel (``heads_n`` > 0),
    pairs or not, takes the one-program-per-SM rule above: auto split only (``config.split`` 0)."""
    return (config.split == 0 and heads_n > 0 and not pair
            and ONE_PER_SM_MIN_PROGRAMS[heads_n] <= programs and 2 * programs <= num_sms(device))


def short_rows_unsplit(config: KernelConfig, max_tiles: int, num_tokens: int, num_heads: int, heads_n: int) -> bool:
    """Whether a Gluon launch over rows of ``max_tiles`` key tiles runs unsplit whatever the SM
    count: auto split, rows of at most SHORT_ROWS_MAX_TILES tiles, on the heads-on-N kernel
    (``heads_n`` > 0) or above SHORT_ROWS_SPLIT_MAX_TOKEN_HEADS token-heads."""
    return (config.split == 0 and max_tiles <= SHORT_ROWS_MAX_TILES
            and (heads_n > 0 or num_tokens * num_heads > SHORT_ROWS_SPLIT_MAX_TOKEN_HEADS))


# The heads-on-N Gluon kernel (hopper_heads: wgmma N = 8 / 16 heads, one K stage, two CTAs per SM)
# against the 64-head one, same runs on the H100 (notes/perf-wave5.md): 5-23 % faster at b = 64-128 on
# layers whose tokens read 16+ key tiles (C4A 1024, C128A 1024: 18), and 23-46 % faster on every
# layer kind where its launch needs no key split (b = 256: C4A 512 / 1024, C128A, window only); a
# tie or up to 6 % slower on split launches of 10 tiles (C4A 512 at b = 64-128) and 14-36 % slower
# on split window-only launches at b = 128 (2 tiles: the extra split's merge costs more than the
# overlap gives); within 0.5 us at b <= 4. Auto takes it for up to HEADS_ON_N_MAX_HEADS heads where
# a token's rows span at least HEADS_ON_N_MIN_TILES key tiles or its launch is not split, which rows
# of at most SHORT_ROWS_MAX_TILES tiles on it never are (short_rows_unsplit: measured on the H200).
# With 16 heads per program (9-16 heads) only where its key split is at most HEADS_ON_N_WIDE_MAX_SPLIT:
# H100, 2026-11-27 (notes/perf-gather.md; both kernels forced, heads-on-N / 64-head us, once the
# split variant's Triton 3.6 spill was gone, e6beefa; with it the limit had been 2): splits of 3-5
# tie or win (48 tokens: C4A 1024 39.4 / 41.4, C128A 33.6 / 38.4; 64 tokens: 44.9 / 44.7, 37.2 /
# 40.3; 88: 52.6 / 66.4, 45.2 / 62.8), splits of 8-16 lose up to 7 % (32 tokens: 32.2 / 30.5, 28.4 /
# 27.9; 16 tokens: C4A 1024 26.2 / 24.4) and larger ones tie (4 tokens: 17.7 / 17.6, 15.9 / 15.9).
# Whole V4-Pro -tp 8 steps against a limit of 4: 48 / 52 tokens (split 5) 1.16x / 1.10x faster (s_q
# 1), 1.21x / 1.16x (s_q 2); a limit of 7 lost 1-4 % at 40-44 tokens (split 6). With 8 heads per
# program also over rows under HEADS_ON_N_MIN_TILES tiles where its split is at most
# HEADS_ON_N_SHORT_ROWS_MAX_SPLIT: same machine, C4A 512 at 88 / 96 / 128 tokens (splits 3 / 2 / 2)
# 37.5 / 38.7 / 44.2 us against 42.5 / 42.9 / 45.2 on the 64-head kernel (two to three runs), a tie at
# 64 (split 4: 31.3 / 31.8), 4 % slower at 16-32 (splits 8-16); whole V4-Flash -tp 8 steps 1.03-1.10x
# faster at 96-128 tokens (s_q 1 and 2). 16 heads there lose 4-8 % even without the spill (C4A 512 at
# 64 / 128 tokens: 34.0 / 47.7 against 31.6 / 45.8), so they keep the 64-head kernel.
HEADS_ON_N_MAX_HEADS = 16
HEADS_ON_N_MIN_TILES = 16
HEADS_ON_N_WIDE_MAX_SPLIT = 5
HEADS_ON_N_SHORT_ROWS_MAX_SPLIT = 4
# Under Triton 3.9 (torch 2.15's) the heads-on-N kernel with 16 heads per program ran 1.28-1.46x
# slower than under 3.6 (H100, h16-c4a1024 / h16-c128a / h16-c4a512 at b = 64 / 128: e.g. C128A b=64
# 35.8 -> 52.4 us), and 1.12-1.23x slower than the 64-head kernel under 3.9 (notes/perf-gather.md);
# 8 heads per program stay ahead of the 64-head kernel there. Auto takes 16 heads per program under
# the Tritons listed only (3.7: unmeasured, kept as before). Since the K stage is indexed through
# ``_opaque_zero`` (session 39: the loop's spilled wgmma descriptors were the cause) 3.9 ties the
# 64-head kernel at b = 64 and beats it by 1.07-1.16x at b = 128; b = 4-32 and whole steps are
# unmeasured, so 3.9 is not listed yet.
HEADS_ON_N_WIDE_TRITONS = ("3.6.", "3.7.", "3.8.")


def heads_on_n(config: KernelConfig, gluon: bool, num_heads: int, max_tiles: int, num_tokens: int,
               device: torch.device, comp_mode: int = K.COMP_NONE) -> int:
    """NH, the heads per program of the heads-on-N Gluon kernel for a launch of ``num_tokens`` tokens
    x ``num_heads`` heads whose rows span ``max_tiles`` key tiles, or 0 for the 64-head kernel:
    never on the portable kernel or above ``hopper_heads.MAX_HEADS`` heads; else as
    ``config.heads_on_n`` says, auto up to HEADS_ON_N_MAX_HEADS heads where the launch is not
    split or, over rows of HEADS_ON_N_MIN_TILES+ tiles, split at most HEADS_ON_N_WIDE_MAX_SPLIT ways
    (16 heads per program, under HEADS_ON_N_WIDE_TRITONS only) / any way (8 heads per program, which
    also take rows of fewer tiles up to a split of HEADS_ON_N_SHORT_ROWS_MAX_SPLIT), and on every
    launch ``one_program_per_sm`` takes, where it compiles with this Triton (``build.compile_error``;
    forced where it does not: ValueError)."""
    from . import hopper_heads

    if not gluon or config.heads_on_n == 0 or num_heads > hopper_heads.MAX_HEADS:
        return 0
    nh = hopper_heads.heads_per_program(num_heads)
    if config.heads_on_n != 1:
        if num_heads > HEADS_ON_N_MAX_HEADS or (nh > 8 and not _triton_version().startswith(HEADS_ON_N_WIDE_TRITONS)):
            return 0
        programs = num_tokens * _cdiv(num_heads, nh)
        split = 1 if short_rows_unsplit(config, max_tiles, num_tokens, num_heads, nh) else \
            choose_split(programs, max_tiles, device, config.split, hopper_heads.CTAS_PER_SM)
        long_rows = max_tiles >= HEADS_ON_N_MIN_TILES
        if nh > 8:
            taken = split == 1 or (long_rows and split <= HEADS_ON_N_WIDE_MAX_SPLIT)
        else:
            taken = long_rows or split <= HEADS_ON_N_SHORT_ROWS_MAX_SPLIT
        if not taken and not one_program_per_sm(config, nh, False, programs, device):
            return 0
    variant = build.hopper_constexprs(comp_mode, write_lse=True, heads_n=nh)
    error = build.compile_error(device_arch(device), "gluon", tuple(sorted(variant.items())))
    if error and config.heads_on_n == 1:
        raise ValueError(f"config.heads_on_n: got 1; allowed only where the heads-on-N kernel compiles; here: {error}")
    return 0 if error else nh


# Token pairs (hopper_heads PAIR): a request's MTP / verify tokens read the same window (shifted by
# one position) and the same C128A rows, so one program serves two consecutive tokens (columns
# 0-7 and 8-15 of wgmma N = 16) and reads each shared row once; the prologue checks that the
# rows overlap as such, else the program reads both lists (exact either way). Window-only and C128A
# layers (no top-k: each token's top-k differs), up to PAIR_MAX_HEADS heads per token. Measured on
# the H100 (notes/perf-wave6.md, 8 heads, 2 tokens per request): C128A 7 % / 11 % / 22 % faster
# at 64 / 128 / 256 pairs, but 14-45 % slower at 1-16 pairs (each split program then has one or two
# key tiles: the pair's longer fixed chain, its overlap check and a merge of two tokens, costs
# more than the halved rows save); window-only layers 20-25 % slower at 64-128 pairs (3 key tiles
# for 129 shared rows against 2 per token). Auto takes it on C128A layers in steps of
# PAIR_AUTO_MIN_TOKENS+ tokens per request with PAIR_AUTO_MIN_PAIRS+ pairs, under the Tritons it was
# measured with (PAIR_AUTO_TRITONS). Triton 3.8 (vLLM's and SGLang's): once its overlap check
# stopped spilling (hopper_heads.PAIR_CHECK_PER_THREAD), 1.01x / 1.08x / 1.22x at 64 / 128 / 256
# pairs (h8-c128a, H100) and whole V4-Flash -tp 8 steps at s_q = 2 1.02x / 1.06x / 1.13x at
# b = 64 / 128 / 256 (notes/perf-wave6.md). Not 3.9 (its variants spill ~250 B): no gain there,
# 52.9 / 78.1 / 116.1 us against 47.9 / 75.9 / 120.1 without (notes/perf-gather.md).
PAIR_MAX_HEADS = 8
PAIR_AUTO_MIN_TOKENS = 2
PAIR_AUTO_MIN_PAIRS = 64
PAIR_AUTO_TRITONS = ("3.6.", "3.8.")


def _triton_version() -> str:
    import triton

    return triton.__version__


def pair_tokens(config: KernelConfig, gluon: bool, num_heads: int, comp_mode: int, tokens_per_request: int,
                num_tokens: int, device: torch.device) -> bool:
    """Whether the Gluon launch of ``num_tokens`` tokens runs two consecutive tokens per program
    (the heads-on-N kernel, 16 columns): never on the portable kernel, with ``heads_on_n`` 0 (the
    64-head kernel), above PAIR_MAX_HEADS heads or on a top-k layer; else as ``config.pair_tokens``
    says, auto on C128A layers (COMP_GLOBAL) where a step has ``tokens_per_request`` >=
    PAIR_AUTO_MIN_TOKENS and PAIR_AUTO_MIN_PAIRS+ pairs under a Triton of PAIR_AUTO_TRITONS, where it
    compiles with this Triton (forced where it does not: ValueError)."""
    if not gluon or config.pair_tokens == 0 or config.heads_on_n == 0 or num_heads > PAIR_MAX_HEADS \
            or comp_mode == K.COMP_C4A_LOCAL:
        return False
    if config.pair_tokens != 1 and (comp_mode != K.COMP_GLOBAL or tokens_per_request < PAIR_AUTO_MIN_TOKENS
                                    or _cdiv(num_tokens, 2) < PAIR_AUTO_MIN_PAIRS
                                    or not _triton_version().startswith(PAIR_AUTO_TRITONS)):
        return False
    variant = build.hopper_constexprs(comp_mode, write_lse=True, heads_n=16, pair=True)
    error = build.compile_error(device_arch(device), "gluon", tuple(sorted(variant.items())))
    if error and config.pair_tokens == 1:
        raise ValueError(f"config.pair_tokens: got 1; allowed only where the token-pair kernel compiles; here: {error}")
    return not error


# The key-tile ping-pong Gluon kernel (hopper_prefill) against the 64-head one, same process (H100,
# torch 2.11, Triton 3.6, tests/gpu_scripts/prefill_ablate.py, notes/perf-prefill.md): faster on
# 4096-token prefill launches (h64 kv8k top-640 1122 -> 1101 us, h64 kv32k top-1152 1863 -> 1760,
# h128 kv32k top-1152 3585 -> 3391: 1.02-1.06x), slower on an unsplit 256-token decode launch
# (h64 C4A 512: 85.9 -> 102.3 us); between 256 and 4096 tokens unmeasured, so auto from 4096.
PINGPONG_AUTO_MIN_TOKENS = 4096


def pingpong(config: KernelConfig, gluon: bool, wide: bool, split: int, num_tokens: int, device: torch.device,
             comp_mode: int = K.COMP_NONE) -> bool:
    """Whether a Gluon launch of ``num_tokens`` tokens runs the key-tile ping-pong kernel
    (``hopper_prefill``): only where it would run the 64-head kernel (``wide``: the V4 record, 64
    heads per program) unsplit (``split`` 1); there as ``config.pingpong`` says, auto from
    PINGPONG_AUTO_MIN_TOKENS tokens, where it compiles with this Triton (forced where it does not:
    ValueError)."""
    if not gluon or not wide or split != 1 or config.pingpong == 0:
        return False
    if config.pingpong != 1 and num_tokens < PINGPONG_AUTO_MIN_TOKENS:
        return False
    variant = build.hopper_constexprs(comp_mode, write_lse=True, pingpong=True)
    error = build.compile_error(device_arch(device), "gluon", tuple(sorted(variant.items())))
    if error and config.pingpong == 1:
        raise ValueError(f"config.pingpong: got 1; allowed only where the ping-pong kernel compiles; here: {error}")
    return not error


def gluon_kernel_names(config: KernelConfig, num_heads: int, comp_mode: int,
                       records: tuple[Record, ...] = (Record.V4_FP8,)) -> str:
    """Which Gluon kernel a layer of ``num_heads`` heads and COMP ``comp_mode`` reading ``records``
    launches, as the launch decides (``v41_codes``, ``heads_on_n``, ``pair_tokens``; where a variant
    does not compile, the 64-head kernel), for ``SparseMLA.explain()``."""
    from . import hopper_heads

    if v41_codes(records) is not None:
        return "the V4.1 records' kernel (hopper_records.py, 64 heads per program on wgmma M)"
    wide = "the 64-head kernel (hopper.py, 64 heads per program on wgmma M)"
    if config.pingpong != 0:
        when = "unsplit launches" if config.pingpong == 1 else f"unsplit launches of {PINGPONG_AUTO_MIN_TOKENS}+ tokens"
        wide += f" (its {when}: the key-tile ping-pong kernel, hopper_prefill.py)"
    if config.heads_on_n == 0 or num_heads > hopper_heads.MAX_HEADS:
        return wide
    nh = hopper_heads.heads_per_program(num_heads)
    narrow = f"the heads-on-N kernel (hopper_heads.py, {nh} heads on wgmma N, 2 CTAs per SM)"
    if config.heads_on_n == 1:
        text = narrow
    elif num_heads > HEADS_ON_N_MAX_HEADS:
        text = wide
    elif nh > 8 and not _triton_version().startswith(HEADS_ON_N_WIDE_TRITONS):
        return f"{wide} (the heads-on-N kernel with {nh} heads per program measured slower under Triton " \
               f"{_triton_version()})"
    elif nh > 8:
        text = (f"{narrow} where the launch needs no key split or splits rows of {HEADS_ON_N_MIN_TILES}+ key tiles "
                f"at most {HEADS_ON_N_WIDE_MAX_SPLIT} ways, else {wide}")
    else:
        text = (f"{narrow} where a token's rows span {HEADS_ON_N_MIN_TILES}+ key tiles or the launch splits them at "
                f"most {HEADS_ON_N_SHORT_ROWS_MAX_SPLIT} ways, else {wide}")
    if config.heads_on_n != 0 and num_heads <= HEADS_ON_N_MAX_HEADS:
        text += (f"; a launch of {ONE_PER_SM_MIN_PROGRAMS[nh]}+ programs filling at most half the SMs always takes "
                 "the heads-on-N kernel, its key split sized for one program per SM, without programmatic dependent "
                 "launch")
    forced = config.pair_tokens == 1 and comp_mode != K.COMP_C4A_LOCAL
    if num_heads <= PAIR_MAX_HEADS and config.pair_tokens != 0 and (forced or comp_mode == K.COMP_GLOBAL):
        when = "always" if forced else \
            f"in steps of {PAIR_AUTO_MIN_TOKENS}+ tokens per request and {PAIR_AUTO_MIN_PAIRS}+ pairs (Triton 3.6, 3.8)"
        text += f"; token pairs (hopper_heads.py PAIR, two tokens x 8 heads on wgmma N) {when}"
    return text


# The in-kernel merge is one program's serial walk over the partials, 8 heads at a time
# (hopper._merge_splits). Measured on the H100 (notes/perf-wave4.md): 4-12 % faster than the
# combine launch for 8 heads (V4-Flash under tensor parallelism 8) at every batch and layer kind,
# but slower from 16 heads at b <= 4 (and 1.6-1.9x slower at 64-128 heads), where the combine
# launch spreads the merge over many programs. Auto takes it up to this many heads.
MERGE_IN_KERNEL_MAX_HEADS = 8


def merge_in_kernel(config: KernelConfig, gluon: bool, split: int, num_heads: int) -> bool:
    """Whether the Gluon kernel merges its ``split`` partials itself (no combine launch) for
    ``num_heads`` heads: never on the portable kernel or without a split; else as
    ``config.merge_in_kernel`` says, auto up to MERGE_IN_KERNEL_MAX_HEADS heads."""
    if not gluon or split <= 1 or config.merge_in_kernel == 0:
        return False
    return config.merge_in_kernel == 1 or num_heads <= MERGE_IN_KERNEL_MAX_HEADS


# Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start before the
# previous kernel in the stream completes; it waits for that one (griddepcontrol.wait) before its
# first load or store, so what overlaps is its launch, block scheduling and address setup with the
# previous kernel's tail; the previous kernel lets it launch early (griddepcontrol.launch_dependents).
# Level 1: the Gluon kernel's launch (after whatever ran before the layer: the previous layer's
# combine or Gluon kernel, an engine's kernels); 2: also the combine launch after the Gluon kernel.
# V4 records' kernels only (hopper.py, hopper_heads.py). Measured on the H100 (notes/perf-small-batch.md,
# Triton 3.6, whole decode steps in one graph): level 1 took 10 % off the V4-Flash TP8 step at b = 2
# (447 -> 404 us: ~1 us per layer boundary), 9 % off V4-Pro TP8 and 6 % off V4-Flash (64 heads);
# the combine launch too took V4-Flash (64-head kernel) a further 6 % at b = 2 and 4 % at b = 64,
# but cost V4-Pro TP8 14 % (after the heads-on-N kernel, two programs per SM: the combine's waiting
# programs share its SMs) and one-layer 128-head cases at b = 2-4 1-2 us (two head blocks; not
# understood). Auto: level 1 on every Gluon V4 launch, the combine's too after the 64-head kernel of
# up to PDL_COMBINE_MAX_HEADS heads.
PDL_COMBINE_MAX_HEADS = 64


def pdl_launches(config: KernelConfig, gluon: bool, v41: bool, combine: bool, heads_n: int = 0,
                 num_heads: int = 64, one_per_sm: bool = False) -> tuple[bool, bool]:
    """(the Gluon kernel's launch, the combine launch) with programmatic dependent launch, for a
    layer of ``num_heads`` heads whose launch is ``gluon`` (the Hopper kernels: sm_90, compiled,
    never under Triton's interpreter) with ``heads_n`` heads per program on wgmma N (0: the 64-head
    kernel), reading V4.1 records or not (``v41``: never), followed by a combine launch or not and
    sized for one program per SM or not (``one_program_per_sm``: auto never): as ``config.pdl``
    says, auto as measured (above). Where either is, both kernels hold their griddepcontrol (the
    ``PDL`` constexpr)."""
    if not gluon or v41 or config.pdl == 0:
        return False, False
    if config.pdl == -1:
        if one_per_sm:
            return False, False
        return True, combine and not heads_n and num_heads <= PDL_COMBINE_MAX_HEADS
    return True, combine and config.pdl == 2


def combine_tile(config: KernelConfig, gluon: bool) -> tuple[int, int]:
    """(heads, dims) per program of the combine launch. After the Gluon kernel 8 x 64: four times
    the programs of 16 x 128, which took 6-15 % off b <= 4 at 16-128 heads on the H100 (the merge
    of 10-18 splits is a latency-bound read of the partials; notes/perf-wave4.md). After the
    portable kernel 16 x 128 (AMD's compile-checked tile; not measured otherwise)."""
    heads, dims = (8, 64) if gluon else (16, 128)
    return config.combine_heads or heads, config.combine_dims or dims


def combine_chunk(config: KernelConfig, gluon: bool) -> int:
    """Splits whose partials the combine launch loads per round trip (``attention.combine_kernel``
    CHUNK, 1 or 4): 4 after the Gluon kernel; 1 after the portable kernel (AMD's compile-checked
    combine, not measured otherwise)."""
    return config.combine_chunk or (4 if gluon else 1)


def portable_constexprs(fmt_codes: tuple[int, int], comp_mode: int, topk_ratio: int, has_sink: bool,
                        write_lse: bool, split: int, tile: Tile, dt, range_checks: bool,
                        shifts: tuple[int, int] = (6, 6), fnuz: bool = False) -> dict:
    """The portable kernel's constexpr arguments (what one compiled variant is); ``shifts``: each
    cache's ``_log2_or_minus1(block_size)`` (default: 64-token pages); ``fnuz``: a cache holds FNUZ
    e4m3 bytes (the kernel then compiles their ±240 fix-up)."""
    return dict(FMT_A=fmt_codes[0], FMT_B=fmt_codes[1], COMP=comp_mode, C4A_RATIO=topk_ratio, HAS_SINK=has_sink,
                WRITE_LSE=write_lse and split == 1, IS_SPLIT=split > 1, BLOCK_H=tile.block_h,
                BLOCK_N=tile.block_n, DT=dt, P_SCRATCH=tile.p_scratch, RANGE_CHECKS=bool(range_checks),
                A_SHIFT=shifts[0], B_SHIFT=shifts[1], FNUZ=fnuz, F32_DECODE=tile.f32_decode)


def launch_options(tile: Tile) -> dict:
    """The portable kernel's compile options (num_warps, num_stages, backend options)."""
    return dict(num_warps=tile.num_warps, num_stages=tile.num_stages, **dict(tile.options))


def sparse_mla_fwd(q: torch.Tensor, out: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Two-scope sparse attention into ``out`` [T, H, 512] (bf16, written in place): the launches of
    :func:`layer_launches` (same arguments), through Triton's JIT path."""
    layer_launches(q, out, *args, **kwargs).plain()
    return out


def layer_launches(
    q: torch.Tensor,
    out: torch.Tensor,
    fmt,
    swa_cache: torch.Tensor,
    swa_rows: torch.Tensor,
    swa_lens: torch.Tensor,
    comp_cache: torch.Tensor | None = None,
    comp_rows: torch.Tensor | None = None,
    comp_lens: torch.Tensor | None = None,
    c4a: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    topk_ratio: int = 4,
    sink: torch.Tensor | None = None,
    scale: float = 512**-0.5,
    kv_scale: float = 1.0,
    swa_fnuz: bool = False,
    comp_fnuz: bool = False,
    lse: torch.Tensor | None = None,
    config: KernelConfig = DEFAULT_CONFIG,
    workspace: torch.Tensor | None = None,
    merge_counters: Callable[[int], torch.Tensor] | None = None,
    tokens_per_request: int = 1,
) -> launch.LayerLaunches:
    """The launches of two-scope sparse attention into ``out`` [T, H, 512] (bf16, written in
    place) and the temporaries they use (``launch.LayerLaunches``; nothing launched yet).

    ``fmt`` a KVFormat (or its name): the record of each cache (``nvfp4_ds_mla``: MXFP8 SWA cache,
    NVFP4 compressed cache). swa_rows int32 [T, W] global slots (+ swa_lens [T]). Compressed scope
    (optional): ``comp_rows`` int32 [T, K] global slots + ``comp_lens`` [T], or, for a top-k layer
    (C4A, C1A, C2A), ``comp_rows`` = LOCAL top-k [T, K] with ``c4a = (block_table int32 [R, nb],
    token_to_req int32 [T], positions int64 [T])`` of the layer's ratio ``topk_ratio`` (translated
    in the kernel; lens = min((pos+1)//topk_ratio, K)).
    ``lse`` optional float32 [T, H] (natural log, sink excluded, -inf for empty rows).
    ``merge_counters(n)`` optional: int32 zeros of at least n entries for a split launch that
    merges in the kernel (``merge_in_kernel``), its programs' arrival counters; the launch leaves
    them zero again, so one buffer serves launches that run one after another (a step's layers,
    graph replays), never two at once. None: zeros made for the call. ``tokens_per_request``: query
    tokens of each request, consecutive (an MTP / verify step: 2+); a hint for ``pair_tokens``
    (the result is exact whatever the rows).

    Any entry naming no row of its cache is skipped like -1 without being read: a slot outside
    ``[0, num_blocks * block_size)``, a local top-k entry outside ``[0, (pos+1)//topk_ratio)``,
    past the block table's columns or whose block id is outside ``[0, num_blocks)``; lens beyond
    the row width count as the width. Caches hold at most 2**31 slots (the callers check).
    """
    T, H, _ = q.shape
    if T == 0:
        return launch.LayerLaunches([], [])
    fmt = KVFormat.parse(fmt)
    records = (fmt.swa_record,) if comp_cache is None else (fmt.swa_record, fmt.comp_record)
    codes = (RECORD_CODE[records[0]], RECORD_CODE[records[-1]])
    a_u8, a_16, a_s0, a_bs, a_nb = _cache_views(swa_cache, codes[0])
    if comp_cache is not None:
        if comp_rows is None:
            raise ValueError("comp_rows: got None with a comp_cache; allowed: int32 [T, width] rows")
        b_u8, b_16, b_s0, b_bs, b_nb = _cache_views(comp_cache, codes[1])
        comp_mode = K.COMP_C4A_LOCAL if c4a is not None else K.COMP_GLOBAL
        b_width = comp_rows.shape[1]
    else:
        b_u8, b_16, b_s0, b_bs, b_nb = a_u8, a_16, a_s0, a_bs, a_nb
        comp_mode = K.COMP_NONE
        b_width = 0
        comp_rows, comp_lens = swa_rows, swa_lens
    if comp_lens is None:
        comp_lens = swa_lens
    if c4a is not None:
        bt, tok2req, pos = c4a
    else:
        bt, tok2req, pos = swa_rows, swa_lens, swa_lens
    ranges = (a_nb * a_bs, swa_rows.shape[1], b_nb * b_bs, bt.shape[1], b_nb)  # the range checks' bounds
    dialects = tuple(Fp8Dialect.FNUZ if fnuz else Fp8Dialect.OCP for fnuz in (swa_fnuz, comp_fnuz))[:len(records)]
    gluon = use_gluon(q.device, records, dialects, config, (swa_cache, comp_cache), comp_mode, H)
    tile = config.tile(device_arch(q.device), H)
    v41 = v41_codes(records)  # V4.1 records: the hopper_records kernel (64 heads per program, no pairs)
    bn, pair, heads_n, n_hb, programs, block_h, split = launch_grid(
        config, gluon, tile, v41 is not None, H, T, q.device, comp_mode, swa_rows.shape[1], b_width,
        tokens_per_request)
    temporaries = []
    if split > 1:
        # partials (acc fp32 [T, split, H, 512], m / l fp32 [T, split, H, 2]) and the count of
        # partials each token wrote (int32 [T]: a token with fewer key tiles than programs writes
        # fewer; attention.split_ranges)
        need = partials_numel(T, split, H)
        if workspace is None or workspace.numel() < need:
            workspace = torch.empty(need, dtype=torch.float32, device=q.device)
            temporaries.append(workspace)
        po = workspace[: T * split * H * 512]
        pml = workspace[T * split * H * 512: need - T]
        pu = workspace[need - T: need].view(torch.int32)
    else:
        po = pml = pu = out  # unused
    grid = (programs * split,)
    write_lse = lse is not None
    counters = None
    if merge_in_kernel(config, gluon, split, H):
        # zeros that must stay the caller's (``temporaries`` are re-allocated, not zeroed, by a
        # bound replay, which reuses the caller's counters: the launch leaves them zero)
        counters = merge_counters(T * n_hb) if merge_counters is not None else \
            torch.zeros(T * n_hb, dtype=torch.int32, device=q.device)
    combine = split > 1 and counters is None
    pdl_attention, pdl_combine = pdl_launches(config, gluon, v41 is not None, combine, heads_n, H,
                                              one_program_per_sm(config, heads_n, pair, programs, q.device))
    lse_t = lse if lse is not None else out
    sink_t = sink if sink is not None else out
    stride_lt = lse.stride(0) if lse is not None else 0
    if gluon:
        constexprs = dict(COMP=comp_mode, C4A_RATIO=topk_ratio, HAS_SINK=sink is not None,
                          WRITE_LSE=write_lse and (split == 1 or counters is not None), IS_SPLIT=split > 1, BN=bn,
                          A_SHIFT=_log2_or_minus1(a_bs), B_SHIFT=_log2_or_minus1(b_bs),
                          RANGE_CHECKS=bool(config.range_checks), MERGE_IN_KERNEL=counters is not None)
        if heads_n:
            constexprs.update(NH=heads_n, PAIR=pair)
        if v41:
            constexprs["FMT_A"], constexprs["FMT_B"] = v41
        elif pingpong(config, gluon, not heads_n, split, T, q.device, comp_mode):
            # the ping-pong kernel holds no griddepcontrol: launched without PDL (its launches are
            # prefill chunks, milliseconds long; unsplit, so no combine follows)
            constexprs["PINGPONG"] = True
            pdl_attention = False
        else:  # griddepcontrol in the kernel where its launch or the combine's is programmatic
            constexprs["PDL"] = pdl_attention or pdl_combine
        fn, options = build.hopper_kernel(constexprs)
        if pdl_attention:
            options = dict(options, launch_pdl=True)
        attention = launch.KernelLaunch(fn, grid, (
            q, q.stride(0), q.stride(1),
            out, out.stride(0), out.stride(1),
            lse_t, stride_lt, sink_t,
            a_u8, a_s0, a_bs, ranges[0], swa_rows, swa_rows.stride(0), swa_lens, ranges[1],
            b_u8, b_s0, b_bs, ranges[2], comp_rows, comp_rows.stride(0), comp_lens,
            bt, bt.stride(0), ranges[3], ranges[4], tok2req, pos, b_width,
            po, pml, counters if counters is not None else pml, pu,
            H, scale * LOG2E, split, *((T,) if heads_n else ()),
        ), constexprs, options)
    else:
        dt = config.dt()
        if tile.p_scratch:
            p_numel, a_numel = p_scratch_numels(grid[0], block_h, bn)
            scr_p = torch.empty(p_numel, dtype=_TORCH_DT[dt], device=q.device)
            scr_a = torch.empty(a_numel, dtype=torch.float32, device=q.device)
            temporaries += [scr_p, scr_a]
        else:
            scr_p = scr_a = out
        attention = launch.KernelLaunch(K.sparse_mla_fwd_kernel, grid, (
            q, q.stride(0), q.stride(1),
            out, out.stride(0), out.stride(1),
            lse_t, stride_lt, sink_t,
            a_u8, a_16, a_s0, a_bs, ranges[0], swa_rows, swa_rows.stride(0), swa_lens, ranges[1],
            b_u8, b_16, b_s0, b_bs, ranges[2], comp_rows, comp_rows.stride(0), comp_lens,
            bt, bt.stride(0), ranges[3], ranges[4], tok2req, pos, b_width,
            po, pml, pu, scr_p, scr_a,
            H, scale * LOG2E, float(kv_scale), split, int(bool(swa_fnuz)), int(bool(comp_fnuz)),
        ), portable_constexprs(codes, comp_mode, topk_ratio, sink is not None, write_lse, split, tile, dt,
                               bool(config.range_checks), (_log2_or_minus1(a_bs), _log2_or_minus1(b_bs)),
                               Fp8Dialect.FNUZ in dialects),
            launch_options(tile))
    launches = [attention]
    if combine:
        launches.append(_combine_launch(po, pml, pu, out, lse, sink, split, combine_tile(config, gluon), block_h,
                                        combine_chunk(config, gluon), (pdl_attention, pdl_combine)))
    return launch.LayerLaunches(launches, temporaries)


def _combine_launch(po, pml, pu, out: torch.Tensor, lse: torch.Tensor | None, sink: torch.Tensor | None, split: int,
                    tile: tuple[int, int], block_h: int, chunk: int, pdl: tuple[bool, bool]) -> launch.KernelLaunch:
    """The split merge of ``split`` partials (``po`` / ``pml`` / ``pu``) into ``out`` [T, H, 512]
    (and ``lse``), ``tile`` = ``combine_tile``'s (heads, dims), at most ``block_h`` heads (the
    attention program's) per program, ``chunk`` = ``combine_chunk``'s partials per round trip,
    ``pdl`` = ``pdl_launches``' (attention, combine) pair."""
    T, H, _ = out.shape
    bh_c, bd = min(tile[0], block_h), tile[1]
    return launch.KernelLaunch(
        K.combine_kernel, (T, _cdiv(H, bh_c), 512 // bd),
        (po, pml, pu, out, out.stride(0), out.stride(1), lse if lse is not None else out,
         lse.stride(0) if lse is not None else 0, sink if sink is not None else out, H, split),
        dict(SPLIT_P2=_next_power_of_2(split), HAS_SINK=sink is not None, WRITE_LSE=lse is not None,
             BLOCK_H=bh_c, BLOCK_D=bd, CHUNK=chunk, PDL=pdl[0] or pdl[1]),
        dict(num_warps=4, **({"launch_pdl": True} if pdl[1] else {})))


def launch_grid(config: KernelConfig, gluon: bool, tile: Tile, v41: bool, num_heads: int, num_tokens: int,
                device: torch.device, comp_mode: int, swa_width: int, comp_width: int,
                tokens_per_request: int = 1) -> tuple[int, bool, int, int, int, int, int]:
    """How a launch of ``num_tokens`` tokens x ``num_heads`` heads over rows of ``swa_width`` +
    ``comp_width`` keys is cut: (keys per tile, token pairs, heads-on-N NH or 0, head blocks per
    token, programs before the split, heads per program, key splits). ``v41``: V4.1 records (the
    hopper_records kernel: 64 heads per program, no pairs)."""
    bn = config.g_block_n if gluon else tile.block_n
    max_tiles = _cdiv(swa_width, bn) + (_cdiv(comp_width, bn) if comp_mode else 0)
    pair = not v41 and pair_tokens(config, gluon, num_heads, comp_mode, tokens_per_request, num_tokens, device)
    if pair:  # two tokens per program, 8 columns each; their key list is at most both tokens' rows
        heads_n, n_hb, max_tiles = 16, 1, 2 * max_tiles
        programs = _cdiv(num_tokens, 2)
    else:
        heads_n = 0 if v41 else heads_on_n(config, gluon, num_heads, max_tiles, num_tokens, device, comp_mode)
        n_hb = _cdiv(num_heads, (heads_n or 64) if gluon else tile.block_h)
        programs = num_tokens * n_hb
    block_h = (heads_n or 64) if gluon else tile.block_h
    if gluon and not v41 and short_rows_unsplit(config, max_tiles, num_tokens, num_heads, heads_n):
        split = 1
    else:
        per_sm = 1 if one_program_per_sm(config, heads_n, pair, programs, device) else build.ctas_per_sm(heads_n)
        split = choose_split(programs, max_tiles, device, config.split, per_sm)
    return bn, pair, heads_n, n_hb, programs, block_h, split


def _launch_grids(config: KernelConfig, gluon: bool, tile: Tile, v41: bool, num_heads: int, device: torch.device,
                  comp_mode: int, swa_width: int, comp_width: int, max_tokens: int | None = None):
    """(tokens, ``launch_grid``'s answer) of every launch shape of 1.. tokens, one and two tokens per
    request: every split launch, which ends where the launches fill the GPU unsplit, and the
    largest launch, ``max_tokens`` tokens (its unsplit grid the largest), where given."""
    most = 4 * num_sms(device) * build.ctas_per_sm(16) + 2  # from here on every launch fills the GPU unsplit
    counts = range(1, most + 1) if max_tokens is None else sorted({*range(1, min(most, max_tokens) + 1), max_tokens})
    for tokens_per_request in (1, PAIR_AUTO_MIN_TOKENS):
        for T in counts:
            yield T, launch_grid(config, gluon, tile, v41, num_heads, T, device, comp_mode, swa_width, comp_width,
                                 tokens_per_request)


def partials_numel(num_tokens: int, split: int, num_heads: int) -> int:
    """fp32 elements of a split launch's partials: acc [T, split, H, 512], (m, l) [T, split, H, 2]
    and the count of partials each token wrote (int32 [T]: a token with fewer key tiles than
    programs writes fewer; ``attention.split_ranges``)."""
    return num_tokens * split * num_heads * (512 + 2) + num_tokens


def p_scratch_numels(programs: int, block_h: int, block_n: int) -> tuple[int, int]:
    """Elements of the portable kernel's per-program P scratch (dot dtype) and alpha scratch (fp32)."""
    return programs * 2 * block_h * block_n, programs * 2 * block_h


def temporaries_bytes(device: torch.device, records: tuple[Record, ...], dialects: tuple[Fp8Dialect, ...],
                      comp_mode: int, num_heads: int, swa_width: int, comp_width: int, max_tokens: int,
                      config: KernelConfig = DEFAULT_CONFIG) -> int:
    """The most workspace bytes (``launch.layout_bytes``) the temporaries of one launch of 1 to
    ``max_tokens`` tokens (rows ``swa_width`` + ``comp_width`` keys wide) take, as
    ``layer_launches`` allocates them on ``device``'s kernel: split partials, the portable kernel's
    P scratch. What a stream's workspace is reserved to at engine start (``TritonBackend.reserve``)."""
    arch = device_arch(device)
    gluon = resolved_kernel(arch, records, dialects, comp_mode, num_heads, config)[0] == "gluon"
    tile, v41 = config.tile(arch, num_heads), v41_codes(records) is not None
    dot_bytes = _TORCH_DT[config.dt()].itemsize
    most = 0
    for T, (bn, _, _, _, programs, block_h, split) in _launch_grids(config, gluon, tile, v41, num_heads, device,
                                                                    comp_mode, swa_width, comp_width, max_tokens):
        sizes = [4 * partials_numel(T, split, num_heads)] if split > 1 else []
        if not gluon and tile.p_scratch:
            p_numel, a_numel = p_scratch_numels(programs * split, block_h, bn)
            sizes += [p_numel * dot_bytes, 4 * a_numel]
        most = max(most, launch.layout_bytes(sizes))
    return most


def warm_combines(device: torch.device, records: tuple[Record, ...], dialects: tuple[Fp8Dialect, ...],
                  comp_mode: int, num_heads: int, swa_width: int, comp_width: int,
                  config: KernelConfig = DEFAULT_CONFIG) -> list[launch.KernelLaunch]:
    """Compile every split combine a launch of 1+ tokens (rows ``swa_width`` + ``comp_width``
    keys wide, or narrower) can make, as ``layer_launches`` makes it with a sink and no LSE (a
    layer's call): one variant per ``SPLIT_P2`` (power of two >= the split), so none compiles
    mid-serving. Each is launched once on one token whose partials are empty (nothing read; its
    output row is written as the empty row: zeros). Returns the launches (for tests); nothing on
    Triton's CPU interpreter, where nothing compiles. Narrower rows cut the key range into fewer
    tiles, so their splits' powers of two are among those of the widest rows."""
    if triton_interpreting():
        return []
    arch = device_arch(device)
    gluon = resolved_kernel(arch, records, dialects, comp_mode, num_heads, config)[0] == "gluon"
    tile, v41 = config.tile(arch, num_heads), v41_codes(records) is not None
    variants: dict[tuple[int, tuple[bool, bool]], int] = {}  # (SPLIT_P2, PDL pair) -> heads per attention program
    for _, (_, pair, heads_n, _, programs, block_h, split) in _launch_grids(
            config, gluon, tile, v41, num_heads, device, comp_mode, swa_width, comp_width):
        if split > 1 and not merge_in_kernel(config, gluon, split, num_heads):
            pdl = pdl_launches(config, gluon, v41, True, heads_n, num_heads,
                               one_program_per_sm(config, heads_n, pair, programs, device))
            variants.setdefault((_next_power_of_2(split), pdl), block_h)
    launches = []
    for (split_p2, pdl), block_h in sorted(variants.items()):
        partials = torch.zeros(split_p2 * num_heads * (512 + 2) + 1, dtype=torch.float32, device=device)
        po, pml = partials[:split_p2 * num_heads * 512], partials[split_p2 * num_heads * 512:-1]
        pu = partials[-1:].view(torch.int32)  # 0 partials written: nothing read
        out = torch.empty(1, num_heads, 512, dtype=torch.bfloat16, device=device)
        sink = torch.zeros(num_heads, dtype=torch.float32, device=device)
        launches.append(_combine_launch(po, pml, pu, out, None, sink, split_p2, combine_tile(config, gluon),
                                        block_h, combine_chunk(config, gluon), pdl))
    for one in launches:
        one.plain()
    return launches
