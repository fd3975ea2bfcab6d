"""Triton kernels of the `triton` backend (imported only when Triton is installed).

Importing any kernel module first patches Triton's CPU interpreter where it is in use (tests on
machines without a GPU), so every kernel here runs under it the same way.
"""

from __future__ import annotations

from ...common.platform import triton_interpreting


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns scalar tensors (1-element 1-d numpy arrays) into ints with
    ``int(array)``, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted");
    loops with tensor bounds then fail. Convert through ``.reshape(-1)[0]`` instead."""
    try:
        from triton.runtime import interpreter as interp
    except Exception:  # pragma: no cover - other Triton versions
        return
    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_dsv4_patched", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._dsv4_patched = True  # type: ignore[attr-defined]  # a marker attribute on a function object
    interp._patch_lang_tensor = patched


if triton_interpreting():
    _patch_interpreter_index()
