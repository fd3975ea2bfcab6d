"""The per-layer-call host path's memos keep every guarantee (issue 24 item 6).

* The checks' memo (``common.checks.LayerChecks``): a layer call that changed anything after a call
  that passed -- a tensor's shape, dtype, device, strides, an alias of ``out`` -- is refused with
  the same ValueError a SparseMLA that never saw a call raises; a repeated call skips the deep
  checks; a ``dataclasses.replace`` copy of a checked LayerInputs carries no key.
* The bound launch (``portable/kernels/launch.py``): the launcher gets every parameter in the
  kernel's own order (checked against the real kernels' signatures), tensors as the addresses
  Triton's launcher reads from them, the call's temporaries at their new addresses; under the
  interpreter nothing is bound and repeated calls give the same bytes as the first. The GPU test
  compares a bound launch's bytes with a plain one's.

No test here reads a time (host times are ``python -m dsv4_attn.bench.host``'s job).
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import inspect
import re
import threading

import pytest
import torch

import dsv4_attn as dsv4
from dsv4_attn import api
from dsv4_attn.common import checks
from dsv4_attn.common.backend import LayerInputs
from dsv4_attn.common.spec import LayerKind
from dsv4_attn.testing.steps import make_step

from kit.launches import c4a_launches

HAS_TRITON = importlib.util.find_spec("triton") is not None
C4A_ONLY = (LayerKind.SWA, LayerKind.C4A)


@pytest.fixture
def case(gen):
    return make_step(gen, [1, 3], [40, 90], kinds=C4A_ONLY, topk=16, max_model_len=1024)


def _set_stream(monkeypatch, stream: int) -> list[int]:
    """Make ``stream`` the current stream as launches read it (``launch._stream_of``: at binding
    and in a replay's C guard); returns the cell that changes it."""
    from dsv4_attn.portable.kernels import launch

    current = [stream]
    monkeypatch.setattr(launch, "_stream_of", lambda: lambda index: current[0])
    return current


def _call(mla, plan, case, **changes):
    args = dict(q=case.q, swa_cache=case.caches["swa"], comp_cache=case.caches[LayerKind.C4A],
                topk=case.topks[LayerKind.C4A], sink=case.sink, out=torch.full_like(case.q, float("nan")))
    args.update(changes)
    return mla.forward(plan, LayerKind.C4A, **args)


def _refusal(mla, plan, case, **changes) -> str:
    with pytest.raises(ValueError) as info:
        _call(mla, plan, case, **changes)
    return str(info.value)


def _changes(case, plan):
    """name -> inputs that differ from the good call in one attribute the checks read."""
    q, swa, comp = case.q, case.caches["swa"], case.caches[LayerKind.C4A]
    topk, T = case.topks[LayerKind.C4A], case.q.shape[0]
    return {
        "q shape": dict(q=q[:-1]),
        "q dtype": dict(q=q.float()),
        "q device": dict(q=q.to("meta")),
        "q strides": dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)),
        "swa_cache dtype": dict(swa_cache=swa.view(torch.bool)),
        "swa_cache row": dict(swa_cache=swa[:, :, :-8]),
        "comp_cache block size": dict(comp_cache=comp.reshape(comp.shape[0] * 2, comp.shape[1] // 2, -1)),
        "comp_cache device": dict(comp_cache=comp.to("meta")),
        "topk dtype": dict(topk=topk.to(torch.int16)),
        "topk width": dict(topk=topk[:, :-1]),
        "sink dtype": dict(sink=case.sink.double()),
        "out dtype": dict(out=torch.empty(q.shape, dtype=torch.float16)),
        "out strides": dict(out=torch.empty(q.shape[::-1], dtype=torch.bfloat16).permute(2, 1, 0)),
        "out is q": dict(out=q),
        "out views the swa cache": dict(out=torch.empty(0, dtype=torch.bfloat16).set_(
            swa.untyped_storage(), 0, tuple(q.shape))),
        "out views the plan's rows": dict(out=torch.empty(0, dtype=torch.bfloat16).set_(
            plan.swa_rows.untyped_storage(), 0, tuple(q.shape))),
        "kv_scale": dict(kv_scale=2.0),
        "kv_scale bool": dict(kv_scale=True),
        "topk None": dict(topk=None),
        "T": dict(q=torch.cat([q, q[:1]]), out=torch.empty(T + 1, *q.shape[1:], dtype=torch.bfloat16)),
    }


def test_a_change_after_a_passed_call_is_refused_as_without_the_memo(case):
    """After a good call (memoized), each change is refused with exactly the message of a fresh
    SparseMLA's first call, and the good call still passes afterwards."""
    warm = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
    plan = warm.plan(case.batch)
    _call(warm, plan, case)
    _call(warm, plan, case)
    for name, changes in _changes(case, plan).items():
        cold = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
        cold_plan = cold.plan(case.batch)
        expected = _unaddressed(_refusal(cold, cold_plan, case, **_changes(case, cold_plan)[name]))
        assert _unaddressed(_refusal(warm, plan, case, **changes)) == expected, name
        assert _unaddressed(_refusal(warm, plan, case, **changes)) == expected, f"{name}, twice"
    assert not _call(warm, plan, case).isnan().any()


def _unaddressed(message: str) -> str:
    """A refusal without its byte addresses (each model's plan buffers live elsewhere)."""
    return re.sub(r"0x[0-9a-f]+", "0x?", message)


def test_a_tensor_changed_in_place_after_a_passed_call_is_refused(case):
    """The same out object, made non-contiguous in place (as_strided_) after a call that passed."""
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(case.batch)
    out = torch.empty(2 * case.q.numel(), dtype=torch.bfloat16).view(2, *case.q.shape)[0]
    _call(mla, plan, case, out=out)
    T, H, D = case.q.shape
    out.as_strided_(case.q.shape, (2 * H * D, D, 1))
    with pytest.raises(ValueError, match=r"^out: got .*contiguous=False"):
        _call(mla, plan, case, out=out)


def test_a_repeated_call_skips_the_deep_checks_and_a_new_one_runs_them(case, monkeypatch):
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(case.batch)
    calls = []
    real = checks.check_layer
    monkeypatch.setattr(checks, "check_layer", lambda *a: calls.append(1) or real(*a))
    out = torch.empty_like(case.q)
    for _ in range(3):
        _call(mla, plan, case, out=out)
    assert len(calls) == 1
    _call(mla, plan, case, out=torch.empty_like(case.q))  # another out: its checks run
    assert len(calls) == 2
    _call(mla, mla.plan(case.batch), case, out=out)  # the next step, same facts: memoized
    assert len(calls) == 2
    mla.forward(plan := mla.plan(case.batch), LayerKind.C4A, case.q, case.caches["swa"],
                case.caches[LayerKind.C4A], topk=case.topks[LayerKind.C4A], sink=case.sink, out=out, validate=True)
    assert len(calls) == 3  # validate reads values: never memoized


def test_a_replaced_copy_of_checked_inputs_carries_no_key(case):
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
    plan = mla.plan(case.batch)
    layer = mla.layer_inputs(plan, LayerKind.C4A, case.q, case.caches["swa"], case.caches[LayerKind.C4A],
                             case.topks[LayerKind.C4A], case.sink)
    again = mla.layer_inputs(plan, LayerKind.C4A, case.q, case.caches["swa"], case.caches[LayerKind.C4A],
                             case.topks[LayerKind.C4A], case.sink)
    assert layer.checked_key is not None and layer.checked_key == again.checked_key
    assert dataclasses.replace(layer, q=case.q[:1]).checked_key is None
    assert layer.token_slice(0, 1).checked_key == (layer.checked_key, 0, 1)
    other = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch")
    theirs = other.layer_inputs(other.plan(case.batch), LayerKind.C4A, case.q, case.caches["swa"],
                                case.caches[LayerKind.C4A], case.topks[LayerKind.C4A], case.sink)
    assert theirs.checked_key != layer.checked_key  # two models' keys never mix


# ---- the bound launch -----------------------------------------------------------------------
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton missing")


@needs_triton
@pytest.mark.parametrize("kernel", ["portable", "gluon", "pingpong"])
def test_bound_parameters_follow_each_kernels_own_signature(case, monkeypatch, kernel):
    """What the launcher gets is what JITFunction.run hands it: every parameter in the signature's
    order (inspect's binding of the kernel's Python function), constexprs where they stand. The
    Gluon (H100) kernels' launches (the 64-head kernel and its split combine; the ping-pong prefill
    kernel, unsplit) are described here as on an sm_90 GPU; nothing is launched."""
    from dsv4_attn.portable.kernels import launch, ops

    if kernel != "portable":
        if not ops._gluon_importable():
            pytest.skip("this Triton's Gluon does not import the Hopper kernel")
        monkeypatch.setattr(ops, "use_gluon", lambda *args, **kwargs: True)
    if kernel == "pingpong":
        monkeypatch.setattr(ops, "device_arch", lambda device: "sm90")
        layer = c4a_launches(case, split=1, heads_on_n=0, pingpong=1)
        assert [one.fn.__module__.rsplit(".", 1)[-1] for one in layer.launches] == ["hopper_prefill"]
    else:
        layer = c4a_launches(case, split=2)
        assert len(layer.launches) == 2  # the attention kernel and the split combine
        assert ("hopper" in layer.launches[0].fn.__module__) == (kernel == "gluon")
    for one in layer.launches:
        expected = inspect.signature(one.fn.fn).bind(*one.args, **one.constexprs).arguments
        ordered = launch.ordered_parameters(one)
        assert ordered is not None and len(ordered) == len(expected)
        assert all(a is b for a, b in zip(ordered, expected.values()))


class _Recording:
    """A CompiledKernel stand-in whose launcher records its arguments."""

    function, packed_metadata = "function", "packed"

    def __init__(self) -> None:
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


@needs_triton
def test_a_replay_hands_the_launcher_the_plain_launchs_arguments(case, monkeypatch):
    """Bound from a layer's launches (split partials and P scratch as temporaries), a replay calls
    each launcher with the grid, the stream, no hooks and every parameter: tensors as their
    addresses, the temporaries at the new ones (same offsets), everything else as given."""
    from dsv4_attn.portable.kernels import launch

    layer = c4a_launches(case, split=2)
    assert len(layer.temporaries) == 3  # split partials, P scratch, alpha scratch
    kernels = [_Recording() for _ in layer.launches]
    _set_stream(monkeypatch, 1234)
    workspace = launch.Workspace(torch.device("cpu"))
    replay = launch.bind_launches(layer, kernels, torch.device("cpu"), workspace)
    assert replay() is True and replay() is True
    for one, kernel in zip(layer.launches, kernels):
        first, again = kernel.calls
        assert again == first  # the same arguments every call: the temporaries stay in the workspace
        grid = (tuple(one.grid) + (1, 1))[:3]
        assert first[:9] == (*grid, 1234, "function", "packed", None, None, None)
        params = launch.ordered_parameters(one)
        assert len(first) == 9 + len(params)
        for sent, given in zip(first[9:], params):
            if not isinstance(given, torch.Tensor):
                assert sent == given or (sent is given)
                continue
            storage = given.untyped_storage().data_ptr()
            temps = [t for t in layer.temporaries if t.untyped_storage().data_ptr() == storage]
            if not temps:
                assert sent == given.data_ptr()
                continue
            (temp,) = temps  # in the workspace, at the temporary's place, same offset and alignment
            lo = workspace.address
            assert lo <= sent and sent + given.numel() * given.element_size() <= lo + workspace.size
            assert (sent - given.data_ptr()) % 16 == 0
    # the temporaries' places in the workspace do not overlap
    offsets, size = launch.temporaries_layout(layer.temporaries)
    spans = sorted((o, o + t.numel() * t.element_size()) for o, t in zip(offsets, layer.temporaries))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= size <= workspace.size


@needs_triton
def test_a_workspace_grown_by_a_later_binding_moves_every_replay_of_its_stream(case, monkeypatch):
    """Replays share their stream's workspace; a binding that needs more grows it (never a replay),
    and an earlier replay then hands its launchers the temporaries' places in the new buffer."""
    from dsv4_attn.portable.kernels import launch

    _set_stream(monkeypatch, 0)
    workspace = launch.Workspace(torch.device("cpu"))
    small = c4a_launches(case, split=2)
    small_kernels = [_Recording() for _ in small.launches]
    replay = launch.bind_launches(small, small_kernels, torch.device("cpu"), workspace)
    assert replay()
    before = workspace.address
    small.temporaries.append(torch.empty(workspace.size + 4096, dtype=torch.uint8))  # a larger call's need
    launch.bind_launches(small, [_Recording() for _ in small.launches], torch.device("cpu"), workspace)
    assert workspace.address != before
    assert replay()
    old, new = (call[9:] for call in small_kernels[0].calls)
    moved = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
    assert moved and all(new[i] - workspace.address == old[i] - before for i in moved)


@needs_triton
def test_temporaries_above_the_workspace_limit_are_not_bound(case, monkeypatch):
    """A call whose temporaries exceed WORKSPACE_LIMIT (a large prefill's P scratch) stays plain:
    no replay, the workspace not grown."""
    from dsv4_attn.portable.kernels import launch

    _set_stream(monkeypatch, 0)
    layer = c4a_launches(case, split=2)
    size = launch.temporaries_layout(layer.temporaries)[1]
    workspace = launch.Workspace(torch.device("cpu"))
    monkeypatch.setattr(launch, "WORKSPACE_LIMIT", size - 1)
    assert launch.bind_launches(layer, [_Recording() for _ in layer.launches], torch.device("cpu"), workspace) is None
    assert workspace.buffer is None
    monkeypatch.setattr(launch, "WORKSPACE_LIMIT", size)
    assert launch.bind_launches(layer, [_Recording() for _ in layer.launches], torch.device("cpu"), workspace)
    assert workspace.size == size


@needs_triton
def test_in_a_graph_capture_replays_step_aside_and_nothing_is_bound(case, monkeypatch):
    """Inside a capture (as ``common.plan.capturing`` and the driver's query a replay's C guard asks,
    ``launch._capture_query``, report it) a bound call launches plainly --
    its temporaries then come from the capture's pool, not the workspace a graph could outlive --
    and the backend binds nothing (no workspace grows there); after it, the replay runs again.
    Kernels stubbed, launches bound as on a GPU."""
    from dsv4_attn.bench import host
    from dsv4_attn.portable import triton_backend
    from dsv4_attn.portable.kernels import launch

    stream_capturing = [False]

    def is_capturing(stream, status) -> int:  # the driver's cuStreamIsCapturing, as the replay's C guard asks it
        status[0] = int(stream_capturing[0])
        return 0

    query = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))(is_capturing)
    monkeypatch.setattr(launch, "_capture_query", lambda device: ctypes.cast(query, ctypes.c_void_p).value)
    with host.kernels_stubbed():
        runs, plain = [], []
        monkeypatch.setattr(host._StubCompiled, "run", staticmethod(lambda *args: runs.append(args)))
        real_plain = launch.KernelLaunch.plain
        monkeypatch.setattr(launch.KernelLaunch, "plain", lambda one: plain.append(one) or real_plain(one))
        mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="triton")
        plan = mla.plan(case.batch)
        out = torch.empty_like(case.q)
        for _ in range(3):  # plain, plain + bind, bound
            _call(mla, plan, case, out=out)
        backend = mla._backend("triton")
        bound = dict(backend._replays)
        sizes = {key: w.size for key, w in backend._workspaces.items()}
        launches, runs_before = len(plain), len(runs)
        monkeypatch.setattr(triton_backend, "capturing", lambda device: True)
        stream_capturing[0] = True
        _call(mla, plan, case, out=out)  # a capture: the plain launches, nothing bound
        fresh_q = case.q.clone()
        _call(mla, plan, case, q=fresh_q, out=out)  # a call never seen, twice (outside: bound): nothing bound
        _call(mla, plan, case, q=fresh_q, out=out)
        assert len(plain) > launches and len(runs) == runs_before
        assert backend._replays.keys() == bound.keys() and all(backend._replays[k] is v for k, v in bound.items())
        assert {key: w.size for key, w in backend._workspaces.items()} == sizes
        monkeypatch.setattr(triton_backend, "capturing", lambda device: False)
        stream_capturing[0] = False
        launches = len(plain)
        _call(mla, plan, case, out=out)  # after the capture: the bound launches again
        assert len(plain) == launches and len(runs) > runs_before


