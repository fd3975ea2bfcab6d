"""Backend protocol, registry and selection with reasons (xformers ``dispatch.py`` style).

A backend is a thin adapter: it declares what it cannot serve (``unsupported_reasons``; an
empty list means supported), optionally prepares per-step metadata (cached in the plan per
layer kind), and runs ``forward(plan, layer, out)``. The registry maps names to import paths,
so vendor modules are imported only when that backend is asked about; an import failure is a
reason, not a crash. Selection walks a per-platform priority list; when nothing fits it
raises one error listing every backend with all its reasons.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import enum
import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from .. import envs
from . import choices
from .layout import CacheGeometry, Fp8Dialect, KVFormat
from .platform import Platform
from .spec import MAX_HEADS, LayerKind, ModelSpec

if TYPE_CHECKING:
    from .plan import StepPlan


class Phase(str, enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


@dataclass
class LayerInputs:
    """One layer's inputs to ``Backend.forward``.

    kind          layer kind (SWA, C4A, C128A, C1A, C2A: common.spec.LayerKind)
    q             bf16 [T, H, 512], RMS-normed and roped; H = heads as the caller holds them
                  (padded heads allowed: their sink must be -inf and their output is ignored)
    swa_cache     this layer's SWA cache (format ``fmt``)
    comp_cache    this layer's compressed cache (ratio = kind.ratio) or None for window-only layers
    topk          int32 [T, K] LOCAL compressed positions from the indexer (top-k kinds only)
    sink          float32 [H] sink logits (natural-log units), or None for no sink
    fmt           cache format of both caches
    softmax_scale scale applied to q·k
    kv_scale      per-tensor scale of FP8_TENSOR caches (1.0 otherwise)
    swa_dialect / comp_dialect   fp8 dialect of each cache (FNUZ SWA on gfx942)
    swa_geo / comp_geo           geometry of each cache (comp_geo None for window-only layers),
                  set by ``SparseMLA`` once it has checked the caches: backends read it and
                  never re-check a cache (build one with ``SparseMLA.layer_inputs``)
    """

    kind: LayerKind
    q: torch.Tensor
    swa_cache: torch.Tensor
    comp_cache: torch.Tensor | None
    topk: torch.Tensor | None
    sink: torch.Tensor | None
    fmt: KVFormat
    softmax_scale: float
    kv_scale: float = 1.0
    swa_dialect: Fp8Dialect = Fp8Dialect.OCP
    comp_dialect: Fp8Dialect = Fp8Dialect.OCP
    swa_geo: CacheGeometry = field(kw_only=True)
    comp_geo: CacheGeometry | None = field(kw_only=True)

    def token_slice(self, start: int, stop: int) -> LayerInputs:
        """The same layer restricted to tokens [start, stop)."""
        topk = None if self.topk is None else self.topk[start:stop]
        return replace(self, q=self.q[start:stop], topk=topk)

    @property
    def shape(self) -> LayerShape:
        return LayerShape(self.kind, self.fmt, (self.swa_dialect, self.comp_dialect), self.q.shape[1],
                          self.swa_geo, self.comp_geo)


@dataclass(frozen=True)
class LayerShape:
    """A layer without its tensors' contents: what a backend's per-step metadata depends on
    besides the plan, so layers of one shape share it within a step (``Backend.meta``).

    kind       layer kind
    fmt        cache format; dialects (SWA, compressed) FP8 dialects of the caches
    num_heads  H of q as handed over (padded heads included)
    swa_geo / comp_geo   the caches' geometry (comp_geo None for window-only layers)
    """

    kind: LayerKind
    fmt: KVFormat
    dialects: tuple[Fp8Dialect, Fp8Dialect]
    num_heads: int
    swa_geo: CacheGeometry
    comp_geo: CacheGeometry | None

    def window_only(self) -> LayerShape:
        """The shape of a window-only layer with the same heads and SWA cache: its metadata is what
        every kind of the step shares (the window's rows, head staging)."""
        return replace(self, kind=LayerKind.SWA, comp_geo=None)


Dialects = tuple[Fp8Dialect, Fp8Dialect]  # (SWA cache, compressed cache)
OCP_CACHES: Dialects = (Fp8Dialect.OCP, Fp8Dialect.OCP)


@dataclass(frozen=True)
class PlatformSupport:
    """One platform a backend runs on.

    vendor          a ``common.platform.VENDORS`` name ("cuda", "rocm", "cpu", ...), or "*" for any
    archs           arch names it runs on ("gfx942"; a trailing "*" matches a family: "sm10*");
                    empty = every arch of the vendor
    min_capability  NVIDIA compute-capability floor, e.g. (8, 0)
    label           README / refusal text, e.g. "NVIDIA SM90, SM100 family"
    """

    vendor: str
    archs: tuple[str, ...] = ()
    min_capability: tuple[int, int] | None = None
    label: str = ""

    def matches(self, platform: Platform) -> bool:
        if self.vendor not in ("*", platform.vendor):
            return False
        if self.archs and not any(platform.arch == a or (a.endswith("*") and platform.arch.startswith(a[:-1]))
                                  for a in self.archs):
            return False
        if self.min_capability is not None:
            cap = platform.capability
            return cap is not None and cap >= self.min_capability
        return True


@dataclass(frozen=True)
class Capabilities:
    """What a backend serves, as data: ``reasons()`` checks a request against it (one generic
    function for every backend), ``support_matrix()`` renders it into the README, and
    ``SparseMLA.explain()`` shows its refusals. A backend adds only what data cannot say
    (libraries present, arch-by-format rules) in ``Backend.extra_reasons``.

    platforms   where it runs (any one matches)
    formats     KV formats it reads
    kinds       layer kinds it serves (None: every (ratio, selection), V4's and V4.1's)
    heads       (min, max) query heads per rank
    phases      phases it implements (a forced backend is forced for these only)
    dialects    FP8 dialects it reads (FNUZ is gfx942's; NVIDIA kernels read OCP only)
    windows     sliding-window lengths it serves (None: any)
    platform_need  refusal text off its platforms, e.g. "needs an NVIDIA SM90 or SM100-family GPU"
                (default: "runs on <platform labels>"); "; this is <vendor>/<arch>" follows
    heads_note  README text beside the head range, e.g. "padded to 64/128"
    validated   where its results come from: "H100 (hardware)", "emulated", "contract tests"...
    notes       anything a user must know (one line)
    """

    platforms: tuple[PlatformSupport, ...]
    formats: tuple[KVFormat, ...]
    kinds: tuple[LayerKind, ...] | None = None
    heads: tuple[int, int] = (1, MAX_HEADS)
    phases: tuple[Phase, ...] = (Phase.DECODE, Phase.PREFILL)
    dialects: tuple[Fp8Dialect, ...] = (Fp8Dialect.OCP,)
    windows: tuple[int, ...] | None = None
    platform_need: str = ""
    heads_note: str = ""
    validated: str = ""
    notes: str = ""

    @property
    def platform_text(self) -> str:
        return "; ".join(p.label or p.vendor for p in self.platforms)

    def platform_reasons(self, platform: Platform) -> list[str]:
        if any(p.matches(platform) for p in self.platforms):
            return []
        need = self.platform_need or f"runs on {self.platform_text}"
        return [f"{need}; this is {platform.vendor}/{platform.arch}"]

    def reasons(self, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, dialects: Dialects = OCP_CACHES) -> list[str]:
        """Every way (spec, format, kind, dialects) falls outside the declared data (platform and
        phase are checked by ``Backend.reasons``)."""
        reasons = []
        if self.kinds is not None and kind not in self.kinds:
            reasons.append(f"serves {'/'.join(k.name for k in self.kinds)} layers only (not {kind.name})")
        if fmt not in self.formats:
            reasons.append(f"reads {'/'.join(f.value for f in self.formats)} caches only (not {fmt.value})")
        lo, hi = self.heads
        if not lo <= spec.num_heads <= hi:
            reasons.append(f"serves {lo}-{hi} heads per rank (not {spec.num_heads})")
        if self.windows is not None and spec.window not in self.windows:
            reasons.append(f"serves {'/'.join(map(str, self.windows))}-token sliding windows only "
                           f"(the model has {spec.window})")
        if fmt.uses_fp8 and fmt in self.formats:
            used = zip(("SWA", "compressed"), dialects[: 2 if kind.has_comp_scope else 1])
            reasons += [f"reads {'/'.join(d.value for d in self.dialects)} fp8 only; the {cache} cache is "
                        f"{dialect.value}" for cache, dialect in used if dialect not in self.dialects]
        return reasons


class Backend:
    """Base class of all backends.

    name           registry name
    capabilities   what it serves, as data (``Capabilities``)
    splits_phases  True: the front end calls forward separately for the decode and prefill
                   token ranges (the plan passed is then a phase sub-plan)
    uncapturable   {phase: why} for the phases whose forward cannot run inside a CUDA-graph
                   capture (a host sync); engines and the bench run those eagerly
    batch_invariant  True: given ``plan.batch_invariant`` a token's output bytes depend on its
                   own inputs only (no split decision, no batch-shaped reduction)

    ``reasons(...)`` = the declared data's refusals + ``extra_reasons`` (what data cannot say);
    [] means supported. ``forward`` runs a layer; ``prepare`` builds its per-step metadata (a
    small frozen dataclass of the backend's), which ``meta`` caches in the plan once per layer
    shape, so layers of one kind share it and no backend keeps step state of its own.
    """

    name: str = "?"
    capabilities: Capabilities
    splits_phases: bool = False
    uncapturable: Mapping[Phase, str] = MappingProxyType({})
    batch_invariant: bool = False

    @property
    def phases(self) -> tuple[Phase, ...]:
        return self.capabilities.phases

    def platform_reasons(self, platform: Platform) -> list[str]:
        """Why this backend cannot run on ``platform`` at all ([] = it can); the declared
        platforms unless a backend knows better (an emulator serving any device)."""
        return self.capabilities.platform_reasons(platform)

    def extra_reasons(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
                      dialects: Dialects) -> list[str]:
        """Refusals the declared data cannot express (a missing library, an arch that reads a
        format only with some instruction), asked only on a platform it runs on."""
        return []

    def unsupported_reasons(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind,
                            phase: Phase, dialects: Dialects = OCP_CACHES) -> list[str]:
        """Every reason this backend cannot serve the combination; [] = supported."""
        kind, fmt, phase = LayerKind.parse(kind), KVFormat.parse(fmt), Phase(phase)
        if phase not in self.phases:
            return [f"implements {'/'.join(p.value for p in self.phases)} only (not {phase.value})"]
        reasons = self.capabilities.reasons(spec, fmt, kind, dialects)
        on_platform = self.platform_reasons(platform)
        if on_platform:
            return reasons + on_platform
        return reasons + self.extra_reasons(platform, spec, fmt, kind, phase, dialects)

    def choice(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
               dialects: Dialects) -> str:
        """How the backend would run a combination it serves, when it has options (a vendor
        entry point, a mode) and why; shown by ``SparseMLA.explain()``. "" = nothing to say."""
        return ""

    def reserve(self, plan: StepPlan, fmt: KVFormat, num_heads: int, dialects: Dialects, decode_tokens: int) -> None:
        """Engine start: allocate the buffers later steps of up to ``decode_tokens`` decode tokens
        will use (an engine's memory profile then counts them), nothing by default."""

    def prepare(self, plan: StepPlan, shape: LayerShape) -> Any:
        """Per-step metadata of the layers of ``shape`` over ``plan``'s tokens (scheduler
        metadata, index rows every such layer reads, staging buffers), None = nothing. Called by
        ``meta`` only; a phase sub-plan is a plan of its own."""
        return None

    def meta(self, plan: StepPlan, shape: LayerShape) -> Any:
        """``prepare(plan, shape)`` once per plan, backend instance and shape (cached in the plan:
        the next step's plan starts empty)."""
        return plan.cached((self, shape), lambda: self.prepare(plan, shape))

    def forward(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor) -> None:
        """Write attention for all ``plan.num_tokens`` tokens into ``out`` [T, H, 512] bf16."""
        raise NotImplementedError


class BackendUnavailableError(RuntimeError):
    """No backend (or not the forced one) can serve a layer kind / phase; lists every reason."""


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


def requested_backend(explicit: str = "auto") -> tuple[str, str]:
    """(name or 'auto', where it came from)."""
    if explicit != "auto":
        return explicit, "argument"
    ctx = _forced.get()
    if ctx is not None and ctx != "auto":
        return ctx, "dsv4_attn.backend() context"
    env = envs.BACKEND.get()  # ValueError for a name that is not registered
    if env != "auto":
        return env, f"{ENV_BACKEND} environment variable"
    return "auto", "auto"


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
    bounds = _range_bounds(platform.arch, where, Phase(phase).value, kind.name, choices.heads_bucket(spec.num_heads),
                           fmt.value)
    return where, bisect.bisect_right(bounds, num_tokens)


@functools.lru_cache(maxsize=256)
def _range_bounds(arch: str, where: str | None, phase: str, kind: str, heads: int, fmt: str) -> tuple[int, ...]:
    """The sorted range bounds of the table's entries for one layer (``where``, the
    DSV4_ATTN_CHOICES file that table_for reads, keys the cache)."""
    entries, _ = choices.table_for(arch)
    return tuple(sorted({bound for e in entries if (e.phase, e.kind, e.heads, e.fmt) == (phase, kind, heads, fmt)
                         for bound in e.tokens}))


def layers_per_step(spec: ModelSpec, kind: LayerKind) -> int:
    """How many layers of ``kind`` one step of the model runs (ModelSpec.layers; at least 1): what a
    backend's per-step work is shared by (common/choices.py)."""
    return max(1, sum(layer.kind == kind for layer in spec.layers))


def select(platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
           requested: str = "auto", source: str = "auto", dialects: Dialects = OCP_CACHES,
           num_tokens: int | None = None) -> str:
    """Name of the backend to run ``kind`` / ``phase``; raises BackendUnavailableError with every
    backend's reasons when the requested one (or, for auto, every candidate) refuses. With
    ``num_tokens`` (the phase's tokens in this launch) auto tries a measured order first."""
    if requested != "auto":
        if requested not in _REGISTRY:
            raise ValueError(f"backend: got {requested!r} (from {source}); allowed: {sorted(_REGISTRY)} or 'auto'")
        forced = get_backend(requested)
        if forced is not None and phase not in forced.phases:
            return select(platform, spec, fmt, kind, phase, dialects=dialects, num_tokens=num_tokens)
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
        reasons = reasons_for(name, platform, spec, fmt, kind, phase, dialects)
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
