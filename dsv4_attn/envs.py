"""Every environment variable dsv4_attn reads, in one place: its default, what it means and which
values it allows. ``dsv4-attn probe`` prints them all (:func:`table`).

Read a variable with ``envs.BACKEND.get()`` (parsed, validated). A value outside the allowed set
raises ``ValueError`` naming the variable, what it got and what is allowed -- nothing falls back
silently. Values are case-insensitive where they are words. Variables of other projects that the
probe shows (TRITON_INTERPRET, CUDA_VISIBLE_DEVICES, ...) are listed in ``FOREIGN``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    """name, default (the raw text used when unset or empty), meaning, allowed_text (what it
    allows, for errors and the probe table; a callable when it depends on the registry) and parse
    (raw text -> value; raises ValueError on anything else)."""

    name: str
    default: str
    meaning: str
    allowed_text: str | Callable[[], str]
    parse: Callable[[str], Any]

    @property
    def allowed(self) -> str:
        return self.allowed_text() if callable(self.allowed_text) else self.allowed_text

    @property
    def raw(self) -> str | None:
        """The variable's text as set (stripped), or None when unset or empty."""
        value = os.environ.get(self.name, "").strip()
        return value or None

    def get(self) -> Any:
        raw = self.raw  # one read of the environment
        text = raw if raw is not None else self.default
        try:
            return self.parse(text)
        except ValueError:
            raise ValueError(f"{self.name}: got {text!r}; allowed: {self.allowed}") from None


