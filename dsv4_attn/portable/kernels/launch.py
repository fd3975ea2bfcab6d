"""Kernel launches with less host time: a layer call's launches, repeated through the compiled
kernels Triton bound at their first launch.

``kernel[grid](*args, **constexprs)`` goes through Triton's ``JITFunction.run``: it specializes
every argument (type, 16-byte alignment, ``== 1``), builds the cache key, finds the compiled
kernel and only then calls its launcher: ~20-40 us per launch on a GPU machine's CPU for our ~45
arguments. A layer call whose inputs are those of an earlier call (``LayerInputs.checked_key``:
every tensor's address, shape, strides, dtype, device; the plan's) launches the same kernels with
the same arguments, so ``Replay`` keeps what that earlier launch resolved -- the
``CompiledKernel``, the grid, the arguments with each tensor as the address Triton's launcher
would read from it -- and calls the launcher directly:
``kernel.run(gx, gy, gz, stream, kernel.function, kernel.packed_metadata, metadata, enter_hook,
exit_hook, *every_parameter)``, the call ``JITFunction.run`` ends with in Triton 3.6, 3.8 and
3.9 alike (``triton/runtime/jit.py``; ``CompiledKernel.run`` / ``function`` /
``packed_metadata`` in ``triton/compiler/compiler.py``). The call's temporaries (split partials,
P scratch) are not allocated per call: they lie in the stream's :class:`Workspace`, sized when a
replay is bound, so a replay's arguments are fixed and the call only hands them to the launchers.

A bound call is also *relocatable*: every argument that lies in one of the call's own tensors
(q, out, the caches, top-k, the sink: ``bind_launches``' ``sources``) is kept as (which tensor,
byte offset), so :meth:`Replay.relocated` serves a later call whose tensors have the same
shapes, strides, dtypes and 16-byte alignment at other addresses (the next layer of the step,
with its own caches; a step's new activations): the same kernels, grid and every other argument.
``SparseMLA`` decides when that holds (its relocation key) and runs the one check that reads
addresses (``out`` overlapping an input) itself.

Not bound (always the plain launch): Triton's CPU interpreter (no compiled kernel), ROCm (its
buffer-op specialization also reads the tensors' sizes), a launch hook installed (a profiler
sees every launch through Triton's own path), a kernel that compiled to nothing; a replay steps
aside (the plain launch runs) on another GPU or stream than its binding's and in a graph capture.
A replay's guards and launches run in one C call (``native_replay``; where it cannot be built,
nothing is bound). It hands each kernel whose parameters it can pack to the CUDA driver itself
(``driver_launch``: ``cuLaunchKernelEx`` with the parameter block packed when the replay fills
its arguments, checked against the kernel's PTX); the others, and every replay under
``DSV4_ATTN_DIRECT_LAUNCH=0``, go through Triton's ``CudaLauncher`` as above.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from triton import knobs

from ... import envs
from ...common.checks import byte_span
from ...common.platform import triton_interpreting
from . import driver_launch, native_replay
from .driver_launch import CUDA_ERROR_INVALID_CONTEXT, DirectLaunch, KernelLayout


@dataclass
class KernelLaunch:
    """One launch: ``fn[grid](*args, **constexprs, **options)``."""

    fn: Any  # a triton.jit kernel
    grid: tuple[int, ...]
    args: tuple  # the runtime parameters, in order (tensors, ints, floats)
    constexprs: dict  # the constexpr parameters by name
    options: dict = field(default_factory=dict)  # num_warps, num_stages, maxnreg, ...

    def plain(self):
        """Launch through Triton's JIT path; returns what it returns (the CompiledKernel on a GPU)."""
        return self.fn[self.grid](*self.args, **self.constexprs, **self.options)


@dataclass
class LayerLaunches:
    """A layer call's launches, in order, and the temporaries they use (each a flat tensor the
    launcher allocated for this call only: split partials, P scratch)."""

    launches: list[KernelLaunch]
    temporaries: list[torch.Tensor]

    def plain(self) -> list:
        return [launch.plain() for launch in self.launches]


@dataclass(frozen=True)
class _Temp:
    """An argument inside temporary ``index`` at ``offset`` bytes."""

    index: int
    offset: int