@needs_triton
def test_two_streams_bind_into_workspaces_of_their_own(case, monkeypatch):
    """The same layer call bound on two streams: each stream's launches get temporaries in that
    stream's workspace (two buffers), so layers running at once on two streams never share them."""
    from dsv4_attn.bench import host

    with host.kernels_stubbed():
        runs = []
        monkeypatch.setattr(host._StubCompiled, "run", staticmethod(lambda *args: runs.append(args)))
        mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="triton")
        plan = mla.plan(case.batch)
        out = torch.empty_like(case.q)
        sent = {}
        current_stream = _set_stream(monkeypatch, 0)
        for stream in (1, 2):
            current_stream[0] = stream
            for _ in range(3):  # plain, plain + bind, bound
                _call(mla, plan, case, out=out)
            sent[stream] = runs[-1]
        workspaces = mla._backend("triton")._workspaces
        assert {key[1] for key in workspaces} == {1, 2}
        spans = {key[1]: (w.address, w.address + w.size) for key, w in workspaces.items()}
        assert spans[1][1] <= spans[2][0] or spans[2][1] <= spans[1][0]  # two buffers
        for stream, args in sent.items():
            assert args[3] == stream
            lo, hi = spans[stream]
            other_lo, other_hi = spans[3 - stream]
            inside = [a for a in args[9:] if isinstance(a, int) and lo <= a < hi]
            assert inside and not [a for a in args[9:] if isinstance(a, int) and other_lo <= a < other_hi]


