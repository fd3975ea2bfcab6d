"""Backend `aiter`: DeepSeek-V4 / V4.1 sparse decode on AMD gfx950 (MI355X) / gfx942 (MI300X) via AITER.

Decode only (``phases = (DECODE,)``): prefill tokens go to `triton` / `torch` through the front
end. Three AITER entry points, tried in this order (``PATHS``; features are probed from the
installed functions' signatures and the shipped code objects, never from the version string).
DeepSeek-V4.1's top-k kinds (C1A, C2A) run on ``sparse_mla_fwd`` only: that is the one AITER
entry point vLLM 0.33 runs V4.1 through on ROCm (``models/deepseek_v41/amd/rocm.py``, V4 record);
the other two refuse them with that reason.

``sparse_mla_fwd`` (``aiter.ops.triton.attention.sparse_mla``, gfx950)
    One call per layer: both scopes (``extra_*``), compacted ragged CSR of GLOBAL slots and the
    sink in the kernel; caches read in place (MODEL1, BF16, FP8_TENSOR in gfx950's OCP). The
    keyword set vLLM 0.33 calls; no AITER release has it yet.

``mla_decode_fwd_v4_nm`` (``aiter.mla``, AITER >= 0.1.18, gfx950 code object ``hsa/gfx950/mla_v4``)
    AITER's own DeepSeek-V4 decode, MODEL1 caches only: one call for both scopes with the sink in
    the kernel. Its rows are 512-byte packs (448 e4m3 NoPE, each tile's UE8M0 scale written
    twice) plus a separate bf16 RoPE tensor, which a MODEL1 cache cannot be read as in place: this
    step's selected records are repacked byte for byte into a bounded scratch. q is packed the
    same way (e4m3 with per-64 e8m0 scales; the kernel's fixed 1/sqrt(512) scale folded in).

``mla_decode_fwd`` (``aiter.mla``, ``return_lse=True``)
    Any format. The code objects read 576-element rows (per-head q stride and KV row fixed at
    512 + 64), so q is staged zero-padded to 576 and this step's selected rows are gathered
    (decoded in their own FP8 dialect) into a bounded scratch of 576-wide rows with a zero RoPE
    tail, as AITER's own tests lay them out. One call per scope, natural-log LSE, merged with
    ``common.merge.merge_lse`` and ``apply_sink``. Modes per batch size:

    persistent  T < ``persistent_max_batch`` (default 32, AITER's own batch gate, #4144): FP8/FP8
                operands (power-of-two per-tensor scales), heads padded to a count whose code
                object writes the LSE (gfx950 16/64/128, gfx942 64; :data:`PERSISTENT_LSE`),
                fixed-stride compacted indices and a ``topk=`` work plan sized for the
                persistent batch (``get_mla_metadata_info_v1``), refilled once per step per scope;
    split       otherwise: BF16/BF16 (FP8 split kernels need >= 128 keys per split, AITER's fp8
                cap, and write no LSE with one split), heads 16 / 128, ragged CSR, >= 2 splits
                (the LSE comes from stage 2). Its code objects address rows with 24-bit row
                numbers and 32-bit byte offsets: the gathered scratch must stay below both.

Every index list is compacted (no -1 or out-of-range entry inside a range: the kernels read
every index of a range). Rows with no key are masked from the adapter's own counts, whatever
the kernel reports there. AITER loads kernels on first use, so the first eager decode of a layer
configuration also runs every kernel variant the batch size could later select (persistent and
split, single- and multi-split) on a one-token dummy; a first use inside a graph capture raises.

Everything a step touches lives in :mod:`.scratch` buffers (graph-stable, shared by layers).
The AITER API comes through ONE seam, :func:`load_aiter`: the real library on ROCm, or the
AITER EMULATOR (:mod:`.emulate`, a model of the kernels) when ``emulate.enable()`` was called or
``DSV4_ATTN_AITER_EMULATOR`` is set; then CPU/CUDA devices are accepted and every result is
labelled emulated. See docs/rocm.md.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import itertools
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import envs
from ..common.backend import (
    Backend,
    Capabilities,
    LaunchLimit,
    LayerInputs,
    LayerShape,
    Phase,
    PlatformSupport,
)
from ..common.layout import Fp8Dialect, KVFormat, Record, gather_rows, new_cache, packed_records, quantize_model1
from ..common.merge import apply_sink, merge_lse
from ..common.plan import StepPlan
from ..common.platform import LibraryInfo, Platform, probe
from ..common.spec import HEAD_DIM, NOPE_DIM, NUM_QUANT_TILES, V4_KINDS, LayerKind, ModelSpec
from . import emulate
from .scratch import AiterScratch, ScopeBuffers, ScratchKey, compact, quantize_pow2_, write_indices

ARCHS = ("gfx942", "gfx950")
AITER_SOURCE = "git+https://github.com/ROCm/aiter.git@v0.1.20.post1"  # pyproject's `rocm` extra
INSTALL_HINT = ("Install AITER v0.1.20.post1 from a clone of dsv4-attn: AITER_USE_SYSTEM_TRITON=1 pip install "
                "--no-build-isolation -e '.[rocm]' (needs ROCm with hipcc and a ROCm torch; PyPI's amd-aiter 0.1.7 "
                "is too old: docs/rocm.md \"Install AITER\")")
NATIVE_DIALECT = {"gfx942": Fp8Dialect.FNUZ, "gfx950": Fp8Dialect.OCP}
PATHS = ("sparse_mla_fwd", "mla_decode_fwd_v4_nm", "mla_decode_fwd")
# what each path costs or gains, shown by explain() for the path auto picks
PATH_NOTES = {
    "sparse_mla_fwd": "caches read in place; both scopes and the sink in one launch",
    "mla_decode_fwd_v4_nm": "AITER's DSv4 kernel: both scopes and the sink in one launch over this step's MODEL1 "
                            "records repacked byte for byte; q in e4m3 with per-tile scales",
    "mla_decode_fwd": "this step's rows gathered into 576-wide rows; one launch per scope, LSE merge and sink "
                      "in the front end; fp8 q/kv below the persistent batch, bf16 above",
}
ROW = 576  # elements per q head / KV row that mla_decode_fwd's code objects read
NM_ROW = 512  # v4 nm packed row bytes
NM_HEADS = (16, 32, 64, 128)
NM_OBJECT = "mla_a8w8_qh64_qseqlen1_gqaratio64_nm.co"
# split mode (bf16/bf16): heads -> code object; 24-bit rows, 32-bit byte offsets
SPLIT_OBJECTS = {16: "mla_dec_stage1_bf16_a16w16_subQ16_mqa16.co", 128: "mla_dec_stage1_bf16_a16w16_subQ128_mqa128.co"}
SPLIT_MAX_ROWS, SPLIT_MAX_BYTES = 1 << 24, 1 << 32
# persistent FP8/FP8 heads -> the code object AITER 0.1.20 launches with an LSE, where it writes
# one (gfx950's 32-head *_lse_ps object is its non-LSE twin: docs/rocm.md "Evidence")
PERSISTENT_LSE = {
    "gfx950": {16: "mla_a8w8_qh16_qseqlen1_gqaratio16_lse_ps.co", 64: "mla_a8w8_qh16_qseqlen4_gqaratio16_lse_v3_ps.co",
               128: "mla_a8w8_qh32_qseqlen4_gqaratio32_lse_ps.co"},
    "gfx942": {64: "mla_a8w8_qh64_qseqlen1_gqaratio64_lse_v3_ps.co"},
}
# the kernels fold an in-kernel sink into their running max, where +inf gives inf - inf = NaN;
# staged as this instead it still zeroes the head (exp(s - 1e30) = 0)
SINK_MAX = 1e30
ENV_AITER_EXPERIMENTAL = "AITER_ENABLE_EXPERIMENTAL"  # routes 64/128-head FP8 persistent decode to HK kernels
_SPARSE_KWARGS = ("out", "attn_sink", "extra_kv", "extra_indptr", "extra_indices", "has_invalid", "kv_scale",
                  "kv_lora_rank", "qk_rope_head_dim")
_DECODE_PARAMS = ("q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens",
                  "max_seqlen_q", "sm_scale", "num_kv_splits", "num_kv_splits_indptr", "q_scale", "kv_scale",
                  "return_lse")
_NM_PARAMS = ("q", "qrope", "kv_buffer", "kvrope", "output", "qo_indptr", "kv_indptr", "kv_page_indices",
              "max_seqlen_q", "sink", "num_kv_splits")
# The first AITER release whose path behaves as the adapter needs (the signatures cannot tell):
# v4 nm before 0.1.18 merges unwritten splits of short rows (#4117) and folds out-of-range page
# ids to row 0 (#4245); split mode before 0.1.19 looks for an LSE-writing split code object
# (asm_mla.cu ``lse_flag = lse != nullptr``), finds none and raises.
MIN_VERSION = {"mla_decode_fwd_v4_nm": ((0, 1, 18), "0.1.17 lacks AITER #4117 (empty splits of short rows merged) "
                                                    "and #4245 (out-of-range page ids read row 0)"),
               "mla_decode_fwd": ((0, 1, 19), "before 0.1.19 split mode with return_lse=True finds no code object "
                                              "(asm_mla.cu lse_flag lacks '&& persistent') and raises")}
# Paths that compute in fp8 (AITER's a8w8 kernels: q rounded to e4m3, P rounded to fp8 before
# P.V): opt-in (FP8_COMPUTE). Their error, measured through the emulator on the adversarial cases
# of tests/test_aiter.py (garbage past the valid top-k, permuted block tables, MTP, 16-128 heads,
# +-inf sinks), against the bf16 paths' (tests/test_aiter.py::test_fp8_compute_is_opt_in_and_labelled).
FP8_REL_L2 = 5e-2
FP8_NOTE = (f"computes in fp8 (e4m3 q, fp8 probabilities): rel L2 up to {FP8_REL_L2:.1e} against float64, "
            "EMULATED, vs <= 5e-3 for every default path")
# kv_granularity of a persistent work plan: the gfx942 64-head FP8 object (and AITER's own test for
# 64 fp8 heads on either arch) needs works of whole 32-key passes (SUB_KV = 32, AITER #3188)
PLAN_GRANULARITY = {64: 32}
# keyword aliases across AITER revisions (0.1.7 names the work plan ``work_info``)
_ALIASES = {"work_info_set": ("work_info_set", "work_info")}
# keywords older revisions lack; dropped when the installed signature has no such parameter
_OPTIONAL = frozenset({"page_size", "nhead_kv", "kv_last_page_lens", "dtype_q", "dtype_kv", "max_split_per_batch",
                       "num_kv_splits"})


# ---- the one seam to AITER ------------------------------------------------------------------
@dataclass(frozen=True)
class AiterAPI:
    """What the backend uses of AITER. ``error`` says why AITER is unusable (then the functions
    are None). ``asm_objects``: names of the shipped code objects under ``hsa/<arch>/mla`` and
    ``hsa/<arch>/mla_v4``."""

    version: str | None
    arch: str | None
    emulated: bool
    mla_decode_fwd: Callable | None = None
    get_mla_metadata_info_v1: Callable | None = None
    get_mla_metadata_v1: Callable | None = None
    mla_decode_fwd_v4_nm: Callable | None = None
    sparse_mla_fwd: Callable | None = None
    asm_objects: frozenset = frozenset()
    error: str | None = None


_env_emulator: tuple[str, Any] | None = None


def _from_object(obj: Any) -> AiterAPI:
    return AiterAPI(version=obj.version, arch=obj.arch, emulated=True, mla_decode_fwd=obj.mla_decode_fwd,
                    get_mla_metadata_info_v1=obj.get_mla_metadata_info_v1, get_mla_metadata_v1=obj.get_mla_metadata_v1,
                    mla_decode_fwd_v4_nm=obj.mla_decode_fwd_v4_nm, sparse_mla_fwd=obj.sparse_mla_fwd,
                    asm_objects=frozenset(obj.asm_objects))


def load_aiter(platform: Platform | None = None) -> AiterAPI:
    """The AITER API: the emulator when switched on (``emulate.enable()`` or
    ``DSV4_ATTN_AITER_EMULATOR``), else the real library on a ROCm machine, else an AiterAPI whose
    ``error`` says why. Never imports ``aiter`` off ROCm (its import runs rocminfo and raises)."""
    global _env_emulator
    if emulate.active() is not None:
        return _from_object(emulate.active())
    env = envs.AITER_EMULATOR.get()  # validated: off / on words, arch or arch:flavor
    if env not in ("0", "off", "false"):
        if _env_emulator is None or _env_emulator[0] != env:
            _env_emulator = (env, emulate.parse_env(env))
        return _from_object(_env_emulator[1])
    plat = platform or probe()
    if plat.vendor != "rocm":
        return AiterAPI(None, None, False, error=(
            f"needs a ROCm GPU (gfx942/gfx950); this is {plat.vendor}/{plat.arch}. To exercise the backend "
            f"here, switch on the AITER emulator: dsv4_attn.rocm.emulate.enable() or {emulate.ENV_EMULATOR}=1"))
    return _load_real(plat.arch)


@functools.lru_cache(maxsize=4)
def _load_real(arch: str) -> AiterAPI:
    try:
        import aiter  # noqa: PLC0415 - ROCm only, lazily
        from aiter import mla
    except Exception as exc:  # missing, or broken (rocminfo, JIT) -> a refusal reason
        return AiterAPI(None, arch, False, error=f"cannot import aiter: {type(exc).__name__}: {exc}. {INSTALL_HINT}")
    try:
        from aiter.ops.triton.attention.sparse_mla import sparse_mla_fwd
    except Exception:
        sparse_mla_fwd = None
    try:
        version = importlib.metadata.version("amd-aiter")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(aiter, "__version__", "unknown")
    return AiterAPI(version, arch, False, getattr(mla, "mla_decode_fwd", None),
                    getattr(aiter, "get_mla_metadata_info_v1", None), getattr(aiter, "get_mla_metadata_v1", None),
                    getattr(mla, "mla_decode_fwd_v4_nm", None), sparse_mla_fwd, _asm_objects(aiter.__file__, arch))


def _asm_objects(aiter_init: str, arch: str) -> frozenset:
    """Names of the code objects under ``hsa/<arch>/mla`` and ``hsa/<arch>/mla_v4`` (wheel:
    ``aiter_meta/hsa``; source tree: ``hsa``; or ``AITER_ASM_DIR``)."""
    pkg = os.path.dirname(os.path.abspath(aiter_init))
    roots = [os.environ.get("AITER_ASM_DIR", ""), os.path.join(pkg, "..", "aiter_meta", "hsa"),
             os.path.join(pkg, "..", "hsa"), os.path.join(pkg, "hsa")]
    names: set[str] = set()
    for root in filter(None, roots):
        for sub in ("mla", "mla_v4"):
            folder = os.path.join(root, arch, sub)
            if os.path.isdir(folder):
                names.update(os.listdir(folder))
    return frozenset(names)


@functools.lru_cache(maxsize=64)
def _params(fn: Callable) -> frozenset:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _call(fn: Callable, **kwargs):
    """Call ``fn`` by keyword, mapping names across AITER revisions (positional orders differ)."""
    params = _params(fn)
    use = {}
    for key, value in kwargs.items():
        name = next((n for n in _ALIASES.get(key, (key,)) if n in params), None)
        if name is None:
            if key in _OPTIONAL:
                continue
            raise ValueError(f"aiter: {getattr(fn, '__name__', fn)} has no parameter {key!r}; allowed: an AITER "
                             "revision whose signature has it (see docs/rocm.md)")
        use[name] = value
    return fn(**use)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ---- features (signatures and code objects, not the version string) --------------------------
def _sparse_reasons(api: AiterAPI) -> list[str]:
    if api.sparse_mla_fwd is None:
        return ["aiter.ops.triton.attention.sparse_mla.sparse_mla_fwd not found (no AITER release has it; "
                "vLLM 0.33 calls it)"]
    missing = [k for k in _SPARSE_KWARGS if k not in _params(api.sparse_mla_fwd)]
    if missing:
        return [f"sparse_mla_fwd lacks keyword(s) {missing} (the sink and second scope vLLM 0.33 passes)"]
    if api.arch != "gfx950":
        return [f"sparse_mla_fwd is gfx950-only (its Gluon kernels; it asserts so), got {api.arch}"]
    return []


def _version(text: str | None) -> tuple[int, ...] | None:
    """(major, minor, patch) of an AITER version string ("0.1.20.post1" -> (0, 1, 20)); None when
    unreadable (a source build without metadata: no version gate applies)."""
    parts = []
    for piece in (text or "").split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts) if len(parts) == 3 else None


def _version_reasons(api: AiterAPI, path: str) -> list[str]:
    minimum, why = MIN_VERSION[path]
    have = _version(api.version)
    if have is None or have >= minimum:
        return []
    return [f"AITER {api.version}: {why}; allowed: AITER >= {'.'.join(map(str, minimum))}"]


def _nm_reasons(api: AiterAPI, fmt: KVFormat, heads: int) -> list[str]:
    if api.mla_decode_fwd_v4_nm is None:
        return ["aiter.mla.mla_decode_fwd_v4_nm not found (AITER >= 0.1.17)"]
    if _version_reasons(api, "mla_decode_fwd_v4_nm"):
        return _version_reasons(api, "mla_decode_fwd_v4_nm")
    missing = [k for k in _NM_PARAMS if k not in _params(api.mla_decode_fwd_v4_nm)]
    if missing:
        return [f"mla_decode_fwd_v4_nm lacks parameter(s) {missing}"]
    if NM_OBJECT not in api.asm_objects:
        return [f"no v4 nm code object ({NM_OBJECT}) under hsa/{api.arch}/mla_v4 (AITER ships it for gfx950)"]
    if fmt is not KVFormat.MODEL1_FP8:
        return [f"reads MODEL1 (fp8_ds_mla) records only, got {fmt.value}"]
    if heads > NM_HEADS[-1]:
        return [f"{heads} heads; allowed: <= {NM_HEADS[-1]} (padded to {NM_HEADS})"]
    return []


def _decode_reasons(api: AiterAPI) -> list[str]:
    if api.mla_decode_fwd is None:
        return ["aiter.mla.mla_decode_fwd not found"]
    missing = [k for k in _DECODE_PARAMS if k not in _params(api.mla_decode_fwd)]
    if "return_lse" in missing:
        return ["mla_decode_fwd has no return_lse (AITER 0.1.7: final_lse is returned unwritten), so the two "
                "scopes cannot be merged nor the sink applied"]
    if missing:
        return [f"mla_decode_fwd lacks parameter(s) {missing}"]
    if _version_reasons(api, "mla_decode_fwd"):
        return _version_reasons(api, "mla_decode_fwd")
    absent = [name for name in SPLIT_OBJECTS.values() if name not in api.asm_objects]
    return [f"split-mode code object(s) {absent} missing under hsa/{api.arch}/mla"] if absent else []


def _aiter_experimental() -> bool:
    """AITER's ``is_experimental_enabled()`` (aiter/jit/core.py): an int other than 0."""
    try:
        return int(os.environ.get(ENV_AITER_EXPERIMENTAL, "0")) != 0
    except ValueError:
        return False


