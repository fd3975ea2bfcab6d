"""The backend protocol (xformers ``dispatch.py`` style): what a backend declares and implements.

A backend is a thin adapter: it declares what it serves as data (``Capabilities``) and what
data cannot say (``extra_reasons``; an empty list means supported), optionally prepares
per-step metadata (cached in the plan per layer shape), and runs ``forward(plan, layer, out)``.
A backend whose buffers bound one launch declares that bound (``launch_limit``): selection then
sends a larger launch to the next backend, so no backend builds another inside itself. The hooks
tools read (``label``, ``emulated``, ``emulation_tag``, ``uncapturable``, ``describe_binary``,
``raw_ops``) are declared here with their defaults, so tools never probe a
backend with ``getattr`` nor import a vendor module. The registry, selection and forcing live in
``common/registry.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

import torch

from .layout import CacheGeometry, Fp8Dialect, KVFormat
from .plan import Phase, StepPlan
from .platform import Platform
from .spec import MAX_HEADS, LayerKind, ModelSpec


class Repeat(Protocol):
    """A backend's bound layer call (``Backend.repeat``)."""

    def __call__(self) -> bool:
        """Run the call again; False (nothing run) when it cannot now (the caller then takes the
        full path)."""

    def relocated(self, sources: tuple[torch.Tensor | None, ...]) -> Repeat | None:
        """The same call for tensors ``sources`` (``repeat_sources`` of the new call) that differ
        from the bound call's only in their addresses (same shapes, strides, dtypes, devices and
        addresses % 16: the caller checks), or None when it cannot be moved."""