@needs_triton
def test_a_replay_steps_aside_for_a_launch_hook(case, monkeypatch):
    from triton import knobs

    from dsv4_attn.portable.kernels import launch

    layer = c4a_launches(case, split=2)
    kernels = [_Recording() for _ in layer.launches]
    _set_stream(monkeypatch, 0)
    replay = launch.bind_launches(layer, kernels, torch.device("cpu"), launch.Workspace(torch.device("cpu")))
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert replay() is False and not any(k.calls for k in kernels)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)


@needs_triton
def test_a_replay_bound_on_one_stream_steps_aside_on_another(case, monkeypatch):
    """What a launch shares between its calls (the in-kernel merge's arrival counters) is its
    stream's: a replay bound on one stream never launches on another (two streams running layers
    at once would race on them); the caller launches plainly."""
    from dsv4_attn.portable.kernels import launch

    layer = c4a_launches(case, split=2)
    kernels = [_Recording() for _ in layer.launches]
    current_stream = _set_stream(monkeypatch, 1234)
    replay = launch.bind_launches(layer, kernels, torch.device("cpu"), launch.Workspace(torch.device("cpu")))
    current_stream[0] = 99
    assert replay() is False and not any(k.calls for k in kernels)
    current_stream[0] = 1234
    assert replay() is True and all(len(k.calls) == 1 for k in kernels)