def _persistent_heads(api: AiterAPI, heads: int) -> tuple[int | None, str | None]:
    """(heads handed to the persistent kernel, None) or (None, why persistent mode is off)."""
    for name in ("get_mla_metadata_info_v1", "get_mla_metadata_v1"):
        if getattr(api, name) is None:
            return None, f"aiter.{name} not found"
    if "topk" not in _params(api.get_mla_metadata_v1):
        return None, "get_mla_metadata_v1 has no topk (sparse work plans)"
    table = {h: n for h, n in PERSISTENT_LSE.get(api.arch, {}).items() if n in api.asm_objects}
    if _aiter_experimental():
        table = {h: n for h, n in table.items() if h not in (64, 128)}
    padded = next((h for h in sorted(table) if h >= heads), None)
    if padded is None:
        return None, (f"no persistent FP8 code object that writes an LSE for {heads} heads on {api.arch} (have "
                      f"{sorted(table) or 'none'}; {ENV_AITER_EXPERIMENTAL} reroutes 64/128 heads to kernels "
                      "without one)")
    return padded, None


def _split_heads(heads: int) -> int:
    return 16 if heads <= 16 else 128


def _split_mgc(split_heads: int) -> int:
    """Keys per split stage 2 counts for bf16 split mode (aiter/mla.py ``mgc``: 64 at 16 heads,
    16 at 128): it merges ``min(S, cdiv(L, mgc))`` partials of a row of L keys."""
    return 64 if split_heads == 16 else 16


