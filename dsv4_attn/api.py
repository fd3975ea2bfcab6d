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

import functools
import importlib.util

import torch

from .common import checks, registry
from .common.backend import Backend, BackendUnavailableError, LayerInputs, Phase, repeat_sources
from .common.batch import StepBatch
from .common.layout import Fp8Dialect, KVFormat
from .common.plan import FrontEnd, PlanBuffers, StepPlan, TorchFrontEnd, build_plan
from .common.platform import Platform, platform_for_device, triton_interpreting
from .common.rows import StepRows
from .common.selection import Selection, measured_lines
from .common.spec import LayerKind, ModelSpec


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
    batch_invariant  True: a token's output bytes depend on its own inputs only, never on the
                other requests of its batch nor on a split decision (reproducible sampling: RL
                rollouts, evaluation; docs/batch-invariance.md). Backends that cannot promise it
                are refused at construction; auto's choice no longer depends on the batch size.
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
        batch_invariant: bool = False,
    ) -> None:
        checks.check_construction(spec, max_tokens, max_reqs, backend, registry.backend_names(), front_end,
                                  _FRONT_ENDS)
        self.spec = spec
        self._scale = spec.scale  # (a frozen spec's) read per layer call
        self.fmt = KVFormat.parse(fmt)
        self.swa_dialect = Fp8Dialect.parse(swa_dialect)
        self.comp_dialect = Fp8Dialect.parse(comp_dialect)
        self.max_tokens = max_tokens
        self.max_reqs = max_reqs
        self._front_end_choice = front_end
        self.batch_invariant = checks.check_switch(batch_invariant, "batch_invariant")
        self._explicit = backend
        self._device = checks.parse_device(device) if device is not None else None
        self._front_end: FrontEnd | None = (_make_front_end(front_end, self._device)
                                            if self._device is not None else None)
        self._buffers: PlanBuffers | None = None
        self._generation = 0
        self._checks = checks.LayerChecks()  # the per-layer checks, with their memo of passed calls
        self._backends: dict[str, Backend] = {}  # this model's own instances (their buffers are its own)
        self._selection = Selection(self._backend)  # decisions cached per kind, phase, launch-size range
        self._repeats: dict[tuple, tuple] = {}  # repeat key -> (backend, its Backend.repeat, MetadataProof)
        self._step_keys = checks.Interner()  # (plan facts, plan tensors, kind) -> the number a repeat key holds
        self._relocatable: dict[tuple, tuple] = {}  # a call's relocation key -> (backend, a Backend.repeat)
        # Refuse at construction (engine start) when the requested backend cannot run a layer.
        for kind in spec.kinds:
            for phase in Phase:
                name = self.backend_for(kind, phase)
                if batch_invariant:
                    checks.check_batch_invariant(registry.get_backend(name), kind, phase)

    # ---- backend choice -------------------------------------------------------------------
    @property
    def dialects(self) -> tuple[Fp8Dialect, Fp8Dialect]:
        return self.swa_dialect, self.comp_dialect

    @property
    def platform(self) -> Platform:
        return platform_for_device(self._device or checks.default_device())

    def backend_for(self, kind: LayerKind | str | int, phase: Phase | str, num_tokens: int | None = None) -> str:
        """Name of the backend that runs ``kind`` / ``phase`` now (raises with reasons if none);
        with ``num_tokens`` (the phase's tokens in one launch) auto selection follows the measured
        choices table where it covers the launch (common/choices.py)."""
        kind, phase = self.spec.check_kind(kind), Phase(phase)
        requested, source = registry.requested_backend(self._explicit)
        return self._selection.pick(self.platform, self.spec, self.fmt, self.dialects, kind, phase, requested,
                                    source, num_tokens)

    def explain(self) -> str:
        """Table: per backend, kind and phase: chosen / ok / refused, with the reasons."""
        plat = self.platform
        requested, source = registry.requested_backend(self._explicit)
        front = self._front_end.name if self._front_end else f"{self._front_end_choice} (chosen at the first plan)"
        lines = [
            f"dsv4_attn on {plat.vendor}/{plat.arch} ({plat.device_name}), format {self.fmt.value}, "
            f"{self.spec.num_heads} heads, requested backend: {requested} ({source}), index front end: {front}",
            f"{'backend':<18} {'kinds':<14} {'phase':<8} {'status':<8} reasons",
        ]
        for name in registry.backend_names():
            verdicts: dict[tuple[str, str, str], list[str]] = {}  # (phase, status, why) -> kinds, each reason once
            for phase in Phase:
                for kind in self.spec.kinds:
                    reasons = registry.reasons_for(name, plat, self.spec, self.fmt, kind, phase, self.dialects)
                    try:
                        chosen = self.backend_for(kind, phase) == name
                    except BackendUnavailableError:
                        chosen = False
                    status = "chosen" if chosen else ("ok" if not reasons else "refused")
                    impl = registry.get_backend(name)  # importable: reasons_for said nothing against it
                    why = reasons or ([impl.choice(plat, self.spec, self.fmt, kind, phase, self.dialects)]
                                      if impl else [])
                    if chosen:  # where its launches above its launch limit run, first
                        beyond = functools.partial(self.backend_for, kind, phase)
                        why.insert(0, self._selection.limit_note(name, phase, beyond))
                    verdicts.setdefault((phase.value, status, "; ".join(r for r in why if r)), []).append(kind.name)
            every_kind = len(self.spec.kinds)
            rows = [("all" if len(kinds) == every_kind else ",".join(kinds), phase, status, why)
                    for (phase, status, why), kinds in verdicts.items()]
            if len({row[2:] for row in rows}) == 1 and all(row[0] == "all" for row in rows):
                rows = [("all", "all") + rows[0][2:]]  # the same verdict everywhere: one line
            lines.extend(f"{name:<18} {k:<14} {p:<8} {st:<8} {why}" for k, p, st, why in rows)
        return "\n".join(lines + measured_lines(plat, self.spec, self.fmt, requested))

    # ---- per step ---------------------------------------------------------------------------
    def plan(self, batch: StepBatch | StepRows, validate: bool = False) -> StepPlan:
        """Build the step's shared metadata into the preallocated buffers (no host sync).

        ``batch`` is a StepBatch (block tables: the rows are built here) or a StepRows
        (ready-made rows: viewed, not copied; see ``dsv4_attn.common.rows``).
        ``validate=True`` also runs the value checks that read device tensors (``validate()``).
        The returned plan is valid until the next successful ``plan()`` call (a refused one
        leaves it valid). Every call re-reads the batch's tensors: engines update them in place.
        """
        checks.check_step(self.spec, batch, self.max_tokens, self.max_reqs, self._device)
        if validate:
            batch.validate()
        buffers = self._ensure_buffers(batch.device)
        # only now: a refused step leaves the previous plan (and its buffers) valid
        self._generation += 1
        return build_plan(self.spec, batch, buffers, self, self._generation, self._front_end,
                          self.batch_invariant)

    def reserve(self, plan: StepPlan, decode_tokens: int | None = None) -> None:
        """Engine start (a memory profile): let each decode backend allocate the buffers steps of
        up to ``decode_tokens`` decode tokens (default ``max_tokens``) will use (``Backend.reserve``),
        and compile the index front end's kernels (``FrontEnd.warm``: the top-k rows', and the
        step rows' for a plan of a StepBatch)."""
        plan.front_end.warm(self._ensure_buffers(plan.device), step_rows=isinstance(plan.batch, StepBatch))
        for name in dict.fromkeys(self.backend_for(kind, Phase.DECODE) for kind in self.spec.kinds):
            self._backend(name).reserve(plan, self.fmt, self.spec.num_heads, self.dialects,
                                        decode_tokens or self.max_tokens)
        self._selection.forget()  # reserve may have moved a launch limit: decide again

    def _ensure_buffers(self, device: torch.device) -> PlanBuffers:
        """The plan buffers, allocated on the first plan's device."""
        if self._buffers is None:
            self._device = self._device or checks.parse_device(device)
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
        sink       float32 [H], contiguous (None = no sink)
        out        bf16 [T, H, 512] contiguous, written in place (allocated when None)
        validate   also check the step's values against the caches (reads device tensors: a
                   sync): every used block id inside its cache, topk entries inside each
                   token's valid prefix -1 or visible, no NaN sink. Without it any out-of-range
                   block id, slot or top-k entry is skipped like -1 (never read), and NaN in a
                   selected key or the sink comes out as NaN (docs/bad-input.md).
        Returns out.
        """
        kind = self.spec.check_kind(kind)
        checks.check_plan_current(plan, self, self._generation)
        tensors = (q, swa_cache, comp_cache, topk, sink, out)
        repeat = None if validate or out is None else self._repeat_key(plan, kind, kv_scale, tensors)
        if repeat is not None and out is not None and self._repeated(repeat[0], repeat[1], tensors):
            return out
        signature = None if validate else self._checks.signature(plan, kind, kv_scale, *tensors)
        if repeat is not None and signature is not None and out is not None and self._relocated(
                repeat[0], repeat[1], signature, plan, q, out, swa_cache, comp_cache, topk, sink):
            return out
        layer = self._checked(plan, kind, q, swa_cache, comp_cache, topk, sink, kv_scale, validate, out, signature)
        if out is None:
            out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        route = self._route(plan, layer.kind)
        if route[0][2] is None:  # one backend for the whole step
            backend = route[0][0]
            backend.forward(plan, layer, out)
            if repeat is not None and signature is not None:
                replay = backend.repeat(plan, layer, out)
                self._remember(repeat[1], backend, replay, tensors)
                self._remember_relocatable(self._relocation_key(signature, repeat[1], swa_cache, comp_cache),
                                           backend, replay)
            return out
        for backend, sub_plan, tokens in route:
            backend.forward(sub_plan, layer.token_slice(*tokens), out[tokens[0]:tokens[1]])
        return out

    REPEATS_LIMIT = 4096  # repeatable layer calls kept; forgotten when full

    def _repeat_key(self, plan: StepPlan, kind: LayerKind, kv_scale, tensors: tuple) -> tuple | None:
        """(the step's route for ``kind``: ``_route``, the call's repeat key), or None when an input
        has no address or kv_scale is not a plain number (the full path says what is wrong).

        The key: a number for (the plan's facts the checks read, the plan tensors a ``kind`` launch
        reads, ``kind``), kv_scale and its type, the address of each of ``tensors`` (q, swa_cache,
        comp_cache, topk, sink, out; None for None) and the caches' storage offsets. With a
        ``checks.MetadataProof`` of the tensors (type, shape, strides, dtype, device) it is
        everything the checks and a bound launch read: a call with an equal key and a proof that
        holds is a call that passed, and its launches are the bound ones."""
        if type(kv_scale) not in (float, int):
            return None
        route, step = plan.cached(("repeat", kind, registry.context_backend()), lambda: (
            self._route(plan, kind),
            self._step_keys((self._checks.plan_key(plan), checks.plan_tensors_key(plan, kind), kind))))
        q, swa_cache, comp_cache, topk, sink, out = tensors
        try:
            return route, (step, type(kv_scale), kv_scale, q.data_ptr(), swa_cache.data_ptr(),
                           swa_cache.storage_offset(),
                           None if comp_cache is None else (comp_cache.data_ptr(), comp_cache.storage_offset()),
                           None if topk is None else topk.data_ptr(), None if sink is None else sink.data_ptr(),
                           out.data_ptr())
        except (AttributeError, RuntimeError):  # not a tensor, or one without an address (FakeTensor)
            return None

    def _repeated(self, route: tuple, key: tuple, tensors: tuple) -> bool:
        """Run a layer call again through what its backend bound for an earlier call of the same
        ``key`` (``_repeat_key``) whose proof of its ``tensors``' metadata still holds, when the
        step's ``route`` for the layer's kind (``_route``) still sends it to that backend; False
        when none ran."""
        found = self._repeats.get(key)
        if found is None:
            return False
        backend, repeat, proof = found
        return route[0][0] is backend and route[0][2] is None and proof(tensors) and repeat()

    @staticmethod
    def _relocation_key(signature: tuple, repeat_key: tuple, swa_cache: torch.Tensor,
                        comp_cache: torch.Tensor | None) -> tuple:
        """What a call keeps when its tensors move (16-byte alignment kept):
        ``checks.relocation_signature`` of its checks' ``signature``, the number for (plan facts,
        plan tensors, kind) that heads its ``repeat_key``, the caches' storage offsets mod 16."""
        return (checks.relocation_signature(signature), repeat_key[0], swa_cache.storage_offset() % 16,
                None if comp_cache is None else comp_cache.storage_offset() % 16)

    def _relocated(self, route: tuple, repeat_key: tuple, signature: tuple, plan: StepPlan, q: torch.Tensor,
                   out: torch.Tensor, swa_cache: torch.Tensor, comp_cache: torch.Tensor | None,
                   topk: torch.Tensor | None, sink: torch.Tensor | None) -> bool:
        """Run a layer call through what its backend bound for an earlier call whose tensors differed
        only in their addresses (the same ``_relocation_key``), when the step's ``route`` still
        sends the kind to that backend. The earlier call passed every check that reads no address;
        the one that does (``out`` overlapping an input) runs here, and refuses as the full path
        would. The moved call is kept under ``repeat_key`` for its own repeats. False when none ran
        (no key is built while nothing was bound: backends that bind nothing pay nothing here)."""
        if not self._relocatable:
            return False
        found = self._relocatable.get(self._relocation_key(signature, repeat_key, swa_cache, comp_cache))
        if found is None:
            return False
        backend, template = found
        if route[0][0] is not backend or route[0][2] is not None:
            return False
        checks.check_out_alone(out, plan, q, swa_cache, comp_cache, topk, sink)
        moved = template.relocated(repeat_sources(q, out, swa_cache, comp_cache, topk, sink))
        if moved is None or not moved():
            return False
        self._remember(repeat_key, backend, moved, (q, swa_cache, comp_cache, topk, sink, out))
        return True

    def _remember(self, key: tuple, backend: Backend, repeat, tensors: tuple) -> None:
        if repeat is None:
            return
        if len(self._repeats) >= self.REPEATS_LIMIT:
            self._repeats.clear()
        self._repeats[key] = (backend, repeat, checks.MetadataProof(tensors))

    def _remember_relocatable(self, key: tuple, backend: Backend, repeat) -> None:
        if repeat is None:
            return
        if len(self._relocatable) >= self.REPEATS_LIMIT:
            self._relocatable.clear()
        self._relocatable[key] = (backend, repeat)

    def _route(self, plan: StepPlan, kind: LayerKind) -> tuple:
        """((backend, sub-plan, token range), ...) that run ``kind``'s layers of ``plan``: one
        backend for the whole step (``((backend, None, None),)``: ``plan`` itself, which its own
        cache must not hold -- a plan referring to itself is freed only by a garbage collection,
        with every per-step tensor its backends' metadata holds), or one per phase. Decided once per plan, kind
        and ``dsv4_attn.backend()`` context, so every layer of a step after the first pays two
        lookups: the environment (``DSV4_ATTN_BACKEND``, ``DSV4_ATTN_CHOICES``) is read at the
        first layer of each kind of a plan, so a change takes effect at the next step (reading it
        at every layer call cost ~1 us per variable)."""
        return plan.cached(("route", kind, registry.context_backend()), lambda: self._new_route(plan, kind))

    def _new_route(self, plan: StepPlan, kind: LayerKind) -> tuple:
        T, nd = plan.num_tokens, plan.num_decode_tokens
        phases = [(p, a, b) for p, a, b in ((Phase.DECODE, 0, nd), (Phase.PREFILL, nd, T)) if b > a]
        names = {p: self.backend_for(kind, p, None if self.batch_invariant else b - a) for p, a, b in phases}
        backends = {p: self._backend(n) for p, n in names.items()}
        if len(set(names.values())) == 1 and not backends[phases[0][0]].splits_phases:
            return ((backends[phases[0][0]], None, None),)
        return tuple((backends[p], plan.phase_plan(p), (a, b)) for p, a, b in phases)

    def layer_inputs(self, plan: StepPlan, kind: LayerKind | str | int, q: torch.Tensor, swa_cache: torch.Tensor,
                     comp_cache: torch.Tensor | None = None, topk: torch.Tensor | None = None,
                     sink: torch.Tensor | None = None, kv_scale: float = 1.0, validate: bool = False,
                     out: torch.Tensor | None = None) -> LayerInputs:
        """One layer's inputs checked against ``plan`` (the arguments of :meth:`forward`, ``out``
        included when given), with the caches' geometry, as ``Backend.forward`` takes them (for
        callers that drive a backend directly, e.g. one phase at a time)."""
        return self._layer_inputs(plan, kind, q, swa_cache, comp_cache, topk, sink, kv_scale, validate, out)

    def _layer_inputs(self, plan: StepPlan, kind, q, swa_cache, comp_cache, topk, sink, kv_scale: float,
                      validate: bool, out: torch.Tensor | None = None) -> LayerInputs:
        kind = self.spec.check_kind(kind)
        checks.check_plan_current(plan, self, self._generation)
        return self._checked(plan, kind, q, swa_cache, comp_cache, topk, sink, kv_scale, validate, out, None)

    def _checked(self, plan: StepPlan, kind: LayerKind, q, swa_cache, comp_cache, topk, sink, kv_scale: float,
                 validate: bool, out: torch.Tensor | None, signature: tuple | None) -> LayerInputs:
        """Every check of a layer's inputs (``kind`` parsed, ``plan`` current), once; the backends
        trust the result (its geometry). ``signature``: the call's, when the caller has it."""
        layer = LayerInputs(kind, q, swa_cache, comp_cache, topk, sink, self.fmt, self._scale, kv_scale,
                            self.swa_dialect, self.comp_dialect,
                            swa_geo=None, comp_geo=None)  # type: ignore[arg-type]  # set below, once checked
        layer.swa_geo, layer.comp_geo, layer.checked_key = self._checks(plan, layer, out, validate, signature)
        if layer.checked_key is not None:
            layer.checked_out = out
        return layer

    def _backend(self, name: str) -> Backend:
        if name not in self._backends:
            self._backends[name] = registry.new_backend(name)
        return self._backends[name]


_FRONT_ENDS = ("auto", "torch", "triton")


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
    return registry.backend_names()


__all__ = ["SparseMLA", "Backend", "LayerInputs", "Phase", "backend_names"]
