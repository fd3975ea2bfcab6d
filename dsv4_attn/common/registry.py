"""The backend registry, selection with reasons, and forcing a backend.

The registry maps names to import paths, so vendor modules are imported only when that backend
is asked about; an import failure is a reason, not a crash. Selection walks a per-platform
priority list (a measured order first where the arch's choices table covers the launch); when
nothing fits it raises one error listing every backend with all its reasons. Tools (the probe,
the parity matrix, the bench) reach backends only through this module.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import functools
import importlib
from collections.abc import Callable

from .. import envs
from . import choices
from .backend import OCP_CACHES, Backend, BackendUnavailableError, Dialects, Phase
from .layout import KVFormat
from .platform import Platform
from .spec import LayerKind, ModelSpec

# name -> "module:Class" (or a Backend instance registered at run time, e.g. by tests)
_REGISTRY: dict[str, str | Backend] = {
    "torch": "dsv4_attn.portable.torch_backend:TorchBackend",
    "triton": "dsv4_attn.portable.triton_backend:TritonBackend",
    "flashmla": "dsv4_attn.cuda.flashmla:FlashMLABackend",
    "flashinfer-trtllm": "dsv4_attn.cuda.flashinfer:FlashInferTRTLLMBackend",
    "aiter": "dsv4_attn.rocm.aiter:AiterBackend",
}
PACKAGED = tuple(_REGISTRY)  # the backends this package ships (the README's support matrix)

# Auto-selection order per vendor, refined per "vendor/arch/phase" where measurements say so
# (priority_for). The torch backend is the CPU default; on GPUs it is slow (~30x FlashMLA) and
# is never picked silently: force it with backend="torch".
# Where the measured choices table of the arch covers a launch (common/choices.py,
# dsv4_attn/data/choices/<arch>-<device>.json), its order comes first; these lists order everything else.
# sm90 prefill: triton reads the fp8 cache in place (no host sync, no bf16 workspace) and took
# 0.38-0.85x the time of the flashmla backend (bf16 gather + FlashMLA prefill) on the 12
# `dsv4-attn bench` prefill configs (H100, 2026-11-23, notes/perf-wave2.md).
PRIORITY: dict[str, list[str]] = {
    "cuda": ["flashmla", "flashinfer-trtllm", "triton"],
    "cuda/sm90/prefill": ["triton", "flashmla", "flashinfer-trtllm"],
    "rocm": ["aiter", "triton"],
    "cpu": ["torch"],
}


def priority_for(platform: Platform, phase: Phase) -> list[str]:
    """The auto-selection order for ``platform`` and ``phase``: the most specific PRIORITY key
    of "vendor/arch/phase", "vendor/phase", "vendor"."""
    phase = Phase(phase)
    for key in (f"{platform.vendor}/{platform.arch}/{phase.value}", f"{platform.vendor}/{phase.value}",
                platform.vendor):
        if key in PRIORITY:
            return PRIORITY[key]
    return []


_instances: dict[str, Backend] = {}
_import_errors: dict[str, str] = {}


def register_backend(name: str, backend: str | Backend, priority: dict[str, int] | None = None) -> None:
    """Register ``backend`` (an instance or a "module:Class" path) under ``name``.

    ``priority`` optionally inserts it into vendor priority lists, e.g. ``{"cpu": 0}`` (into the
    vendor's list and every refinement of it, "cpu/...").
    """
    _REGISTRY[name] = backend
    _instances.pop(name, None)
    _import_errors.pop(name, None)
    for vendor, index in (priority or {}).items():
        PRIORITY.setdefault(vendor, [])
        for key, order in PRIORITY.items():
            if key == vendor or key.startswith(vendor + "/"):
                if name in order:
                    order.remove(name)
                order.insert(index, name)


def unregister_backend(name: str) -> None:
    _REGISTRY.pop(name, None)
    _instances.pop(name, None)
    _import_errors.pop(name, None)
    for order in PRIORITY.values():
        if name in order:
            order.remove(name)


def backend_names() -> list[str]:
    return list(_REGISTRY)


def module_of(name: str) -> str:
    """The module that defines backend ``name`` (for messages)."""
    target = _REGISTRY[name]
    return target.partition(":")[0] if isinstance(target, str) else type(target).__module__


def import_error(name: str) -> str:
    """Why backend ``name``'s module could not be imported ("" when it was, or was not tried)."""
    return _import_errors.get(name, "")


def get_backend(name: str) -> Backend | None:
    """The process-wide instance of a backend for capability questions (selection, explain,
    the support matrix), or None when its module cannot be imported. Layers run on each
    SparseMLA's own instance (``new_backend``), so per-model buffers are never shared."""
    if name not in _REGISTRY:
        raise ValueError(f"backend: got {name!r}; allowed: {sorted(_REGISTRY)} or 'auto'")
    if name in _instances:
        return _instances[name]
    if name in _import_errors:
        return None
    target = _REGISTRY[name]
    if isinstance(target, Backend):
        _instances[name] = target
        return target
    module_name, _, cls_name = target.partition(":")
    try:
        backend = getattr(importlib.import_module(module_name), cls_name)()
    except Exception as exc:  # a broken or missing module is a refusal reason
        _import_errors[name] = f"cannot import {target}: {type(exc).__name__}: {exc}"
        return None
    _instances[name] = backend
    return backend


def new_backend(name: str) -> Backend:
    """A fresh instance of backend ``name`` for one SparseMLA (its buffers are that model's); a
    backend registered as an instance is that instance. Raises when the module cannot be imported."""
    shared = get_backend(name)
    if shared is None:
        raise BackendUnavailableError(_import_errors[name])
    return shared if isinstance(_REGISTRY[name], Backend) else type(shared)()


def reasons_for(name: str, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind,
                phase: Phase, dialects: Dialects = OCP_CACHES) -> list[str]:
    """Every reason backend ``name`` cannot serve the combination ([] = supported): an import
    failure, else the backend's ``unsupported_reasons`` (declared data + extras)."""
    backend = get_backend(name)
    if backend is None:
        return [_import_errors[name]]
    try:
        return backend.unsupported_reasons(platform, spec, fmt, kind, phase, dialects)
    except Exception as exc:
        return [f"unsupported_reasons raised {type(exc).__name__}: {exc}"]


# ---- forcing a backend: argument > `with backend(...)` > DSV4_ATTN_BACKEND > auto --------------
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("dsv4_attn_backend", default=None)
ENV_BACKEND = envs.BACKEND.name


@contextlib.contextmanager
def backend(name: str):
    """``with dsv4_attn.backend("triton"): ...`` forces a backend for SparseMLA objects created
    with backend="auto"; a forced backend that cannot run raises (never a silent fallback)."""
    if name != "auto" and name not in _REGISTRY:
        raise ValueError(f"backend: got {name!r}; allowed: {sorted(_REGISTRY)} or 'auto'")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def context_backend() -> str | None:
    """The backend a ``dsv4_attn.backend()`` context forces here, or None."""
    return _forced.get()


def requested_backend(explicit: str = "auto") -> tuple[str, str]:
    """(name or 'auto', where it came from)."""
    if explicit != "auto":
        return explicit, "argument"
    ctx = _forced.get()
    if ctx is not None and ctx != "auto":
        return ctx, "dsv4_attn.backend() context"
    env = env_backend()
    if env != "auto":
        return env, f"{ENV_BACKEND} environment variable"
    return "auto", "auto"


def env_backend() -> str:
    """``DSV4_ATTN_BACKEND`` (envs.BACKEND) checked against the registry: 'auto' or a registered
    name; ValueError naming the variable otherwise."""
    name = envs.BACKEND.get()
    if name != "auto" and name not in _REGISTRY:
        raise ValueError(f"{ENV_BACKEND}: got {name!r}; allowed: 'auto' or one of {backend_names()}")
    return name


def auto_order(platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
               num_tokens: int | None = None) -> tuple[list[str], str]:
    """(candidates in order, why that order): the measured order for this launch when the
    platform's choices table covers it (common/choices.py), then the priority list."""
    order = priority_for(platform, phase)
    if num_tokens is None or num_tokens <= 0:
        return order, f"auto ({platform.vendor} {Phase(phase).value} priority list)"
    hit = choices.measured(platform.arch, Phase(phase).value, kind.name, spec.num_heads, fmt.value, num_tokens,
                           platform.device_name)
    if hit is None:
        return order, f"auto ({platform.vendor} {Phase(phase).value} priority list; no measurement covers it)"
    entry, where = hit
    layers = layers_per_step(spec, kind)
    first = [name for name in entry.ranked(layers) if name in _REGISTRY]
    costs = entry.costs(layers)
    why = f"{where}: {layers} {kind.name} layer(s) per step: {costs}; " if costs else f"{where}: "
    return first + [name for name in order if name not in first], f"measured ({why}{entry.evidence})"


def launch_bucket(platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
                  num_tokens: int) -> tuple[str | None, int]:
    """(the choices file, which of its launch-size ranges for this layer holds ``num_tokens``): every
    launch size of one bucket gets the same :func:`auto_order`, so a decision cached per bucket is
    the decision, without the ~35 us of looking the order up at each layer call."""
    where = envs.CHOICES.raw
    bounds = _range_bounds(platform.arch, platform.device_name, where, Phase(phase).value, kind.name,
                           choices.heads_bucket(spec.num_heads), fmt.value)
    return where, bisect.bisect_right(bounds, num_tokens)


@functools.lru_cache(maxsize=256)
def _range_bounds(arch: str, device: str, where: str | None, phase: str, kind: str, heads: int,
                  fmt: str) -> tuple[int, ...]:
    """The sorted range bounds of the table's entries for one layer (``where``, the
    DSV4_ATTN_CHOICES file that table_for reads, keys the cache)."""
    entries, _, _ = choices.table_for(arch, device)
    return tuple(sorted({bound for e in entries if (e.phase, e.kind, e.heads, e.fmt) == (phase, kind, heads, fmt)
                         for bound in e.tokens}))


def layers_per_step(spec: ModelSpec, kind: LayerKind) -> int:
    """How many layers of ``kind`` one step of the model runs (ModelSpec.layers; at least 1): what a
    backend's per-step work is shared by (common/choices.py)."""
    return max(1, sum(layer.kind == kind for layer in spec.layers))


def launch_reasons(name: str, phase: Phase, num_tokens: int | None,
                   instances: Callable[[str], Backend] | None) -> list[str]:
    """Why the instance of ``name`` that would run it (``instances(name)``) cannot take a launch of
    ``num_tokens`` tokens (its ``launch_limit``); [] without a launch size or instances."""
    if not num_tokens or instances is None:
        return []
    limit = instances(name).launch_limit(Phase(phase))
    return [] if limit is None else limit.reasons(num_tokens)


def select(platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
           requested: str = "auto", source: str = "auto", dialects: Dialects = OCP_CACHES,
           num_tokens: int | None = None, instances: Callable[[str], Backend] | None = None) -> str:
    """Name of the backend to run ``kind`` / ``phase``; raises BackendUnavailableError with every
    backend's reasons when the requested one (or, for auto, every candidate) refuses. With
    ``num_tokens`` (the phase's tokens in this launch) auto tries a measured order first, and with
    ``instances`` (name -> the instance that would run it) each one's ``launch_limit`` applies: a
    forced backend serves the launches within its limit and the phases it implements, auto the rest."""
    if requested != "auto":
        if requested not in _REGISTRY:
            raise ValueError(f"backend: got {requested!r} (from {source}); allowed: {sorted(_REGISTRY)} or 'auto'")
        forced = get_backend(requested)
        if forced is not None and (phase not in forced.phases
                                   or launch_reasons(requested, phase, num_tokens, instances)):
            return select(platform, spec, fmt, kind, phase, dialects=dialects, num_tokens=num_tokens,
                          instances=instances)
        reasons = reasons_for(requested, platform, spec, fmt, kind, phase, dialects)
        if reasons:
            raise BackendUnavailableError(
                f"backend {requested!r} (forced by {source}) cannot run {kind.name} {phase.value} "
                f"on {platform.vendor}/{platform.arch} with {fmt.value}:\n"
                + "\n".join(f"  - {r}" for r in reasons)
            )
        return requested
    candidates, _ = auto_order(platform, spec, fmt, kind, phase, num_tokens)
    report = []
    for name in candidates:
        reasons = (reasons_for(name, platform, spec, fmt, kind, phase, dialects)
                   or launch_reasons(name, phase, num_tokens, instances))
        if not reasons:
            return name
        report.append((name, reasons))
    others = [n for n in _REGISTRY if n not in candidates]
    lines = [f"No backend found for {kind.name} {phase.value} on {platform.vendor}/{platform.arch} "
             f"({platform.device_name}) with {fmt.value}, {spec.num_heads} heads:"]
    for name, reasons in report:
        lines.append(f"`{name}` is not supported because:")
        lines.extend(f"    {r}" for r in reasons)
    if others:
        lines.append(f"Not in the auto priority list for {platform.vendor} (force with backend=...): "
                     + ", ".join(others))
    raise BackendUnavailableError("\n".join(lines))


def support_matrix(names: tuple[str, ...] = PACKAGED) -> str:
    """Markdown support matrix rendered from the declared capabilities of ``names`` (default: the
    packaged backends, not the variants tests and the bench register at run time)."""
    fmt_names = {KVFormat.MODEL1_FP8: "MODEL1 fp8", KVFormat.BF16: "bf16", KVFormat.FP8_TENSOR: "fp8 per-tensor",
                 KVFormat.MXFP8: "V4.1 MXFP8", KVFormat.NVFP4: "V4.1 MXFP8 + NVFP4"}
    lines = ["| backend | platforms | KV formats | layer kinds | heads | phases | validated | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for name in names:
        backend = get_backend(name)
        caps = getattr(backend, "capabilities", None)
        if backend is None or caps is None:
            why = _import_errors.get(name, "declares no capabilities")
            lines.append(f"| `{name}` | ? | ? | ? | ? | ? | ? | {why} |")
            continue
        formats = ", ".join(fmt_names.get(f, f.value) for f in caps.formats)
        kinds = "all (V4 and V4.1)" if caps.kinds is None else ", ".join(k.name for k in caps.kinds)
        if caps.windows is not None:
            kinds += f" (window {'/'.join(map(str, caps.windows))} only)"
        heads = f"{caps.heads[0]}-{caps.heads[1]}" + (f" ({caps.heads_note})" if caps.heads_note else "")
        phases = ", ".join(p.value for p in caps.phases)
        lines.append(f"| `{name}` | {caps.platform_text} | {formats} | {kinds} | {heads} | {phases} | "
                     f"{caps.validated} | {caps.notes} |")
    return "\n".join(lines)
