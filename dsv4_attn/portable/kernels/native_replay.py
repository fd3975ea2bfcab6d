"""A bound layer call's launches repeated in C (``native_replay.c``: a ``launch.Replay``'s guards,
then its launches, the driver's directly), built once per process with Triton's own C build
(``triton.runtime.build.compile_module_from_src``, the one that builds Triton's launchers, cached
in Triton's cache: the same compiler and Python headers any NVIDIA launch of Triton needs).

Why in C: 2.1-3.8 us less host time per repeated layer call than the same guards and
``cuLaunchKernelEx`` through ctypes, on a GPU machine's CPU (notes/host-time.md).
"""

from __future__ import annotations

import functools
import warnings
from importlib import resources
from types import ModuleType

_MODULE = "dsv4_attn_native_replay"


@functools.cache
def built() -> ModuleType | None:
    """The module (its ``replay``: native_replay.c says what it takes and returns), or None when it
    could not be built here (a warning says why; launches are then not bound: every layer call
    takes the full path)."""
    try:
        from triton.runtime.build import compile_module_from_src

        source = resources.files(__package__).joinpath("native_replay.c").read_text()
        return compile_module_from_src(source, _MODULE)
    except Exception as error:  # a missing compiler or headers: say so once, bind nothing
        warnings.warn(f"dsv4_attn: portable/kernels/native_replay.c could not be built ({error!r}); layer calls "
                      "are not repeated through bound launches (~10-20 us more host time per layer call)",
                      RuntimeWarning, stacklevel=2)
        return None
