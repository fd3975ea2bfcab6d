"""The Gluon / Triton names that moved between the Triton versions the package supports (3.6 - 3.9:
what torch 2.11 - 2.15 pin), resolved once here so the kernels call one name on every version.

Gluon is experimental and renames its builtins between releases; the kernels use these aliases
(``compat.barrier()``, ``compat.async_load(...)``) instead of the versioned names:

* ``barrier``: a CTA-wide barrier. Triton 3.6 calls it ``gl.thread_barrier``; 3.7 renamed it
  ``gl.barrier`` (3.8 and 3.9 have only that).
* ``async_load``: ``cp.async`` from global into shared memory. Up to 3.7 it is
  ``async_copy.async_copy_global_to_shared``; 3.8 renamed it ``async_copy.async_load``; 3.9 keeps the
  old name only as a stub that raises.

Both keep their arguments across the rename (checked by compiling the Hopper kernel under each
version: ci/compile-matrix.sh). Triton 3.9 also removed ``tl.make_block_ptr``: no kernel uses block
pointers (tests/test_compile_matrix.py checks the sources).
"""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy


def _newest(module, *names: str):
    """The first of ``names`` (newest first) that ``module`` defines."""
    for name in names:
        found = getattr(module, name, None)
        if found is not None:
            return found
    raise ImportError(f"this Triton's {module.__name__} has none of {', '.join(names)} (supported: Triton 3.6 - 3.9)")


barrier = _newest(gl, "barrier", "thread_barrier")
async_load = _newest(async_copy, "async_load", "async_copy_global_to_shared")