@dataclass(frozen=True)
class _Source:
    """An argument inside the call's tensor ``index`` (``bind_launches``' sources) at ``offset``
    bytes from its address."""

    index: int
    offset: int


@dataclass
class _Bound:
    run: Any
    function: Any
    packed_metadata: Any
    grid: tuple[int, int, int]
    args: tuple  # every parameter in order; tensors as addresses (a temporary's / a source's: filled per call)
    fills: tuple[tuple[int, int, int], ...]  # (position in args, temporary, byte offset in it)
    source_fills: tuple[tuple[int, int, int], ...]  # (position in args, source, byte offset from its address)
    layout: KernelLayout | None = None  # its direct launch (driver_launch), None: Triton's launcher


class Workspace:
    """The temporaries of the replays bound on one (device, stream): one byte buffer, grown at
    binding to the largest layer call's temporaries bound there (or, once reserved at engine
    start, allocated then and never grown: ``reserve``), never by a replay, and shared
    by every replay of that stream. Launches on one stream run one after another and a layer
    call's temporaries live within its own launches only (the split partials the attention kernel
    writes and the combine reads right after; P scratch inside one kernel), so the next call on
    the stream may take the same bytes. Allocated while its stream is current (the caching
    allocator then frees a replaced buffer in that stream's order); replays never run on another
    stream nor inside a graph capture (``Replay.__call__``)."""

    def __init__(self, device: torch.device, cap: int | None = None) -> None:
        self.device = device
        self.buffer: torch.Tensor | None = None
        self.address = 0  # the buffer's first 16-byte aligned address
        self.size = 0  # bytes usable from ``address``
        self.cap = cap  # set by ``reserve``: the most it may hold (None: up to WORKSPACE_LIMIT)

    def ensure(self, size: int) -> None:
        """At least ``size`` bytes from a 16-byte aligned ``address`` (a new buffer when smaller)."""
        if self.buffer is None or self.size < size:
            self.buffer = torch.empty(size + 16, dtype=torch.uint8, device=self.device)
            start = self.buffer.data_ptr()
            self.address, self.size = start + (-start) % 16, size

    def reserve(self, size: int) -> None:
        """Engine start: ``size`` bytes (at most WORKSPACE_LIMIT) allocated now, inside the engine's
        memory profile, and the workspace never grows past them: a call whose temporaries do not
        fit is not bound (``bind_launches``) and allocates them per call, as an unbound call does."""
        self.cap = min(max(size, self.cap or 0), WORKSPACE_LIMIT)
        self.ensure(self.cap)

    def fits(self, size: int) -> bool:
        """Whether temporaries of ``size`` bytes may be placed here."""
        return size <= (WORKSPACE_LIMIT if self.cap is None else self.cap)


_TEMP_ALIGN = 256  # each temporary's place in a workspace starts at a multiple of this (+ its own % 16)


