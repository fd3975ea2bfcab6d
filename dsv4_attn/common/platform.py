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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .. import envs
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
class DeviceFacts:
    """What a vendor's probe reads off device 0."""

    arch: str  # "sm90", "gfx942", ...
    device_name: str
    fp8_dialect: Fp8Dialect = Fp8Dialect.OCP
    num_units: int | None = None  # SMs / CUs


@dataclass(frozen=True)
class Vendor:
    """A kind of device the package can run on: the ONE place a new vendor plugs in
    (``register_vendor``); backends then name it in their declared platforms and the
    auto-selection order takes a ``PRIORITY`` entry under its name.

    name          "cuda", "rocm", "cpu" (and e.g. "xpu"): Platform.vendor, PRIORITY keys
    label         for humans: "NVIDIA", "AMD", "CPU"
    torch_device  torch device type of its tensors ("cuda" for ROCm builds of torch too)
    detect        facts of device 0 when this vendor's device is present, else None; may raise
                  (a broken driver), which the probe turns into a CPU platform with a note
    is_gpu        whether kernels run on an accelerator
    """

    name: str
    label: str
    torch_device: str
    detect: Callable[[], DeviceFacts | None]
    is_gpu: bool = True


def _detect_rocm() -> DeviceFacts | None:
    if not (torch.cuda.is_available() and getattr(torch.version, "hip", None)):
        return None
    props = torch.cuda.get_device_properties(0)
    arch = getattr(props, "gcnArchName", "gfx?").split(":")[0]
    dialect = Fp8Dialect.FNUZ if arch == "gfx942" else Fp8Dialect.OCP  # gfx942 computes in FNUZ e4m3
    return DeviceFacts(arch, props.name, dialect, props.multi_processor_count)


def _detect_cuda() -> DeviceFacts | None:
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
        return None
    props = torch.cuda.get_device_properties(0)
    return DeviceFacts(f"sm{props.major}{props.minor}", props.name, Fp8Dialect.OCP, props.multi_processor_count)


CPU = Vendor("cpu", "CPU", "cpu", lambda: DeviceFacts("cpu", "cpu"), is_gpu=False)
# Probed in this order; the CPU always answers and stays last.
VENDORS: dict[str, Vendor] = {v.name: v for v in (Vendor("rocm", "AMD", "cuda", _detect_rocm),
                                                   Vendor("cuda", "NVIDIA", "cuda", _detect_cuda), CPU)}


def register_vendor(vendor: Vendor) -> None:
    """Add (or replace) a vendor; it is probed before the CPU. Call ``probe(refresh=True)`` after."""
    if not isinstance(vendor, Vendor) or vendor.name == CPU.name:
        raise ValueError(f"vendor: got {vendor!r}; allowed: a Vendor other than the built-in cpu")
    others = {name: v for name, v in VENDORS.items() if name not in (vendor.name, CPU.name)}
    VENDORS.clear()
    VENDORS.update(others)
    VENDORS[vendor.name] = vendor
    VENDORS[CPU.name] = CPU


@dataclass(frozen=True)
class Platform:
    """vendor: a ``VENDORS`` name ('cuda' | 'rocm' | 'cpu' | a registered one); arch: 'sm90',
    'sm100', 'sm120', 'gfx942', 'gfx950', 'cpu', ..."""

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
        vendor = VENDORS.get(self.vendor)
        return vendor.is_gpu if vendor is not None else self.vendor != "cpu"

    @property
    def label(self) -> str:
        """"NVIDIA sm90", "AMD gfx942", "CPU"."""
        vendor = VENDORS.get(self.vendor)
        name = vendor.label if vendor is not None else self.vendor
        return name if self.arch == self.vendor else f"{name} {self.arch}"

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


def dist_version(*dists: str) -> str | None:
    """The installed version of the first of ``dists`` (distribution names) that is installed."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _library_info(key: str, module: str, dist: str) -> LibraryInfo:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError, AttributeError) as exc:  # parent package import failed
        return LibraryInfo(key, False, note=f"{type(exc).__name__}: {exc}")
    if spec is None:
        return LibraryInfo(key, False)
    version = dist_version(dist)
    location = spec.origin or next(iter(spec.submodule_search_locations or []), None)
    return LibraryInfo(key, True, version, location)


def _device_facts() -> tuple[str, DeviceFacts]:
    """(vendor name, facts of device 0): the first registered vendor whose device is present."""
    for vendor in VENDORS.values():
        try:
            facts = vendor.detect()
        except Exception as exc:  # a broken driver must not break the probe
            return CPU.name, DeviceFacts("cpu", f"cpu ({vendor.label} probe failed: {type(exc).__name__}: {exc})")
        if facts is not None:
            return vendor.name, facts
    return CPU.name, DeviceFacts("cpu", "cpu")


@functools.lru_cache(maxsize=1)
def _probe_cached() -> Platform:
    vendor, facts = _device_facts()
    libs = {key: _library_info(key, mod, dist) for key, (mod, dist) in _LIBRARIES.items()}
    env_lib = envs.FLASHMLA_LIB.get()
    if env_lib:
        libs["flashmla_lib"] = LibraryInfo("flashmla_lib", os.path.isfile(env_lib), location=env_lib,
                                           note=envs.FLASHMLA_LIB.name)
    triton = libs["triton"]
    return Platform(
        vendor=vendor,
        arch=facts.arch,
        device_name=facts.device_name,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda if vendor == "cuda" else None,
        hip_version=getattr(torch.version, "hip", None) if vendor == "rocm" else None,
        triton_version=triton.version if triton.found else None,
        fp8_dialect=facts.fp8_dialect,
        num_sms=facts.num_units,
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
    if device.type == CPU.torch_device and plat.vendor != CPU.name:
        return Platform("cpu", "cpu", "cpu", plat.torch_version, triton_version=plat.triton_version,
                        libraries=plat.libraries)
    return plat
