"""A bound launch handed straight to the CUDA driver: ``cuLaunchKernelEx`` with the kernel's
parameters packed once per bound call instead of parsed at every launch (the call itself is made by
``native_replay.c``; the memory it reads is laid out here with ctypes).

Why: a repeated layer call (``launch.Replay``) launches the same kernels with the same arguments
every time. Triton's launcher still converts ~60 Python arguments per launch and runs its Python
``CudaLauncher.__call__`` (~2.7 us a launch on the GPU machine's CPU, notes/host-time.md); the
driver call itself is what remains here.

What this must agree on with Triton's launcher (3.6's generated one and 3.8 / 3.9's ``driver.c``,
``third_party/nvidia/backend/driver.py``; the same in all three):

* the parameters: the kernel signature's entries (``CompiledKernel.src.signature``, in order) but
  its constexprs, then two scratch pointers (global, profile), null here;
* the configuration: grid (x times ``num_ctas``), block ``32 * num_warps``, dynamic shared memory
  ``metadata.shared``, the stream; attributes: programmatic stream serialization where
  ``metadata.launch_pdl``, cooperative where ``metadata.launch_cooperative_grid``.

Taken only where nothing else could differ, else ``kernel_layout`` returns None and Triton's
launcher runs as before: one CTA per cluster (``num_ctas`` 1), no global or profile scratch, no
instrumentation, shared memory within what every launcher passes without an extra attribute
(<= 228 KiB), every parameter a pointer or an ``i32`` / ``i64`` / ``u32`` / ``u64`` / ``fp32``
(types whose size no Triton packs differently: 3.6 packs ``i1`` in one byte, 3.8 in four), and the
packed sizes equal to the PTX entry's ``.param`` list -- the check that the block has the layout
the compiled kernel reads, made once per kernel (``ptx_param_sizes``). Any error the driver
returns raises, as Triton's launcher does. A thread with no current CUDA context is refused by the
replay's capture guard (the driver's ``cuStreamIsCapturing`` fails there), so its call launches
plainly and Triton's launcher makes the context current; a launch the driver refuses for that
reason all the same (error 201) gets Triton's launcher.
"""

from __future__ import annotations

import ctypes
import functools
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# parameter type -> its struct format: the types packed here (module docstring)
_PARAM_FORMATS = {"i32": "i", "u32": "I", "i64": "q", "u64": "Q", "fp32": "f", "f32": "f"}
_POINTER = "Q"
_SLOT = 8  # each parameter in its own 8-byte slot of the block (the driver reads it from its address)
_SHARED_LIMIT = 228 * 1024  # above this Triton 3.8+ adds an oversized-shared-memory attribute
_ATTR_COOPERATIVE = 2  # CU_LAUNCH_ATTRIBUTE_COOPERATIVE (cuda.h)
_ATTR_PDL = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
CUDA_ERROR_INVALID_CONTEXT = 201


