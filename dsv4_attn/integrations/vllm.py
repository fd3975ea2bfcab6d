"""vLLM plugin: run vLLM 0.33's DeepSeek-V4 attention layers on dsv4_attn.

Enable it (nothing changes otherwise): ``DSV4_ATTN_VLLM=1`` in the environment, or
``--attention-backend DSV4_ATTN``. Docs: docs/vllm.md.

How it hooks in. In vLLM 0.33 DeepSeek-V4 layers do not go through the attention-backend
registry: each decoder layer builds its attention from a class the model module picks, and that
class pins its backend classes. So ``register()`` (the ``vllm.general_plugins`` entry point, run
in every vLLM process) wraps that choice:

* CUDA: ``vllm.models.deepseek_v4.nvidia.model._select_dsv4_attn_cls`` (looked up when a decoder
  layer, MTP layer included, is built) returns our subclass of the class vLLM picked;
* ROCm: the decoder layer's ``__init__`` sees our subclass under the module-global name
  ``DeepseekV4ROCMAiterMLAAttention`` while it builds its attention;
* DeepSeek-V4.1 on CUDA: ``vllm.models.deepseek_v41.nvidia.model._select_dsv4_attn_cls`` returns
  our subclass of V4.1's FlashMLA layer class (``DeepseekV4FlashMLAAttention`` of that package),
  whose caches, KV sharing and metadata builders the shim keeps; the V4.1 classes whose contract
  differs (mega attention, FlashInfer) and V4.1 on ROCm are refused at engine start, with reasons
  (docs/vllm.md, "DeepSeek-V4.1").

The model modules are patched right after they are imported (a post-import hook), so loading
the plugin never imports vLLM's model code. Our subclass keeps everything of vLLM's layer
(projections, RMSNorm/RoPE, cache writes, compressor, indexer, its metadata builders and KV-cache
specs) and replaces only ``forward_mqa``: it maps vLLM's per-step metadata onto a
:class:`StepBatch`, plans it once per step and KV-cache group (:class:`StepPlanner`) and runs
:meth:`SparseMLA.forward` into vLLM's output buffer. Which dsv4_attn backend runs is the usual
probe decision (``DSV4_ATTN_BACKEND`` forces one). What cannot be served is refused when the
layer is built (engine start), with reasons.

vLLM metadata -> StepBatch (per step; vLLM orders the batch decodes first):

=============================  ==============================================================
StepBatch                      vLLM 0.33
=============================  ==============================================================
query_start_loc int32 [R+1]    ``DeepseekSparseSWAMetadata.query_start_loc`` (padded requests
                               repeat the last offset; tokens past it are CUDA-graph padding)
seq_lens int32 [R]             ``.seq_lens`` (include this step's tokens)
num_decode_tokens              ``.num_decode_tokens`` (split at 1 + speculative tokens)
swa_block_table / size         ``.block_table`` (this layer's SWA-cache group) / ``.block_size``
                               (64 tokens per block)
comp_block_tables[ratio]       ``DeepseekV4FlashMLAMetadata.block_table`` of the compressed-cache
                               group of each ratio among the plan's layers (none for a plan of
                               SWA-only layers); V4.1: the metadata of the layer's KV source
                               (``compressed_cache_prefix``), whose cache tensor it reads
block_size                     ``DeepseekV4FlashMLAMetadata.block_size`` (in UNCOMPRESSED tokens;
                               ratio-r blocks hold block_size // r entries): V4 256; V4.1 64 on
                               SM90, 128 on SM100
swa_start                      ``DeepseekSparseSWAMetadata.replay_start`` (V4.1 SWA bounded
                               replay; None otherwise)
num_tokens                     ``q.shape[0]`` (padded token count)
topk (top-k layers)            the model's shared ``topk_indices_buffer`` [max_tokens, index_topk]
                               of LOCAL compressed positions, last written by the layer's indexer
                               (V4 C4A) or by its index source (V4.1 C1A / C2A)
=============================  ==============================================================

Positions are derived from query_start_loc/seq_lens on the device (they equal vLLM's
``positions``); nothing in a plan reads a device value on the host, so a plan built inside a
captured CUDA graph is rebuilt from vLLM's persistent buffers at every replay.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .. import envs
from ..api import SparseMLA
from ..common.backend import Phase
from ..common.batch import StepBatch
from ..common.layout import Fp8Dialect, KVFormat
from ..common.plan import StepPlan
from ..common.platform import probe
from ..common.spec import MAX_HEADS, LayerKind, ModelSpec, model_layer_kinds

ENV_ENABLE = "DSV4_ATTN_VLLM"
ENV_PREFIX = "DSV4_ATTN_"  # every variable of the package (dsv4_attn/envs.py)
RAY_EXTRA_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"  # vllm/envs.py, read by vllm/ray/ray_env.py
BACKEND_NAME = "DSV4_ATTN"  # the --attention-backend name this plugin adds
TESTED_VLLM_SERIES = "0.33"  # vLLM internals the hooks touch move between minor releases
CUDA_MODEL_MODULE = "vllm.models.deepseek_v4.nvidia.model"
ROCM_MODEL_MODULE = "vllm.models.deepseek_v4.amd.model"
V41_CUDA_MODEL_MODULE = "vllm.models.deepseek_v41.nvidia.model"
V41_ROCM_MODEL_MODULE = "vllm.models.deepseek_v41.amd.model"

# Under the "vllm" logger so that vLLM's logging configuration prints it.
logger = logging.getLogger("vllm.dsv4_attn")


# ---- opt-in, version and platform gates ------------------------------------------------------
def env_enabled() -> bool:
    """``DSV4_ATTN_VLLM`` (envs.VLLM, the one reader: 1/on or 0/off/unset); anything else is an error."""
    return envs.VLLM.get()


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
    return version.split("+")[0].split(".")[:2] == TESTED_VLLM_SERIES.split(".")


def check_vllm_version(version: str) -> None:
    if not is_tested_version(version):
        raise RuntimeError(
            f"dsv4_attn vLLM plugin: got vLLM {version}; allowed: vLLM {TESTED_VLLM_SERIES}.x (the only "
            "series it is tested with: it hooks vLLM's DeepSeek-V4 model modules, which change between "
            f"releases). Install vllm=={TESTED_VLLM_SERIES}.* or turn the plugin off (unset {ENV_ENABLE}, "
            f"drop --attention-backend {BACKEND_NAME})."
        )


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
    import importlib.metadata as md

    try:
        version = md.version("vllm")
    except md.PackageNotFoundError:
        version = None
    declared = any(ep.name == "dsv4_attn" for ep in md.entry_points(group="vllm.general_plugins"))
    raw = envs.VLLM.raw
    if version is None:
        verdict = "off (vllm not installed)"
    elif not is_tested_version(version):
        verdict = f"refused (vLLM {version}; tested: {TESTED_VLLM_SERIES}.x)"
    elif not declared:
        verdict = ("off (dsv4-attn's vllm.general_plugins entry point is not installed: pip install -e <a clone of "
                   "dsv4-attn> in this environment)")
    elif env_enabled():
        verdict = (f"on ({ENV_ENABLE}={raw}): DeepSeek-V4 attention layers run on dsv4_attn, and DeepSeek-V4.1's on "
                   "CUDA (FlashMLA layer class; refusals: docs/vllm.md)")
    else:
        verdict = f"available: on with {ENV_ENABLE}=1 or --attention-backend {BACKEND_NAME}"
    return {"vllm": version or "not installed", "entry point": "installed" if declared else "missing",
            ENV_ENABLE: raw or "unset", "vllm plugin": verdict}


# ---- the entry point -------------------------------------------------------------------------
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
    platform = vllm_platform()
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
        f"SM100. Or turn the plugin off (unset {ENV_ENABLE}, drop --attention-backend {BACKEND_NAME})."
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

    _select_dsv4_attn_cls._dsv4_attn_hook = True
    module._select_dsv4_attn_cls = _select_dsv4_attn_cls


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

    __init__._dsv4_attn_hook = True
    layer_cls.__init__ = __init__


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
        self.name, self.patch, self.loader = name, patch, None

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


# ---- the layer ------------------------------------------------------------------------------------
class DSv4AttnLayerMixin:
    """Put in front of a vLLM DeepSeek-V4 attention class: ``forward_mqa`` runs on dsv4_attn.

    vLLM's contract (``DeepseekV4Attention.forward_mqa``): ``q`` bf16 [T, H, 512], normed and
    roped, heads padded with zeros to ``padded_heads`` (the base class's padding, kept because
    vLLM's fused q-norm/RoPE kernel and the sink ``attn_sink`` [padded_heads] float32 (-inf on
    padded heads) are sized by it); ``output`` bf16 [T, padded_heads, 512], written in place in
    the rotated frame; heads >= n_local_heads are sliced off by vLLM. ``kv`` is unused: vLLM has
    already written it into the SWA cache, and attention reads every key back from the caches.
    ``attn_metadata is None`` (profiling / dummy run): plan buffers reserved, ``output`` zeroed.
    """

    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        if num_heads > MAX_HEADS:
            raise ValueError(
                f"num_attention_heads / tensor_parallel_size: got {num_heads} query heads per rank; allowed: "
                f"<= {MAX_HEADS} with dsv4_attn (raise --tensor-parallel-size)"
            )
        return super().get_padded_num_q_heads(num_heads)

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.dsv4_setup(vllm_config)

    def dsv4_setup(self, vllm_config) -> None:
        """Engine-start checks and the shared planner; the end of ``__init__``."""
        reasons = unsupported_reasons(self, vllm_config)
        if reasons:
            raise ValueError(f"dsv4_attn cannot serve {self.prefix} ({type(self).__name__}):\n"
                             + "\n".join(f"  - {r}" for r in reasons))
        self.dsv4_kind = self.dsv4_layer_kind(self.compress_ratio)
        self.dsv4_comp_prefix = self.dsv4_comp_owner()
        self.dsv4_planner = planner_for(self, vllm_config)
        self.dsv4_planner.add_layer(self)

    # ---- what differs between the model versions --------------------------------------------------
    @staticmethod
    def dsv4_layer_kind(ratio: int) -> LayerKind:
        """V4 stores window-only layers as ratio 1 (``max(1, config ratio)``)."""
        return LayerKind.SWA if ratio <= 1 else LayerKind.from_ratio(ratio)

    def dsv4_model_kinds(self, vllm_config) -> tuple[LayerKind, ...]:
        return tuple(LayerKind.parse(k) for k in ("swa", "c4a", "c128a"))

    def dsv4_kv_format(self) -> KVFormat:
        """The records vLLM stores (its __init__ turned every fp8 dtype into fp8_ds_mla)."""
        return KVFormat.MODEL1_FP8

    def dsv4_comp_owner(self) -> str:
        """The layer whose compressed cache (and metadata entry) this layer reads."""
        return self.prefix

    def dsv4_comp_cache(self) -> torch.Tensor:
        """The compressed cache this layer reads (bound after __init__)."""
        return self.kv_cache

    def forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                    output: torch.Tensor) -> None:
        from vllm.forward_context import get_forward_context

        forward = get_forward_context()
        attn_metadata = forward.attn_metadata
        if attn_metadata is None:  # profiling / dummy run
            self.dsv4_planner.reserve(q.device)
            output.zero_()
            return
        if not isinstance(attn_metadata, dict):
            raise ValueError(f"attn_metadata: got {type(attn_metadata).__name__}; allowed: one dict per "
                             "step (micro-batching is not supported by dsv4_attn)")
        self.dsv4_planner.attend(self, attn_metadata, q, output, forward)


class DSv41AttnLayerMixin(DSv4AttnLayerMixin):
    """Put in front of vLLM 0.33's DeepSeek-V4.1 FlashMLA layer class: the V4 contract, with V4.1's
    layer numbering (0 window only, 1 C1A, 2 C2A), KV sharing (a layer reads the compressed cache
    and block table of its KV source, ``compressed_cache_prefix``; its top-k is what its index
    source's indexer last wrote into the shared buffer) and records (SM100 stores the MXFP8
    record under the name fp8_ds_mla, and nvfp4_ds_mla's NVFP4 compressed cache)."""

    @staticmethod
    def dsv4_layer_kind(ratio: int) -> LayerKind:
        return V41_KINDS[ratio]  # vLLM's __init__ accepts 0, 1 and 2 only

    def dsv4_model_kinds(self, vllm_config) -> tuple[LayerKind, ...]:
        ratios = getattr(vllm_config.model_config.hf_config, "compress_ratios", None) or [0]
        return tuple(dict.fromkeys([LayerKind.SWA] + [V41_KINDS[int(r)] for r in ratios]))

    def dsv4_kv_format(self) -> KVFormat:
        if not self.kv_mxfp8:  # every GPU but SM100 keeps the V4 record for V4.1
            return KVFormat.MODEL1_FP8
        return KVFormat.NVFP4 if self.kv_cache_dtype == "nvfp4_ds_mla" else KVFormat.MXFP8

    def dsv4_comp_owner(self) -> str:
        return self.compressed_cache_prefix or self.prefix  # None for window-only layers

    def dsv4_comp_cache(self) -> torch.Tensor:
        return self._compressed_kv_cache()


V41_KINDS = {0: LayerKind.SWA, 1: LayerKind.C1A, 2: LayerKind.C2A}


class DSv4AttnRocmLayerMixin(DSv4AttnLayerMixin):
    """ROCm layer contract: ``forward_mqa`` leaves the output de-rotated (inverse RoPE at the
    query positions) unless the fp8 ``wo_a`` path does it in ``_o_proj`` (vLLM's
    ``DeepseekV4ROCMAiterMLAAttention.forward_mqa``)."""

    def forward_mqa(self, q, kv, positions, output) -> None:
        super().forward_mqa(q, kv, positions, output)
        from vllm.forward_context import get_forward_context

        if get_forward_context().attn_metadata is not None and self._wo_a_fp8_weight is None:
            from vllm.v1.attention.ops.rocm_aiter_mla_sparse import rocm_inverse_rope_rows_

            rocm_inverse_rope_rows_(output[:, : self.n_local_heads, :], positions,
                                    self.rotary_emb.cos_sin_cache, self.rope_head_dim)


def unsupported_reasons(layer, vllm_config) -> list[str]:
    """Why dsv4_attn cannot serve this vLLM layer / configuration ([] = it can).

    The KV-cache dtype needs no check here: the layer classes this plugin accepts use vLLM's
    fp8_ds_mla layout, whose ``__init__`` maps every fp8 dtype to fp8_ds_mla and raises for the
    others before this runs (``_resolve_dsv4_kv_cache_dtype``).
    """
    reasons = []
    ratio = layer.compress_ratio
    block_size = resolved_block_size(layer, vllm_config)
    if ratio > 1 and block_size % ratio:
        reasons.append(f"--block-size: got {block_size}; allowed: a multiple of {ratio} (the ratio-{ratio} "
                       f"cache holds block_size // {ratio} entries per block); or leave --block-size unset "
                       "(vLLM then picks its compressed kernel's block size)")
    if getattr(layer, "max_image_tokens", 0):  # V4 only: V4.1 image tokens keep the causal window
        reasons.append("vision variant (vision_max_n_token > 0): in-image bidirectional SWA windows are "
                       "not modelled by dsv4_attn")
    spec = vllm_config.speculative_config
    if spec is not None and spec.use_dspark():
        reasons.append("DSpark speculative decoding: non-causal draft windows are not modelled by dsv4_attn")
    parallel = vllm_config.parallel_config
    if parallel.use_ubatching:
        reasons.append(
            f"micro-batching (--ubatch-size {parallel.ubatch_size}, --enable-dbo {parallel.enable_dbo}): "
            "vLLM runs the micro-batches' forwards interleaved, each with its own metadata, and they would "
            "overwrite each other's plan buffers; allowed: --ubatch-size 0 or 1 without --enable-dbo")
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            reasons.append(f"{name}: got {getattr(parallel, name)}; allowed: 1 (context-parallel KV sharding "
                           "is not modelled by dsv4_attn)")
    extra = vllm_config.additional_config
    if isinstance(extra, dict) and extra.get("decode_backend", "auto") != "auto":
        reasons.append(f"additional_config decode_backend={extra['decode_backend']!r}: DeepSeek-V4.1's specialized "
                       "decode runs FULL-graph decode steps on its own attention kernels, which never reach this "
                       "layer's, so dsv4_attn would be bypassed; allowed: decode_backend 'auto'")
    if getattr(vllm_config.kernel_config, "monokernel", False):
        reasons.append("--monokernel: decode steps of the eligible layers run vLLM's mono decode kernel and "
                       "never reach this layer's attention, so dsv4_attn would be bypassed; drop --monokernel")
    return reasons


def resolved_block_size(layer, vllm_config) -> int:
    """The KV-cache block size (uncompressed tokens) vLLM will run ``layer`` with. vLLM builds the
    model while ``cache_config.block_size`` still holds its placeholder default (16) and resolves
    it only after ``load_model`` (``v1/executor/multiproc_executor.py`` ->
    ``platforms/interface.py`` ``update_block_size_for_backend``): ``--block-size`` when given,
    else a size every layer's attention backend supports -- a multiple of the compressed
    backend's kernel block (DeepSeek-V4: 256; V4.1: 64 on SM90, 128 on SM100), the size
    predicted here."""
    cache = vllm_config.cache_config
    if cache.user_specified_block_size:
        return cache.block_size
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):  # V4.1's backend reads the device through it
        return layer.get_attn_backend().get_preferred_block_size(cache.DEFAULT_BLOCK_SIZE)


