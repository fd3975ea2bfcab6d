"""Registration: the ``vllm.general_plugins`` entry point and the hooks into vLLM's model modules.

``register()`` (run by vLLM in every process) makes ``--attention-backend DSV4_ATTN`` a known
name, carries the opt-in to Ray data-parallel actors, and patches vLLM's DeepSeek-V4 / V4.1
model modules right after they are imported (a post-import hook: loading the plugin never
imports vLLM's model code) so that their layer-class selection hands back our subclass
(:mod:`.layer`) while the plugin is on (:mod:`.gates`).
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
from collections.abc import Callable
from typing import Any

from . import gates
from .gates import (
    BACKEND_NAME,
    ENV_ENABLE,
    GATE,
    check_vllm_version,
    enabled_for,
    env_enabled,
    is_tested_version,
    logger,
    refuse_v41_rocm,
    vllm_version,
)
from .layer import DSv4AttnLayerMixin, DSv4AttnRocmLayerMixin, DSv41AttnLayerMixin

ENV_PREFIX = "DSV4_ATTN_"  # every variable of the package (dsv4_attn/envs.py)
RAY_EXTRA_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"  # vllm/envs.py, read by vllm/ray/ray_env.py
CUDA_MODEL_MODULE = "vllm.models.deepseek_v4.nvidia.model"
ROCM_MODEL_MODULE = "vllm.models.deepseek_v4.amd.model"
V41_CUDA_MODEL_MODULE = "vllm.models.deepseek_v41.nvidia.model"
V41_ROCM_MODEL_MODULE = "vllm.models.deepseek_v41.amd.model"


def register() -> None:
    """``vllm.general_plugins`` entry point: vLLM calls it in every process; idempotent.

    Opted out (no ``DSV4_ATTN_VLLM=1``), on a tested vLLM and a CUDA/ROCm platform, it only makes
    ``--attention-backend DSV4_ATTN`` a known name and installs the selection hook, which hands
    back vLLM's own class unless that name is chosen. On an untested vLLM or another platform it
    does nothing when opted out (the name stays unknown, so the flag fails in vLLM's parser) and
    raises when ``DSV4_ATTN_VLLM=1``.
    """
    enabled = env_enabled()
    version = vllm_version()
    if not is_tested_version(version):
        if enabled:
            check_vllm_version(version)
        logger.debug("dsv4_attn: vLLM %s is untested; plugin left off", version)
        return
    platform = gates.vllm_platform()
    if platform not in ("cuda", "rocm"):
        if enabled:
            raise RuntimeError(
                f"dsv4_attn vLLM plugin: got vLLM platform {platform!r}; allowed: cuda or rocm (the "
                f"DeepSeek-V4 model modules it hooks). Unset {ENV_ENABLE} on this platform."
            )
        return
    _register_backend_name()
    carry_env_to_ray_actors()
    if platform == "cuda":
        _after_import(CUDA_MODEL_MODULE, _patch_cuda_model)
        _after_import(V41_CUDA_MODEL_MODULE, _patch_v41_cuda_model)
    else:
        _after_import(ROCM_MODEL_MODULE, _patch_rocm_model)
        _after_import(V41_ROCM_MODEL_MODULE, _patch_v41_rocm_model)
    if enabled:
        v41 = "DeepSeek-V4.1's too" if platform == "cuda" else "DeepSeek-V4.1 is refused on ROCm"
        logger.info("dsv4_attn: %s=1, vLLM %s on %s: DeepSeek-V4 attention layers built in this process will "
                    "run on dsv4_attn, %s (a log line per layer class follows when they are built); other "
                    "models are not affected", ENV_ENABLE, version, platform, v41)


def carry_env_to_ray_actors() -> None:
    """With ``--data-parallel-backend ray`` vLLM starts each engine core as a Ray actor whose
    environment is only the driver's variables ``vllm/ray/ray_env.py`` ``get_env_vars_to_copy``
    selects (vLLM's own prefixes: ``VLLM_``, ``NCCL_``, ...; ``v1/engine/utils.py``
    ``CoreEngineActorManager``), so ``DSV4_ATTN_VLLM=1`` would stay behind and the actors would
    build vLLM's own layers. When any ``DSV4_ATTN_*`` variable is set, add the prefix to vLLM's
    own knob for extra prefixes; that knob is itself a ``VLLM_`` variable, so it travels into the
    actors too, and from there to their workers (Ray executor: the whole environment;
    multiprocessing: inherited). ``--attention-backend DSV4_ATTN`` needs nothing: it travels in
    the config."""
    if not any(name.startswith(ENV_PREFIX) for name in os.environ):
        return
    prefixes = [p.strip() for p in os.environ.get(RAY_EXTRA_PREFIXES, "").split(",") if p.strip()]
    if ENV_PREFIX not in prefixes:
        os.environ[RAY_EXTRA_PREFIXES] = ",".join(prefixes + [ENV_PREFIX])


def _register_backend_name() -> None:
    """Add DSV4_ATTN to vLLM's AttentionBackendEnum so the flag parses (once per process)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, f"{__name__}.DSv4AttnBackend")
    # vLLM pickles the config (with this member) into spawned workers: unpickling then imports
    # this module and re-creates the member instead of failing on an unknown enum value.
    AttentionBackendEnum[BACKEND_NAME].__reduce_ex__ = _reduce_backend_member


def _reduce_backend_member(protocol):
    return _backend_member, ()


def _backend_member():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    _register_backend_name()
    return AttentionBackendEnum[BACKEND_NAME]


def __getattr__(name: str):
    # The enum member's class path; built lazily so this module imports without vLLM.
    if name == "DSv4AttnBackend":
        return _backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.lru_cache(maxsize=1)
def _backend_class() -> type:
    """What ``AttentionBackendEnum.DSV4_ATTN.get_class()`` returns: vLLM's DSv4 sparse-MLA backend
    under our name. DeepSeek-V4 layers never ask for it (they pin their classes); it exists so
    the name resolves wherever vLLM looks it up."""
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4SparseMLABackend

    class DSv4AttnBackend(DeepseekV4SparseMLABackend):
        @staticmethod
        def get_name() -> str:
            return BACKEND_NAME

    DSv4AttnBackend.__module__ = __name__
    return DSv4AttnBackend


# ---- hooks into vLLM's model modules ------------------------------------------------------------
def layer_class_for(vllm_config, vllm_cls: type, rocm: bool = False) -> type:
    """The DSv4 attention class to build: ``vllm_cls`` unless the plugin is on for this config,
    else our subclass of it. Raises when the plugin is on but cannot serve ``vllm_cls``."""
    if not enabled_for(vllm_config):
        return vllm_cls
    check_vllm_version(vllm_version())
    if not getattr(vllm_cls, "use_fp8_ds_mla_layout", False):
        raise ValueError(
            f"--attention-backend: vLLM chose {vllm_cls.__name__}, which stores plain bf16/fp8 KV rows; "
            "allowed with dsv4_attn: the fp8_ds_mla KV layout (FlashMLA / ROCm / FlashInfer-SM120 layer "
            "classes). Drop --attention-backend FLASHINFER_MLA_SPARSE_DSV4 or turn the plugin off."
        )
    return _subclass(vllm_cls, DSv4AttnRocmLayerMixin if rocm else DSv4AttnLayerMixin)


def v41_layer_class_for(vllm_config, vllm_cls: type, flashmla_cls: type) -> type:
    """DeepSeek-V4.1 on CUDA: ``vllm_cls`` unless the plugin is on for this config, else our
    subclass of V4.1's FlashMLA layer class ``flashmla_cls``. vLLM's default on SM100, mega
    attention, is a subclass of it with the same caches and metadata but another layer contract
    (un-normed, un-roped Q in; inverse-RoPE'd FP8 out): by default the shim builds on FlashMLA's
    class instead; named explicitly it is refused, as are the FlashInfer classes."""
    if not enabled_for(vllm_config):
        return vllm_cls
    check_vllm_version(vllm_version())
    backend = getattr(vllm_config.attention_config.backend, "name", None)
    named = backend not in (None, BACKEND_NAME)
    if vllm_cls is flashmla_cls or (issubclass(vllm_cls, flashmla_cls) and not named):
        if vllm_cls is not flashmla_cls:
            logger.info("dsv4_attn: vLLM picked %s for DeepSeek-V4.1; dsv4_attn serves the layers on the caches and "
                        "metadata of %s instead (the same geometry; --kv-cache-dtype auto stores the fp8_ds_mla "
                        "record)", vllm_cls.__name__, flashmla_cls.__name__)
        return _subclass(flashmla_cls, DSv41AttnLayerMixin)
    if issubclass(vllm_cls, flashmla_cls):
        why = ("its kernel takes the un-normed, un-roped query in its own interleaved layout and returns the "
               "output inverse-RoPE'd and FP8-quantized, a layer contract dsv4_attn does not implement")
    else:
        why = "its KV caches and metadata are the FlashInfer kernels' (the shim serves V4.1 on FlashMLA's)"
    raise ValueError(
        f"--attention-backend: vLLM chose {vllm_cls.__name__} for DeepSeek-V4.1 ({backend or 'default for this GPU'}): "
        f"{why}; allowed with dsv4_attn: FLASHMLA_SPARSE_DSV41, {BACKEND_NAME} or no --attention-backend on SM90 / "
        f"SM100. Or turn the plugin off ({GATE.turn_off()})."
    )


@functools.cache
def _subclass(base: type, mixin: type) -> type:
    name = "DSv4Attn" + base.__name__.removeprefix("DeepseekV4")
    if mixin is DSv41AttnLayerMixin:
        name = name.replace("DSv4Attn", "DSv41Attn")
    doc = f"{base.__name__} with its sparse attention run by dsv4_attn (see {__name__})."
    return type(name, (mixin, base), {"__module__": __name__, "__doc__": doc})


def _wrap_selection(module, choose: Callable[[Any, Callable[[Any], type]], type]) -> None:
    """Route ``module._select_dsv4_attn_cls(vllm_config)`` through ``choose(vllm_config, vLLM's
    own selection)`` (idempotent: a wrapped selection is left as it is)."""
    select = module._select_dsv4_attn_cls
    if getattr(select, "_dsv4_attn_hook", False):
        return

    @functools.wraps(select)
    def _select_dsv4_attn_cls(vllm_config):
        return choose(vllm_config, select)

    hooked: Any = _select_dsv4_attn_cls  # a function with our marker attribute
    hooked._dsv4_attn_hook = True
    module._select_dsv4_attn_cls = hooked


def _patch_cuda_model(module) -> None:
    """Wrap the CUDA model module's layer-class selection."""
    _wrap_selection(module, lambda vllm_config, select: layer_class_for(vllm_config, select(vllm_config)))


def _patch_rocm_model(module) -> None:
    """The ROCm decoder layer names its attention class directly: show it ours while it builds
    one (idempotent). Afterwards the name is vLLM's again, and our subclass still passes the
    model's ``isinstance(module, DeepseekV4ROCMAiterMLAAttention)`` checks."""
    layer_cls = module.DeepseekV4DecoderLayer
    init = layer_cls.__init__
    if getattr(init, "_dsv4_attn_hook", False):
        return

    @functools.wraps(init)
    def __init__(self, vllm_config, *args, **kwargs):
        vllm_cls = module.DeepseekV4ROCMAiterMLAAttention
        module.DeepseekV4ROCMAiterMLAAttention = layer_class_for(vllm_config, vllm_cls, rocm=True)
        try:
            init(self, vllm_config, *args, **kwargs)
        finally:
            module.DeepseekV4ROCMAiterMLAAttention = vllm_cls

    hooked: Any = __init__  # a function with our marker attribute
    hooked._dsv4_attn_hook = True
    layer_cls.__init__ = hooked


def _patch_v41_cuda_model(module) -> None:
    """Wrap DeepSeek-V4.1's CUDA layer-class selection."""
    _wrap_selection(module, lambda vllm_config, select: v41_layer_class_for(
        vllm_config, select(vllm_config), module.DeepseekV4FlashMLAAttention))


def _patch_v41_rocm_model(module) -> None:
    """DeepSeek-V4.1's ROCm layer selection refuses while the plugin is on (before vLLM selects)."""

    def choose(vllm_config, select):
        refuse_v41_rocm(vllm_config)
        return select(vllm_config)

    _wrap_selection(module, choose)


_hooks: dict[str, _PatchAfterImport] = {}


def _after_import(name: str, patch: Callable[[Any], None]) -> None:
    """Run ``patch(module)`` now if ``name`` is imported, else right after it is (once)."""
    if name in sys.modules:
        patch(sys.modules[name])
    elif name not in _hooks:
        _hooks[name] = _PatchAfterImport(name, patch)
        sys.meta_path.insert(0, _hooks[name])


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``name`` with the other finders, and wraps its loader to patch after executing it."""

    def __init__(self, name: str, patch: Callable[[Any], None]) -> None:
        self.name, self.patch = name, patch
        self.loader: Any = None  # the loader the other finders found, set by find_spec

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                self.loader, spec.loader = spec.loader, self
                return spec
        return None

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, attr):  # get_source, get_filename, ... (tracebacks, inspect)
        return getattr(self.__dict__["loader"], attr)