class _Attribute(ctypes.Structure):
    """CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union (int values at its start)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("numAttrs", ctypes.c_uint)]


class _Launch(ctypes.Structure):
    """``struct direct_launch`` of native_replay.c: cuLaunchKernelEx's configuration and function,
    the parameter block and how many 8-byte slots it has (the C replay hands the driver each
    slot's address)."""

    _fields_ = [("config", ctypes.c_void_p), ("function", ctypes.c_void_p), ("block", ctypes.c_void_p),
                ("params", ctypes.c_longlong)]


# The same layouts as struct formats: a direct launch's memory is packed in one call (DirectLaunch).
_LAUNCH_FORMAT = "QQQq"
_CONFIG_FORMAT = "7I4xQQI4x"
_ATTRIBUTE_FORMAT = "i4xi60x"
_CONFIG_AT = ctypes.sizeof(_Launch)
_ATTRIBUTES_AT = _CONFIG_AT + ctypes.sizeof(_Config)

# cuda.h's layouts on a 64-bit platform, and the formats matching them; elsewhere nothing launches directly
_STRUCTS_MATCH = (ctypes.sizeof(_Attribute) == 72 == struct.calcsize("<" + _ATTRIBUTE_FORMAT)
                  and ctypes.sizeof(_Config) == 56 == struct.calcsize("<" + _CONFIG_FORMAT)
                  and ctypes.sizeof(_Launch) == 32 == struct.calcsize("<" + _LAUNCH_FORMAT))


@dataclass(frozen=True)
class KernelLayout:
    """How one compiled kernel is launched directly: which of JITFunction.run's arguments are
    parameters (positions, in order), the format of their block (8-byte slots, then the two null
    scratch pointers), and the launch configuration's fixed part."""

    positions: tuple[int, ...]
    slots: str  # the parameter block's struct format
    block: int  # threads per CTA
    shared: int  # dynamic shared memory, bytes
    attributes: tuple[int, ...]  # attribute ids, each set to 1

    @property
    def params(self) -> int:
        """Parameters in all: those at ``positions``, then the two scratch pointers."""
        return len(self.positions) + 2

    @property
    def block_at(self) -> int:
        """Where a direct launch's parameter block starts in its memory (after one attribute slot
        at least)."""
        return _ATTRIBUTES_AT + ctypes.sizeof(_Attribute) * max(1, len(self.attributes))

    @functools.cached_property
    def frame(self) -> struct.Struct:
        """A direct launch's memory: struct direct_launch, CUlaunchConfig, the attribute slots, the
        parameter block."""
        attributes = _ATTRIBUTE_FORMAT * max(1, len(self.attributes))
        return struct.Struct("<" + _LAUNCH_FORMAT + _CONFIG_FORMAT + attributes + self.slots)


def _slot_format(fmt: str) -> str:
    return fmt + "x" * (_SLOT - struct.calcsize("<" + fmt))


_ENTRY = re.compile(r"\.entry\s+\w+\s*\(([^)]*)\)")
_PARAM_TYPE = re.compile(r"\.[usbf](8|16|32|64)\b")


def ptx_param_sizes(ptx: str) -> tuple[int, ...] | None:
    """The byte size of each parameter of the PTX's (first) kernel entry, in order; None when one
    is not a plain scalar (an array: a by-value struct such as a TMA descriptor) or there is no
    entry."""
    entry = _ENTRY.search(ptx)
    if entry is None:
        return None
    sizes = []
    for param in filter(None, (p.strip() for p in entry.group(1).split(","))):
        kind = _PARAM_TYPE.search(param)
        if kind is None or "[" in param:
            return None
        sizes.append(int(kind.group(1)) // 8)
    return tuple(sizes)


def kernel_layout(kernel) -> KernelLayout | None:
    """The direct launch of ``kernel`` (a Triton CompiledKernel for CUDA), or None where it must
    go through Triton's launcher (module docstring)."""
    try:
        signature = list(kernel.src.signature.values())
        meta = kernel.metadata
        ptx = kernel.asm["ptx"]
    except (AttributeError, KeyError, TypeError):
        return None
    if not _STRUCTS_MATCH or getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "global_scratch_size", 0) \
            or getattr(meta, "profile_scratch_size", 0) or getattr(meta, "instrumentation_mode", "") \
            or not 0 <= meta.shared <= _SHARED_LIMIT:
        return None
    positions, formats = [], []
    for i, ty in enumerate(signature):
        if ty == "constexpr":
            continue
        fmt = _POINTER if isinstance(ty, str) and ty.startswith("*") else _PARAM_FORMATS.get(ty)
        if fmt is None:  # a tuple, a tensor descriptor, a type some Triton packs otherwise
            return None
        positions.append(i)
        formats.append(fmt)
    formats += [_POINTER, _POINTER]  # global and profile scratch: null
    sizes = tuple(struct.calcsize("<" + f) for f in formats)
    if ptx_param_sizes(ptx) != sizes:
        return None
    attributes = tuple(a for a, on in ((_ATTR_PDL, meta.launch_pdl), (_ATTR_COOPERATIVE,
                                                                     meta.launch_cooperative_grid)) if on)
    return KernelLayout(tuple(positions), "".join(map(_slot_format, formats)), 32 * meta.num_warps, meta.shared,
                        attributes)


class DirectLaunch:
    """One launch, packed: ``address`` is that of its ``struct direct_launch`` (native_replay.c:
    the configuration's address, the CUfunction, the parameter block's address and slot count),
    nothing converted per call. It owns one buffer holding that struct and what it points to
    (``KernelLayout.frame``: configuration, attributes, parameter block), packed in one call: a
    relocated replay makes one per launch at its first call (notes/host-time.md)."""

    def __init__(self, layout: KernelLayout, function: int, grid: tuple[int, int, int], stream: int,
                 args: Sequence) -> None:
        self.layout = layout
        self._buffer = ctypes.create_string_buffer(layout.frame.size)
        base = self.address = ctypes.addressof(self._buffer)
        attributes = [value for attribute in layout.attributes for value in (attribute, 1)] or [0, 0]
        layout.frame.pack_into(self._buffer, 0, base + _CONFIG_AT, function, base + layout.block_at, layout.params,
                               grid[0], grid[1], grid[2], layout.block, 1, 1, layout.shared, stream,
                               base + _ATTRIBUTES_AT, len(layout.attributes), *attributes,
                               *[args[i] for i in layout.positions], 0, 0)

    @property
    def config(self) -> _Config:
        """The CUlaunchConfig (a view of the buffer)."""
        return _Config.from_buffer(self._buffer, _CONFIG_AT)

    @property
    def block_address(self) -> int:
        """Where the parameter block lies (its slots' addresses are what the driver reads)."""
        return self.address + self.layout.block_at

    @property
    def block(self) -> bytes:
        """The parameter block: each parameter in its 8-byte slot, then the two null scratch
        pointers."""
        return bytes(self._buffer)[self.layout.block_at:]


def launch_kernel_ex() -> int:
    """The address of libcuda's ``cuLaunchKernelEx`` (what native_replay.c's ``replay`` calls)."""
    return _driver()[0]


def stream_is_capturing() -> int:
    """The address of libcuda's ``cuStreamIsCapturing`` (native_replay.c's capture guard asks it
    of the replay's stream, which its stream guard found current: torch's
    ``torch.cuda.is_current_stream_capturing`` asks the runtime the same of the current stream)."""
    return _driver()[2]


def error_text(code: int) -> str:
    """The driver's name for CUresult ``code``."""
    name = ctypes.c_char_p()
    _driver()[1](code, ctypes.byref(name))
    return f"CUDA error {code} ({name.value.decode() if name.value else 'unknown'})"


@functools.cache
def _driver() -> tuple[int, Any, int]:
    """(cuLaunchKernelEx's address, cuGetErrorName, cuStreamIsCapturing's address)."""
    library = ctypes.CDLL("libcuda.so.1")
    name = library.cuGetErrorName
    name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    name.restype = ctypes.c_int
    return _address(library.cuLaunchKernelEx), name, _address(library.cuStreamIsCapturing)


def _address(function: Any) -> int:
    """A ctypes function's address in the library."""
    return ctypes.cast(function, ctypes.c_void_p).value or 0
