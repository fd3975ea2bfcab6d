"""Platform probe: what this machine is and which vendor libraries it can offer.

``probe()`` never raises and never imports a vendor library (importing AITER runs
``rocminfo`` and raises off ROCm; importing vLLM is slow): libraries are located with
``importlib.util.find_spec`` and versioned with ``importlib.metadata``. Whether a library
actually LOADS and has the right op signatures is the backend's business (its
``unsupported_reasons``), reported by ``dsv4-attn probe`` next to this.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from dataclasses import asdict, dataclass, field

import torch

from .layout import Fp8Dialect


def triton_interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` selects Triton's CPU interpreter (read from the environment;
    imports nothing)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# (import name, distribution name) of the vendor libraries we can use.
_LIBRARIES = {
    "flash_mla": ("flash_mla", "flash-mla"),
    "vllm_flashmla": ("vllm._flashmla_C", "vllm"),
    "sgl_kernel": ("sgl_kernel", "sglang-kernel"),
    "flashinfer": ("flashinfer", "flashinfer-python"),
    "aiter": ("aiter", "amd-aiter"),
    "vllm": ("vllm", "vllm"),
    "triton": ("triton", "triton"),
}


@dataclass(frozen=True)
class LibraryInfo:
    name: str
    found: bool
    version: str | None = None
    location: str | None = None
    note: str | None = None


@dataclass(frozen=True)
class Platform:
    """vendor: 'cuda' | 'rocm' | 'cpu'; arch: 'sm90', 'sm100', 'sm120', 'gfx942', 'gfx950', 'cpu', ..."""

    vendor: str
    arch: str
    device_name: str
    torch_version: str
    cuda_version: str | None = None
    hip_version: str | None = None
    triton_version: str | None = None
    fp8_dialect: Fp8Dialect = Fp8Dialect.OCP
    num_sms: int | None = None
    libraries: dict[str, LibraryInfo] = field(default_factory=dict)

    @property
    def is_gpu(self) -> bool:
        return self.vendor in ("cuda", "rocm")

    @property
    def capability(self) -> tuple[int, int] | None:
        """(major, minor) for NVIDIA archs like 'sm90' / 'sm100', else None."""
        if self.vendor != "cuda" or not self.arch.startswith("sm"):
            return None
        digits = self.arch[2:].rstrip("a").rstrip("f")
        return (int(digits[:-1]), int(digits[-1])) if digits.isdigit() and len(digits) >= 2 else None

    def library(self, name: str) -> LibraryInfo:
        return self.libraries.get(name, LibraryInfo(name, False, note="not probed"))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["fp8_dialect"] = self.fp8_dialect.value
        return d


def _library_info(key: str, module: str, dist: str) -> LibraryInfo:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError, AttributeError) as exc:  # parent package import failed
        return LibraryInfo(key, False, note=f"{type(exc).__name__}: {exc}")
    if spec is None:
        return LibraryInfo(key, False)
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = None
    location = spec.origin or (list(spec.submodule_search_locations or []) or [None])[0]
    return LibraryInfo(key, True, version, location)


def _device_facts() -> tuple[str, str, str, Fp8Dialect, int | None]:
    """(vendor, arch, device name, fp8 dialect, SM/CU count) of device 0."""
    try:
        if not torch.cuda.is_available():
            return "cpu", "cpu", "cpu", Fp8Dialect.OCP, None
        props = torch.cuda.get_device_properties(0)
        if getattr(torch.version, "hip", None):
            arch = getattr(props, "gcnArchName", "gfx?").split(":")[0]
            dialect = Fp8Dialect.FNUZ if arch == "gfx942" else Fp8Dialect.OCP
            return "rocm", arch, props.name, dialect, props.multi_processor_count
        return ("cuda", f"sm{props.major}{props.minor}", props.name, Fp8Dialect.OCP,
                props.multi_processor_count)
    except Exception as exc:  # a broken driver must not break the probe
        return "cpu", "cpu", f"cpu (GPU probe failed: {type(exc).__name__}: {exc})", Fp8Dialect.OCP, None


@functools.lru_cache(maxsize=1)
def _probe_cached() -> Platform:
    vendor, arch, name, dialect, sms = _device_facts()
    libs = {key: _library_info(key, mod, dist) for key, (mod, dist) in _LIBRARIES.items()}
    env_lib = os.environ.get("DSV4_ATTN_FLASHMLA_LIB")
    if env_lib:
        libs["flashmla_lib"] = LibraryInfo("flashmla_lib", os.path.isfile(env_lib), location=env_lib,
                                           note="DSV4_ATTN_FLASHMLA_LIB")
    triton = libs["triton"]
    return Platform(
        vendor=vendor,
        arch=arch,
        device_name=name,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda if vendor == "cuda" else None,
        hip_version=getattr(torch.version, "hip", None) if vendor == "rocm" else None,
        triton_version=triton.version if triton.found else None,
        fp8_dialect=dialect,
        num_sms=sms,
        libraries=libs,
    )


def probe(refresh: bool = False) -> Platform:
    """Describe this machine (cached; ``refresh=True`` probes again). Never raises."""
    if refresh:
        _probe_cached.cache_clear()
    return _probe_cached()


def platform_for_device(device: torch.device) -> Platform:
    """The probe, or a CPU platform when the tensors live on the CPU of a GPU machine."""
    plat = probe()
    if device.type == "cpu" and plat.vendor != "cpu":
        return Platform("cpu", "cpu", "cpu", plat.torch_version, triton_version=plat.triton_version,
                        libraries=plat.libraries)
    return plat
