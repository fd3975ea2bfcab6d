"""SparseMLA: plan once per step, run every layer on the best backend the probe found.

    mla = SparseMLA(ModelSpec(num_heads=64, topk=512), "fp8_ds_mla", device="cuda")
    plan = mla.plan(batch)                               # once per engine step
    out = mla.forward(plan, LayerKind.C4A, q, swa_cache, comp_cache, topk=topk, sink=sink)
    print(mla.explain())                                 # which backend runs what, and why

Backend choice: ``backend=`` argument > ``with dsv4_attn.backend(name):`` > the
``DSV4_ATTN_BACKEND`` environment variable > the platform's priority list. A forced backend
that cannot serve a layer kind raises with its reasons; nothing falls back silently. Decode
and prefill tokens may run on different backends (e.g. AITER decode, Triton prefill); the
front end then splits the token range.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import cast

import torch

from .common import backend as backend_mod
from .common import choices
from .common.backend import Backend, LayerInputs, Phase
from .common.batch import StepBatch
from .common.indices import check_local_topk, validate_local_topk
from .common.layout import CacheGeometry, Fp8Dialect, KVFormat, check_cache
from .common.plan import FrontEnd, PlanBuffers, StepPlan, TorchFrontEnd, build_plan, build_rows_plan, check_step
from .common.platform import Platform, platform_for_device, triton_interpreting
from .common.rows import StepRows
from .common.spec import HEAD_DIM, MAX_HEADS, LayerKind, ModelSpec

_UNSET = object()  # marks an omitted keyword argument


class SparseMLA:
    """DSv4 two-scope sparse attention with sinks for one model (per TP rank).

    spec        ModelSpec (heads on this rank, top-k width, max_model_len, window, scale, layers)
    fmt         KVFormat (or "fp8_ds_mla" / "bfloat16" / "fp8_e4m3") of the SWA and compressed caches
    backend     "auto" or a registered backend name (see ``dsv4_attn.backend_names()``)
    device      where plan buffers live (default: the first batch's device)
    max_tokens  most tokens in one step (plan buffers are sized for it)
    swa_dialect / comp_dialect   FP8 dialect of each cache ("ocp", or "fnuz" for gfx942's SWA cache)
    front_end   who builds the index rows: "auto" (Triton on GPUs when Triton is importable, one
                launch per step; torch otherwise), "torch", or "triton" (a GPU, or the CPU under
                TRITON_INTERPRET=1). Both give the same rows; see ``common.plan.FrontEnd``.
    """

    def __init__(
        self,
        spec: ModelSpec,
        fmt: KVFormat | str,
        backend: str = "auto",
        device: torch.device | str | None = None,
        max_tokens: int = 8192,
        max_reqs: int = 1024,
        swa_dialect: Fp8Dialect | str = Fp8Dialect.OCP,
        comp_dialect: Fp8Dialect | str = Fp8Dialect.OCP,
        front_end: str = "auto",
    ) -> None:
        if not isinstance(spec, ModelSpec):
            raise ValueError(f"spec: got {type(spec).__name__}; allowed: a ModelSpec")
        for name, value in (("max_tokens", max_tokens), ("max_reqs", max_reqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: got {value!r}; allowed: a positive int")
        if not isinstance(backend, str):
            raise ValueError(f"backend: got {backend!r}; allowed: 'auto' or one of {backend_mod.backend_names()}")
        if backend != "auto" and backend not in backend_mod.backend_names():
            raise ValueError(f"backend: got {backend!r}; allowed: 'auto' or one of {backend_mod.backend_names()}")
        self.spec = spec
        self.fmt = KVFormat.parse(fmt)
        self.swa_dialect = Fp8Dialect.parse(swa_dialect)
        self.comp_dialect = Fp8Dialect.parse(comp_dialect)
        self.max_tokens = max_tokens
        self.max_reqs = max_reqs
        if front_end not in _FRONT_ENDS:
            raise ValueError(f"front_end: got {front_end!r}; allowed: one of {_FRONT_ENDS}")
        self._front_end_choice = front_end
        self._explicit = backend
        self._device = _parse_device(device)
        self._front_end: FrontEnd | None = (_make_front_end(front_end, self._device)
                                            if self._device is not None else None)
        self._buffers: PlanBuffers | None = None
        self._generation = 0
        self._selected: dict[tuple, str] = {}
        self._backends: dict[str, Backend] = {}  # this model's own instances (their buffers are its own)
        # Refuse at construction (engine start) when the requested backend cannot run a layer.
        for kind in spec.kinds:
            for phase in Phase:
                self.backend_for(kind, phase)

    # ---- backend choice -------------------------------------------------------------------
    @property
    def dialects(self) -> tuple[Fp8Dialect, Fp8Dialect]:
        return self.swa_dialect, self.comp_dialect

    @property
    def platform(self) -> Platform:
        return platform_for_device(self._device or torch.device("cuda" if torch.cuda.is_available() else "cpu"))

    def backend_for(self, kind: LayerKind | str | int, phase: Phase | str, num_tokens: int | None = None) -> str:
        """Name of the backend that runs ``kind`` / ``phase`` now (raises with reasons if none);
        with ``num_tokens`` (the phase's tokens in one launch) auto selection follows the measured
        choices table where it covers the launch (common/choices.py)."""
        kind, phase = self.spec.check_kind(kind), Phase(phase)
        requested, source = backend_mod.requested_backend(self._explicit)
        order = None
        if requested == "auto" and num_tokens:
            order = tuple(backend_mod.auto_order(self.platform, self.spec, self.fmt, kind, phase, num_tokens)[0])
        key = (requested, kind, phase, order)
        if key not in self._selected:
            self._selected[key] = backend_mod.select(self.platform, self.spec, self.fmt, kind, phase,
                                                     requested, source, self.dialects, num_tokens)
        return self._selected[key]

    def explain(self) -> str:
        """Table: per backend, kind and phase: chosen / ok / refused, with the reasons."""
        plat = self.platform
        requested, source = backend_mod.requested_backend(self._explicit)
        front = self._front_end.name if self._front_end else f"{self._front_end_choice} (chosen at the first plan)"
        lines = [
            f"dsv4_attn on {plat.vendor}/{plat.arch} ({plat.device_name}), format {self.fmt.value}, "
            f"{self.spec.num_heads} heads, requested backend: {requested} ({source}), index front end: {front}",
            f"{'backend':<18} {'kinds':<14} {'phase':<8} {'status':<8} reasons",
        ]
        for name in backend_mod.backend_names():
            verdicts: dict[tuple[str, str, str], list[str]] = {}  # (phase, status, why) -> kinds, each reason once
            for phase in Phase:
                for kind in self.spec.kinds:
                    reasons = backend_mod.reasons_for(name, plat, self.spec, self.fmt, kind, phase, self.dialects)
                    try:
                        chosen = self.backend_for(kind, phase) == name
                    except backend_mod.BackendUnavailableError:
                        chosen = False
                    status = "chosen" if chosen else ("ok" if not reasons else "refused")
                    impl = backend_mod.get_backend(name)  # importable: reasons_for said nothing against it
                    why = reasons or ([impl.choice(plat, self.spec, self.fmt, kind, phase, self.dialects)]
                                      if impl else [])
                    verdicts.setdefault((phase.value, status, "; ".join(r for r in why if r)), []).append(kind.name)
            every_kind = len(self.spec.kinds)
            rows = [("all" if len(kinds) == every_kind else ",".join(kinds), phase, status, why)
                    for (phase, status, why), kinds in verdicts.items()]
            if len({row[2:] for row in rows}) == 1 and all(row[0] == "all" for row in rows):
                rows = [("all", "all") + rows[0][2:]]  # the same verdict everywhere: one line
            lines.extend(f"{name:<18} {k:<14} {p:<8} {st:<8} {why}" for k, p, st, why in rows)
        return "\n".join(lines + self._measured_lines(plat, requested))

    def _measured_lines(self, plat: Platform, requested: str) -> list[str]:
        """The measured choices (common/choices.py) that reorder auto selection for this model, by
        token range; "chosen" above is the choice for a launch no measurement covers."""
        entries, where = choices.table_for(plat.arch)
        kinds = {k.name for k in self.spec.kinds}
        mine = [e for e in entries if e.kind in kinds and e.fmt == self.fmt.value
                and e.heads == choices.heads_bucket(self.spec.num_heads)]
        if not mine or requested != "auto":
            return []
        out = [f"measured choices ({where}; auto tries this order first for launches in range; where the "
               "table has per-step costs, ordered for this model's layers of the kind):"]
        for e in mine:
            layers = backend_mod.layers_per_step(self.spec, LayerKind.parse(e.kind))
            costs = e.costs(layers)
            out.append(f"  {e.kind:<6} {e.phase:<8} tokens {e.tokens[0]}-{e.tokens[1] - 1}: "
                       f"{' > '.join(e.ranked(layers))}  [{f'{costs}; ' if costs else ''}{e.evidence}]")
        return out

    # ---- per step ---------------------------------------------------------------------------
    def plan(self, batch: StepBatch | StepRows, validate: bool = False) -> StepPlan:
        """Build the step's shared metadata into the preallocated buffers (no host sync).

        ``batch`` is a StepBatch (block tables: the rows are built here) or a StepRows
        (ready-made rows: viewed, not copied; see ``dsv4_attn.common.rows``).
        ``validate=True`` also runs the value checks that read device tensors (``validate()``).
        The returned plan is valid until the next successful ``plan()`` call (a refused one
        leaves it valid). Every call re-reads the batch's tensors: engines update them in place.
        """
        if isinstance(batch, StepRows):
            return self._plan_rows(batch, validate)
        if not isinstance(batch, StepBatch):
            raise ValueError(f"batch: got {type(batch).__name__}; allowed: a StepBatch or a StepRows")
        if batch.num_reqs > self.max_reqs:
            raise ValueError(f"batch: got {batch.num_reqs} requests; allowed: <= max_reqs ({self.max_reqs})")
        buffers = self._ensure_buffers(batch.device)
        check_step(self.spec, batch, buffers)
        if validate:
            batch.validate()
        # only now: a refused step leaves the previous plan (and its buffers) valid
        self._generation += 1
        return build_plan(self.spec, batch, buffers, self, self._generation, self._front_end)

    def reserve(self, plan: StepPlan, decode_tokens: int | None = None) -> None:
        """Engine start (a memory profile): let each decode backend allocate the buffers steps of
        up to ``decode_tokens`` decode tokens (default ``max_tokens``) will use (``Backend.reserve``)."""
        for name in dict.fromkeys(self.backend_for(kind, Phase.DECODE) for kind in self.spec.kinds):
            self._backend(name).reserve(plan, self.fmt, self.spec.num_heads, self.dialects,
                                        decode_tokens or self.max_tokens)

    def _plan_rows(self, rows: StepRows, validate: bool) -> StepPlan:
        rows.check()
        rows.check_model(self.spec)
        num_tokens = rows.checked_num_tokens
        if num_tokens > self.max_tokens:
            raise ValueError(f"batch.num_tokens: got {num_tokens}; allowed: <= max_tokens ({self.max_tokens}) "
                             "of this SparseMLA (raise max_tokens)")
        if self._device is not None and rows.device != self._device:
            raise ValueError(f"batch: got device {rows.device}; allowed: {self._device} (the SparseMLA's device)")
        if validate:
            rows.validate()
        buffers = self._ensure_buffers(rows.device)
        self._generation += 1
        return build_rows_plan(self.spec, rows, buffers, self, self._generation, self._front_end)

    def _ensure_buffers(self, device: torch.device) -> PlanBuffers:
        """The plan buffers, allocated on the first plan's device."""
        if self._buffers is None:
            self._device = self._device or device
            self._buffers = PlanBuffers.allocate(self.spec, self.max_tokens, self._device)
            self._front_end = self._front_end or _make_front_end(self._front_end_choice, self._device)
        return self._buffers

    def forward(
        self,
        plan: StepPlan,
        kind: LayerKind | str | int,
        q: torch.Tensor,
        swa_cache: torch.Tensor,
        comp_cache: torch.Tensor | None = None,
        topk: torch.Tensor | None = None,
        sink: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        kv_scale: float = 1.0,
        validate: bool = False,
        *,
        c4a_topk: torch.Tensor | None | object = _UNSET,
    ) -> torch.Tensor:
        """One layer's attention.

        kind       the layer's LayerKind (one of ``spec.kinds``), or its name ("c4a", "c2a", ...)
        q          bf16 [T, H, 512], T = plan.num_tokens, num_heads <= H <= 128 (extra heads are
                   padding: give them sink -inf; their output rows are written but meaningless)
        swa_cache  this layer's SWA cache; comp_cache the compressed cache it reads (of ratio
                   kind.ratio; layers sharing a compressed cache pass the same tensor)
        topk       int32 [T, K] the indexer's LOCAL top-k (compressed entry numbers of the
                   token's request, -1 unused) for top-k kinds (C4A, C1A, C2A); None otherwise,
                   and None when the plan holds the kind's global rows (a StepRows' GlobalRows).
                   ``c4a_topk=`` is accepted as its V4 name.
        sink       float32 [H] (None = no sink)
        out        bf16 [T, H, 512] contiguous, written in place (allocated when None)
        validate   also check the step's values against the caches (reads device tensors: a
                   sync): every used block id inside its cache, c4a_topk entries inside each
                   token's valid prefix -1 or visible, no NaN sink. Without it any out-of-range
                   block id, slot or top-k entry is skipped like -1 (never read), and NaN in a
                   selected key or the sink comes out as NaN (docs/bad-input.md).
        Returns out.
        """
        topk_name = "topk"
        if c4a_topk is not _UNSET:
            if topk is not None:
                raise ValueError("c4a_topk: got a tensor beside topk; allowed: one of them (c4a_topk is the V4 "
                                 "name of topk)")
            topk, topk_name = cast("torch.Tensor | None", c4a_topk), "c4a_topk"
        layer = self._layer_inputs(plan, kind, q, swa_cache, comp_cache, topk, sink, kv_scale, validate, topk_name,
                                   out)
        if out is None:
            out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        T, nd = plan.num_tokens, plan.num_decode_tokens
        phases = [(p, a, b) for p, a, b in ((Phase.DECODE, 0, nd), (Phase.PREFILL, nd, T)) if b > a]
        names = {p: self.backend_for(kind, p, b - a) for p, a, b in phases}
        backends = {p: self._backend(n) for p, n in names.items()}
        if len(set(names.values())) == 1 and not backends[phases[0][0]].splits_phases:
            backends[phases[0][0]].forward(plan, layer, out)
            return out
        for phase, a, b in phases:
            backends[phase].forward(plan.phase_plan(phase), layer.token_slice(a, b), out[a:b])
        return out

    def layer_inputs(self, plan: StepPlan, kind: LayerKind | str | int, q: torch.Tensor, swa_cache: torch.Tensor,
                     comp_cache: torch.Tensor | None = None, topk: torch.Tensor | None = None,
                     sink: torch.Tensor | None = None, kv_scale: float = 1.0, validate: bool = False) -> LayerInputs:
        """One layer's inputs checked against ``plan`` (the arguments of :meth:`forward`), with the
        caches' geometry, as ``Backend.forward`` takes them (for callers that drive a backend
        directly, e.g. one phase at a time)."""
        return self._layer_inputs(plan, kind, q, swa_cache, comp_cache, topk, sink, kv_scale, validate)

    def _layer_inputs(self, plan: StepPlan, kind, q, swa_cache, comp_cache, topk, sink, kv_scale: float,
                      validate: bool, topk_name: str = "topk", out: torch.Tensor | None = None) -> LayerInputs:
        """Every check of a layer's inputs, once; the backends trust the result (its geometry)."""
        kind = self.spec.check_kind(kind)
        unchecked = LayerInputs(kind, q, swa_cache, comp_cache, topk, sink, self.fmt, self.spec.scale, kv_scale,
                                self.swa_dialect, self.comp_dialect,
                                swa_geo=None, comp_geo=None)  # type: ignore[arg-type]  # set below, once checked
        swa_geo, comp_geo = self._check(plan, unchecked, out, validate, topk_name)
        return dataclasses.replace(unchecked, swa_geo=swa_geo, comp_geo=comp_geo)

    def _backend(self, name: str) -> Backend:
        if name not in self._backends:
            self._backends[name] = backend_mod.new_backend(name)
        return self._backends[name]

    # ---- validation ---------------------------------------------------------------------------
    def _check(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor | None, validate: bool,
               topk_name: str = "topk") -> tuple[CacheGeometry, CacheGeometry | None]:
        """Every check of ``layer`` (its geometry fields unset) and ``out``; returns the geometry
        of the SWA cache and of the compressed cache (None for window-only layers)."""
        if not isinstance(plan, StepPlan) or plan.owner is not self:
            raise ValueError("plan: got a plan not built by this SparseMLA; allowed: the result of this object's "
                             "plan()")
        if plan.generation != self._generation:
            raise ValueError(
                f"plan: got the plan of step {plan.generation}, but plan() has since been called for step "
                f"{self._generation} and its buffers were overwritten; allowed: the latest plan"
            )
        T, q = plan.num_tokens, layer.q
        if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[0] != T \
                or q.shape[2] != HEAD_DIM or not (self.spec.num_heads <= q.shape[1] <= MAX_HEADS):
            got = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(
                f"q: got {got}; allowed: torch.bfloat16 [T={T}, H, {HEAD_DIM}] with "
                f"{self.spec.num_heads} <= H <= {MAX_HEADS} (T = plan.num_tokens)"
            )
        if q.stride(2) != 1:
            raise ValueError(f"q: got strides {tuple(q.stride())}; allowed: last dim contiguous")
        if q.device != plan.device:
            raise ValueError(f"q: got device {q.device}; allowed: {plan.device} (the plan's device)")
        H = q.shape[1]
        swa_geo = check_cache(layer.swa_cache, self.fmt.swa_record, "swa_cache", self.swa_dialect)
        self._check_device("swa_cache", layer.swa_cache, q.device)
        comp_geo = None
        if layer.kind.has_comp_scope:
            if layer.comp_cache is None:
                raise ValueError(f"comp_cache: got None; allowed: the ratio-{layer.kind.ratio} cache for "
                                 f"{layer.kind.name} layers")
            comp_geo = check_cache(layer.comp_cache, self.fmt.comp_record, "comp_cache", self.comp_dialect)
            self._check_device("comp_cache", layer.comp_cache, q.device)
            want_bs = plan.batch.comp_block_size(layer.kind)  # None: global rows fit any block size
            if want_bs is not None and comp_geo.block_size != want_bs:
                raise ValueError(
                    f"comp_cache: got block size {comp_geo.block_size}; allowed: batch.block_size // "
                    f"{layer.kind.ratio} = {want_bs}"
                )
        elif layer.comp_cache is not None:
            raise ValueError("comp_cache: got a tensor for a window-only (SWA) layer; allowed: None")
        self._check_addressable("swa_cache", swa_geo)
        if comp_geo is not None:
            self._check_addressable("comp_cache", comp_geo)
        if plan.batch.swa_block_size is not None and swa_geo.block_size != plan.batch.swa_block_size:
            raise ValueError(f"swa_cache: got block size {swa_geo.block_size}; allowed: "
                             f"batch.swa_block_size = {plan.batch.swa_block_size}")
        if layer.kind.uses_topk and not plan.translates_topk(layer.kind):
            if layer.topk is not None:
                raise ValueError(f"{topk_name}: got a tensor for a {layer.kind.name} layer whose global rows the plan "
                                 f"holds (StepRows.comp[{layer.kind.ratio}] is GlobalRows); allowed: None")
        elif layer.kind.uses_topk:
            if layer.topk is None:
                raise ValueError(f"{topk_name}: got None; allowed: int32 [T, K] local top-k for {layer.kind.name} "
                                 "layers")
            check_local_topk(layer.topk, T, q.device, topk_name, self.spec.comp_width(layer.kind))
        elif layer.topk is not None:
            what = "attends every compressed entry" if layer.kind.attends_all else "is window-only"
            raise ValueError(f"{topk_name}: got a tensor for a {layer.kind.name} layer, which {what}; allowed: None")
        if layer.sink is not None:
            s = layer.sink
            if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.shape != (H,) \
                    or s.device != q.device:
                got = f"{s.dtype} {tuple(s.shape)} on {s.device}" if isinstance(s, torch.Tensor) else type(s).__name__
                raise ValueError(f"sink: got {got}; allowed: torch.float32 [{H}] on {q.device}")
        if not (isinstance(layer.kv_scale, (int, float)) and not isinstance(layer.kv_scale, bool)
                and math.isfinite(layer.kv_scale) and layer.kv_scale > 0):
            raise ValueError(f"kv_scale: got {layer.kv_scale!r}; allowed: a finite float > 0")
        if self.fmt is not KVFormat.FP8_TENSOR and layer.kv_scale != 1.0:
            raise ValueError(f"kv_scale: got {layer.kv_scale}; allowed: 1.0 for format {self.fmt.value}")
        if out is not None:
            if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or out.shape != q.shape \
                    or not out.is_contiguous() or out.device != q.device:
                got = (f"{out.dtype} {tuple(out.shape)} contiguous={out.is_contiguous()} on {out.device}"
                       if isinstance(out, torch.Tensor) else type(out).__name__)
                raise ValueError(f"out: got {got}; allowed: contiguous torch.bfloat16 {tuple(q.shape)} on {q.device}")
        if validate:
            self._check_values(plan, layer, swa_geo, comp_geo, topk_name)
        return swa_geo, comp_geo

    @staticmethod
    def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
        if t.device != device:
            raise ValueError(f"{name}: got device {t.device}; allowed: {device} (q's device)")

    @staticmethod
    def _check_addressable(name: str, geo) -> None:
        # slots are int32 everywhere (rows, kernels' in-kernel translations): a bigger cache
        # would wrap them into other rows' slots
        if geo.num_slots > 2**31:
            raise ValueError(f"{name}: got {geo.num_blocks} blocks x {geo.block_size} = {geo.num_slots} slots; "
                             "allowed: at most 2**31 (slots are int32)")

    @staticmethod
    def _check_values(plan: StepPlan, layer: LayerInputs, swa_geo, comp_geo, topk_name: str) -> None:
        """validate=True: the step's block ids (StepBatch) or slots (StepRows) against the caches,
        the top-k entries, the sink."""
        geos: dict[str | int, CacheGeometry] = {"swa": swa_geo}
        if comp_geo is not None:
            geos[layer.kind.ratio] = comp_geo
        if isinstance(plan.batch, StepRows):
            plan.batch.validate({key: geo.num_slots for key, geo in geos.items()})
        else:
            plan.batch.validate({key: geo.num_blocks for key, geo in geos.items()})
        if layer.topk is not None:
            validate_local_topk(plan.tokens, layer.topk, layer.kind.ratio, topk_name)
        if layer.sink is not None and bool(layer.sink.isnan().any()):
            h = int(layer.sink.isnan().nonzero()[0])
            raise ValueError(f"sink: got NaN at head {h}; allowed: a float or ±inf per head (a NaN sink "
                             "makes that head's output NaN)")


_FRONT_ENDS = ("auto", "torch", "triton")


def _parse_device(device) -> torch.device | None:
    """``device`` as a torch.device that exists on this machine (None stays None)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: got {device!r}; allowed: None, 'cpu', 'cuda', 'cuda:N' or a torch.device "
                         f"({exc})") from None
    module = getattr(torch, dev.type, None)
    if dev.type != "cpu" and not (module is not None and hasattr(module, "is_available") and module.is_available()):
        raise ValueError(f"device: got {device!r}; allowed: a device this machine has ({dev.type} is not "
                         "available here)")
    count = getattr(module, "device_count", None)
    if dev.index is not None and count is not None and dev.index >= count():
        raise ValueError(f"device: got {device!r}; allowed: {dev.type}:0 .. {dev.type}:{count() - 1}")
    return dev


def _make_front_end(choice: str, device: torch.device) -> FrontEnd:
    """The index front end for ``device``: Triton on GPUs (CUDA and ROCm builds of torch both
    report device type "cuda") when it is importable, else torch; "triton" forced where it
    cannot run raises."""
    has_triton = importlib.util.find_spec("triton") is not None
    triton_runs = has_triton and (device.type == "cuda" or triton_interpreting())
    if choice == "triton" and not triton_runs:
        why = "triton is not importable" if not has_triton else f"device {device} is not a GPU"
        raise ValueError(f"front_end: got 'triton', but {why}; allowed: 'torch' or 'auto' here "
                         "(or TRITON_INTERPRET=1 to run the kernels on the CPU)")
    if choice == "torch" or (choice == "auto" and not (has_triton and device.type == "cuda")):
        return TorchFrontEnd()
    from .portable.kernels.indices import TritonFrontEnd

    return TritonFrontEnd()


def backend_names() -> list[str]:
    return backend_mod.backend_names()


__all__ = ["SparseMLA", "Backend", "LayerInputs", "Phase", "backend_names"]