def _scope_widths(spec: ModelSpec) -> tuple[tuple[str, int], ...]:
    """Row width of every scope, by name: the window ("swa") and each compressed layer kind of the
    model. One scratch serves every layer kind (the window scope is shared)."""
    return (("swa", spec.window),) + tuple((k.name.lower(), spec.comp_width(k)) for k in spec.kinds
                                           if k.has_comp_scope)


def _base_reasons(api: AiterAPI) -> list[str]:
    if api.error:
        return [api.error]
    if api.arch not in ARCHS:
        return [f"arch {api.arch}: allowed {ARCHS}"]
    return []


def aiter_text(info: dict, lib: LibraryInfo) -> list[str]:
    """``describe_aiter``'s facts in words (``lib``: the platform's LibraryInfo of aiter): first
    line found / not usable, then the paths it serves and what the others lack, each reason once."""
    if not info["found"]:
        where = (f"AITER {lib.version or '(version unknown)'} installed at {lib.location}; " if lib.found else "")
        return [f"not usable: {where}{' '.join(str(info['error']).split())}"]
    emulated = ", EMULATED" if info["emulated"] else ""
    lines = [f"found: AITER {info['version']} on {info['arch']} (fp8 dialect {info['dialect']}{emulated})"]
    enabled = [f"{path} ({status.removeprefix('enabled').strip(' ()')})" if status != "enabled" else path
               for path, status in info["paths"].items() if status.startswith("enabled")]
    lines.append(f"serves: {', '.join(enabled) or 'nothing'}")
    lacking: dict[str, list[str]] = {}  # reason -> paths, so that each reason is printed once
    for path, status in info["paths"].items():
        if not status.startswith("enabled"):
            lacking.setdefault(status, []).append(path)
    lines += [f"lacks ({', '.join(paths)}): {' '.join(why.split())}" for why, paths in lacking.items()]
    if lacking:
        lines.append('what each AITER version has: docs/rocm.md "Install AITER"')
    return lines