def _word(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.lower()
        if value not in choices:
            raise ValueError(value)
        return value
    return parse


def _switch(text: str) -> bool:
    value = text.lower()
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(value)


def _int_at_least(lowest: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < lowest:
            raise ValueError(text)
        return value
    return parse


def _text(text: str) -> str:
    return text


def _lower(text: str) -> str:
    return text.lower()


def _emulator(text: str) -> str:
    """off/on words, an AITER arch, or arch:flavor (the forms ``emulation.parse_env`` reads)."""
    from .emulation.releases import ARCHS, FLAVORS  # lazy: the emulation package imports torch

    value = text.lower()
    arch, colon, flavor = value.partition(":")
    if value in ("0", "off", "false", "1", "on", "true") or (arch in ARCHS and (not colon or flavor in FLAVORS)):
        return value
    raise ValueError(value)


# The registry checks the name (common.registry.env_backend): this module imports nothing of the
# package at import time (only _emulator reads the emulator's names, lazily), so every module may read it.
BACKEND = EnvVar("DSV4_ATTN_BACKEND", "auto",
                 "force one backend for every SparseMLA created with backend='auto' (a forced backend that "
                 "cannot serve a layer raises with its reasons)", "'auto' or a registered backend name "
                 "(`dsv4-attn probe` lists them)", _lower)
VLLM = EnvVar("DSV4_ATTN_VLLM", "0", "let the vLLM plugin run vLLM's DeepSeek-V4 attention on dsv4_attn",
              "1/on or 0/off", _switch)
SGLANG = EnvVar("DSV4_ATTN_SGLANG", "0", "let the SGLang plugin run SGLang's DeepSeek-V4 attention on dsv4_attn "
                "(--attention-backend dsv4_attn sets it for the processes SGLang starts)", "1/on or 0/off", _switch)
FLASHMLA_LIB = EnvVar("DSV4_ATTN_FLASHMLA_LIB", "",
                      "path of a FlashMLA shared library (e.g. vLLM's _flashmla_C.abi3.so) tried after the "
                      "flash_mla, vllm and sgl_kernel packages", "a file path", _text)
CHOICES = EnvVar("DSV4_ATTN_CHOICES", "",
                 "a measured-choices table (JSON from `dsv4-attn bench --write-choices`) used instead of the "
                 "packaged one for its GPU arch", "a file path", _text)
AITER_EMULATOR = EnvVar("DSV4_ATTN_AITER_EMULATOR", "0",
                        "run the aiter backend against the AITER emulator on any device (results are labelled "
                        "EMULATED)", "0/off, 1/on (gfx950), an arch (gfx942, gfx950) or arch:flavor (flavor "
                        "0.1.20, 0.1.7 or sparse)",
                        _emulator)
AITER_PATH = EnvVar("DSV4_ATTN_AITER_PATH", "auto", "which AITER entry point the aiter backend uses",
                    "auto, sparse_mla_fwd, mla_decode_fwd_v4_nm or mla_decode_fwd",
                    _word("auto", "sparse_mla_fwd", "mla_decode_fwd_v4_nm", "mla_decode_fwd"))
AITER_FP8_COMPUTE = EnvVar("DSV4_ATTN_AITER_FP8_COMPUTE", "0",
                           "let the aiter backend run AITER's a8w8 kernels (mla_decode_fwd_v4_nm, mla_decode_fwd "
                           "persistent), which round q and the probabilities to fp8: faster, about 10x less "
                           "accurate than the bf16 paths (docs/rocm.md \"Accuracy\")", "1/on or 0/off", _switch)
AITER_PERSISTENT_MAX_BATCH = EnvVar("DSV4_ATTN_AITER_PERSISTENT_MAX_BATCH", "32",
                                    "with DSV4_ATTN_AITER_FP8_COMPUTE on, mla_decode_fwd runs its persistent "
                                    "kernels below this many decode tokens (0 = never)", "an int >= 0",
                                    _int_at_least(0))
AITER_MAX_DECODE_TOKENS = EnvVar("DSV4_ATTN_AITER_MAX_DECODE_TOKENS", "1024",
                                 "decode tokens the aiter backend's scratch buffers hold (unset: the engine's "
                                 "decode tokens, sized at engine start; 1024 outside an engine); larger decode "
                                 "launches run on triton / torch", "an int >= 1",
                                 _int_at_least(1))

DIRECT_LAUNCH = EnvVar("DSV4_ATTN_DIRECT_LAUNCH", "1",
                       "a repeated layer call on an NVIDIA GPU hands its bound Triton kernels to the CUDA driver "
                       "(cuLaunchKernelEx, parameters packed once: portable/kernels/driver_launch.py); 0: through "
                       "Triton's launcher, as before (read when a call is bound)", "1/on or 0/off", _switch)

OURS = (BACKEND, VLLM, SGLANG, FLASHMLA_LIB, CHOICES, AITER_EMULATOR, AITER_PATH, AITER_FP8_COMPUTE,
        AITER_PERSISTENT_MAX_BATCH, AITER_MAX_DECODE_TOKENS, DIRECT_LAUNCH)
# Other projects' variables that change what dsv4_attn does, shown by the probe.
FOREIGN = {"TRITON_INTERPRET": "Triton runs kernels in its CPU interpreter (tests on machines without a GPU)",
           "CUDA_VISIBLE_DEVICES": "which NVIDIA GPUs torch sees", "HIP_VISIBLE_DEVICES": "which AMD GPUs torch sees",
           "AITER_ASM_DIR": "where AITER's code objects are read from",
           "AITER_ENABLE_EXPERIMENTAL": "AITER routes 64/128-head FP8 persistent decode to kernels without a final "
                                        "LSE: the aiter backend then pads persistent heads to 16 only",
           "FLASHINFER_CUBIN_DIR": "where FlashInfer's TRTLLM-gen cubins are read from"}


def table() -> list[dict[str, Any]]:
    """One row per variable: name, value as set (None when unset), default, meaning, allowed,
    and error (the ValueError text when the set value is not allowed, else None)."""
    rows = []
    for var in OURS:
        error = None
        try:
            var.get()
        except ValueError as exc:
            error = str(exc)
        rows.append({"name": var.name, "value": var.raw, "default": var.default, "meaning": var.meaning,
                     "allowed": var.allowed, "error": error})
    for name, meaning in FOREIGN.items():
        rows.append({"name": name, "value": os.environ.get(name) or None, "default": "", "meaning": meaning,
                     "allowed": "", "error": None})
    return rows