@needs_triton
def test_under_the_interpreter_nothing_is_bound_and_repeats_give_the_same_bytes(case):
    from dsv4_attn.common.platform import triton_interpreting
    from dsv4_attn.portable.kernels import launch

    if not triton_interpreting():
        pytest.skip("the interpreter runs on CPU-only machines")
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="triton")
    plan = mla.plan(case.batch)
    out = torch.full_like(case.q, float("nan"))
    first = _call(mla, plan, case, out=out).clone()
    assert not first.isnan().any()
    for _ in range(2):
        out.fill_(float("nan"))
        assert torch.equal(_call(mla, plan, case, out=out), first)
    assert not launch.bindable(case.q.device)
    assert not mla._backend("triton")._replays  # no key on the interpreter: every launch plain


@needs_triton
def test_a_replay_key_reads_only_the_layers_own_tables(gen, monkeypatch):
    """A C128A layer of a step that carries no ratio-4 table (a KV-cache group without C4A layers)
    of a model that has C4A layers: its replay key reads only its own kind's tables (it read every
    top-k kind's and raised). Keys made here as on a GPU; launches stay plain (interpreter)."""
    from dsv4_attn.portable.kernels import launch

    case = make_step(gen, [1, 2], [300, 700], kinds=(LayerKind.SWA, LayerKind.C4A, LayerKind.C128A), topk=16,
                     max_model_len=1024)
    b = case.batch
    batch = dsv4.StepBatch.from_lists([1, 2], [300, 700], b.swa_block_table, b.swa_block_size,
                                      {128: b.comp_block_tables[128]}, b.block_size, b.max_model_len)
    monkeypatch.setattr(launch, "bindable", lambda device: True)
    _set_stream(monkeypatch, 0)
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="triton")
    plan = mla.plan(batch)
    out = torch.empty_like(case.q)
    outs = []
    for _ in range(2):
        out.fill_(float("nan"))
        outs.append(mla.forward(plan, LayerKind.C128A, case.q, case.caches["swa"], case.caches[LayerKind.C128A],
                                sink=case.sink, out=out).clone())
    assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])
    assert len(mla._backend("triton")._replays) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled kernels)")