def describe_aiter(platform: Platform | None = None) -> dict:
    """What ``dsv4-attn probe`` prints for AITER: version, arch, FP8 dialect, which paths are
    enabled (or why not), and whether this is the emulator."""
    api = load_aiter(platform)
    out = {"found": api.error is None, "emulated": api.emulated, "version": api.version, "arch": api.arch,
           "dialect": NATIVE_DIALECT[api.arch].value if api.arch in NATIVE_DIALECT else None, "error": api.error}
    base = _base_reasons(api)
    decode = base or _decode_reasons(api)
    persistent = decode or [r for r in [_persistent_heads(api, 1)[1]] if r]
    fp8_on = envs.AITER_FP8_COMPUTE.get()
    switch = "opted in" if fp8_on else f"off: opt in with {envs.AITER_FP8_COMPUTE.name}=1"
    fp8 = f"fp8 compute, {switch}: {FP8_NOTE}"
    out["fp8_compute"] = fp8_on
    out["paths"] = {
        "sparse_mla_fwd": "; ".join(base or _sparse_reasons(api)) or "enabled (bf16 compute)",
        "mla_decode_fwd_v4_nm": "; ".join(base or _nm_reasons(api, KVFormat.MODEL1_FP8, 1)) or (
            f"{'enabled' if fp8_on else 'available'} (fp8_ds_mla; {fp8})"),
        "mla_decode_fwd (split)": "; ".join(decode) or "enabled (bf16 compute)",
        "mla_decode_fwd (persistent)": "; ".join(persistent) or (
            f"{'enabled' if fp8_on else 'available'} (heads "
            f"{sorted(h for h, n in PERSISTENT_LSE[api.arch].items() if n in api.asm_objects)}; {fp8})"),
    }
    return out


