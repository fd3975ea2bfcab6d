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
``packed_metadata`` in ``triton/compiler/compiler.py``). Only the call's temporaries (split
partials, P scratch) are new at each call: allocated as the first call allocated them (the same
sizes; an address of other alignment than the bound one falls back to the plain launch).

Not bound (always the plain launch): Triton's CPU interpreter (no compiled kernel), ROCm (its
buffer-op specialization also reads the tensors' sizes), a launch hook installed (a profiler
sees every launch through Triton's own path), a kernel that compiled to nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from triton import knobs

from ...common.platform import triton_interpreting


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


@dataclass
class _Bound:
    run: Any
    function: Any
    packed_metadata: Any
    grid: tuple[int, int, int]
    args: tuple  # every parameter in order; tensors as addresses (a temporary's: filled per call)
    fills: tuple[tuple[int, int, int], ...]  # (position in args, temporary, byte offset in it)


class Replay:
    """The launches of one layer call, bound: ``__call__`` repeats them for a call with the same
    inputs (same ``checked_key``), allocating only the temporaries."""

    def __init__(self, bound: list[_Bound], temps: list[tuple[int, torch.dtype, int]], device: torch.device) -> None:
        self._bound = bound
        self._temps = [(n, dtype) for n, dtype, _ in temps]  # (numel, dtype)
        self._aligns = [align for _, _, align in temps]  # address % 16 at binding
        self._device = device
        self._gpu = current_gpu(device)  # the kernels were loaded on it (the current GPU at binding)
        # the stream at binding: buffers a launch shares between its calls (the in-kernel merge's
        # arrival counters) are its stream's, so a call on another stream launches plainly
        self._stream = current_stream(device)

    def __call__(self) -> bool:
        """Launch again; False (nothing launched) when a launch hook is installed now, another GPU
        or stream is current or a temporary came at an alignment other than the bound one: the
        caller launches plainly."""
        hooks = knobs.runtime
        device = self._device
        if hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls or current_gpu(device) != self._gpu:
            return False
        stream = current_stream(device)
        if stream != self._stream:
            return False
        temps = [torch.empty(n, dtype=dtype, device=device) for n, dtype in self._temps]  # alive until launched
        addresses = [t.data_ptr() for t in temps]
        if [a % 16 for a in addresses] != self._aligns:
            return False
        for b in self._bound:
            args: tuple | list = b.args
            if b.fills:
                args = filled = list(b.args)
                for i, temp, offset in b.fills:
                    filled[i] = addresses[temp] + offset
            b.run(*b.grid, stream, b.function, b.packed_metadata, None, None, None, *args)
        return True


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
    return torch.cuda.current_device() if device.type == "cuda" else None


def current_stream(device: torch.device):
    """The stream a launch on ``device`` goes to now, as Triton's JIT path reads it."""
    return _stream_of()(device.index)


@functools.cache
def _stream_of():
    """Triton's ``driver.active.get_current_stream`` (its driver is fixed per process)."""
    from triton.runtime import driver

    return driver.active.get_current_stream


def run(layer: LayerLaunches, device: torch.device, bind: bool) -> Replay | None:
    """Launch ``layer``'s kernels through Triton's JIT path; with ``bind`` (and where
    :func:`bindable`), return their Replay for the next call with the same inputs."""
    compiled = layer.plain()
    if not (bind and bindable(device)):
        return None
    return bind_launches(layer, compiled, device)


def bind_launches(layer: LayerLaunches, compiled: list, device: torch.device) -> Replay | None:
    """The Replay of ``layer`` whose launches returned ``compiled`` (CompiledKernels), or None
    when one cannot be bound."""
    storages = [t.untyped_storage().data_ptr() for t in layer.temporaries]
    temps = [(t.numel(), t.dtype, t.data_ptr() % 16) for t in layer.temporaries]
    bound = []
    for launch, kernel in zip(layer.launches, compiled):
        if kernel is None or not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            return None
        args = ordered_parameters(launch)
        if args is None:
            return None
        args = tuple(_as_address(a, layer.temporaries, storages) for a in args)
        fills = tuple((i, a.index, a.offset) for i, a in enumerate(args) if isinstance(a, _Temp))
        gx, gy, gz = (tuple(launch.grid) + (1, 1))[:3]
        run_fn = kernel.run  # a property: loads the kernel (CompiledKernel._init_handles) if needed
        bound.append(_Bound(run_fn, kernel.function, kernel.packed_metadata, (gx, gy, gz), args, fills))
    return Replay(bound, temps, device)


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


def _as_address(arg, temporaries: list[torch.Tensor], storages: list[int]):
    """A tensor argument as what the launcher reads from it (its address), or as a _Temp when it
    lies in one of the call's temporaries; other arguments unchanged."""
    if not isinstance(arg, torch.Tensor):
        return arg
    storage = arg.untyped_storage().data_ptr()
    for i, (temp, temp_storage) in enumerate(zip(temporaries, storages)):
        if storage == temp_storage:
            return _Temp(i, arg.data_ptr() - temp.data_ptr())
    return arg.data_ptr()