@pytest.mark.parametrize("batch", [[1, 1], [3, 2, 1, 4, 2, 1, 1, 3]])  # few tokens split (+ combine); more do not
@pytest.mark.parametrize("heads", [16, 8])  # 8: the split merged inside the Gluon kernel (its counters bound)
def test_bound_launches_give_the_plain_launchs_bytes_on_the_gpu(gen, batch, heads):
    from dsv4_attn.portable.kernels import launch

    seqs = [40 + 37 * i for i in range(len(batch))]
    case = make_step(gen, batch, seqs, kinds=C4A_ONLY, heads=heads, topk=64, max_model_len=4096, device="cuda")
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="triton", device="cuda")
    plan = mla.plan(case.batch)
    out = torch.full_like(case.q, float("nan"))
    outs = []
    for _ in range(5):  # plain, plain + bind, replays
        out.fill_(float("nan"))
        outs.append(_call(mla, plan, case, out=out).clone())
    torch.cuda.synchronize()
    backend = mla._backend("triton")
    replays = [r for r in backend._replays.values() if isinstance(r, launch.Replay)]
    assert replays
    # the repeats went to the driver directly (driver_launch), every kernel's parameters packed
    assert all(len(launch.direct_launches(r)) == len(r._bound) > 0 for r in replays)
    # a thread that made no CUDA call yet repeats the call too (where no context is current there,
    # the replay's capture guard refuses and the call launches plainly; torch's getters may already
    # have made it current: either way the bytes must match)
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    worker = threading.Thread(target=_call, args=(mla, plan, case), kwargs=dict(out=out))
    worker.start()
    worker.join()
    torch.cuda.synchronize()
    outs.append(out.clone())
    assert not outs[0].isnan().any()
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert all(not counters.any() for counters in backend._counters.values())  # every launch leaves them 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled kernels)")
@pytest.mark.parametrize("batch", [[1, 1], [3, 2, 1, 4, 2, 1, 1, 3]])
@pytest.mark.parametrize("heads", [16, 8])
def test_a_relocated_call_gives_the_bytes_of_its_own_plain_launch_on_the_gpu(gen, batch, heads):
    """Two layers of one step (the second's q, caches, top-k, sink and out drawn anew: other bytes
    at other addresses, same shapes): the second runs the first's bound launches relocated, and
    writes exactly what a plain launch of its own inputs writes."""
    seqs = [40 + 37 * i for i in range(len(batch))]
    layers = [make_step(gen, batch, seqs, kinds=C4A_ONLY, heads=heads, topk=64, max_model_len=4096, device="cuda")
              for _ in range(2)]
    mla = dsv4.SparseMLA(layers[0].spec, "fp8_ds_mla", backend="triton", device="cuda")
    plan = mla.plan(layers[0].batch)
    outs = [_call(mla, plan, one, out=torch.full_like(one.q, float("nan"))) for one in layers]
    assert len(mla._relocatable) == 1 and len(mla._repeats) == 2  # the second call: relocated, then kept
    alone = dsv4.SparseMLA(layers[0].spec, "fp8_ds_mla", backend="triton", device="cuda")
    want = _call(alone, alone.plan(layers[0].batch), layers[1], out=torch.full_like(layers[1].q, float("nan")))
    torch.cuda.synchronize()
    assert not want.isnan().any() and torch.equal(outs[1], want) and not torch.equal(outs[0], outs[1])


@needs_triton
def test_a_repeated_call_runs_only_its_boundc4a_launches(case, monkeypatch):
    """From the second call with the same inputs (the first: plain launches, then bound), a layer
    call neither checks its inputs again, builds its LayerInputs nor its launches: it hands the
    bound launchers their arguments, one call each (the attention kernel and the split combine); a
    changed input then takes the full path and is refused as always. Kernels stubbed, launches
    bound as on a GPU."""
    from dsv4_attn.bench import host
    from dsv4_attn.portable.kernels import launch, ops

    with host.kernels_stubbed():
        runs = []
        monkeypatch.setattr(host._StubCompiled, "run", staticmethod(lambda *args: runs.append(args)))
        mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="triton")
        plan = mla.plan(case.batch)
        out = torch.empty_like(case.q)
        for _ in range(2):
            _call(mla, plan, case, out=out)
        per_call = len(runs)  # the second call's launches: the first bound ones
        assert per_call >= 1
        real_checks = checks.check_layer
        monkeypatch.setattr(checks, "check_layer", _forbidden)
        monkeypatch.setattr(ops, "layer_launches", _forbidden)
        monkeypatch.setattr(launch, "bind_launches", _forbidden)
        monkeypatch.setattr(api, "LayerInputs", _forbidden)
        for _ in range(3):
            _call(mla, plan, case, out=out)
        assert len(runs) == 4 * per_call
        assert [len(args) for args in runs[per_call:]] == [len(args) for args in runs[:per_call]] * 3
        monkeypatch.setattr(checks, "check_layer", real_checks)
        monkeypatch.setattr(api, "LayerInputs", LayerInputs)
        with pytest.raises(ValueError, match=r"^q: got torch.bfloat16 \("):
            _call(mla, plan, case, q=case.q[:-1], out=out)


