"""Backend `aiter`: DeepSeek-V4 sparse decode on AMD gfx950 (MI355X) / gfx942 (MI300X) via AITER.

Decode only (``phases = (DECODE,)``): prefill tokens go to `triton` / `torch` through the front
end. Two AITER paths, chosen by what the installed AITER offers (features are detected with
``inspect.signature`` and the shipped asm code objects, never from the version string):

``sparse_mla_fwd`` (newer AITER, ``aiter.ops.triton.attention.sparse_mla``; preferred)
    One call per layer: both scopes (``extra_*``), ragged CSR indices of GLOBAL slots and the
    sink inside the kernel; caches read in place: MODEL1 (fp8_ds_mla, gfx950 only), BF16
    (gfx950 for two-scope layers), FP8_TENSOR (gfx942/gfx950, arch-native FP8 dialect). Its
    optional LSE would INCLUDE the sink; forward needs none, so none is requested.

``mla_decode_fwd`` (the seed design of vLLM PR #40889 / #40892)
    No sink and one KV scope per call: the SWA scope and the compressed scope are two calls
    returning ``(out, lse)`` (``return_lse=True``: natural log), merged with
    ``common.merge.merge_lse`` and ``apply_sink`` (rows with no key forced to 0: AITER can
    return NaN there). Page size 1: ``kv_indices`` are row numbers. Modes, per batch size:

    persistent  T < ``persistent_max_batch`` (default 32, AITER's own
                ``AITER_MLA_DECODE_PERSISTENT_MAX_BATCH``: persistent is 1.4-1.6x slower at high
                concurrency, ROCm/aiter #4144) and a persistent LSE code object exists (gfx950,
                FP8/FP8 only): fixed-stride ``kv_indices`` with -1 sentinels and a ``topk=`` work
                plan from ``get_mla_metadata_v1`` (sized once by ``get_mla_metadata_info_v1`` for
                the max batch, refilled once per step per scope kind, shared by all layers);
    split       otherwise: non-persistent, ragged CSR, ``num_kv_splits >= 2`` (the LSE is written
                by AITER's stage-2 reduce only; gfx942's one-split FP8 kernel writes none).

    Kernel operands: FP8_TENSOR and BF16 caches are read in place as fixed-stride rows
    (``[rows, 1, 1, 512]``; slots remapped when blocks are padded); MODEL1 caches are served by
    gathering ONLY this step's selected rows into a bounded scratch (bf16, exact, in split mode;
    arch-native FP8 with a power-of-two per-tensor scale in persistent mode). q is staged into
    scratch: bf16, or arch-native FP8 with a power-of-two per-tensor ``q_scale``. Heads are
    padded (q zeros, sink -inf) to what the kernels take: split 16 / 128, persistent 16 / 32 /
    64 / 128. BF16 caches never run persistent (no persistent LSE kernel for BF16).

FP8 dialect: gfx942 reads FNUZ e4m3, gfx950 OCP; scales are ``[1]`` float32 tensors. Caches in
the other dialect are refused (in place) or re-encoded (gathered MODEL1 rows).

Everything a step touches lives in :mod:`.scratch` buffers (graph-stable, shared by layers).
The AITER API comes through ONE seam, :func:`load_aiter`: the real library on ROCm, or the
AITER EMULATOR (:mod:`.emulate`) when ``dsv4_attn.rocm.emulate.enable()`` was called or
``DSV4_ATTN_AITER_EMULATOR`` is set — then CPU/CUDA devices are accepted and every result is
labelled emulated (``AiterBackend.label``, ``describe_aiter()["emulated"]``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..common.backend import Backend, Capabilities, LayerInputs, Phase, PlatformSupport
from ..common.layout import Fp8Dialect, KVFormat, check_cache, gather_rows
from ..common.merge import apply_sink, lse_base2_to_natural, merge_lse
from ..common.plan import StepPlan
from ..common.platform import Platform, probe
from ..common.spec import HEAD_DIM, V4_KINDS, LayerKind, ModelSpec
from . import emulate
from .scratch import AiterScratch, ScopeBuffers, ScratchKey, quantize_pow2_, write_indices

ARCHS = ("gfx942", "gfx950")
NATIVE_DIALECT = {"gfx942": Fp8Dialect.FNUZ, "gfx950": Fp8Dialect.OCP}
PATHS = ("sparse_mla_fwd", "mla_decode_fwd")
ENV_PATH = "DSV4_ATTN_AITER_PATH"
ENV_PERSISTENT_MAX_BATCH = "DSV4_ATTN_AITER_PERSISTENT_MAX_BATCH"
ENV_MAX_DECODE_TOKENS = "DSV4_ATTN_AITER_MAX_DECODE_TOKENS"
# mla_decode_fwd(return_lse=True) final LSE is natural log (stage-2 ``e_max + log(e_sum)``,
# reduce.cu ``logf(sum) + max``); kept as a switch because AITER's split statistics are base 2
# in some kernels (vLLM rocm_aiter_mla.py) and an MI355X run must confirm it (docs/rocm.md).
DECODE_LSE_IS_BASE2 = False
_SPARSE_KWARGS = ("out", "attn_sink", "extra_kv", "extra_indptr", "extra_indices", "has_invalid", "kv_scale",
                  "kv_lora_rank", "qk_rope_head_dim")
_DECODE_PARAMS = ("q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens",
                  "max_seqlen_q", "sm_scale", "num_kv_splits", "num_kv_splits_indptr", "q_scale", "kv_scale",
                  "return_lse")
_SPLIT_HEADS = (16, 128)
_PERSISTENT_HEADS = (16, 32, 64, 128)
# keyword aliases across AITER revisions (0.1.7 names the work plan ``work_info``)
_ALIASES = {"work_info_set": ("work_info_set", "work_info")}
# keywords older revisions lack; dropped when the installed signature has no such parameter
_OPTIONAL = frozenset({"page_size", "nhead_kv", "kv_last_page_lens", "dtype_q", "dtype_kv", "max_split_per_batch",
                       "num_kv_splits"})


# ---- the one seam to AITER ------------------------------------------------------------------
@dataclass(frozen=True)
class AiterAPI:
    """What the backend uses of AITER. ``error`` says why AITER is unusable (then the functions
    are None). ``asm_objects``: names of the shipped asm code objects for ``arch``."""

    version: str | None
    arch: str | None
    emulated: bool
    mla_decode_fwd: Callable | None = None
    get_mla_metadata_info_v1: Callable | None = None
    get_mla_metadata_v1: Callable | None = None
    sparse_mla_fwd: Callable | None = None
    asm_objects: frozenset = frozenset()
    error: str | None = None


_override: Any = None
_env_emulator: tuple[str, Any] | None = None


def set_api_override(api: Any) -> None:
    """Route the backend to ``api`` (an object with AiterAPI's attributes, e.g. an
    ``emulate.AiterEmulator``) or back to the real library with None. Used by ``emulate.enable``."""
    global _override
    _override = api


def _from_object(obj: Any) -> AiterAPI:
    return AiterAPI(version=obj.version, arch=obj.arch, emulated=bool(getattr(obj, "emulated", False)),
                    mla_decode_fwd=obj.mla_decode_fwd, get_mla_metadata_info_v1=obj.get_mla_metadata_info_v1,
                    get_mla_metadata_v1=obj.get_mla_metadata_v1, sparse_mla_fwd=obj.sparse_mla_fwd,
                    asm_objects=frozenset(obj.asm_objects))


def load_aiter(platform: Platform | None = None) -> AiterAPI:
    """The AITER API: the emulator when switched on (``emulate.enable()`` or
    ``DSV4_ATTN_AITER_EMULATOR``), else the real library on a ROCm machine, else an AiterAPI whose
    ``error`` says why. Never imports ``aiter`` off ROCm (its import runs rocminfo and raises)."""
    global _env_emulator
    if _override is not None:
        return _from_object(_override)
    env = os.environ.get(emulate.ENV_EMULATOR, "")
    if env.strip() not in ("", "0"):
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
        return AiterAPI(None, arch, False, error=f"cannot import aiter: {type(exc).__name__}: {exc} "
                        "(pip install amd-aiter, or use a ROCm image with AITER)")
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
                    sparse_mla_fwd, _asm_objects(aiter.__file__, arch))


def _asm_objects(aiter_init: str, arch: str) -> frozenset:
    """Names of the asm code objects under ``hsa/<arch>/mla`` (wheel: ``aiter_meta/hsa``; source
    tree: ``hsa``; or ``AITER_ASM_DIR``)."""
    pkg = os.path.dirname(os.path.abspath(aiter_init))
    roots = [os.environ.get("AITER_ASM_DIR", ""), os.path.join(pkg, "..", "aiter_meta", "hsa"),
             os.path.join(pkg, "..", "hsa"), os.path.join(pkg, "hsa")]
    names: set[str] = set()
    for root in roots:
        folder = os.path.join(root, arch, "mla") if root else ""
        if folder and os.path.isdir(folder):
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


# ---- features (signature checked, not the version string) -----------------------------------
def _sparse_missing(api: AiterAPI) -> str | None:
    if api.sparse_mla_fwd is None:
        return ("aiter.ops.triton.attention.sparse_mla.sparse_mla_fwd not found (newer AITER only; the PyPI "
                "0.1.7 wheel lacks it)")
    missing = [k for k in _SPARSE_KWARGS if k not in _params(api.sparse_mla_fwd)]
    return f"sparse_mla_fwd lacks keyword(s) {missing}" if missing else None


def _decode_missing(api: AiterAPI) -> str | None:
    if api.mla_decode_fwd is None:
        return "aiter.mla.mla_decode_fwd not found"
    missing = [k for k in _DECODE_PARAMS if k not in _params(api.mla_decode_fwd)]
    if "return_lse" in missing:
        return ("mla_decode_fwd has no return_lse (AITER 0.1.7: final_lse is returned unwritten), so the two "
                "scopes cannot be merged nor the sink applied")
    return f"mla_decode_fwd lacks parameter(s) {missing}" if missing else None


def _persistent_missing(api: AiterAPI) -> str | None:
    for name in ("get_mla_metadata_info_v1", "get_mla_metadata_v1"):
        if getattr(api, name) is None:
            return f"aiter.{name} not found"
    if "topk" not in _params(api.get_mla_metadata_v1):
        return "get_mla_metadata_v1 has no topk (sparse work plans)"
    if api.arch != "gfx950":
        return f"{api.arch} has no persistent MLA kernel that returns an LSE (vLLM: gfx942 ships no LSE code object)"
    if not any("a8w8" in n and "lse" in n and "_ps" in n for n in api.asm_objects):
        return f"no persistent FP8/FP8 LSE code object (*a8w8*lse*_ps*) under hsa/{api.arch}/mla"
    return None


def _base_reasons(api: AiterAPI) -> list[str]:
    if api.error:
        return [api.error]
    if api.arch not in ARCHS:
        return [f"arch {api.arch}: allowed {ARCHS}"]
    return []


def _sparse_reasons(api: AiterAPI, fmt: KVFormat, kind: LayerKind) -> list[str]:
    missing = _sparse_missing(api)
    if missing:
        return [missing]
    if fmt is KVFormat.MODEL1_FP8 and api.arch != "gfx950":
        return [f"fp8_ds_mla caches are read by sparse_mla_fwd on gfx950 only (got {api.arch})"]
    if fmt is KVFormat.BF16 and kind.has_comp_scope and api.arch != "gfx950":
        return [f"the bf16 two-scope loop of sparse_mla_fwd is gfx950 only (got {api.arch})"]
    return []


def _decode_heads(persistent: bool, heads: int) -> int:
    """Heads handed to mla_decode_fwd: the smallest supported count >= heads (q padded)."""
    return next(h for h in (_PERSISTENT_HEADS if persistent else _SPLIT_HEADS) if h >= heads)


def describe_aiter(platform: Platform | None = None) -> dict:
    """What ``dsv4-attn probe`` prints for AITER: version, arch, FP8 dialect, which paths are
    enabled (or why not), and whether this is the emulator."""
    api = load_aiter(platform)
    out = {"found": api.error is None, "emulated": api.emulated, "version": api.version, "arch": api.arch,
           "dialect": NATIVE_DIALECT[api.arch].value if api.arch in NATIVE_DIALECT else None, "error": api.error}
    base = _base_reasons(api)
    decode = base or ([_decode_missing(api)] if _decode_missing(api) else [])
    out["paths"] = {
        "sparse_mla_fwd": "; ".join(base or [r for r in [_sparse_missing(api)] if r]) or "enabled",
        "mla_decode_fwd (split)": "; ".join(decode) or "enabled",
        "mla_decode_fwd (persistent)": "; ".join(decode or [r for r in [_persistent_missing(api)] if r]) or "enabled",
    }
    return out


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: got {value!r}; allowed: an int") from None


# ---- the backend --------------------------------------------------------------------------------
class AiterBackend(Backend):
    """AITER decode adapter (see module docstring).

    path                  "auto" (sparse_mla_fwd where it serves the format/arch, else
                          mla_decode_fwd), "sparse_mla_fwd" or "mla_decode_fwd"; env DSV4_ATTN_AITER_PATH
    persistent_max_batch  mla_decode_fwd runs persistent for T < this many decode tokens
                          (0 = never); env DSV4_ATTN_AITER_PERSISTENT_MAX_BATCH, default 32
    max_decode_tokens     scratch capacity in decode tokens (bounds the gathered-rows scratch);
                          env DSV4_ATTN_AITER_MAX_DECODE_TOKENS, default 1024
    max_splits            persistent split budget per batch row (get_mla_metadata_v1)
    """

    splits_phases = True
    capabilities = Capabilities(
        platforms=(PlatformSupport("rocm", archs=ARCHS, label="AMD gfx950 (MI355X), gfx942 (MI300X) via AITER"),),
        formats=(KVFormat.MODEL1_FP8, KVFormat.BF16, KVFormat.FP8_TENSOR),
        kinds=V4_KINDS,
        phases=(Phase.DECODE,),
        dialects=(Fp8Dialect.OCP, Fp8Dialect.FNUZ),  # arch-native in place; gathered rows re-encoded
        heads_note="padded to 16/32/64/128 where a kernel needs it",
        validated="emulated (AITER emulator: CPU CI, H100 CUDA-graph test); not yet run on MI300X/MI355X",
        notes="decode only; sparse_mla_fwd preferred (gfx950, newer AITER), else mla_decode_fwd + LSE merge",
    )

    def __init__(self, path: str | None = None, persistent_max_batch: int | None = None,
                 max_decode_tokens: int | None = None, max_splits: int = 16, name: str = "aiter") -> None:
        self.name = name
        self.path = path if path is not None else os.environ.get(ENV_PATH, "auto").strip() or "auto"
        if self.path not in ("auto",) + PATHS:
            raise ValueError(f"path: got {self.path!r}; allowed: 'auto', {PATHS}")
        self.persistent_max_batch = (persistent_max_batch if persistent_max_batch is not None
                                     else _env_int(ENV_PERSISTENT_MAX_BATCH, 32))
        self.max_decode_tokens = (max_decode_tokens if max_decode_tokens is not None
                                  else _env_int(ENV_MAX_DECODE_TOKENS, 1024))
        for arg, value in (("persistent_max_batch", self.persistent_max_batch),
                           ("max_decode_tokens", self.max_decode_tokens), ("max_splits", max_splits)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if arg[0] == "p" else 1):
                raise ValueError(f"{arg}: got {value!r}; allowed: an int >= {0 if arg[0] == 'p' else 1}")
        self.max_splits = max_splits
        self._scratch: dict[ScratchKey, AiterScratch] = {}
        self._warned_env = False

    def label(self) -> str:
        """"aiter" plus "[EMULATED gfx950 ...]" when the emulator serves it (for result files)."""
        api = load_aiter()
        return f"{self.name} [EMULATED {api.arch}, AITER {api.version}]" if api.emulated else self.name

    # ---- selection --------------------------------------------------------------------------
    def choose_path(self, api: AiterAPI, fmt: KVFormat, kind: LayerKind) -> tuple[str | None, list[str]]:
        """(path, []) or (None, reasons) for a format and layer kind."""
        reasons = _base_reasons(api)
        if reasons:
            return None, reasons
        candidates = PATHS if self.path == "auto" else (self.path,)
        for path in candidates:
            why = (_sparse_reasons(api, fmt, kind) if path == "sparse_mla_fwd"
                   else [r for r in [_decode_missing(api)] if r])
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
            warnings.warn("dsv4_attn: the AITER EMULATOR is switched on on a ROCm machine; results are emulated")
        path, reasons = self.choose_path(api, fmt, kind)
        if path is None or not fmt.uses_fp8:
            return reasons
        return self._dialect_problems(api, fmt, kind, path, dialects)

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor) -> None:
        T = plan.num_tokens
        if T == 0:
            return
        if T > self.max_decode_tokens:
            raise ValueError(f"plan: got {T} decode tokens; allowed: <= max_decode_tokens ({self.max_decode_tokens}) "
                             f"of the aiter backend (raise it: AiterBackend(max_decode_tokens=...) or "
                             f"{ENV_MAX_DECODE_TOKENS})")
        api = load_aiter()
        path, reasons = self.choose_path(api, layer.fmt, layer.kind)
        if path is None:
            raise ValueError("aiter: cannot run this layer:\n" + "\n".join(f"  - {r}" for r in reasons))
        problems = self._dialect_problems(api, layer.fmt, layer.kind, path, (layer.swa_dialect, layer.comp_dialect))
        if problems:
            raise ValueError("; ".join(problems))
        if path == "sparse_mla_fwd":
            self._forward_sparse(api, plan, layer, out)
        else:
            self._forward_decode(api, plan, layer, out)

    @staticmethod
    def _dialect_problems(api: AiterAPI, fmt: KVFormat, kind: LayerKind, path: str, dialects) -> list[str]:
        """Caches read in place must be in the arch's FP8 dialect: FP8_TENSOR always, MODEL1 on
        sparse_mla_fwd (gathered MODEL1 rows are decoded in their own dialect and re-encoded)."""
        native = NATIVE_DIALECT[api.arch]
        if not (fmt is KVFormat.FP8_TENSOR or (fmt is KVFormat.MODEL1_FP8 and path == PATHS[0])):
            return []
        names = ("swa_dialect", "comp_dialect")[: 2 if kind.has_comp_scope else 1]
        return [f"{name}: got {dialect.value}; allowed: {native.value} ({api.arch} reads its native FP8 encoding "
                f"in place for {fmt.value} caches)" for name, dialect in zip(names, dialects) if dialect is not native]

    def _get_scratch(self, api: AiterAPI, plan: StepPlan, key_args: dict) -> AiterScratch:
        spec = plan.spec
        key = ScratchKey(device=plan.device, max_tokens=self.max_decode_tokens,
                         widths=(("swa", spec.window), ("c4a", spec.c4a_topk), ("c128a", spec.c128a_width)),
                         max_splits=self.max_splits, **key_args)
        if key not in self._scratch:
            info = None
            if key.persistent:
                def info():
                    return _call(api.get_mla_metadata_info_v1, batch_size=key.max_tokens, max_seqlen_qo=1,
                                 num_head_qo=key.heads, q_dtype=key.q_dtype, kv_dtype=key.kv_dtype, is_sparse=True,
                                 fast_mode=True, num_kv_splits=key.max_splits, max_split_per_batch=key.max_splits)
            self._scratch[key] = AiterScratch.allocate(key, info)
        return self._scratch[key]

    def _scope(self, plan: StepPlan, scr: AiterScratch, name: str, rows: torch.Tensor, lens: torch.Tensor,
               remap_key: tuple | None, per_layer: bool, api: AiterAPI) -> ScopeBuffers:
        """Build a scope's indices (and persistent work plan) once per step, or every call for C4A
        (``per_layer``) whose rows differ per layer while its work plan does not."""
        sb = scr.scopes[name]
        key = (self.name, "aiter-scope", name, scr.key, remap_key)

        def build():
            remap = None if remap_key is None else functools.partial(_remap_rows, *remap_key)
            write_indices(sb, rows, lens, scr.key.layout, remap, scr.key.gather)
            return sb

        if per_layer:
            build()
        else:
            plan.cached(key, build)
        if scr.key.persistent:
            plan.cached(key + ("work-plan",), lambda: self._fill_work_plan(api, scr, sb, plan.num_tokens))
        return sb

    @staticmethod
    def _fill_work_plan(api: AiterAPI, scr: AiterScratch, sb: ScopeBuffers, T: int) -> bool:
        k = scr.key
        wmd, wi, wis, ri, rfm, rpm = sb.meta
        _call(api.get_mla_metadata_v1, seqlens_qo_indptr=scr.qo_indptr[: T + 1],
              seqlens_kv_indptr=sb.kv_indptr[: T + 1], kv_last_page_lens=scr.last_page[:T],
              num_heads_per_head_k=k.heads, num_heads_k=1, is_causal=True, work_metadata_ptrs=wmd,
              work_info_set=wis, work_indptr=wi, reduce_indptr=ri, reduce_final_map=rfm, reduce_partial_map=rpm,
              page_size=1, kv_granularity=16, max_seqlen_qo=1, uni_seqlen_qo=1, fast_mode=True, topk=sb.width,
              max_split_per_batch=k.max_splits, dtype_q=k.q_dtype, dtype_kv=k.kv_dtype)
        return True

    def _scopes(self, plan: StepPlan, layer: LayerInputs) -> list[tuple[str, torch.Tensor, torch.Tensor, Any, Fp8Dialect]]:
        """(scope name, rows, lens, cache, dialect) of the layer's scopes, SWA first."""
        scopes = [("swa", plan.swa_rows, plan.swa_lens, layer.swa_cache, layer.swa_dialect)]
        if layer.kind.has_comp_scope:
            rows, lens = plan.comp_scope(layer.kind, layer.topk)
            scopes.append((layer.kind.name.lower(), rows, lens, layer.comp_cache, layer.comp_dialect))
        return scopes

    # ---- path 1: sparse_mla_fwd ---------------------------------------------------------------
    def _forward_sparse(self, api: AiterAPI, plan: StepPlan, layer: LayerInputs, out: torch.Tensor) -> None:
        T, H = plan.num_tokens, layer.q.shape[1]
        scr = self._get_scratch(api, plan, dict(heads=H, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                                                layout="ragged", gather=False, persistent=False, staged=False))
        built = []
        for name, rows, lens, cache, _ in self._scopes(plan, layer):
            sb = self._scope(plan, scr, name, rows, lens, None, name == "c4a", api)
            scale = None
            if layer.fmt is KVFormat.FP8_TENSOR:
                scale = sb.kv_scale
                scale.fill_(layer.kv_scale)
            built.append((sb, cache, scale))
        (swa, swa_cache, swa_scale), extra = built[0], (built[1] if len(built) > 1 else None)
        kwargs = dict(kv_scale=swa_scale, kv_lora_rank=HEAD_DIM, qk_rope_head_dim=0, has_invalid=False, out=out,
                      attn_sink=layer.sink)
        if extra is not None:
            sb, cache, scale = extra
            kwargs.update(extra_kv=cache, extra_indptr=sb.kv_indptr[: T + 1],
                          extra_indices=sb.kv_indices[: T * sb.width], extra_kv_scale=scale)
        api.sparse_mla_fwd(layer.q, swa_cache, swa.kv_indptr[: T + 1], swa.kv_indices[: T * swa.width],
                           layer.softmax_scale, **kwargs)
        empty = swa.counts[:T] == 0
        if extra is not None:
            empty &= extra[0].counts[:T] == 0
        out.masked_fill_(empty[:, None, None], 0.0)  # AITER's output for a row with no key is unspecified

    # ---- path 2: mla_decode_fwd, two scopes + LSE merge + sink ----------------------------------
    def _forward_decode(self, api: AiterAPI, plan: StepPlan, layer: LayerInputs, out: torch.Tensor) -> None:
        T, H = plan.num_tokens, layer.q.shape[1]
        fp8 = NATIVE_DIALECT[api.arch].torch_dtype
        persistent = (layer.fmt is not KVFormat.BF16 and T < self.persistent_max_batch
                      and _persistent_missing(api) is None)
        in_place = layer.fmt is not KVFormat.MODEL1_FP8
        kv_dtype = (fp8 if persistent or layer.fmt is KVFormat.FP8_TENSOR else torch.bfloat16)
        heads = _decode_heads(persistent, H)
        scr = self._get_scratch(api, plan, dict(heads=heads, q_dtype=kv_dtype, kv_dtype=kv_dtype,
                                                layout="fixed" if persistent else "ragged", gather=not in_place,
                                                persistent=persistent, staged=True))
        q = scr.q[:T]
        if kv_dtype == torch.bfloat16:
            q[:, :H].copy_(layer.q)
        else:
            quantize_pow2_(q[:, :H], layer.q, scr.q_scale)
        # split mode: >= 2 splits (the LSE comes from the stage-2 reduce), more for small batches
        splits = self.max_splits if persistent else min(self.max_splits, max(2, math.ceil(512 / T)))
        if not persistent:
            torch.arange(0, (T + 1) * splits, splits, out=scr.splits_indptr[: T + 1])
        results = []
        for i, (name, rows, lens, cache, dialect) in enumerate(self._scopes(plan, layer)):
            cache_name = "swa_cache" if name == "swa" else "comp_cache"
            geo = check_cache(cache, layer.fmt, cache_name, dialect)
            remap_key = (geo.block_size, geo.block_stride // HEAD_DIM) if in_place else None
            if in_place and (geo.block_stride % HEAD_DIM or geo.num_blocks * geo.block_stride // HEAD_DIM >= 2**31):
                raise ValueError(f"{cache_name}: got block stride {geo.block_stride} elements x {geo.num_blocks} "
                                 f"blocks; allowed: a multiple of {HEAD_DIM} with < 2**31 rows in all (AITER reads "
                                 "fixed-stride rows with int32 indices)")
            sb = self._scope(plan, scr, name, rows, lens, remap_key, name == "c4a", api)
            kv, kv_scale = self._kv_operand(scr, sb, cache, layer, geo, dialect, T, in_place)
            o = scr.out[i][:T]
            meta = dict(zip(("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
                             "reduce_partial_map"), sb.meta)) if persistent else {}
            _, lse = _call(api.mla_decode_fwd, q=q, kv_buffer=kv, o=o, qo_indptr=scr.qo_indptr[: T + 1],
                           kv_indptr=sb.kv_indptr[: T + 1], kv_indices=sb.kv_indices[: T * sb.width],
                           kv_last_page_lens=scr.last_page[:T], max_seqlen_q=1, page_size=1, nhead_kv=1,
                           sm_scale=layer.softmax_scale,
                           num_kv_splits=splits,
                           num_kv_splits_indptr=None if persistent else scr.splits_indptr[: T + 1],
                           q_scale=scr.q_scale if kv_dtype != torch.bfloat16 else None,
                           kv_scale=kv_scale, return_lse=True, **meta)
            lse_buf = scr.lse[i][:T]
            lse_buf.copy_(lse_base2_to_natural(lse) if DECODE_LSE_IS_BASE2 else lse)
            results.append((o, lse_buf))
        merged, lse = results[0] if len(results) == 1 else merge_lse(*results[0], *results[1])
        sink = None
        if layer.sink is not None:
            sink = scr.sink
            sink[:H].copy_(layer.sink)
        out.copy_(apply_sink(merged, lse, sink)[:, :H])

    @staticmethod
    def _kv_operand(scr: AiterScratch, sb: ScopeBuffers, cache: torch.Tensor, layer: LayerInputs, geo, dialect,
                    T: int, in_place: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(kv_buffer [rows, 1, 1, 512], kv_scale [1] or None) for one scope call."""
        fp8 = scr.key.kv_dtype != torch.bfloat16
        if in_place:
            num_rows = ((geo.num_blocks - 1) * geo.block_stride + geo.block_size * HEAD_DIM) // HEAD_DIM
            rows = cache.as_strided((num_rows, 1, 1, HEAD_DIM), (HEAD_DIM, HEAD_DIM, HEAD_DIM, 1),
                                    cache.storage_offset())
            if fp8:
                sb.kv_scale.fill_(layer.kv_scale)
            return rows, (sb.kv_scale if fp8 else None)
        n = T * sb.width
        values = gather_rows(cache, layer.fmt, geo, sb.slots[:n], 1.0, dialect)  # only this step's rows
        dst = scr.gather[:n]
        if fp8:
            quantize_pow2_(dst, values, sb.kv_scale)
        else:
            dst.copy_(values)
        return dst.view(n, 1, 1, HEAD_DIM), (sb.kv_scale if fp8 else None)


def _remap_rows(block_size: int, span: int, rows: torch.Tensor) -> torch.Tensor:
    """Global slots -> fixed-stride row numbers of a plain cache whose blocks are ``span`` rows
    apart (``span > block_size`` when other layers' pages are interleaved); -1 stays -1."""
    if span == block_size:
        return rows
    r = rows.long()
    mapped = (r // block_size) * span + r % block_size
    return torch.where(r >= 0, mapped, torch.full_like(mapped, -1)).to(torch.int32)
