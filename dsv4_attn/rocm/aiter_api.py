"""The one seam to AITER: the real library on a ROCm machine, or the AITER EMULATOR
(:mod:`dsv4_attn.emulation`) when it is switched on; and calling its functions by keyword across
revisions."""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import emulation, envs
from ..common.platform import Platform, probe

AITER_SOURCE = "git+https://github.com/ROCm/aiter.git@v0.1.20.post1"  # pyproject's `rocm` extra
INSTALL_HINT = ("Install AITER v0.1.20.post1 from a clone of dsv4-attn: AITER_USE_SYSTEM_TRITON=1 pip install "
                "--no-build-isolation -e '.[rocm]' (needs ROCm with hipcc and a ROCm torch; PyPI's amd-aiter 0.1.7 "
                "is too old: docs/rocm.md \"Install AITER\")")
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

    def function(self, name: str) -> Callable[..., Any]:
        """The AITER function ``name`` (a field above); raises where this AITER lacks it (the
        backend refuses a path whose function is missing before it could call it)."""
        fn = getattr(self, name)
        if fn is None:
            raise RuntimeError(f"aiter: AITER {self.version} on {self.arch} has no {name}; the path calling it "
                               "should have been refused (aiter_features)")
        return fn


_env_emulator: tuple[str, Any] | None = None


def _from_object(obj: Any) -> AiterAPI:
    return AiterAPI(version=obj.version, arch=obj.arch, emulated=True, mla_decode_fwd=obj.mla_decode_fwd,
                    get_mla_metadata_info_v1=obj.get_mla_metadata_info_v1, get_mla_metadata_v1=obj.get_mla_metadata_v1,
                    mla_decode_fwd_v4_nm=obj.mla_decode_fwd_v4_nm, sparse_mla_fwd=obj.sparse_mla_fwd,
                    asm_objects=frozenset(obj.asm_objects))


def load_aiter(platform: Platform | None = None) -> AiterAPI:
    """The AITER API: the emulator when switched on (``emulation.enable()`` or
    ``DSV4_ATTN_AITER_EMULATOR``), else the real library on a ROCm machine, else an AiterAPI whose
    ``error`` says why. Never imports ``aiter`` off ROCm (its import runs rocminfo and raises)."""
    global _env_emulator
    emulator = emulation.active()
    if emulator is not None:
        return _from_object(emulator)
    env = envs.AITER_EMULATOR.get()  # validated: off / on words, arch or arch:flavor
    if env not in ("0", "off", "false"):
        if _env_emulator is None or _env_emulator[0] != env:
            _env_emulator = (env, emulation.parse_env(env))
        return _from_object(_env_emulator[1])
    plat = platform or probe()
    if plat.vendor != "rocm":
        return AiterAPI(None, None, False, error=(
            f"needs a ROCm GPU (gfx942/gfx950); this is {plat.vendor}/{plat.arch}. To exercise the backend "
            f"here, switch on the AITER emulator: dsv4_attn.emulation.enable() or {emulation.ENV_EMULATOR}=1"))
    return load_real(plat.arch)


@functools.lru_cache(maxsize=4)
def load_real(arch: str) -> AiterAPI:
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
                    getattr(mla, "mla_decode_fwd_v4_nm", None), sparse_mla_fwd, find_asm_objects(aiter.__file__, arch))


def find_asm_objects(aiter_init: str, arch: str) -> frozenset:
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
def parameters(fn: Callable) -> frozenset:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def call_by_keyword(fn: Callable, **kwargs):
    """Call ``fn`` by keyword, mapping names across AITER revisions (positional orders differ)."""
    params = parameters(fn)
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