def _in_place_changes():
    """name -> a change of one input of a bound call, made on that very tensor object (resized,
    restrided, moved to other memory) or by handing another tensor (of equal metadata at another
    address; the same bytes as another dtype): each must take the full path (the repeat's proof
    reads every attribute)."""
    def restride(t):  # same address, shape and memory; the last two dims laid out the other way
        if t.dim() == 1:
            return t.as_strided_(t.shape, (0,))
        return t.as_strided_(t.shape, (*t.stride()[:-2], 1, t.shape[-2]))

    def moved(t):  # the same shape and strides in other memory
        return t.set_(t.clone().untyped_storage(), 0, t.shape, t.stride())

    return {
        "q resized in place": lambda a: a["q"].resize_(a["q"].shape[0] - 1, *a["q"].shape[1:]),
        "q restrided in place": lambda a: restride(a["q"]),
        "q moved in place": lambda a: moved(a["q"]),
        "out restrided in place": lambda a: restride(a["out"]),
        "out moved in place": lambda a: moved(a["out"]),
        "out viewed as float16 (same bytes, shape, strides)": lambda a: a.update(out=a["out"].view(torch.float16)),
        "topk restrided in place": lambda a: restride(a["topk"]),
        "topk resized in place": lambda a: a["topk"].resize_(a["topk"].shape[0], a["topk"].shape[1] - 1),
        "sink moved in place": lambda a: moved(a["sink"]),
        "sink resized in place": lambda a: a["sink"].resize_(a["sink"].shape[0] - 1),
        "swa_cache moved in place": lambda a: moved(a["swa_cache"]),
        "sink restrided in place": lambda a: restride(a["sink"]),
        "swa_cache restrided in place": lambda a: restride(a["swa_cache"]),
        "comp_cache resized in place": lambda a: a["comp_cache"].resize_(
            a["comp_cache"].shape[0] - 1, *a["comp_cache"].shape[1:]),
        "another q, equal metadata": lambda a: a.update(q=a["q"].clone()),
        "another out, equal metadata": lambda a: a.update(out=torch.empty_like(a["out"])),
    }


# the changes of _in_place_changes that move a tensor and keep everything else (16-byte alignment too)
_MOVES = ("q moved in place", "out moved in place", "sink moved in place", "swa_cache moved in place",
          "another q, equal metadata", "another out, equal metadata")


@needs_triton
@pytest.mark.parametrize("proof", ["torch TensorGuards", "python signatures"])
@pytest.mark.parametrize("change", list(_in_place_changes()))
def test_a_changed_input_of_a_bound_call_takes_the_full_path_or_moves_thec4a_launches(case, monkeypatch, change, proof):
    """After a call's launches are bound (kernels stubbed, bound as on a GPU), changing one input
    -- on the same tensor object in place, or by handing another tensor -- runs the checks again
    (refused where they refuse, as always) instead of the bound launches; a change of nothing but
    where a tensor lies runs the bound launches relocated: without the checks that read no
    address, with the launchers handed the tensor's new address and never its old one. With
    either proof of the tensors' metadata (``checks.MetadataProof``)."""
    from dsv4_attn.bench import host

    if proof == "python signatures":
        monkeypatch.setattr(checks, "_TensorGuards", None)
    with host.kernels_stubbed():
        runs = []
        monkeypatch.setattr(host._StubCompiled, "run", staticmethod(lambda *args: runs.append(args)))
        mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="triton")
        plan = mla.plan(case.batch)
        args = _layer_args(case)
        for _ in range(2):  # plain + bind, bound
            mla.forward(plan, LayerKind.C4A, **args)
        assert mla._repeats  # bound
        checked = []
        real = checks.check_layer
        monkeypatch.setattr(checks, "check_layer", lambda *a: checked.append(1) or real(*a))
        mla.forward(plan, LayerKind.C4A, **args)
        assert not checked  # the unchanged call repeats its bound launches
        before = {name: t.data_ptr() for name, t in args.items()}
        _in_place_changes()[change](args)
        del runs[:]
        try:
            mla.forward(plan, LayerKind.C4A, **args)
        except ValueError:
            pass
        if change not in _MOVES:
            assert checked, f"{change}: the bound launches ran without the checks"
            return
        (name,) = [n for n, t in args.items() if t.data_ptr() != before[n]]
        assert not checked and runs, f"{change}: not relocated"
        sent = [a for one in runs for a in one if isinstance(a, int)]
        assert args[name].data_ptr() in sent and before[name] not in sent, f"{change}: {name}'s old address launched"


def _layer_args(case, **changes):
    """A C4A layer call's tensors of ``case``: its own copies of the caches, top-k, q and sink (the
    next layer of a step: same shapes, other memory)."""
    args = dict(q=case.q.clone(), swa_cache=case.caches["swa"].clone(), comp_cache=case.caches[LayerKind.C4A].clone(),
                topk=case.topks[LayerKind.C4A].clone(), sink=case.sink.clone(), out=torch.empty_like(case.q))
    args.update(changes)
    return args


def _sent(mla, call) -> list[tuple]:
    """What the replay ``mla`` keeps for ``call`` (its arguments) hands each launcher."""
    (replay,) = [r for k, (_, r, _) in mla._repeats.items()  # a repeat key: q's address at 3, swa_cache's at 4
                 if k[3] == call["q"].data_ptr() and k[4] == call["swa_cache"].data_ptr()]
    return [replay.triton_launch(i)[1] for i in range(len(replay._bound))]


@needs_triton
def test_the_next_layer_of_a_step_runs_the_first_ones_launches_moved_to_its_tensors(case, monkeypatch):
    """A step's second C4A layer (its own caches, q, top-k, sink and out: same shapes) runs what
    the first layer's call bound, relocated: no checks but the overlap one, no launches built; its
    launchers get exactly the arguments its own full path binds (the memos forgotten, same plan).
    Kernels stubbed, bound as on a GPU."""
    from dsv4_attn.bench import host
    from dsv4_attn.portable.kernels import ops

    first, second = _layer_args(case), _layer_args(case)
    with host.kernels_stubbed():
        mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="triton")
        plan = mla.plan(case.batch)
        mla.forward(plan, LayerKind.C4A, **first)  # plain + bind
        overlap = []
        real_alone = checks.check_out_alone
        monkeypatch.setattr(checks, "check_layer", _forbidden)
        monkeypatch.setattr(ops, "layer_launches", _forbidden)
        monkeypatch.setattr(checks, "check_out_alone", lambda *a: overlap.append(1) or real_alone(*a))
        mla.forward(plan, LayerKind.C4A, **second)
        assert overlap == [1]
        moved, bound_first = _sent(mla, second), _sent(mla, first)
        assert moved != bound_first
        monkeypatch.undo()
        mla._repeats.clear()
        mla._relocatable.clear()
        mla._backend("triton")._replays.clear()
        mla.forward(plan, LayerKind.C4A, **second)  # the full path, bound for these tensors
        assert moved == _sent(mla, second)


