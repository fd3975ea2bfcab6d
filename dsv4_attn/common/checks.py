"""Every check of what a user hands ``SparseMLA``: its arguments, a step, a layer's inputs.

One home for the refusals (docs/bad-input.md): each raises a ``ValueError`` that names the
argument, what it got and what is allowed, before any buffer is written or kernel launched.
Host checks (shapes, dtypes, devices, widths) always run; the value checks that read device
tensors (a sync) only with ``validate=True``. Vendor-free: nothing here imports a backend.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any

import torch

from .backend import LayerInputs
from .batch import StepBatch
from .indices import check_local_topk, validate_local_topk
from .layout import CacheGeometry, KVFormat, check_cache
from .plan import StepPlan
from .rows import StepRows
from .spec import HEAD_DIM, MAX_HEADS, LayerKind, ModelSpec


# ---- devices ---------------------------------------------------------------------------------
def default_device() -> torch.device:
    """Where work goes when nobody said: the current GPU when torch sees one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def parse_device(device, name: str = "device") -> torch.device:
    """``device`` (a string or torch.device; the argument ``name``) as a torch.device this
    machine has; ValueError for a malformed name or a device torch cannot see (never a silent
    fallback to the CPU). ROCm GPUs are cuda devices to torch."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name}: got {device!r}; allowed: 'cpu', 'cuda', 'cuda:N' or a torch.device "
                         f"({exc})") from None
    module = getattr(torch, dev.type, None)
    if dev.type != "cpu" and not (module is not None and hasattr(module, "is_available") and module.is_available()):
        what = "GPU" if dev.type == "cuda" else f"{dev.type} device"
        raise ValueError(f"{name}: got {device!r}, but torch sees no {what} (torch {torch.__version__}); "
                         "allowed: cpu or a device this machine has")
    count = getattr(module, "device_count", None)
    if dev.index is not None and count is not None and dev.index >= count():
        raise ValueError(f"{name}: got {device!r}; allowed: {dev.type}:0 .. {dev.type}:{count() - 1}")
    if dev.type != "cpu" and dev.index is None and hasattr(module, "current_device"):
        # "cuda" means the current GPU; its tensors report "cuda:N", which device checks compare with
        dev = torch.device(dev.type, module.current_device())
    return dev


def resolve_device(device, name: str = "device") -> torch.device:
    """``device`` parsed (:func:`parse_device`), or :func:`default_device` when None / empty."""
    return parse_device(device, name) if device else default_device()


# ---- construction ----------------------------------------------------------------------------
def check_construction(spec, max_tokens, max_reqs, backend, backend_names: list[str], front_end,
                       front_ends: tuple[str, ...]) -> None:
    """``SparseMLA.__init__``'s plain arguments."""
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec: got {type(spec).__name__}; allowed: a ModelSpec")
    for name, value in (("max_tokens", max_tokens), ("max_reqs", max_reqs)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: got {value!r}; allowed: a positive int")
    if not isinstance(backend, str) or (backend != "auto" and backend not in backend_names):
        raise ValueError(f"backend: got {backend!r}; allowed: 'auto' or one of {backend_names}")
    if front_end not in front_ends:
        raise ValueError(f"front_end: got {front_end!r}; allowed: one of {front_ends}")


def check_switch(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: got {value!r}; allowed: True or False")
    return value


def check_batch_invariant(backend, kind, phase) -> None:
    """``backend`` (the one chosen for ``kind`` / ``phase``) promises batch-invariant outputs."""
    if backend is None or not backend.batch_invariant:
        name = getattr(backend, "name", "?")
        raise ValueError(f"batch_invariant: got True, but backend {name!r} (chosen for {kind.name} {phase.value}) "
                         "does not promise a token's bytes independent of its batch; allowed: backend='triton' "
                         "(docs/batch-invariance.md)")


# ---- a step ----------------------------------------------------------------------------------
def check_step(spec: ModelSpec, batch, max_tokens: int, max_reqs: int, device: torch.device | None) -> int:
    """Every host check of a step (StepBatch or StepRows) before ``plan()`` writes anything: a
    refused step leaves the previous plan valid. Returns the step's num_tokens."""
    if isinstance(batch, StepRows):
        batch.check()
        batch.check_model(spec)
    elif isinstance(batch, StepBatch):
        if batch.num_reqs > max_reqs:
            raise ValueError(f"batch: got {batch.num_reqs} requests; allowed: <= max_reqs ({max_reqs})")
        batch.check()
        if batch.max_model_len > spec.max_model_len:
            raise ValueError(f"batch.max_model_len: got {batch.max_model_len}; allowed: <= spec.max_model_len "
                             f"({spec.max_model_len}), which fixes the row width of the \"all\" layers (C128A)")
        unknown = sorted(set(batch.comp_block_tables) - set(spec.comp_ratios))
        if unknown:
            raise ValueError(f"batch.comp_block_tables: got ratio(s) {unknown}; allowed: the model's compression "
                             f"ratios {list(spec.comp_ratios)}")
    else:
        raise ValueError(f"batch: got {type(batch).__name__}; allowed: a StepBatch or a StepRows")
    num_tokens = batch.checked_num_tokens
    if num_tokens > max_tokens:
        raise ValueError(f"batch.num_tokens: got {num_tokens}; allowed: <= max_tokens ({max_tokens}) "
                         "of this SparseMLA (raise max_tokens)")
    if device is not None and batch.device != device and parse_device(batch.device) != device:  # "cuda" = "cuda:N"
        raise ValueError(f"batch: got device {batch.device}; allowed: {device} (the SparseMLA's device)")
    return num_tokens


# ---- a layer ---------------------------------------------------------------------------------
def check_plan_current(plan, owner, generation: int) -> StepPlan:
    """``plan`` was built by ``owner`` and is its latest (older plans' buffers are overwritten)."""
    if not isinstance(plan, StepPlan) or plan.owner is not owner:
        raise ValueError("plan: got a plan not built by this SparseMLA; allowed: the result of this object's "
                         "plan()")
    if plan.generation != generation:
        raise ValueError(
            f"plan: got the plan of step {plan.generation}, but plan() has since been called for step "
            f"{generation} and its buffers were overwritten; allowed: the latest plan"
        )
    return plan


def check_layer(plan: StepPlan, layer: LayerInputs, out: torch.Tensor | None,
                validate: bool) -> tuple[CacheGeometry, CacheGeometry | None]:
    """Every check of ``layer`` (its geometry fields unset) and ``out`` against ``plan``; returns
    the geometry of the SWA cache and of the compressed cache (None for window-only layers)."""
    spec, q = plan.spec, layer.q
    _check_q(q, plan, spec)
    swa_geo, comp_geo = _check_caches(plan, layer)
    _check_topk(plan, layer)
    _check_sink_and_scale(layer)
    if out is not None:
        _check_out(out, q)
        check_out_alone(out, plan, layer.q, layer.swa_cache, layer.comp_cache, layer.topk, layer.sink)
    if validate:
        _check_values(plan, layer, swa_geo, comp_geo)
    return swa_geo, comp_geo


class Interner:
    """A number per distinct value (tuples of signatures), unique across every Interner of the
    process: keys built from these numbers are cheap to hash and never mix two owners' values."""

    LIMIT = 4096  # values kept; forgotten when full (a forgotten value gets a new number)

    def __init__(self) -> None:
        self._ids: dict = {}

    def get(self, value) -> int | None:
        """The number of ``value`` if it has one."""
        return self._ids.get(value)

    def __call__(self, value) -> int:
        """The number of ``value`` (a new one the first time)."""
        found = self._ids.get(value)
        if found is None:
            if len(self._ids) >= self.LIMIT:
                self._ids.clear()
            found = self._ids[value] = next(_IDS)
        return found


_IDS = itertools.count(1)


class LayerChecks:
    """:func:`check_layer` (without ``validate``) with a memo of the calls that passed: a call whose
    every input has the signature of one that passed against a plan of the same facts (the step's
    tokens, device, block sizes, rows and buffers: everything ``check_layer`` reads from a plan)
    passes without the deep checks. A signature is O(1) attributes per tensor -- its type, address,
    shape, strides, dtype and device -- which are everything the host checks read: equal
    signatures, equal verdicts. A call that changed any of them (another shape, dtype, device, an
    alias of ``out``) misses and runs every check, so it is refused exactly as without the memo.
    One per SparseMLA; refusals are never stored."""

    def __init__(self) -> None:
        self._plan_facts = Interner()
        self._passed = Interner()  # signature of a call that passed -> its number (the checked key)
        self._geometry: dict[int, tuple[CacheGeometry, CacheGeometry | None]] = {}

    def __call__(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor | None, validate: bool,
                 signature: tuple | None = None) -> tuple[CacheGeometry, CacheGeometry | None, int | None]:
        """(SWA geometry, compressed geometry, the call's checked key: a number equal for calls of
        equal signatures, or None when not memoized). ``signature``: the call's :meth:`signature`
        when the caller has it already."""
        if not validate and signature is None:
            signature = self.signature(plan, layer.kind, layer.kv_scale, layer.q, layer.swa_cache, layer.comp_cache,
                                       layer.topk, layer.sink, out)
        if validate or signature is None:
            return (*check_layer(plan, layer, out, validate), None)
        key = self._passed.get(signature)
        found = self._geometry.get(key) if key is not None else None
        if found is None:
            found = check_layer(plan, layer, out, False)  # raises: nothing stored
            key = self._passed(signature)
            if len(self._geometry) >= Interner.LIMIT:
                self._geometry.clear()
            self._geometry[key] = found
        return found[0], found[1], key

    def signature(self, plan: StepPlan, kind: LayerKind, kv_scale, q, swa_cache, comp_cache, topk, sink,
                  out) -> tuple | None:
        """The call's signature (the plan's facts, ``kind`` parsed, kv_scale, every tensor's
        :func:`tensor_signature`), or None when an input is not a tensor (or None) or kv_scale not
        a plain number (the full checks then say what is wrong)."""
        if type(kv_scale) not in (float, int):
            return None
        try:
            # the tensors' signatures from position _SIGNATURE_TENSORS on (relocation_signature)
            return (self.plan_key(plan), kind, type(kv_scale), kv_scale, tensor_signature(q),
                    tensor_signature(swa_cache), tensor_signature(comp_cache), tensor_signature(topk),
                    tensor_signature(sink), tensor_signature(out))
        except (AttributeError, RuntimeError):  # not a tensor, or one without an address (FakeTensor)
            return None

    def plan_key(self, plan: StepPlan) -> int:
        """A number for what ``check_layer`` reads from ``plan`` (once per plan): equal numbers,
        equal verdicts for equal calls."""
        return plan.cached("check_facts", lambda: self._plan_facts(_plan_facts(plan)))


def relocation_signature(signature: tuple) -> tuple:
    """A call's :meth:`LayerChecks.signature` with each tensor's address replaced by its remainder
    mod 16: equal for calls whose tensors differ at most in where they lie (16-byte alignment
    kept). Every check but :func:`check_out_alone` reads no address, so such calls have the same
    verdict once that one passes; the kernels' arguments differ only in those addresses (and each
    kernel's specialization, Triton's 16-byte divisibility, is the same)."""
    head, tensors = signature[:_SIGNATURE_TENSORS], signature[_SIGNATURE_TENSORS:]
    return (*head, *(None if t is None else (t[0], t[1] % 16, *t[2:]) for t in tensors))


_SIGNATURE_TENSORS = 4  # where a LayerChecks.signature's tensor signatures start

_PLAN_TENSORS = Interner()


def plan_tensors_key(plan: StepPlan, kind: LayerKind) -> int:
    """A number for the signatures of every plan tensor a ``kind`` layer's launches read (once per
    plan and kind; equal numbers, equal tensors up to their values): with a call's signature, what
    fixes every argument of its kernel launches."""
    return plan.cached(("plan_tensors", kind), lambda: _PLAN_TENSORS(_plan_tensors(plan, kind)))


def _plan_tensors(plan: StepPlan, kind: LayerKind) -> tuple:
    """What ``plan_tensors_key`` numbers: every plan tensor's signature, and the step's shape a kernel
    choice may read (tokens, decode tokens, the requests' start offsets)."""
    table = tensor_signature(plan.batch.comp_block_table(kind)) if plan.translates_topk(kind) else None
    rows = tuple((ratio, tensor_signature(r), tensor_signature(n)) for ratio, (r, n) in plan.comp_rows.items())
    starts = tensor_signature(getattr(plan.batch, "query_start_loc", None))
    return (plan.num_tokens, plan.num_decode_tokens, plan.batch_invariant, starts,
            *map(tensor_signature, (plan.positions, plan.token_to_req, plan.swa_rows, plan.swa_lens)), rows, table)


def _plan_facts(plan: StepPlan) -> tuple:
    """What ``check_layer`` reads from ``plan`` (once per plan)."""
    batch = plan.batch
    comp = tuple((kind, batch.comp_block_size(kind), plan.translates_topk(kind))
                 for kind in plan.spec.kinds if kind.has_comp_scope)
    return (plan.num_tokens, plan.device, batch.swa_block_size, comp,
            tuple(plan.cached("out_check_spans", lambda: _plan_spans(plan))))


def tensor_signature(t: torch.Tensor | None) -> tuple | None:
    """(type, address, shape, strides, dtype, device) of a tensor, None for None: every attribute a
    host check of a tensor reads (never its values). AttributeError for what is not a tensor."""
    if t is None:
        return None
    return type(t), t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


def working_tensor_guards() -> Any:
    """torch's ``TensorGuards`` (torch/csrc/dynamo/guards.cpp: the C++ tensor check torch.compile's
    guards run; a private API) where it works as ``MetadataProof`` uses it -- made on a tensor,
    it passes that tensor and refuses one of another shape --, else None (``MetadataProof`` then
    compares signatures in Python). Both keywords are passed: its constructor reads them
    unchecked."""
    try:
        from torch._C._dynamo import guards as dynamo_guards

        made: Any = dynamo_guards.TensorGuards  # its .pyi does not describe the tensors it takes
        t = torch.empty(2)
        guards = made(t, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        if guards.check(t) and not guards.check(torch.empty(3)):
            return made
    except Exception:  # any failure of a private API means: do not use it
        pass
    return None


_TensorGuards = working_tensor_guards()  # checked once per process


class MetadataProof:
    """Proof that tensors keep the metadata they had when the proof was made: each one's type,
    shape, strides, dtype and device -- :func:`tensor_signature` but the address. ``proof(tensors)``
    is True when every tensor of ``tensors`` (the same positions None as at making) still has
    them; False may also mean "not proven" (a tensor handed twice, another ``requires_grad`` or
    dispatch keys, e.g. made outside ``torch.inference_mode`` and checked inside): never True for
    a changed one.

    Runs torch's C++ check that torch.compile's guards run (``TensorGuards``: ~0.15 us a tensor on
    the CPU CI uses, against ~0.6 us to build a signature in Python), or, on a torch without it,
    compares signatures."""

    def __init__(self, tensors: tuple[torch.Tensor | None, ...]) -> None:
        at = [i for i, t in enumerate(tensors) if t is not None]
        # the present tensors of a call, always as a tuple (itemgetter of one position gives the item)
        self._present = operator.itemgetter(*at) if len(at) > 1 else lambda ts: tuple(ts[i] for i in at)
        present = self._present(tensors)
        if _TensorGuards is None:
            self._guards = None
            self._signatures = tuple(map(_metadata, present))
        else:
            self._guards = _TensorGuards(*present, dynamic_dims_sizes=None, dynamic_dims_strides=None)

    def __call__(self, tensors: tuple[torch.Tensor | None, ...]) -> bool:
        present = self._present(tensors)
        if self._guards is None:
            try:
                return tuple(map(_metadata, present)) == self._signatures
            except AttributeError:  # not a tensor: not proven
                return False
        return self._guards.check(*present)


def _metadata(t: torch.Tensor) -> tuple:
    """``tensor_signature`` but the address."""
    return type(t), t.shape, t.stride(), t.dtype, t.device


def _check_q(q, plan: StepPlan, spec: ModelSpec) -> None:
    T = plan.num_tokens
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[0] != T \
            or q.shape[2] != HEAD_DIM or not (spec.num_heads <= q.shape[1] <= MAX_HEADS):
        got = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(
            f"q: got {got}; allowed: torch.bfloat16 [T={T}, H, {HEAD_DIM}] with "
            f"{spec.num_heads} <= H <= {MAX_HEADS} (T = plan.num_tokens)"
        )
    if q.stride(2) != 1:
        raise ValueError(f"q: got strides {tuple(q.stride())}; allowed: last dim contiguous")
    if q.device != plan.device:
        raise ValueError(f"q: got device {q.device}; allowed: {plan.device} (the plan's device)")


def _check_caches(plan: StepPlan, layer: LayerInputs) -> tuple[CacheGeometry, CacheGeometry | None]:
    device, kind = layer.q.device, layer.kind
    swa_geo = check_cache(layer.swa_cache, layer.fmt.swa_record, "swa_cache", layer.swa_dialect)
    _check_device("swa_cache", layer.swa_cache, device)
    comp_geo = None
    if kind.has_comp_scope:
        if layer.comp_cache is None:
            raise ValueError(f"comp_cache: got None; allowed: the ratio-{kind.ratio} cache for {kind.name} layers")
        comp_geo = check_cache(layer.comp_cache, layer.fmt.comp_record, "comp_cache", layer.comp_dialect)
        _check_device("comp_cache", layer.comp_cache, device)
        want_bs = plan.batch.comp_block_size(kind)  # None: global rows fit any block size
        if want_bs is not None and comp_geo.block_size != want_bs:
            raise ValueError(
                f"comp_cache: got block size {comp_geo.block_size}; allowed: batch.block_size // "
                f"{kind.ratio} = {want_bs}"
            )
    elif layer.comp_cache is not None:
        raise ValueError("comp_cache: got a tensor for a window-only (SWA) layer; allowed: None")
    _check_addressable("swa_cache", swa_geo)
    if comp_geo is not None:
        _check_addressable("comp_cache", comp_geo)
    if plan.batch.swa_block_size is not None and swa_geo.block_size != plan.batch.swa_block_size:
        raise ValueError(f"swa_cache: got block size {swa_geo.block_size}; allowed: "
                         f"batch.swa_block_size = {plan.batch.swa_block_size}")
    return swa_geo, comp_geo


def _check_topk(plan: StepPlan, layer: LayerInputs) -> None:
    kind = layer.kind
    if kind.uses_topk and not plan.translates_topk(kind):
        if layer.topk is not None:
            raise ValueError(f"topk: got a tensor for a {kind.name} layer whose global rows the plan "
                             f"holds (StepRows.comp[{kind.ratio}] is GlobalRows); allowed: None")
    elif kind.uses_topk:
        if layer.topk is None:
            raise ValueError(f"topk: got None; allowed: int32 [T, K] local top-k for {kind.name} layers")
        check_local_topk(layer.topk, plan.num_tokens, layer.q.device, "topk", plan.spec.comp_width(kind))
    elif layer.topk is not None:
        what = "attends every compressed entry" if kind.attends_all else "is window-only"
        raise ValueError(f"topk: got a tensor for a {kind.name} layer, which {what}; allowed: None")


def _check_sink_and_scale(layer: LayerInputs) -> None:
    H, device = layer.q.shape[1], layer.q.device
    s = layer.sink
    # contiguous: the kernels read head h's sink at sink + h (a strided view would be read wrongly)
    if s is not None and (not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.shape != (H,)
                          or s.device != device or not s.is_contiguous()):
        got = (f"{s.dtype} {tuple(s.shape)} stride {tuple(s.stride())} on {s.device}" if isinstance(s, torch.Tensor)
               else type(s).__name__)
        raise ValueError(f"sink: got {got}; allowed: contiguous torch.float32 [{H}] on {device}")
    kv_scale = layer.kv_scale
    if not (isinstance(kv_scale, (int, float)) and not isinstance(kv_scale, bool)
            and math.isfinite(kv_scale) and kv_scale > 0):
        raise ValueError(f"kv_scale: got {kv_scale!r}; allowed: a finite float > 0")
    if layer.fmt is not KVFormat.FP8_TENSOR and kv_scale != 1.0:
        raise ValueError(f"kv_scale: got {kv_scale}; allowed: 1.0 for format {layer.fmt.value}")


def _check_out(out, q: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or out.shape != q.shape \
            or not out.is_contiguous() or out.device != q.device:
        got = (f"{out.dtype} {tuple(out.shape)} contiguous={out.is_contiguous()} on {out.device}"
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ValueError(f"out: got {got}; allowed: contiguous torch.bfloat16 {tuple(q.shape)} on {q.device}")


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) bytes ``t`` can touch (a superset for strided views)."""
    first = t.data_ptr()
    if t.is_contiguous():  # the common case, without a Python loop over the dims
        return first, first + t.nbytes
    if t.numel() == 0:
        return first, first
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
    return first, first + extent * t.element_size()


def _spans(named: list[tuple[str, torch.Tensor | None]]) -> list[tuple[str, torch.device, int, int]]:
    """(name, device, first byte, last byte) of each tensor given (None skipped)."""
    return [(name, t.device, *byte_span(t)) for name, t in named if t is not None]


def _plan_spans(plan: StepPlan) -> list[tuple[str, torch.device, int, int]]:
    """The byte spans of the plan's index tensors: once per plan, since every layer of the step
    checks its ``out`` against the same buffers."""
    named: list[tuple[str, torch.Tensor | None]] = [
        ("plan.positions", plan.positions), ("plan.token_to_req", plan.token_to_req),
        ("plan.token_valid", plan.token_valid), ("plan.swa_rows", plan.swa_rows), ("plan.swa_lens", plan.swa_lens)]
    for ratio, (rows, lens) in plan.comp_rows.items():
        named += [(f"plan.comp_rows[{ratio}]", rows), (f"plan.comp_rows[{ratio}] lens", lens)]
    return _spans(named)


def check_out_alone(out: torch.Tensor, plan: StepPlan, q: torch.Tensor, swa_cache: torch.Tensor,
                    comp_cache: torch.Tensor | None, topk: torch.Tensor | None, sink: torch.Tensor | None) -> None:
    """``out`` shares no byte with an input, a cache or the plan's buffers: the kernels write
    ``out`` while they read those (a cache would be overwritten, q read after being written). The
    one check whose verdict depends on addresses (``relocation_signature``)."""
    readers = _spans([("q", q), ("swa_cache", swa_cache), ("comp_cache", comp_cache), ("topk", topk),
                      ("sink", sink)])
    readers += plan.cached("out_check_spans", lambda: _plan_spans(plan))
    lo, hi = byte_span(out)
    for name, device, t_lo, t_hi in readers:
        if device != out.device:
            continue
        if lo < t_hi and t_lo < hi:
            raise ValueError(f"out: got a tensor overlapping {name} (bytes {lo:#x}..{hi:#x} and {t_lo:#x}..{t_hi:#x}); "
                             f"allowed: memory of its own (the kernels read {name} while writing out)")


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: got device {t.device}; allowed: {device} (q's device)")


def _check_addressable(name: str, geo: CacheGeometry) -> None:
    # slots are int32 everywhere (rows, kernels' in-kernel translations): a bigger cache
    # would wrap them into other rows' slots
    if geo.num_slots > 2**31:
        raise ValueError(f"{name}: got {geo.num_blocks} blocks x {geo.block_size} = {geo.num_slots} slots; "
                         "allowed: at most 2**31 (slots are int32)")


def _check_values(plan: StepPlan, layer: LayerInputs, swa_geo: CacheGeometry, comp_geo: CacheGeometry | None) -> None:
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
        validate_local_topk(plan.tokens, layer.topk, layer.kind.ratio, "topk")
    if layer.sink is not None and bool(layer.sink.isnan().any()):
        h = int(layer.sink.isnan().nonzero()[0])
        raise ValueError(f"sink: got NaN at head {h}; allowed: a float or ±inf per head (a NaN sink "
                         "makes that head's output NaN)")