def refuse_v41_rocm(vllm_config) -> None:
    """Engine start of DeepSeek-V4.1 on ROCm with the plugin on: refused (its layer is not hooked)."""
    if enabled_for(vllm_config):
        raise ValueError(
            "dsv4_attn vLLM plugin: got a DeepSeek-V4.1 model on ROCm (vllm.models.deepseek_v41.amd); allowed: "
            "DeepSeek-V4 on ROCm, DeepSeek-V4.1 on CUDA. V4.1's ROCm layer (DeepseekV41ROCMAiterMLAAttention) "
            "is not hooked, so dsv4_attn would not run; unset "
            f"{ENV_ENABLE} and drop --attention-backend {BACKEND_NAME} to serve it on vLLM's own kernels."
        )


# ---- which layers share a plan --------------------------------------------------------------
@dataclass(frozen=True)
class PlanGroup:
    """The caches whose block tables one StepPlan is built from: an SWA cache and at most one
    compressed cache per ratio, each named by a layer prefix (the key of its metadata in vLLM's
    ``attn_metadata``)."""

    swa_prefix: str
    comp_prefixes: tuple[tuple[int, str], ...] = ()
    # The KV-cache group of its ratio-128 cache (``group_of``'s name for it; None without one):
    # plans of a step with the same one build the same C128A rows, so they share one row set.
    c128a_table: Any = field(default=None, compare=False)

    @property
    def has_c128a(self) -> bool:
        return any(ratio == LayerKind.C128A.ratio for ratio, _ in self.comp_prefixes)


