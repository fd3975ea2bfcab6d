"""The vLLM plugin's gates: opt-in (``DSV4_ATTN_VLLM`` or ``--attention-backend DSV4_ATTN``),
the tested vLLM series, the platform, and ``status()`` for ``dsv4-attn probe``."""

from __future__ import annotations

import logging

from ... import envs
from ..base import EngineGate

BACKEND_NAME = "DSV4_ATTN"  # the --attention-backend name this plugin adds
TESTED_VLLM_SERIES = "0.33"  # vLLM internals the hooks touch move between minor releases
GATE = EngineGate(
    engine="vLLM", dist="vllm", entry_group="vllm.general_plugins", switch=envs.VLLM, backend_name=BACKEND_NAME,
    tested=(TESTED_VLLM_SERIES,), series=True, allowed=f"vLLM {TESTED_VLLM_SERIES}.x",
    why_pinned="it hooks vLLM's DeepSeek-V4 model modules, which change between releases")
ENV_ENABLE = GATE.env_name

# Under the "vllm" logger so that vLLM's logging configuration prints it.
logger = logging.getLogger("vllm.dsv4_attn")


def env_enabled() -> bool:
    """``DSV4_ATTN_VLLM`` (envs.VLLM, the one reader: 1/on or 0/off/unset); anything else is an error."""
    return GATE.env_enabled()


def names_our_backend(vllm_config) -> bool:
    """True when ``--attention-backend`` (``attention_config.backend``) is DSV4_ATTN."""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return getattr(backend, "name", None) == BACKEND_NAME


def enabled_for(vllm_config) -> bool:
    return env_enabled() or names_our_backend(vllm_config)


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def is_tested_version(version: str) -> bool:
    return GATE.is_tested(version)


def check_vllm_version(version: str) -> None:
    GATE.check_version(version)


def vllm_platform() -> str:
    """vLLM's platform: 'cuda', 'rocm', or another name (cpu, xpu, ...) the shim does not hook."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_rocm():
        return "rocm"
    return str(getattr(current_platform, "device_name", None) or type(current_platform).__name__)


def status() -> dict[str, str]:
    """The plugin's state for ``dsv4-attn probe`` (reads package metadata; imports no vLLM code)."""
    return GATE.status("DeepSeek-V4 attention layers run on dsv4_attn, and DeepSeek-V4.1's on CUDA (FlashMLA "
                       "layer class; refusals: docs/vllm.md)")


def refuse_v41_rocm(vllm_config) -> None:
    """Engine start of DeepSeek-V4.1 on ROCm with the plugin on: refused (its layer is not hooked)."""
    if enabled_for(vllm_config):
        raise ValueError(
            "dsv4_attn vLLM plugin: got a DeepSeek-V4.1 model on ROCm (vllm.models.deepseek_v41.amd); allowed: "
            "DeepSeek-V4 on ROCm, DeepSeek-V4.1 on CUDA. V4.1's ROCm layer (DeepseekV41ROCMAiterMLAAttention) "
            f"is not hooked, so dsv4_attn would not run; {GATE.turn_off()} to serve it on vLLM's own kernels."
        )