@needs_triton
def test_a_moved_call_is_refused_as_the_full_path_refuses_it(case, monkeypatch):
    """The one check that reads addresses runs on a relocated call: an out over the next layer's
    SWA cache is refused with the full path's message; an out whose address is otherwise aligned
    (another remainder mod 16) is not relocated (the kernels' specialization could differ) and
    runs every check."""
    from dsv4_attn.bench import host

    first = _layer_args(case)
    swa = first["swa_cache"].clone()
    over_cache = torch.empty(0, dtype=torch.bfloat16).set_(swa.untyped_storage(), 0, tuple(case.q.shape))
    with host.kernels_stubbed():
        mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="triton")
        plan = mla.plan(case.batch)
        mla.forward(plan, LayerKind.C4A, **first)
        fresh = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="triton")
        with pytest.raises(ValueError) as full:
            fresh.forward(fresh.plan(case.batch), LayerKind.C4A, **_layer_args(case, swa_cache=swa, out=over_cache))
        with pytest.raises(ValueError) as moved:
            mla.forward(plan, LayerKind.C4A, **_layer_args(case, swa_cache=swa, out=over_cache))
        assert str(moved.value) == str(full.value) and "out: got a tensor overlapping swa_cache" in str(full.value)
        checked = []
        real = checks.check_layer
        monkeypatch.setattr(checks, "check_layer", lambda *a: checked.append(1) or real(*a))
        shifted = torch.empty(case.q.numel() + 1, dtype=torch.bfloat16)[1:].view(case.q.shape)  # 2 bytes on
        mla.forward(plan, LayerKind.C4A, **_layer_args(case, out=shifted))
        assert checked


@needs_triton
def test_a_launch_argument_no_single_source_holds_makes_the_replay_unmovable(case, monkeypatch):
    """bind_launches keeps an argument as (source, offset) only where exactly one of the call's
    tensors holds it; where two sources share its storage and neither starts at or spans it, the
    replay still runs (its addresses as bound) but ``relocated`` gives None."""
    from dsv4_attn.portable.kernels import launch

    layer = c4a_launches(case, split=2)
    _set_stream(monkeypatch, 0)
    kernels = [_Recording() for _ in layer.launches]
    q = layer.launches[0].args[0]
    movable = launch.bind_launches(layer, kernels, torch.device("cpu"), launch.Workspace(torch.device("cpu")), (q,))
    assert movable.relocated((q.clone(),)) is not None
    # two sources in q's storage, both starting where q does: which one q came from is unknown
    shared, other = (torch.empty(0, dtype=q.dtype).set_(q.untyped_storage(), 0, (1,)) for _ in range(2))
    stuck = launch.bind_launches(layer, kernels, torch.device("cpu"), launch.Workspace(torch.device("cpu")),
                                 (shared, other))
    assert stuck() is True and stuck.relocated((shared, other)) is None


def _forbidden(*args, **kwargs):
    raise AssertionError("a bound repeat ran the full path")


# ---- the split combine's variants, compiled at engine start -----------------------------------
def _variant(one) -> tuple:
    """What Triton compiles one variant of a launch for: the kernel, its constexprs and options,
    and the specialization of each runtime argument (tensors: dtype and 16-byte alignment; ints:
    == 1 and divisibility by 16), ``do_not_specialize`` arguments (the combine's ``split``) left out."""
    names = one.fn.arg_names
    special = []
    for name, arg in zip(names, one.args):
        if name in ("split",):
            continue
        if isinstance(arg, torch.Tensor):
            special.append((name, arg.dtype, arg.data_ptr() % 16 == 0))
        elif isinstance(arg, int):
            special.append((name, arg == 1, arg % 16 == 0))
        else:
            special.append((name, type(arg)))
    return one.fn.__name__, tuple(sorted(one.constexprs.items())), tuple(sorted(one.options.items())), tuple(special)