def layout_bytes(sizes: list[int]) -> int:
    """The most bytes ``temporaries_layout`` can take for temporaries of ``sizes`` bytes (whatever
    their addresses % 16)."""
    end = 0
    for size in sizes:
        end = -(-end // _TEMP_ALIGN) * _TEMP_ALIGN + 15 + size
    return end


def temporaries_layout(temporaries: list[torch.Tensor]) -> tuple[list[int], int]:
    """(byte offset of each temporary in a workspace, bytes in all): each at the address % 16 it
    had when its launches were bound, so every pointer the kernels were specialized for (Triton's
    16-byte divisibility) keeps that property."""
    offsets, end = [], 0
    for t in temporaries:
        start = -(-end // _TEMP_ALIGN) * _TEMP_ALIGN + t.data_ptr() % 16
        offsets.append(start)
        end = start + t.numel() * t.element_size()
    return offsets, end


class Replay:
    """The launches of one layer call, bound: ``__call__`` repeats them for a call with the same
    inputs (same ``checked_key``), their temporaries in the stream's :class:`Workspace`."""

    def __init__(self, native: Callable, bound: list[_Bound], offsets: list[int], workspace: Workspace,
                 device: torch.device, sources: tuple[int, ...] = (), relocatable: bool = False) -> None:
        self._bound = bound
        self._offsets = offsets  # each temporary's byte offset in the workspace
        self._workspace = workspace
        self._device = device
        self._sources = sources  # the addresses of the call's own tensors (bind_launches' sources)
        self._relocatable = relocatable
        self._gpu = current_gpu(device)  # the kernels were loaded on it (the current GPU at binding)
        # the stream at binding: the workspace and the buffers a launch shares between its calls
        # (the in-kernel merge's arrival counters) are its stream's, so a call on another stream
        # launches plainly
        self._stream = current_stream(device)
        self._replay = native  # native_replay.c's replay
        self._driver = driver_launch.launch_kernel_ex() if any(b.layout for b in bound) else 0
        # what the C replay checks before launching (native_replay.c: guards)
        self._guards = (knobs.runtime, _stream_of(), device.index, self._stream, _capture_query(device),
                        _current_device(), self._gpu)
        self._filled_for = -1  # the workspace address ``_launches`` holds
        # each launch as native_replay.c takes it: its DirectLaunch (the owner of the buffers the
        # driver reads), or (Triton's launcher, its arguments)
        self._launches: tuple[DirectLaunch | tuple, ...] = ()

    def __call__(self) -> bool:
        """Launch again; False (nothing launched) when a launch hook is installed now, another GPU
        or stream is current or a graph capture is in progress: the caller launches plainly (its
        temporaries then come from the capture's pool, which outlives no graph). The guards and
        the launches run in one C call (``native_replay``)."""
        if self._workspace.address != self._filled_for:  # the first call, or the workspace grew since
            self._fill()
        result = self._replay(self._driver, self._launches, 0, self._guards)
        while result is not None:
            if result is False:
                return False
            index, code = result  # the driver refused launch ``index``; the ones before it ran
            _launch_failed(code, self.triton_launch(index))
            result = self._replay(self._driver, self._launches, index + 1, None)
        return True

    def relocated(self, tensors: tuple[torch.Tensor | None, ...]) -> Replay | None:
        """This replay for a call whose own tensors (``bind_launches``' sources, in that order) are
        ``tensors``: the same launches with every argument that lay in one of them moved to the
        new one, the rest as bound. The caller guarantees the new tensors' shapes, strides, dtypes,
        devices and addresses % 16 equal the bound ones'. None when this replay cannot be moved
        (an argument in a source could not be told apart from another source)."""
        if not self._relocatable or len(tensors) != len(self._sources):
            return None
        moved = object.__new__(Replay)
        moved.__dict__.update(self.__dict__, _filled_for=-1, _launches=(),
                              _sources=tuple(0 if t is None else t.data_ptr() for t in tensors))
        return moved

    def _fill(self) -> None:
        """Every launch's arguments with the temporaries at their places in the workspace now and
        the call's own tensors at their addresses. (A call running in another thread keeps the
        launches it started with: its C call holds their tuple.)"""
        launches: list[DirectLaunch | tuple] = []
        for b in self._bound:
            args = self._arguments(b)
            launches.append(self._triton_call(b, args) if b.layout is None else
                            DirectLaunch(b.layout, b.function, b.grid, self._stream, args))
        self._launches = tuple(launches)
        self._filled_for = self._workspace.address

    def _arguments(self, b: _Bound) -> list:
        """Every parameter of launch ``b``: the temporaries at their places in the workspace now,
        the call's own tensors at their addresses."""
        args = list(b.args)
        base = self._workspace.address
        for i, temp, offset in b.fills:
            args[i] = base + self._offsets[temp] + offset
        for i, source, offset in b.source_fills:
            args[i] = self._sources[source] + offset
        return args

    def _triton_call(self, b: _Bound, args: list) -> tuple:
        """(Triton's launcher of ``b``, what JITFunction.run hands it) for the parameters ``args``."""
        return b.run, (*b.grid, self._stream, b.function, b.packed_metadata, None, None, None, *args)

    def triton_launch(self, index: int) -> tuple:
        """Launch ``index`` as Triton's launcher takes it, (launcher, its arguments): made when a
        direct launch falls back to it (and for the tests), not at every fill."""
        b = self._bound[index]
        return self._triton_call(b, self._arguments(b))


def _launch_failed(code: int, triton_launch: tuple) -> None:
    """After the driver refused a direct launch with CUresult ``code``: Triton's launcher where the
    calling thread has no current CUDA context (it makes the device's primary context current, as
    at any plain launch), else the error, as Triton's launcher raises it."""
    if code == CUDA_ERROR_INVALID_CONTEXT:
        run, args = triton_launch
        run(*args)
        return
    raise RuntimeError(f"dsv4_attn direct launch (portable/kernels/driver_launch.py), cuLaunchKernelEx: "
                       f"{driver_launch.error_text(code)}")


def bindable(device: torch.device) -> bool:
    """Whether launches on ``device`` can be bound (module docstring)."""
    return device.type == "cuda" and _compiled_cuda()


@functools.cache
def _compiled_cuda() -> bool:
    """CUDA (not ROCm) and compiled kernels: Triton picks its interpreter once per process, when
    the kernels are defined, so this is read once (not the environment at every layer call)."""
    return torch.version.hip is None and not triton_interpreting()


def current_gpu(device: torch.device) -> int | None:
    """The current GPU's index (what a bound kernel was loaded on) for a tensor on ``device``."""
    return _current_device()() if device.type == "cuda" else None


@functools.cache
def _current_device():
    """``torch.cuda.current_device`` without its lazy-initialisation check (a replay exists only
    once CUDA ran a kernel): torch's own ``_cuda_getDevice``, where this torch has it."""
    return getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _capture_query(device: torch.device) -> int:
    """What a replay's C guard asks whether a capture is in progress on its stream: the address of
    the driver's ``cuStreamIsCapturing`` on a GPU, 0 (no capture possible) elsewhere."""
    return driver_launch.stream_is_capturing() if device.type == "cuda" else 0


def current_stream(device: torch.device):
    """The stream a launch on ``device`` goes to now, as Triton's JIT path reads it."""
    return _stream_of()(device.index)


@functools.cache
def _stream_of():
    """Triton's ``driver.active.get_current_stream`` (its driver is fixed per process)."""
    from triton.runtime import driver

    return driver.active.get_current_stream


def run(layer: LayerLaunches, device: torch.device, workspace: Workspace | None,
        sources: tuple[torch.Tensor | None, ...] = ()) -> Replay | None:
    """Launch ``layer``'s kernels through Triton's JIT path; with a ``workspace`` (the current
    stream's, where :func:`bindable`), return their Replay for the next call with the same inputs
    (relocatable over ``sources``: ``bind_launches``)."""
    compiled = layer.plain()
    if workspace is None or not bindable(device):
        return None
    return bind_launches(layer, compiled, device, workspace, sources)


# The most bytes of temporaries a bound call may place in its stream's workspace, which stays
# allocated. A split launch has at most one partial ([heads per program, 514] fp32) per program
# slot (``ops.choose_split``): <= 17 MiB on an H100 (132 slots x 64 heads), <= 40 MiB on an MI300X
# (304 x 64); larger temporaries (a forced ``config.split`` on many tokens, the portable kernel's P
# scratch of a prefill chunk: 100+ MiB) belong to launches whose GPU time dwarfs the host path's,
# and stay per call (the plain launch), allocated and freed as before.
WORKSPACE_LIMIT = 128 << 20


def bind_launches(layer: LayerLaunches, compiled: list, device: torch.device, workspace: Workspace,
                  sources: tuple[torch.Tensor | None, ...] = ()) -> Replay | None:
    """The Replay of ``layer`` whose launches returned ``compiled`` (CompiledKernels), its
    temporaries placed in ``workspace`` (grown to hold them: at binding, never per call), or None
    when one cannot be bound (temporaries the workspace may not hold, ``Workspace.fits``, among the
    reasons). ``sources``: the call's own tensors (None for an absent one); every argument lying
    in one of them is kept as (source, offset), which makes the Replay relocatable
    (``Replay.relocated``) unless an argument's source is ambiguous."""
    offsets, size = temporaries_layout(layer.temporaries)
    native = native_replay.built()
    if not workspace.fits(size) or native is None:
        return None
    storages = [t.untyped_storage().data_ptr() for t in layer.temporaries]
    spans = _source_spans(sources)
    direct = envs.DIRECT_LAUNCH.get()
    bound = []
    relocatable = True
    for launch, kernel in zip(layer.launches, compiled):
        if kernel is None or not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            return None
        args = ordered_parameters(launch)
        if args is None:
            return None
        args = tuple(_as_address(a, layer.temporaries, storages, spans) for a in args)
        relocatable = relocatable and not any(isinstance(a, _Ambiguous) for a in args)
        args = tuple(a.address if isinstance(a, _Ambiguous) else a for a in args)
        fills = tuple((i, a.index, a.offset) for i, a in enumerate(args) if isinstance(a, _Temp))
        source_fills = tuple((i, a.index, a.offset) for i, a in enumerate(args) if isinstance(a, _Source))
        gx, gy, gz = (tuple(launch.grid) + (1, 1))[:3]
        run_fn = kernel.run  # a property: loads the kernel (CompiledKernel._init_handles) if needed
        layout = _direct_layout(kernel) if direct and gx * gy * gz > 0 else None
        bound.append(_Bound(run_fn, kernel.function, kernel.packed_metadata, (gx, gy, gz), args, fills, source_fills,
                            layout))
    workspace.ensure(size)
    addresses = tuple(0 if t is None else t.data_ptr() for t in sources)
    return Replay(native.replay, bound, offsets, workspace, device, addresses, relocatable and bool(sources))


_LAYOUTS: dict[str, KernelLayout | None] = {}  # by the compiled kernel's hash: its PTX is read once


def _direct_layout(kernel) -> KernelLayout | None:
    """``driver_launch.kernel_layout(kernel)``, once per compiled kernel."""
    key = getattr(kernel, "hash", None)
    if not isinstance(key, str):
        return driver_launch.kernel_layout(kernel)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = driver_launch.kernel_layout(kernel)
    return _LAYOUTS[key]


def ordered_parameters(launch: KernelLaunch) -> tuple | None:
    """Every parameter of ``launch.fn`` in its signature's order (the runtime arguments, then the
    constexprs where they stand): what ``JITFunction.run`` hands the launcher. None when the
    arguments do not name each parameter exactly once."""
    names = getattr(launch.fn, "arg_names", None)
    if names is None or len(launch.args) + len(launch.constexprs) != len(names):
        return None
    values = dict(zip(names, launch.args))
    if set(values) & set(launch.constexprs):
        return None
    values.update(launch.constexprs)
    if set(values) != set(names):
        return None
    return tuple(values[name] for name in names)


@dataclass(frozen=True)
class _Ambiguous:
    """A tensor argument (at ``address``) in a source's storage but not in exactly one source: the
    Replay runs, but is not relocatable."""

    address: int


def _source_spans(sources: tuple[torch.Tensor | None, ...]) -> list[tuple[int, int, int, int]]:
    """(index, storage address, first byte, last byte) of each source given."""
    return [(i, t.untyped_storage().data_ptr(), *byte_span(t)) for i, t in enumerate(sources) if t is not None]


def _as_address(arg, temporaries: list[torch.Tensor], storages: list[int], spans: list[tuple[int, int, int, int]]):
    """A tensor argument as what the launcher reads from it (its address), as a _Temp when it
    lies in one of the call's temporaries, as a _Source when in one of its sources (the one it
    starts at, else the one whose bytes hold its address; _Ambiguous when that is not one
    source); other arguments unchanged."""
    if not isinstance(arg, torch.Tensor):
        return arg
    storage, address = arg.untyped_storage().data_ptr(), arg.data_ptr()
    for i, (temp, temp_storage) in enumerate(zip(temporaries, storages)):
        if storage == temp_storage:
            return _Temp(i, address - temp.data_ptr())
    same = [s for s in spans if s[1] == storage]
    if not same:
        return address
    picks = [s for s in same if s[2] == address] or [s for s in same if s[2] <= address < s[3]]
    if len(picks) != 1:
        return _Ambiguous(address)
    return _Source(picks[0][0], address - picks[0][2])


def direct_launches(replay: Replay) -> list[DirectLaunch]:
    """The launches ``replay`` hands the driver itself (filled: after its first call)."""
    return [launch for launch in replay._launches if isinstance(launch, DirectLaunch)]