def _nm_pack(records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MODEL1 records uint8 [N, 584] -> (v4 nm rows uint8 [N, 512], RoPE bf16 [N, 64]): the e4m3
    NoPE bytes, each tile's UE8M0 byte twice (the kernel reads one per 32 columns), zero pad."""
    scales = records[:, ROW : ROW + NUM_QUANT_TILES].repeat_interleave(2, dim=1)
    pad = torch.zeros(records.shape[0], NM_ROW - NOPE_DIM - scales.shape[1], dtype=torch.uint8,
                      device=records.device)
    packed = torch.cat([records[:, :NOPE_DIM], scales, pad], dim=1)
    return packed, records[:, NOPE_DIM:ROW].contiguous().view(torch.bfloat16)


@dataclass(frozen=True)
class AiterMeta:
    """Per-step metadata of one layer shape (``AiterBackend.prepare``).

    path     the AITER entry point that runs the shape (one of PATHS)
    scratch  its buffers (the backend instance's: the same in every step)
    shared   the scopes whose indices every layer of the shape reads, by scope name, built by the
             first layer that reads them: the window (the window-only shape's, when it runs on the
             same scratch) and an "all" kind's rows. Top-k scopes are rebuilt per layer.
    """

    path: str
    scratch: AiterScratch
    shared: dict[str, ScopeBuffers]


# ---- the backend --------------------------------------------------------------------------------
class AiterBackend(Backend):
    """AITER decode adapter (see module docstring). EMULATED / contract-tested only.

    path                  "auto" (the first of PATHS that serves the layer) or one of PATHS;
                          env DSV4_ATTN_AITER_PATH
    fp8_compute           run the paths that compute in fp8 (mla_decode_fwd_v4_nm, mla_decode_fwd
                          persistent): opt-in, they are ~10x less accurate than the bf16 paths
                          (:data:`FP8_NOTE`); env DSV4_ATTN_AITER_FP8_COMPUTE, default off
    persistent_max_batch  with fp8_compute, mla_decode_fwd runs persistent for T < this many
                          decode tokens (0 = never); env DSV4_ATTN_AITER_PERSISTENT_MAX_BATCH, default 32
    max_decode_tokens     scratch capacity in decode tokens (bounds the gathered-rows scratch);
                          env DSV4_ATTN_AITER_MAX_DECODE_TOKENS; unset: the engine's decode
                          tokens when it reserves memory at start (:meth:`reserve`, capped by
                          what split mode can address), else 1024. It is the backend's launch
                          limit (:meth:`launch_limit`): selection sends larger decode launches
                          to the next backend that serves the layer (``explain()`` says which)
    max_splits            split budget per batch row (split mode, persistent work plans)
    """

    splits_phases = True
    capabilities = Capabilities(
        platforms=(PlatformSupport("rocm", archs=ARCHS, label="AMD gfx950 (MI355X), gfx942 (MI300X) via AITER"),),
        formats=(KVFormat.MODEL1_FP8, KVFormat.BF16, KVFormat.FP8_TENSOR),
        kinds=V4_KINDS + (LayerKind.C1A, LayerKind.C2A),  # V4.1's on sparse_mla_fwd only (path_reasons)
        phases=(Phase.DECODE,),
        dialects=(Fp8Dialect.OCP, Fp8Dialect.FNUZ),  # gathered rows are decoded in their own dialect
        heads_note="padded to what each kernel takes: 16/32/64/128",
        validated="emulated (a model of AITER 0.1.20's kernels: CPU CI, H100 CUDA-graph test); never run on "
                  "MI300X/MI355X",
        notes="decode only; bf16 compute by default: sparse_mla_fwd (gfx950, vLLM 0.33's AITER; V4.1's C1A/C2A "
              "only there), else mla_decode_fwd split mode + LSE merge (AITER >= 0.1.19); fp8 compute "
              "(mla_decode_fwd_v4_nm, persistent mode) opt-in: DSV4_ATTN_AITER_FP8_COMPUTE",
    )

    def __init__(self, path: str | None = None, persistent_max_batch: int | None = None,
                 max_decode_tokens: int | None = None, max_splits: int = 16, name: str = "aiter",
                 fp8_compute: bool | None = None) -> None:
        self.name = name
        self.fp8_compute = envs.AITER_FP8_COMPUTE.get() if fp8_compute is None else fp8_compute
        if not isinstance(self.fp8_compute, bool):
            raise ValueError(f"fp8_compute: got {fp8_compute!r}; allowed: True or False")
        self.path = path if path is not None else envs.AITER_PATH.get()
        if self.path not in ("auto",) + PATHS:
            raise ValueError(f"path: got {self.path!r}; allowed: 'auto', {PATHS}")
        self.persistent_max_batch = (persistent_max_batch if persistent_max_batch is not None
                                     else envs.AITER_PERSISTENT_MAX_BATCH.get())
        self.max_decode_tokens = (max_decode_tokens if max_decode_tokens is not None
                                  else envs.AITER_MAX_DECODE_TOKENS.get())
        # given (argument or environment): kept; else reserve() sizes it from the engine
        self._capacity_fixed = max_decode_tokens is not None or envs.AITER_MAX_DECODE_TOKENS.raw is not None
        for arg, value in (("persistent_max_batch", self.persistent_max_batch),
                           ("max_decode_tokens", self.max_decode_tokens), ("max_splits", max_splits)):
            low = 0 if arg == "persistent_max_batch" else (2 if arg == "max_splits" else 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{arg}: got {value!r}; allowed: an int >= {low}")
        self.max_splits = max_splits
        self._scratch: dict[ScratchKey, AiterScratch] = {}
        self._warmed: set[tuple] = set()
        self._warned_env = False

    def label(self) -> str:
        """"aiter" plus "[EMULATED gfx950 ...]" when the emulator serves it (for result files)."""
        api = load_aiter()
        return f"{self.name} [EMULATED {api.arch}, AITER {api.version}]" if api.emulated else self.name

    @property  # type: ignore[override]  # Backend declares a class attribute; here it depends on the emulator
    def emulated(self) -> bool:
        """True while the AITER emulator serves this backend (--emulate-aiter, DSV4_ATTN_AITER_EMULATOR)."""
        return load_aiter().emulated

    def emulation_tag(self) -> str:
        api = load_aiter()
        return f"{self.name}-{api.arch}-{api.version}"

    def describe_binary(self, platform: Platform) -> tuple[dict, list[str]]:
        info = describe_aiter(platform)
        return info, aiter_text(info, platform.library("aiter"))

    # ---- selection --------------------------------------------------------------------------
    def _split_rows_reasons(self, spec: ModelSpec) -> list[str]:
        width = max(w for _, w in _scope_widths(spec))  # the gathered-rows scratch serves every scope
        rows = self.max_decode_tokens * width + 2  # + the scatter dump and the sentinel row
        if rows < SPLIT_MAX_ROWS and rows * ROW * 2 < SPLIT_MAX_BYTES:
            return []
        return [f"split mode gathers up to max_decode_tokens x {width} = {rows} rows of {ROW * 2} B; its code "
                f"objects address rows with 24-bit numbers and 32-bit byte offsets (allowed: < {SPLIT_MAX_ROWS} "
                f"rows and < 4 GiB; lower max_decode_tokens or {envs.AITER_MAX_DECODE_TOKENS.name})"]

    def path_reasons(self, api: AiterAPI, spec: ModelSpec | None, fmt: KVFormat, kind: LayerKind, path: str,
                     dialects=None, heads: int | None = None) -> list[str]:
        """Why ``path`` cannot serve the layer ([] = it can). ``spec`` None skips the checks of the
        model's heads and widths, ``dialects`` (SWA, compressed) None those of the caches' FP8
        encodings; ``heads`` defaults to the spec's."""
        if heads is None and spec is not None:
            heads = spec.num_heads
        if path != "sparse_mla_fwd" and kind not in V4_KINDS:
            return [f"serves DeepSeek-V4.1's {kind.name} layers through sparse_mla_fwd only, the AITER entry point "
                    "vLLM 0.33 runs V4.1 through on ROCm (models/deepseek_v41/amd/rocm.py)"]
        if path == "sparse_mla_fwd":
            why = _sparse_reasons(api)
            in_place = fmt is not KVFormat.BF16
        elif path == "mla_decode_fwd_v4_nm":
            why = _nm_reasons(api, fmt, heads or 1)
            if not why and not self.fp8_compute:
                why = [f"{FP8_NOTE}; opt in with {envs.AITER_FP8_COMPUTE.name}=1 or AiterBackend(fp8_compute=True)"]
            in_place = True  # MODEL1 bytes copied as they are
        else:
            why = _decode_reasons(api) or (self._split_rows_reasons(spec) if spec is not None else [])
            in_place = False  # gathered rows are decoded in their own dialect
        if why or not in_place or dialects is None:
            return why
        native = NATIVE_DIALECT[api.arch]
        names = ("swa_dialect", "comp_dialect")[: 2 if kind.has_comp_scope else 1]
        return [f"{name}: got {d.value}; allowed: {native.value} ({api.arch} reads its native FP8 encoding from "
                f"{fmt.value} bytes on this path)" for name, d in zip(names, dialects) if d is not native]

    def choose_path(self, api: AiterAPI, spec: ModelSpec | None, fmt: KVFormat, kind: LayerKind, dialects=None,
                    heads: int | None = None) -> tuple[str | None, list[str]]:
        """(path, []) or (None, reasons) for a layer."""
        reasons = _base_reasons(api)
        if reasons:
            return None, reasons
        for path in PATHS if self.path == "auto" else (self.path,):
            why = self.path_reasons(api, spec, fmt, kind, path, dialects, heads)
            if not why:
                return path, []
            reasons += [f"{path}: {r}" for r in why]
        return None, reasons

    def platform_reasons(self, platform: Platform) -> list[str]:
        return []  # load_aiter decides: a ROCm gfx942/gfx950 with AITER, or the emulator on any device

    def extra_reasons(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
                      dialects) -> list[str]:
        api = load_aiter(platform)
        if api.emulated and platform.vendor == "rocm" and not self._warned_env:
            self._warned_env = True
            warnings.warn("dsv4_attn: the AITER EMULATOR is switched on on a ROCm machine; results are emulated",
                          stacklevel=2)
        return self.choose_path(api, spec, fmt, kind, tuple(dialects))[1]

    def choice(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
               dialects) -> str:
        """The AITER path auto picks for the layer and why (shown by ``SparseMLA.explain()``)."""
        api, kind = load_aiter(platform), LayerKind.parse(kind)
        path, _ = self.choose_path(api, spec, fmt, kind, tuple(dialects))
        if path is None:
            return ""
        skipped = [f"{p} skipped: {'; '.join(self.path_reasons(api, spec, fmt, kind, p, tuple(dialects)))}"
                   for p in PATHS[: PATHS.index(path)]]
        status = ("EMULATED: a model of AITER's kernels, not AITER" if api.emulated
                  else "this adapter has not yet been validated on MI300X/MI355X hardware (docs/rocm.md)")
        fp8 = self._computes_fp8(api, path, fmt, spec.num_heads)
        precision = (f"fp8 compute opted in ({envs.AITER_FP8_COMPUTE.name}): {FP8_NOTE}" if fp8
                     else "bf16 compute (the accuracy of every other backend)")
        return "; ".join([f"path {path} ({PATH_NOTES[path]})", precision] + skipped + [status])

    def _computes_fp8(self, api: AiterAPI, path: str, fmt: KVFormat, heads: int) -> bool:
        """Whether ``path`` runs AITER's a8w8 kernels for this layer (for some batch size)."""
        if path == "mla_decode_fwd_v4_nm":
            return True
        return path == "mla_decode_fwd" and self._persistent_heads_for(api, fmt, heads) is not None

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor) -> None:
        T = plan.num_tokens
        if T == 0:
            return
        if T > self.max_decode_tokens:  # SparseMLA never sends one (launch_limit); a direct caller may
            raise ValueError(f"plan: got {T} decode tokens; allowed: <= max_decode_tokens ({self.max_decode_tokens}) "
                             "of the aiter backend (SparseMLA runs larger launches on the next backend; raise it: "
                             f"AiterBackend(max_decode_tokens=...) or {envs.AITER_MAX_DECODE_TOKENS.name})")
        api = load_aiter()
        meta = self.meta(plan, layer.shape)
        {"sparse_mla_fwd": self._forward_sparse, "mla_decode_fwd_v4_nm": self._forward_nm,
         "mla_decode_fwd": self._forward_decode}[meta.path](api, plan, meta, layer, out)

    # ---- capacity ---------------------------------------------------------------------------
    def launch_limit(self, phase: Phase) -> LaunchLimit | None:
        """Decode launches fit the scratch's ``max_decode_tokens`` tokens (selection sends larger
        ones to the next backend); prefill never runs here."""
        if Phase(phase) is not Phase.DECODE:
            return None
        set_by = "" if self._capacity_fixed else ", or the engine decode tokens reserve() sets"
        return LaunchLimit(self.max_decode_tokens, f"the scratch's capacity{set_by}")

    def addressable_tokens(self, spec: ModelSpec) -> int:
        """The most decode tokens split mode's gathered rows can address (24-bit row numbers,
        32-bit byte offsets: :meth:`_split_rows_reasons`)."""
        width = max(w for _, w in _scope_widths(spec))
        return max(1, min(SPLIT_MAX_ROWS - 3, (SPLIT_MAX_BYTES - 1) // (ROW * 2) - 3) // width)

    def reserve(self, plan: StepPlan, fmt: KVFormat, num_heads: int, dialects, decode_tokens: int) -> None:
        """Engine start (vLLM's memory profile): unless ``max_decode_tokens`` was given, size the
        scratch for the engine's ``decode_tokens`` (capped by :meth:`addressable_tokens`); then
        allocate every scratch the model's layers will use and run every kernel variant once, so
        no step allocates scratch or loads a kernel (the engine counts this memory before it
        sizes its KV cache)."""
        if not self._capacity_fixed:
            self.max_decode_tokens = min(decode_tokens, self.addressable_tokens(plan.spec))
        api = load_aiter()
        for kind in plan.spec.kinds:
            path, _ = self.choose_path(api, plan.spec, fmt, kind, tuple(dialects), num_heads)
            if path is not None:
                self._path_scratch(path, api, plan, fmt, num_heads)

    def _path_scratch(self, path: str, api: AiterAPI, plan: StepPlan, fmt: KVFormat, heads: int) -> AiterScratch:
        """The scratch ``path`` runs a layer on (allocated, kernels warmed, on first use)."""
        scratch = {"sparse_mla_fwd": self._sparse_scratch, "mla_decode_fwd_v4_nm": self._nm_scratch,
                   "mla_decode_fwd": self._decode_scratch}[path]
        return scratch(api, plan, fmt, heads)

    def prepare(self, plan: StepPlan, shape: LayerShape) -> AiterMeta:
        """The shape's path and scratch (every kernel variant it may run warmed first)."""
        api = load_aiter()
        path, reasons = self.choose_path(api, plan.spec, shape.fmt, shape.kind, shape.dialects, shape.num_heads)
        if path is None:
            raise ValueError("aiter: cannot run this layer:\n" + "\n".join(f"  - {r}" for r in reasons))
        scratch = self._path_scratch(path, api, plan, shape.fmt, shape.num_heads)
        shared: dict[str, ScopeBuffers] = {}
        window_path = self.choose_path(api, plan.spec, shape.fmt, LayerKind.SWA, shape.dialects, shape.num_heads)[0]
        if shape.kind.has_comp_scope and path != "mla_decode_fwd_v4_nm" and window_path == path:
            window = self.meta(plan, shape.window_only())
            if window.scratch is scratch:  # the same buffers: the window scope is built once per step
                shared = window.shared
        return AiterMeta(path, scratch, shared)

    def _get_scratch(self, api: AiterAPI, key: ScratchKey) -> AiterScratch:
        if key not in self._scratch:
            info = None
            if key.persistent:
                def info():
                    return _call(api.get_mla_metadata_info_v1, batch_size=key.max_tokens, max_seqlen_qo=1,
                                 num_head_qo=key.heads, q_dtype=key.q_dtype, kv_dtype=key.kv_dtype, is_sparse=True,
                                 fast_mode=True, num_kv_splits=key.max_splits, max_split_per_batch=key.max_splits)
            self._scratch[key] = AiterScratch.allocate(key, info)
        return self._scratch[key]

    def _scopes(self, plan: StepPlan, layer: LayerInputs) -> list[tuple[str, torch.Tensor, torch.Tensor, Any, Any]]:
        """(scope name, rows, lens, cache, geometry) of the layer's scopes, SWA first."""
        scopes = [("swa", plan.swa_rows, plan.swa_lens, layer.swa_cache, layer.swa_geo)]
        if layer.kind.has_comp_scope:
            rows, lens = plan.comp_scope(layer.kind, layer.topk)
            scopes.append((layer.kind.name.lower(), rows, lens, layer.comp_cache, layer.comp_geo))
        return scopes

    def _indices(self, plan: StepPlan, meta: AiterMeta, name: str, parts, per_layer: bool,
                 api: AiterAPI) -> ScopeBuffers:
        """Build a scope's compacted indices and persistent work plan once per step (kept in
        ``meta.shared``), or every call for top-k kinds (``per_layer``): their rows, and so their
        key counts (holes are dropped), differ per layer. ``parts``: (rows, lens, capacity) per
        cache the scope reads."""
        if not per_layer and name in meta.shared:
            return meta.shared[name]
        scr = meta.scratch
        sb = scr.scopes[name]
        keep, pos, counts = compact(list(parts), sb.width)
        unit = 0
        if scr.key.layout == "padded":
            unit = self._split_count(plan.num_tokens, sb.width, scr.key.heads) * _split_mgc(scr.key.heads)
        write_indices(sb, keep, pos, counts, torch.cat([p[0] for p in parts], dim=1), scr.key.layout, unit,
                      scr.rows.shape[0] - 1 if scr.rows is not None else -1)
        if scr.key.persistent:  # the plan bakes in each token's key range
            self._fill_work_plan(api, scr, sb, plan.num_tokens)
        if not per_layer:
            meta.shared[name] = sb
        return sb

    @staticmethod
    def _fill_work_plan(api: AiterAPI, scr: AiterScratch, sb: ScopeBuffers, T: int) -> None:
        k = scr.key
        wmd, wi, wis, ri, rfm, rpm = sb.meta
        _call(api.get_mla_metadata_v1, seqlens_qo_indptr=scr.qo_indptr[: T + 1],
              seqlens_kv_indptr=sb.kv_indptr[: T + 1], kv_last_page_lens=scr.last_page[:T],
              num_heads_per_head_k=k.heads, num_heads_k=1, is_causal=True, work_metadata_ptrs=wmd,
              work_info_set=wis, work_indptr=wi, reduce_indptr=ri, reduce_final_map=rfm, reduce_partial_map=rpm,
              page_size=1, kv_granularity=PLAN_GRANULARITY.get(k.heads, 16), max_seqlen_qo=1, uni_seqlen_qo=1,
              fast_mode=True, topk=sb.width,
              max_split_per_batch=k.max_splits, dtype_q=k.q_dtype, dtype_kv=k.kv_dtype)

    def _warm(self, key: tuple, runs: list[Callable[[], Any]]) -> None:
        """Run every kernel variant of a layer configuration once, eagerly, before its first use
        (AITER loads modules and compiles Triton kernels then, which a graph capture cannot do)."""
        if key in self._warmed:
            return
        if _capturing():
            raise ValueError(f"aiter: first decode of {key} inside a graph capture; allowed: one eager decode step "
                             "of every layer configuration before capturing (AITER loads kernels on first use)")
        for run in runs:
            run()
        self._warmed.add(key)

    # ---- path 1: sparse_mla_fwd ---------------------------------------------------------------
    def _sparse_scratch(self, api: AiterAPI, plan: StepPlan, fmt: KVFormat, heads: int) -> AiterScratch:
        # its Triton kernels compile per cache format and scope count on first use
        self._warm(("sparse_mla_fwd", fmt, heads),
                   [functools.partial(self._sparse_dummy, api, fmt, heads, plan.device, two) for two in (False, True)])
        return self._get_scratch(api, ScratchKey(
            path="sparse_mla_fwd", device=plan.device, max_tokens=self.max_decode_tokens, heads=heads,
            widths=_scope_widths(plan.spec), q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, layout="slots"))

    @staticmethod
    def _sparse_dummy(api: AiterAPI, fmt: KVFormat, heads: int, device: torch.device, two_scopes: bool) -> None:
        """One token, one zero key in a one-block cache of ``fmt`` (and a second scope)."""
        cache = new_cache(fmt, 1, 64, device)
        i32 = dict(dtype=torch.int32, device=device)
        indptr, indices = torch.arange(2, **i32), torch.zeros(1, **i32)
        scale = torch.ones(1, dtype=torch.float32, device=device) if fmt is KVFormat.FP8_TENSOR else None
        extra = dict(extra_kv=cache, extra_indptr=indptr, extra_indices=indices) if two_scopes else {}
        api.sparse_mla_fwd(torch.zeros(1, heads, HEAD_DIM, dtype=torch.bfloat16, device=device), cache, indptr,
                           indices, 1.0, kv_scale=scale, kv_lora_rank=HEAD_DIM, qk_rope_head_dim=0,
                           has_invalid=False, out=torch.empty(1, heads, HEAD_DIM, dtype=torch.bfloat16, device=device),
                           attn_sink=torch.zeros(heads, dtype=torch.float32, device=device), **extra)

    def _forward_sparse(self, api: AiterAPI, plan: StepPlan, meta: AiterMeta, layer: LayerInputs,
                        out: torch.Tensor) -> None:
        T, H = plan.num_tokens, layer.q.shape[1]
        scr = meta.scratch
        built = []
        for name, rows, lens, cache, geo in self._scopes(plan, layer):
            sb = self._indices(plan, meta, name, [(rows, lens, geo.num_slots)], layer.kind.uses_topk and name != "swa",
                               api)
            scale = None
            if layer.fmt is KVFormat.FP8_TENSOR:
                scale = sb.kv_scale
                scale.fill_(layer.kv_scale)
            built.append((sb, cache, scale))
        (swa, swa_cache, swa_scale), extra = built[0], (built[1] if len(built) > 1 else None)
        kwargs = dict(kv_scale=swa_scale, kv_lora_rank=HEAD_DIM, qk_rope_head_dim=0, has_invalid=False, out=out,
                      attn_sink=None if layer.sink is None else self._stage_sink(scr, layer.sink, H))
        if extra is not None:
            sb, cache, _ = extra
            kwargs.update(extra_kv=cache, extra_indptr=sb.kv_indptr[: T + 1],
                          extra_indices=sb.kv_indices[: T * sb.width])  # one kv_scale serves both caches
        api.sparse_mla_fwd(layer.q, swa_cache, swa.kv_indptr[: T + 1], swa.kv_indices[: T * swa.width],
                           layer.softmax_scale, **kwargs)
        empty = swa.counts[:T] == 0
        if extra is not None:
            empty &= extra[0].counts[:T] == 0
        out.masked_fill_(empty[:, None, None], 0.0)  # AITER's output for a row with no key is unspecified

    # ---- path 2: mla_decode_fwd_v4_nm, both scopes + sink in one call -------------------------
    def _nm_scratch(self, api: AiterAPI, plan: StepPlan, fmt: KVFormat, num_heads: int) -> AiterScratch:
        heads = next(h for h in NM_HEADS if h >= num_heads)
        # one index scope per layer kind, over its SWA keys then its compressed keys
        widths = tuple((name, plan.spec.window + (w if name != "swa" else 0)) for name, w in _scope_widths(plan.spec))
        fp8 = NATIVE_DIALECT[api.arch].torch_dtype
        key = ScratchKey(path="mla_decode_fwd_v4_nm", device=plan.device, max_tokens=self.max_decode_tokens,
                         heads=heads, widths=widths, q_dtype=fp8, kv_dtype=fp8, layout="ragged", row=NM_ROW)
        scr = self._get_scratch(api, key)
        self._warm(("mla_decode_fwd_v4_nm", heads), [lambda: self._nm_dummy(api, heads, plan.device)])
        return scr

    def _forward_nm(self, api: AiterAPI, plan: StepPlan, meta: AiterMeta, layer: LayerInputs,
                    out: torch.Tensor) -> None:
        T, H = plan.num_tokens, layer.q.shape[1]
        scr = meta.scratch
        fp8 = NATIVE_DIALECT[api.arch].torch_dtype
        scopes = self._scopes(plan, layer)
        sb = self._indices(plan, meta, layer.kind.name.lower(),
                           [(rows, lens, geo.num_slots) for _, rows, lens, _, geo in scopes],
                           layer.kind.uses_topk, api)
        col = 0
        for _, rows, _, cache, geo in scopes:  # this step's records, repacked where the indices point
            K = rows.shape[1]
            slots = sb.slots[: T * sb.width].view(T, sb.width)[:, col : col + K].reshape(-1)
            pos = sb.pos[: T * sb.width].view(T, sb.width)[:, col : col + K].reshape(-1)
            packed, rope = _nm_pack(packed_records(cache, Record.V4_FP8, geo, slots))
            scr.rows.index_copy_(0, pos, packed)
            scr.rows_rope.index_copy_(0, pos, rope)
            col += K
        # the kernel's softmax scale is fixed at 1/sqrt(512): fold the layer's into q
        q = layer.q.float() * (layer.softmax_scale * NM_ROW**0.5)
        packed, rope = _nm_pack(quantize_model1(q.reshape(-1, HEAD_DIM).to(torch.bfloat16)))
        scr.q[:T, :H].copy_(packed.view(T, H, NM_ROW))
        scr.q_rope[:T, :H].copy_(rope.view(T, H, -1))
        scr.q[:T, H:].zero_()
        scr.q_rope[:T, H:].zero_()
        n = T * sb.width
        o = scr.out[0][:T]
        # by keyword: kv_last_page_lens is the 9th positional parameter on 0.1.17 / 0.1.18
        _call(api.mla_decode_fwd_v4_nm, q=scr.q[:T].view(fp8), qrope=scr.q_rope[:T],
              kv_buffer=scr.rows[:n].view(fp8).view(n, 1, 1, NM_ROW), kvrope=scr.rows_rope[:n].view(n, 1, 1, -1),
              output=o, qo_indptr=scr.qo_indptr[: T + 1], kv_indptr=sb.kv_indptr[: T + 1],
              kv_page_indices=sb.kv_indices[:n], kv_last_page_lens=scr.last_page[:T], max_seqlen_q=1,
              sink=self._stage_sink(scr, layer.sink, H))
        keyless = (sb.counts[:T] == 0)[:, None, None]
        out.copy_(torch.where(keyless, torch.zeros_like(o[:, :H]), o[:, :H]))

    @staticmethod
    def _stage_sink(scr: AiterScratch, sink: torch.Tensor | None, H: int) -> torch.Tensor:
        """The sink as the kernels take it: padded heads -inf, +inf (output 0) as SINK_MAX."""
        if sink is None:
            scr.sink.fill_(-math.inf)
        else:
            torch.clamp(sink.float(), max=SINK_MAX, out=scr.sink[:H])
        return scr.sink

    @staticmethod
    def _nm_dummy(api: AiterAPI, heads: int, device: torch.device) -> None:
        """One token, one key: a multi-split call (stage 2 compiled) of the v4 nm kernel."""
        fp8 = NATIVE_DIALECT[api.arch].torch_dtype
        i32 = dict(dtype=torch.int32, device=device)
        _call(api.mla_decode_fwd_v4_nm, q=torch.zeros(1, heads, NM_ROW, dtype=fp8, device=device),
              qrope=torch.zeros(1, heads, 64, dtype=torch.bfloat16, device=device),
              kv_buffer=torch.zeros(1, 1, 1, NM_ROW, dtype=fp8, device=device),
              kvrope=torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16, device=device),
              output=torch.zeros(1, heads, HEAD_DIM, dtype=torch.bfloat16, device=device),
              qo_indptr=torch.arange(2, **i32), kv_indptr=torch.arange(2, **i32),
              kv_page_indices=torch.zeros(1, **i32), kv_last_page_lens=torch.ones(1, **i32), max_seqlen_q=1,
              sink=torch.full((heads,), -math.inf, device=device), num_kv_splits=2)

    # ---- path 3: mla_decode_fwd, two scopes + LSE merge + sink ----------------------------------
    def _decode_key(self, api: AiterAPI, plan: StepPlan, heads: int, persistent_heads: int | None,
                    T: int) -> ScratchKey:
        widths = _scope_widths(plan.spec)
        split = ScratchKey(path="mla_decode_fwd", device=plan.device, max_tokens=self.max_decode_tokens,
                           heads=_split_heads(heads), widths=widths, q_dtype=torch.bfloat16,
                           kv_dtype=torch.bfloat16, layout="padded", row=ROW, max_splits=self.max_splits,
                           pad_slack=max(w for _, w in widths) + 2 * _split_mgc(_split_heads(heads)))
        if persistent_heads is None or T >= self.persistent_max_batch:
            return split
        fp8 = NATIVE_DIALECT[api.arch].torch_dtype
        # persistent mode only runs below persistent_max_batch: its work buffers (and the fp32
        # partials AITER allocates per call from them) are sized for that, not max_decode_tokens
        return replace(split, max_tokens=min(self.max_decode_tokens, self.persistent_max_batch - 1),
                       heads=persistent_heads, q_dtype=fp8, kv_dtype=fp8, layout="fixed", persistent=True,
                       pad_slack=0)

    def _persistent_heads_for(self, api: AiterAPI, fmt: KVFormat, heads: int) -> int | None:
        """Heads handed to the persistent (FP8/FP8) kernels, or None where split mode serves every
        batch: persistent mode computes in fp8, so only with fp8_compute, and never for bf16
        caches (their precision is why they are bf16)."""
        if not self.fp8_compute or fmt is KVFormat.BF16 or self.persistent_max_batch <= 1:
            return None
        return _persistent_heads(api, heads)[0]

    def _decode_scratch(self, api: AiterAPI, plan: StepPlan, fmt: KVFormat, H: int) -> AiterScratch:
        persistent_heads = self._persistent_heads_for(api, fmt, H)
        variants = [self._decode_key(api, plan, H, persistent_heads, t) for t in (1, self.persistent_max_batch)]
        self._warm(("mla_decode_fwd",) + tuple(sorted({(k.heads, k.persistent) for k in variants})),
                   [functools.partial(self._decode_dummy, api, k) for k in dict.fromkeys(variants)])
        for key in variants:  # both modes' scratch now: a later batch size allocates nothing
            self._get_scratch(api, key)
        return self._get_scratch(api, self._decode_key(api, plan, H, persistent_heads, plan.num_tokens))

    def _forward_decode(self, api: AiterAPI, plan: StepPlan, meta: AiterMeta, layer: LayerInputs,
                        out: torch.Tensor) -> None:
        T, H = plan.num_tokens, layer.q.shape[1]
        scr = meta.scratch
        key = scr.key
        q = scr.q[:T]
        if key.persistent:
            quantize_pow2_(q[:, :H, :HEAD_DIM], layer.q, scr.q_scale)
        else:
            q[:, :H, :HEAD_DIM].copy_(layer.q)
        q[:, H:, :HEAD_DIM].zero_()
        results = []
        for i, (name, rows, lens, cache, geo) in enumerate(self._scopes(plan, layer)):
            dialect = layer.swa_dialect if name == "swa" else layer.comp_dialect
            sb = self._indices(plan, meta, name, [(rows, lens, geo.num_slots)], layer.kind.uses_topk and name != "swa",
                               api)
            n = T * (sb.width + key.pad_slack)
            values = gather_rows(cache, layer.fmt, geo, sb.slots[: T * rows.shape[1]], layer.kv_scale, dialect)
            staged = torch.empty_like(values, dtype=key.kv_dtype)
            if key.persistent:
                quantize_pow2_(staged, values, sb.kv_scale)
            else:
                staged.copy_(values)
            # by bytes: index_copy_ has no fp8 kernel on every device
            scr.rows.view(torch.uint8 if key.persistent else key.kv_dtype)[:, :HEAD_DIM].index_copy_(
                0, sb.pos[: T * rows.shape[1]], staged.view(torch.uint8) if key.persistent else staged)
            o = scr.out[i][:T]
            work_plan = dict(zip(("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr",
                                  "reduce_final_map", "reduce_partial_map"), sb.meta)) if key.persistent else {}
            splits = self.max_splits if key.persistent else self._split_count(T, sb.width, key.heads)
            if not key.persistent:
                torch.arange(0, (T + 1) * splits, splits, out=scr.splits_indptr[: T + 1])
            _, lse = _call(api.mla_decode_fwd, q=q, kv_buffer=scr.rows.view(-1, 1, 1, ROW), o=o,
                           qo_indptr=scr.qo_indptr[: T + 1], kv_indptr=sb.kv_indptr[: T + 1],
                           kv_indices=sb.kv_indices[:n], kv_last_page_lens=scr.last_page[:T], max_seqlen_q=1,
                           page_size=1, nhead_kv=1, sm_scale=layer.softmax_scale, num_kv_splits=splits,
                           num_kv_splits_indptr=None if key.persistent else scr.splits_indptr[: T + 1],
                           q_scale=scr.q_scale if key.persistent else None,
                           kv_scale=sb.kv_scale if key.persistent else None, return_lse=True, **work_plan)
            # a row with no key has no LSE, whatever the kernel wrote there (+inf, NaN or nothing)
            lse_buf = scr.lse[i][:T]
            lse_buf.copy_(torch.where(sb.counts[:T, None] > 0, lse, torch.full_like(lse, -math.inf)))
            results.append((o, lse_buf))
        merged, lse = results[0] if len(results) == 1 else merge_lse(*results[0], *results[1])
        out.copy_(apply_sink(merged[:, :H], lse[:, :H], layer.sink))

    def _split_count(self, T: int, width: int, heads: int) -> int:
        """Splits per row in split mode: >= 2 (the LSE comes from the stage-2 reduce), more for
        small batches, at most one per ``mgc`` keys of the scope's width (every row's range is
        padded to ``splits * mgc`` sentinel-filled entries: scratch.py, layout "padded")."""
        return min(self.max_splits, max(2, math.ceil(512 / T)), max(2, math.ceil(width / _split_mgc(heads))))

    def _decode_dummy(self, api: AiterAPI, key: ScratchKey) -> None:
        """One token, one zero key: every kernel of a mode (stage 1, stage 2 or reduce, metadata)."""
        dev, h = key.device, key.heads
        i32 = dict(dtype=torch.int32, device=dev)
        one, ar = torch.ones(1, dtype=torch.float32, device=dev), torch.arange(2, **i32)
        meta = {}
        if key.persistent:
            shapes = _call(api.get_mla_metadata_info_v1, batch_size=1, max_seqlen_qo=1, num_head_qo=h,
                           q_dtype=key.q_dtype, kv_dtype=key.kv_dtype, is_sparse=True, fast_mode=True,
                           num_kv_splits=key.max_splits, max_split_per_batch=key.max_splits)
            bufs = [torch.empty(s, dtype=d, device=dev) for s, d in shapes]
            names = ("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
                     "reduce_partial_map")
            meta = dict(zip(names, bufs))
            _call(api.get_mla_metadata_v1, seqlens_qo_indptr=ar, seqlens_kv_indptr=ar,
                  kv_last_page_lens=torch.ones(1, **i32), num_heads_per_head_k=h, num_heads_k=1, is_causal=True,
                  work_metadata_ptrs=bufs[0], work_info_set=bufs[2], work_indptr=bufs[1], reduce_indptr=bufs[3],
                  reduce_final_map=bufs[4], reduce_partial_map=bufs[5], page_size=1,
                  kv_granularity=PLAN_GRANULARITY.get(h, 16),
                  max_seqlen_qo=1, uni_seqlen_qo=1, fast_mode=True, topk=1, max_split_per_batch=key.max_splits,
                  dtype_q=key.q_dtype, dtype_kv=key.kv_dtype)
        _call(api.mla_decode_fwd, q=torch.zeros(1, h, ROW, dtype=key.q_dtype, device=dev),
              kv_buffer=torch.zeros(1, 1, 1, ROW, dtype=key.kv_dtype, device=dev),
              o=torch.zeros(1, h, HEAD_DIM, dtype=torch.bfloat16, device=dev), qo_indptr=ar, kv_indptr=ar,
              kv_indices=torch.zeros(1, **i32), kv_last_page_lens=torch.ones(1, **i32), max_seqlen_q=1, page_size=1,
              nhead_kv=1, sm_scale=1.0, num_kv_splits=key.max_splits if key.persistent else 2,
              num_kv_splits_indptr=None if key.persistent else torch.tensor([0, 2], **i32),
              q_scale=one if key.persistent else None, kv_scale=one if key.persistent else None,
              return_lse=True, **meta)