@needs_triton
@pytest.mark.parametrize("heads", [64, 16])
def test_after_reserve_no_step_launches_a_combine_variant_it_did_not_compile(gen, monkeypatch, heads):
    """SparseMLA.reserve (engine start) compiles every split combine variant (one per power of two
    of the split) that decode steps of 1 .. 48 tokens launch on every layer kind: each step's
    combine launches are variants reserve launched. Launches recorded, never run; the GPU is a
    16-SM one (more splits than the interpreter's 4); as compiled code would (not the interpreter)."""
    from dsv4_attn.portable.kernels import launch, ops

    launched: list = []
    monkeypatch.setattr(launch.KernelLaunch, "plain", lambda one: launched.append(_variant(one)))
    monkeypatch.setattr(ops, "num_sms", lambda device: 16)
    monkeypatch.setattr(ops, "triton_interpreting", lambda: False)
    kinds = (LayerKind.SWA, LayerKind.C4A, LayerKind.C128A)
    first = make_step(gen, [1], [500], kinds=kinds, heads=heads, topk=512, max_model_len=8192)
    mla = dsv4.SparseMLA(first.spec, "fp8_ds_mla", backend="triton")
    mla.reserve(mla.plan(first.batch), 48)
    warmed = {v for v in launched if v[0] == "combine_kernel"}
    launched.clear()
    for b in range(1, 49, 3):
        case = make_step(gen, [1] * b, [300 + 41 * i for i in range(b)], kinds=kinds, heads=heads, topk=512,
                         max_model_len=8192)
        plan = mla.plan(case.batch)
        for kind in kinds[1:]:
            mla.forward(plan, kind, case.q, case.caches["swa"], case.caches[kind], topk=case.topks.get(kind),
                        sink=case.sink, out=torch.empty_like(case.q))
        mla.forward(plan, LayerKind.SWA, case.q, case.caches["swa"], sink=case.sink, out=torch.empty_like(case.q))
    stepped = {v for v in launched if v[0] == "combine_kernel"}
    split_p2s = {dict(v[1])["SPLIT_P2"] for v in stepped}
    assert len(split_p2s) >= 3, split_p2s  # the steps reach several variants
    assert stepped <= warmed, sorted(stepped - warmed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled kernels)")
def test_after_reserve_decode_steps_at_every_split_compile_no_combine(gen):
    """On the GPU: after SparseMLA.reserve, decode steps of 1 .. SMs + 1 tokens (every split a
    64-head launch reaches, down to none) add no compiled combine kernel to Triton's cache."""
    from dsv4_attn.portable.kernels import attention

    kinds = (LayerKind.SWA, LayerKind.C4A, LayerKind.C128A)
    most = torch.cuda.get_device_properties(0).multi_processor_count + 1
    seqs = [300 + 7 * i for i in range(most)]
    case = make_step(gen, [1] * most, seqs, kinds=kinds, heads=64, topk=512, max_model_len=8192, device="cuda")
    mla = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="triton", device="cuda")
    mla.reserve(mla.plan(case.batch), 512)
    compiled = attention.combine_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(compiled)
    assert before >= 2  # reserve compiled the variants
    b = case.batch
    for n in sorted({1, 2, 5, 9, 14, 17, 23, 27, 34, 45, 67, most}):  # 132 SMs: splits 10 .. 2, then none
        batch = dsv4.StepBatch.from_lists([1] * n, seqs[:n], b.swa_block_table[:n], b.swa_block_size,
                                          {r: t[:n] for r, t in b.comp_block_tables.items()}, b.block_size,
                                          b.max_model_len)
        plan = mla.plan(batch)
        for kind in kinds[1:]:
            topk = case.topks[kind][:n] if kind in case.topks else None
            mla.forward(plan, kind, case.q[:n], case.caches["swa"], case.caches[kind], topk=topk, sink=case.sink,
                        out=torch.empty_like(case.q[:n]))
    torch.cuda.synchronize()
    assert len(compiled) == before


@needs_triton
@pytest.mark.parametrize("heads", [64, 16])
def test_reserve_sizes_the_workspace_and_no_decode_step_grows_it(gen, monkeypatch, heads):
    """SparseMLA.reserve (engine start, inside its memory profile) allocates the stream's workspace
    for the temporaries of decode steps of up to its ``decode_tokens``; decode steps of 1 .. 24
    tokens on every layer kind then bind (replays exist) without growing or moving it, and a call
    whose temporaries exceed it (a 200-token step, whose unsplit P scratch of the portable kernel is
    larger than the split partials up to 24 tokens) is not bound and leaves it as it was. Kernels
    stubbed, bound as on a 16-SM GPU. Fails where the workspace first grows at a binding after the
    profile."""
    from dsv4_attn.bench import host
    from dsv4_attn.portable.kernels import launch, ops

    kinds = (LayerKind.SWA, LayerKind.C4A, LayerKind.C128A)

    def step(b):
        return make_step(gen, [1] * b, [300 + 7 * i for i in range(b)], kinds=kinds, heads=heads, topk=512,
                         max_model_len=8192)

    def decode(mla, case, times=3):  # plain, plain + bind, bound
        plan = mla.plan(case.batch)
        for _ in range(times):
            for kind in kinds:
                comp = case.caches[kind] if kind is not LayerKind.SWA else None
                mla.forward(plan, kind, case.q, case.caches["swa"], comp, topk=case.topks.get(kind), sink=case.sink,
                            out=case.out)

    with host.kernels_stubbed():
        monkeypatch.setattr(ops, "num_sms", lambda device: 16)
        first = step(1)
        mla = dsv4.SparseMLA(first.spec, "fp8_ds_mla", backend="triton")
        backend = mla._backend("triton")
        assert not backend._workspaces
        mla.reserve(mla.plan(first.batch), 24)
        (workspace,) = backend._workspaces.values()
        reserved = (workspace.buffer, workspace.address, workspace.size)
        assert workspace.buffer is not None and workspace.size == workspace.cap > 0
        for b in (1, 2, 3, 5, 8, 13, 24):
            case = step(b)
            case.out = torch.empty_like(case.q)
            bound = len(backend._replays)
            decode(mla, case)
            assert [r for r in list(backend._replays.values())[bound:] if isinstance(r, launch.Replay)], b
            assert (workspace.buffer, workspace.address, workspace.size) == reserved, b
        big = step(200)
        big.out = torch.empty_like(big.q)
        bound = len(backend._replays)
        decode(mla, big)
        assert (workspace.buffer, workspace.address, workspace.size) == reserved
        assert not [r for r in list(backend._replays.values())[bound:] if isinstance(r, launch.Replay)]