def plan_groups(layers, group_of: Callable[[str], Any]) -> tuple[dict[str, int], list[PlanGroup]]:
    """Which layers can share one StepPlan: ({layer prefix: plan index}, [PlanGroup per plan]).

    A plan holds the SWA rows of one SWA-cache block table and the C128A rows of one ratio-128
    table, and C4A layers translate their top-k through the ratio-4 table in the plan's batch.
    So layers share a plan when their SWA caches are in one KV-cache group and, per ratio,
    their compressed caches are too: per SWA group, one plan per distinct compressed group of
    each ratio (one in vLLM 0.33's DeepSeek-V4 grouping, see docs/vllm.md). ``group_of(prefix)``
    names the KV-cache group of a cache (its metadata object at run time, vLLM's group index
    when predicting); ``layers`` have ``prefix``, ``swa_cache_layer.prefix``, ``dsv4_kind`` and
    ``dsv4_comp_prefix`` (the layer owning its compressed cache: itself, or V4.1's KV source).
    """
    per_swa: dict[Any, tuple[str, dict[int, list[tuple[Any, str]]]]] = {}  # SWA group -> ratio -> comp groups
    for layer in layers:
        swa_prefix = layer.swa_cache_layer.prefix
        _, comps = per_swa.setdefault(group_of(swa_prefix), (swa_prefix, {}))
        if layer.dsv4_kind.has_comp_scope:
            seen = comps.setdefault(layer.dsv4_kind.ratio, [])
            if all(gid != group_of(layer.dsv4_comp_prefix) for gid, _ in seen):
                seen.append((group_of(layer.dsv4_comp_prefix), layer.dsv4_comp_prefix))
    groups: list[PlanGroup] = []
    first: dict[Any, int] = {}
    for swa_gid, (swa_prefix, comps) in per_swa.items():
        first[swa_gid] = len(groups)
        for j in range(max([1] + [len(c) for c in comps.values()])):
            c128a = comps.get(LayerKind.C128A.ratio, [])
            groups.append(PlanGroup(swa_prefix, tuple((r, c[j][1]) for r, c in comps.items() if j < len(c)),
                                    c128a[j][0] if j < len(c128a) else None))
    index = {}
    for layer in layers:
        swa_gid, j = group_of(layer.swa_cache_layer.prefix), 0
        if layer.dsv4_kind.has_comp_scope:
            j = [gid for gid, _ in per_swa[swa_gid][1][layer.dsv4_kind.ratio]].index(group_of(layer.dsv4_comp_prefix))
        index[layer.prefix] = first[swa_gid] + j
    return index, groups


