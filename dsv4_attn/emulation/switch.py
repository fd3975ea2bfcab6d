"""The process-wide switch: :func:`enable` / :func:`disable` / :func:`active`, and
``DSV4_ATTN_AITER_EMULATOR`` read by :func:`parse_env` (validated in ``envs.py``)."""

from __future__ import annotations

from .emulator import AiterEmulator

# ---- process-wide switch ---------------------------------------------------------------------
ENV_EMULATOR = "DSV4_ATTN_AITER_EMULATOR"
_active: AiterEmulator | None = None


def parse_env(value: str) -> AiterEmulator | None:
    """``DSV4_ATTN_AITER_EMULATOR``: unset/"0" = off; "1" = gfx950 AITER 0.1.20; "gfx942";
    "gfx950:0.1.7" / "gfx950:sparse" (arch[:flavor])."""
    value = (value or "").strip().lower()
    if value in ("", "0", "false", "off"):
        return None
    if value in ("1", "true", "on"):
        return AiterEmulator()
    arch, _, flavor = value.partition(":")
    return AiterEmulator(arch, flavor or "0.1.20")


def enable(arch: str = "gfx950", flavor: str = "0.1.20") -> AiterEmulator:
    """Make the `aiter` backend run against a fresh emulator (process-wide); returns it.

    The backend then accepts CPU/CUDA devices in place of a ROCm GPU and labels everything
    emulated. Undo with :func:`disable`.
    """
    global _active
    _active = AiterEmulator(arch, flavor)
    return _active


def disable() -> None:
    global _active
    _active = None


def active() -> AiterEmulator | None:
    """The emulator switched on by :func:`enable`, or None."""
    return _active