def repeat_sources(q: torch.Tensor, out: torch.Tensor, swa_cache: torch.Tensor, comp_cache: torch.Tensor | None,
                   topk: torch.Tensor | None, sink: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """A layer call's own tensors, in the order a backend binds them and ``Repeat.relocated``
    takes them."""
    return q, out, swa_cache, comp_cache, topk, sink


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
    # set by SparseMLA's checks (common.checks.LayerChecks): equal keys = the same inputs (every
    # tensor's address, shape, strides, dtype, device; the plan's) up to their values, so a backend
    # may reuse what it derived from them. Not an __init__ field: a copy made with
    # dataclasses.replace (other inputs) gets None, never a stale key.
    checked_key: int | tuple | None = field(default=None, init=False, repr=False, compare=False)
    # the ``out`` tensor object those checks covered (its signature is in checked_key), or None
    checked_out: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def comp_storage(self) -> tuple[torch.Tensor, CacheGeometry]:
        """(compressed cache, its geometry) of a layer with a compressed scope; a ValueError for a
        window-only layer (backends ask only for kinds with one)."""
        if self.comp_cache is None or self.comp_geo is None or not self.kind.has_comp_scope:
            raise ValueError(f"comp_cache: got {'None' if self.comp_cache is None else 'a cache'} for a "
                             f"{self.kind.name} layer; allowed: a compressed cache for kinds with a compressed scope")
        return self.comp_cache, self.comp_geo

    def compressed(self, plan: StepPlan, bound: bool = False, multiple: int = 1) -> CompScope:
        """The layer's compressed scope over ``plan``'s tokens (``plan.comp_scope``: rows of global
        slots, with ``bound`` every slot outside the cache -1, padded to ``multiple`` columns),
        with its cache; a ValueError for a window-only layer."""
        cache, geo = self.comp_storage()
        rows, lens = plan.comp_scope(self.kind, self.topk, geo.num_slots if bound else None, multiple)
        if rows is None or lens is None:  # comp_storage passed: the kind has a compressed scope
            raise ValueError(f"kind: got {self.kind.name} without compressed rows; allowed: a kind with a scope")
        return CompScope(rows, lens, cache, geo)

    def token_slice(self, start: int, stop: int) -> LayerInputs:
        """The same layer restricted to tokens [start, stop)."""
        topk = None if self.topk is None else self.topk[start:stop]
        sliced = replace(self, q=self.q[start:stop], topk=topk)
        if self.checked_key is not None:
            sliced.checked_key = (self.checked_key, start, stop)
        return sliced

    @property
    def shape(self) -> LayerShape:
        return LayerShape(self.kind, self.fmt, (self.swa_dialect, self.comp_dialect), self.q.shape[1],
                          self.swa_geo, self.comp_geo)


class CompScope(NamedTuple):
    """A layer's compressed scope as a backend reads it (``LayerInputs.compressed``).

    rows   int32 [T, K] global slots of the compressed cache, -1 unused
    lens   int32 [T] valid entries per token
    cache  the compressed cache; geo its geometry
    """

    rows: torch.Tensor
    lens: torch.Tensor
    cache: torch.Tensor
    geo: CacheGeometry


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


@dataclass(frozen=True)
class LaunchLimit:
    """The most tokens one launch of a phase may carry on a backend instance (``Backend.launch_limit``).

    max_tokens  launches of up to this many tokens run; larger ones go to the next backend
    why         what bounds it, for ``explain()`` and refusals, e.g. "the scratch's capacity"
    """

    max_tokens: int
    why: str

    def reasons(self, num_tokens: int) -> list[str]:
        """[] when a launch of ``num_tokens`` tokens fits, else why not."""
        if num_tokens <= self.max_tokens:
            return []
        return [f"a launch of {num_tokens} tokens is above its limit of {self.max_tokens} ({self.why})"]


class Backend:
    """Base class of all backends.

    name           registry name
    capabilities   what it serves, as data (``Capabilities``)
    splits_phases  True: the front end calls forward separately for the decode and prefill
                   token ranges (the plan passed is then a phase sub-plan)
    uncapturable   {phase: why} for the phases whose forward cannot run inside a CUDA-graph
                   capture (a host sync); engines and the bench run those eagerly
    emulated       True when its results come from an emulator, not the vendor's kernels
                   (the parity matrix labels them so)
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

    def launch_limit(self, phase: Phase) -> LaunchLimit | None:
        """The most tokens one ``phase`` launch may carry on this instance (None: no limit). Read
        by selection at each launch size (``SparseMLA.backend_for``): a larger launch runs on the
        next backend that serves the layer, and ``explain()`` says which. It may change only in
        ``reserve`` (engine start), after which ``SparseMLA`` forgets its cached decisions."""
        return None

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

    def repeat(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor) -> Repeat | None:
        """After ``forward(plan, layer, out)``: a :class:`Repeat` that runs that call again for a
        later call with the same ``layer.checked_key`` and the same plan tensors (``SparseMLA`` keeps
        it, keyed by them), or for one whose tensors (``repeat_sources``) lie elsewhere
        (``Repeat.relocated``); None (the default): none."""
        return None

    # ---- what tools read (the probe, the parity matrix, the bench) -----------------------------
    @property
    def emulated(self) -> bool:
        """True when its results come from an emulator, not the vendor's kernels (a property: an
        adapter may serve the real library or an emulator, decided at run time)."""
        return False

    def label(self) -> str:
        """The backend as result files name it, e.g. "aiter [EMULATED gfx950, AITER 0.1.20]"."""
        return self.name

    def emulation_tag(self) -> str:
        """What an emulated backend emulates, for file names (``aiter-gfx950-0.1.20.post1``)."""
        return self.name

    def describe_binary(self, platform: Platform) -> Any:
        """What the backend found to run on here (vendor library, build, version), JSON-able, for
        ``dsv4-attn probe``; None: nothing beyond its module (the portable backends)."""
        return None

    def raw_ops(self) -> Any:
        """The vendor's raw op namespace as an engine calls it (FlashMLA's ``torch.ops._flashmla_C``),
        for the bench's side-by-side runs; None when the backend has none or it is not loaded."""
        return None


class BackendUnavailableError(RuntimeError):
    """No backend (or not the forced one) can serve a layer kind / phase; lists every reason."""