def predicted_plan_groups(vllm_config, layers) -> list[PlanGroup]:
    """The plans a step will need, from vLLM's own KV-cache grouping of this worker's layers
    (what its engine core computes after the memory profile). Raises what vLLM raises."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    kv_groups = get_global_kv_cache_groups(vllm_config, [get_kv_cache_spec(vllm_config)])
    group_index = {name: i for i, group in enumerate(kv_groups) for name in group.layer_names}
    return plan_groups(layers, group_index.__getitem__)[1]


# ---- one plan per KV-cache group and step, shared by the layers -------------------------------
_planners: dict[tuple, StepPlanner] = {}


def planner_for(layer, vllm_config) -> StepPlanner:
    """The planner shared by every layer with the same setup (created, and logged, once)."""
    topk = layer.topk_indices_buffer
    spec = ModelSpec(
        num_heads=layer.n_local_heads,
        topk=topk.shape[-1] if topk is not None else vllm_config.model_config.hf_config.index_topk,
        max_model_len=layer.max_model_len,
        window=layer.window_size,
        softmax_scale=layer.scale,
        layers=model_layer_kinds(vllm_config.model_config.hf_config, layer.dsv4_model_kinds(vllm_config)),
    )
    sched = vllm_config.scheduler_config
    max_tokens = sched.max_num_batched_tokens
    # gfx942 writes the SWA cache in FNUZ fp8 and the compressed cache in OCP (docs/rocm.md).
    # No block size in the key: vLLM has not resolved it yet (resolved_block_size); steps carry it.
    key = (spec, max_tokens, max(sched.max_num_seqs, max_tokens), probe().fp8_dialect, layer.dsv4_kv_format())
    if key not in _planners:
        planner = StepPlanner(*key, predict=functools.partial(predicted_plan_groups, vllm_config),
                              block_size=lambda: vllm_config.cache_config.block_size)
        planner.log(type(layer))
        _planners[key] = planner
    return _planners[key]


class StepPlanner:
    """The StepPlans of every layer of one model setup (spec, token budget, dialect, KV format).

    A step is one forward pass: vLLM's ForwardContext (a new one per forward, holding that
    forward's ``attn_metadata`` dict), weakly referenced, so that no plan -- and none of vLLM's
    buffers a plan's batch points to -- outlives its forward (vLLM's CUDA-graph memory profile
    tears down a throwaway KV cache and its builders, and must get their memory back). Target
    layers: at the step's first layer the layers are split into
    plan groups (:func:`plan_groups`, keyed by the identities of the metadata objects, which
    vLLM builds once per KV-cache group and step); each group's plan is built by its first layer
    and reused by the others. Draft (MTP) layers -- vLLM's ``is_draft_layer`` -- plan at every
    call into a slot of their own: vLLM's speculator updates the draft metadata in place between
    draft steps (``update_draft_decode_metadata``) and records the whole draft loop in one CUDA
    graph, so no Python-visible key changes between draft steps, while each draft forward runs
    one attention layer, so planning every call costs nothing extra.

    Every plan lives in a slot (a SparseMLA with buffers for ``max_tokens`` tokens); the
    profiling run (:meth:`reserve`) allocates all slots a step will use, C128A rows included, so
    vLLM's memory profile counts them before it sizes the KV cache. Target slots whose plans read
    one ratio-128 table (V4: every plan; vLLM puts all compressed caches in one KV-cache group)
    share one C128A row set (``max_tokens x c128a_width`` int32: 256 MiB at 1M context and 8192
    tokens): each plan of the step rewrites the same rows, so whichever plan a step builds first,
    the rows every C128A layer reads are its step's.

    ``block_size()``: the engine's compressed-cache block size, asked only from the profiling run
    on (vLLM resolves it after building the model; steps carry it in their metadata).
    """

    def __init__(self, spec: ModelSpec, max_tokens: int, max_reqs: int, swa_dialect: Fp8Dialect,
                 fmt: KVFormat = KVFormat.MODEL1_FP8, predict: Callable[[list], list[PlanGroup]] | None = None,
                 *, block_size: Callable[[], int]) -> None:
        self.spec, self.max_tokens, self.max_reqs = spec, max_tokens, max_reqs
        self.swa_dialect, self.block_size, self.fmt = swa_dialect, block_size, fmt
        self.predict = predict
        self.layers: list = []
        self.slots: list[SparseMLA] = [self._new_slot()]  # backend refusals surface here: engine start
        self.draft_slot: SparseMLA | None = None
        self.plans_built = 0
        self.reserved_bytes: int | None = None  # set by reserve()
        self._forward: weakref.ref | None = None  # the step's forward pass
        self._step_key: tuple[int, int] | None = None  # (id(attn_metadata), num tokens) within it
        self._layer_plan: dict[str, int] = {}
        self._groups: list[PlanGroup] = []
        self._plans: dict[int, tuple[SparseMLA, StepPlan]] = {}
        self._row_owner: dict[int, int] = {}  # slot -> the slot whose C128A rows it shares (reserve())

    def _new_slot(self) -> SparseMLA:
        return SparseMLA(self.spec, self.fmt, max_tokens=self.max_tokens, max_reqs=self.max_reqs,
                         swa_dialect=self.swa_dialect, comp_dialect=Fp8Dialect.OCP)

    def add_layer(self, layer) -> None:
        self.layers.append(layer)

    # ---- per layer call ------------------------------------------------------------------------
    def attend(self, layer, attn_metadata: dict, q: torch.Tensor, output: torch.Tensor, forward) -> None:
        """One layer's attention for the step ``attn_metadata`` (vLLM's per-layer-name metadata
        dict): q bf16 [T, H, 512] (H may be below output's head count: zero-padded here), output
        bf16 [T, padded_heads, 512] written in place. ``layer``: a layer set up by this planner
        (``prefix``, ``swa_cache_layer``, ``dsv4_kind``, ``dsv4_comp_prefix``, ``dsv4_comp_cache()``,
        ``topk_indices_buffer``, ``attn_sink``, ``is_draft_layer``). ``forward``: a weak-referenceable
        object that lives as long as the forward pass and no longer (vLLM's ForwardContext)."""
        kind = layer.dsv4_kind
        if getattr(layer, "is_draft_layer", False):
            mla, plan = self._draft_plan(layer, attn_metadata, q.shape[0])
        else:
            mla, plan = self._target_plan(layer, attn_metadata, q.shape[0], forward)
        if q.shape[1] < output.shape[1]:  # FlashInfer-SM120 base: q arrives at the live head count
            q = F.pad(q, (0, 0, 0, output.shape[1] - q.shape[1]))
        mla.forward(plan, kind, q, layer.swa_cache_layer.kv_cache,
                    layer.dsv4_comp_cache() if kind.has_comp_scope else None,
                    topk=layer.topk_indices_buffer if kind.uses_topk else None,
                    sink=layer.attn_sink, out=output)

    def _target_plan(self, layer, attn_metadata: dict, num_tokens: int, forward) -> tuple[SparseMLA, StepPlan]:
        _metadata(attn_metadata, layer.swa_cache_layer.prefix, layer)
        if layer.dsv4_kind.has_comp_scope:
            _metadata(attn_metadata, layer.dsv4_comp_prefix, layer)
        key = (id(attn_metadata), num_tokens)  # the dict lives while we plan from it: its id is unique
        if self._forward is None or self._forward() is not forward or key != self._step_key:  # a new step
            live = [t for t in self.layers
                    if not getattr(t, "is_draft_layer", False) and _has_metadata(t, attn_metadata)]
            self._layer_plan, self._groups = plan_groups(live, lambda prefix: id(attn_metadata[prefix]))
            self._forward, self._step_key, self._plans = weakref.ref(forward, self._forward_ended), key, {}
            self._unshare_other_tables()
        index = self._layer_plan[layer.prefix]
        if index not in self._plans:
            group = self._groups[index]
            comp = {ratio: attn_metadata[prefix] for ratio, prefix in group.comp_prefixes}
            batch = self.step_batch(attn_metadata[group.swa_prefix], comp, num_tokens)
            self._plans[index] = self._plan(self._slot(index, group), batch)
        return self._plans[index]

    def _unshare_other_tables(self) -> None:
        """A slot keeps sharing C128A rows only while its plan and the owner's read one ratio-128
        table this step (as vLLM's grouping predicted at profiling); otherwise it gets rows of its
        own at its next plan (outside vLLM's budget: :meth:`_slot` says so)."""
        groups = self._groups
        for index, owner in list(self._row_owner.items()):
            if max(index, owner) < len(groups) and groups[index].c128a_table == groups[owner].c128a_table:
                continue
            del self._row_owner[index]
            buffers = self.slots[index]._buffers
            if buffers is not None:
                buffers.all_rows.pop(LayerKind.C128A.ratio, None)

    def _forward_ended(self, ref: weakref.ref) -> None:
        """The step's forward pass is gone: drop its plans (they point into vLLM's buffers)."""
        if ref is self._forward:
            self._forward, self._step_key, self._plans = None, None, {}

    def _draft_plan(self, layer, attn_metadata: dict, num_tokens: int) -> tuple[SparseMLA, StepPlan]:
        kind = layer.dsv4_kind
        swa_md = _metadata(attn_metadata, layer.swa_cache_layer.prefix, layer)
        comp = {kind.ratio: _metadata(attn_metadata, layer.dsv4_comp_prefix, layer)} if kind.has_comp_scope else {}
        if self.draft_slot is None:
            self._warn_unreserved("the draft (MTP) layers' slot")
            self.draft_slot = self._new_slot()
        return self._plan(self.draft_slot, self.step_batch(swa_md, comp, num_tokens))

    def _slot(self, index: int, group: PlanGroup) -> SparseMLA:
        while len(self.slots) <= index:
            self._warn_unreserved(f"plan slot {len(self.slots)}")
            self.slots.append(self._new_slot())
        mla = self.slots[index]
        if group.has_c128a and self.reserved_bytes is not None and _buffer_bytes(mla, all_rows_only=True) == 0:
            self._warn_unreserved(f"the C128A rows of plan slot {index}")
        return mla

    def _plan(self, mla: SparseMLA, batch: StepBatch) -> tuple[SparseMLA, StepPlan]:
        self.plans_built += 1
        return mla, mla.plan(batch)

    def step_batch(self, swa_md, comp_mds: dict, num_tokens: int) -> StepBatch:
        """vLLM's DeepseekSparseSWAMetadata and the step's DeepseekV4FlashMLAMetadata per ratio
        -> StepBatch (device tensors and host ints vLLM already holds: no sync). vLLM's SWA
        builder hands V4.1 steps a ``replay_start`` (zeros when nothing replays)."""
        block_sizes = {md.block_size for md in comp_mds.values()}
        if len(block_sizes) > 1:
            raise ValueError(f"attn_metadata: got compressed-cache block sizes {sorted(block_sizes)}; allowed: one "
                             "block size (in uncompressed tokens) for every compressed cache of a step")
        return StepBatch(
            query_start_loc=swa_md.query_start_loc,
            seq_lens=swa_md.seq_lens,
            num_decode_tokens=swa_md.num_decode_tokens,
            swa_block_table=swa_md.block_table,
            swa_block_size=swa_md.block_size,
            comp_block_tables={ratio: md.block_table for ratio, md in comp_mds.items()},
            block_size=block_sizes.pop() if block_sizes else self.block_size(),
            max_model_len=self.spec.max_model_len,
            num_tokens=num_tokens,
            swa_start=getattr(swa_md, "replay_start", None),  # V4.1 SWA bounded replay
        )

    # ---- profiling -------------------------------------------------------------------------------
    def reserve(self, device: torch.device) -> None:
        """Profiling / dummy run: allocate on ``device`` every plan buffer later steps will use,
        as vLLM's KV-cache grouping predicts them (once; later dummy runs change nothing)."""
        if self.reserved_bytes is not None:
            return
        targets = [t for t in self.layers if not getattr(t, "is_draft_layer", False)]
        drafts = [t for t in self.layers if getattr(t, "is_draft_layer", False)]
        groups = [PlanGroup("")]
        if self.predict is not None and targets:
            try:
                groups = self.predict(targets)
            except Exception as exc:  # noqa: BLE001 -- a prediction: serving goes on, loudly
                logger.warning("dsv4_attn: could not predict vLLM's KV-cache groups (%s: %s); plan buffers beyond "
                               "one slot will be allocated at the first step, outside vLLM's KV-cache budget",
                               type(exc).__name__, exc)
        while len(self.slots) < len(groups):
            self.slots.append(self._new_slot())
        owners: dict[Any, int] = {}  # ratio-128 table -> the slot that allocates its rows
        for index, (mla, group) in enumerate(zip(self.slots, groups)):
            owner = owners.setdefault(group.c128a_table, index) if group.has_c128a else index
            if owner != index:
                rows = self.slots[owner]._buffers.all_rows[LayerKind.C128A.ratio]
                mla._ensure_buffers(device).all_rows[LayerKind.C128A.ratio] = rows
                self._row_owner[index] = owner
            self._allocate(mla, device, group.has_c128a)
        if drafts:
            self.draft_slot = self.draft_slot or self._new_slot()
            self._allocate(self.draft_slot, device, any(t.dsv4_kind is LayerKind.C128A for t in drafts))
        self.reserved_bytes = _buffer_bytes(*self.slots, self.draft_slot)
        logger.info("dsv4_attn: reserved %.1f MiB of plan buffers during vLLM's memory profile (%d plan(s) per "
                    "step%s, %d with C128A rows, %d C128A row set(s); %d tokens)", self.reserved_bytes / 2**20,
                    len(groups), " + 1 per draft step" if drafts else "", sum(g.has_c128a for g in groups),
                    sum(g.has_c128a for g in groups) - len(self._row_owner), self.max_tokens)

    def _allocate(self, mla: SparseMLA, device: torch.device, c128a: bool) -> None:
        """Allocate ``mla``'s plan buffers (and C128A rows) by planning an empty batch."""
        empty = torch.zeros(0, 1, dtype=torch.int32)
        batch = StepBatch.from_lists([], [], empty, 64, comp_block_tables={LayerKind.C128A.ratio: empty} if c128a
                                     else {}, block_size=self.block_size(), max_model_len=self.spec.max_model_len,
                                     num_tokens=0, device=device)
        mla.reserve(mla.plan(batch))  # and the decode backends' scratch (aiter): counted by the profile too

    def _warn_unreserved(self, what: str) -> None:
        if self.reserved_bytes is not None:
            logger.warning("dsv4_attn: allocating %s after vLLM's memory profile: it is outside vLLM's KV-cache "
                           "budget (the KV-cache groups differ from the prediction at profiling)", what)

    def log(self, layer_cls: type) -> None:
        mla = self.slots[0]
        choice = {f"{k.name} {p.value}": mla.backend_for(k, p) for k in mla.spec.kinds for p in Phase}
        names = sorted(set(choice.values()))
        logger.info("dsv4_attn: DeepSeek-V4 attention layers of class %s run on dsv4_attn (%s, %s, %d heads per "
                    "rank, backend %s)", layer_cls.__name__, mla.platform.arch, self.fmt.value,
                    self.spec.num_heads, names[0] if len(names) == 1 else choice)


def _has_metadata(layer, attn_metadata: dict) -> bool:
    return layer.swa_cache_layer.prefix in attn_metadata and (
        not layer.dsv4_kind.has_comp_scope or layer.dsv4_comp_prefix in attn_metadata)


def _metadata(attn_metadata: dict, prefix: str, layer):
    if prefix not in attn_metadata:
        raise ValueError(f"attn_metadata: has no entry for {prefix}; allowed: the step's metadata of every "
                         f"cache of {layer.prefix} ({layer.dsv4_kind.name} layer)")
    return attn_metadata[prefix]


def _buffer_bytes(*mlas: SparseMLA | None, all_rows_only: bool = False) -> int:
    """Bytes of the plan buffers of ``mlas`` (None or not yet planned: nothing), a tensor shared
    by several (C128A rows) once; ``all_rows_only``: just the rows of "all" kinds (C128A)."""
    tensors: dict[int, torch.Tensor] = {}
    for mla in mlas:
        buffers = mla._buffers if mla is not None else None
        if buffers is None:
            continue
        own = [t for pair in buffers.all_rows.values() for t in pair]
        if not all_rows_only:
            own += [buffers.positions, buffers.token_to_req, buffers.token_valid, buffers.swa_rows, buffers.swa_lens]
        tensors.update((id(t), t) for t in own)
    return sum(t.numel() * t.element_size() for t in tensors.values())
