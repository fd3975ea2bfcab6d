"""vLLM plugin: run vLLM 0.33's DeepSeek-V4 attention layers on dsv4_attn.

Enable it (nothing changes otherwise): ``DSV4_ATTN_VLLM=1`` in the environment, or
``--attention-backend DSV4_ATTN``. Docs: docs/vllm.md.

How it hooks in (docs/vllm.md). In vLLM 0.33 DeepSeek-V4 layers do
not go through the attention-backend registry: each decoder layer builds its attention from a
class the model module picks, and that class pins its backend classes. So ``register()`` (the
``vllm.general_plugins`` entry point, run in every vLLM process) wraps that choice:

* CUDA: ``vllm.models.deepseek_v4.nvidia.model._select_dsv4_attn_cls`` (looked up when a decoder
  layer, MTP layer included, is built) returns our subclass of the class vLLM picked;
* ROCm: the decoder layer's ``__init__`` sees our subclass under the module-global name
  ``DeepseekV4ROCMAiterMLAAttention`` while it builds its attention.

The model modules are patched right after they are imported (a post-import hook), so loading
the plugin never imports vLLM's model code. Our subclass keeps everything of vLLM's layer
(projections, RMSNorm/RoPE, cache writes, compressor, indexer, its metadata builders and KV-cache
specs) and replaces only ``forward_mqa``: it maps vLLM's per-step metadata onto a
:class:`StepBatch`, plans it once per step and runs :meth:`SparseMLA.forward` into vLLM's output
buffer. Which dsv4_attn backend runs is the usual probe decision (``DSV4_ATTN_BACKEND`` forces
one). What cannot be served is refused when the layer is built (engine start), with reasons.

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
comp_block_tables[ratio]       ``DeepseekV4FlashMLAMetadata.block_table`` of the layer's
                               compressed-cache group (ratio 4 or 128; none for SWA-only layers,
                               whose ``attn_metadata.get(prefix)`` is None)
block_size                     ``DeepseekV4FlashMLAMetadata.block_size`` (256, in UNCOMPRESSED
                               tokens; ratio-r blocks hold 256 // r entries)
num_tokens                     ``q.shape[0]`` (padded token count)
c4a_topk (per C4A layer)       the model's shared ``topk_indices_buffer`` [max_tokens, index_topk]
                               of LOCAL compressed positions, just written by this layer's indexer
=============================  ==============================================================

Positions are derived from query_start_loc/seq_lens (they equal vLLM's ``positions``). One plan
serves every layer of a step that shares the same pair of KV-cache groups (SWA group, compressed
group): plans are keyed on the identities of the two metadata objects, which vLLM builds once
per group per step and hands to every layer of the group.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..api import SparseMLA
from ..common.backend import Phase
from ..common.batch import StepBatch
from ..common.layout import Fp8Dialect, KVFormat
from ..common.plan import StepPlan
from ..common.platform import probe
from ..common.spec import MAX_HEADS, LayerKind, ModelSpec

ENV_ENABLE = "DSV4_ATTN_VLLM"
BACKEND_NAME = "DSV4_ATTN"  # the --attention-backend name this plugin adds
TESTED_VLLM_SERIES = "0.33"  # vLLM internals the hooks touch move between minor releases
CUDA_MODEL_MODULE = "vllm.models.deepseek_v4.nvidia.model"
ROCM_MODEL_MODULE = "vllm.models.deepseek_v4.amd.model"

# Under the "vllm" logger so that vLLM's logging configuration prints it.
logger = logging.getLogger("vllm.dsv4_attn")


# ---- opt-in, version and platform gates ------------------------------------------------------
def env_enabled() -> bool:
    """``DSV4_ATTN_VLLM``: "1" on; unset, "" or "0" off; anything else is an error."""
    value = os.environ.get(ENV_ENABLE, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_ENABLE}: got {value!r}; allowed: '1' (on) or '0' / unset (off)")
    return value == "1"


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
    env = os.environ.get(ENV_ENABLE, "")
    if version is None:
        verdict = "off (vllm not installed)"
    elif not is_tested_version(version):
        verdict = f"refused (vLLM {version}; tested: {TESTED_VLLM_SERIES}.x)"
    elif not declared:
        verdict = "off (dsv4-attn's vllm.general_plugins entry point is not installed: pip install dsv4-attn)"
    elif env == "1":
        verdict = f"on ({ENV_ENABLE}=1): DeepSeek-V4 attention layers run on dsv4_attn"
    else:
        verdict = f"available: on with {ENV_ENABLE}=1 or --attention-backend {BACKEND_NAME}"
    return {"vllm": version or "not installed", "entry point": "installed" if declared else "missing",
            ENV_ENABLE: env or "unset", "vllm plugin": verdict}


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
    if platform == "cuda":
        _after_import(CUDA_MODEL_MODULE, _patch_cuda_model)
    else:
        _after_import(ROCM_MODEL_MODULE, _patch_rocm_model)
    if enabled:
        logger.info("dsv4_attn: %s=1, vLLM %s on %s: DeepSeek-V4 attention layers will run on dsv4_attn",
                    ENV_ENABLE, version, platform)


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
    return _subclass(vllm_cls, rocm)


@functools.lru_cache(maxsize=None)
def _subclass(base: type, rocm: bool) -> type:
    mixin = DSv4AttnRocmLayerMixin if rocm else DSv4AttnLayerMixin
    name = "DSv4Attn" + base.__name__.removeprefix("DeepseekV4")
    doc = f"{base.__name__} with its sparse attention run by dsv4_attn (see {__name__})."
    return type(name, (mixin, base), {"__module__": __name__, "__doc__": doc})


def _patch_cuda_model(module) -> None:
    """Wrap the CUDA model module's layer-class selection (idempotent)."""
    select = module._select_dsv4_attn_cls
    if getattr(select, "_dsv4_attn_hook", False):
        return

    @functools.wraps(select)
    def _select_dsv4_attn_cls(vllm_config):
        return layer_class_for(vllm_config, select(vllm_config))

    _select_dsv4_attn_cls._dsv4_attn_hook = True
    module._select_dsv4_attn_cls = _select_dsv4_attn_cls


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


_hooks: dict[str, "_PatchAfterImport"] = {}


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
    ``attn_metadata is None`` (profiling / dummy run): zero ``output``.
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
        # vLLM's V4 layers number window-only layers 1 (max(1, config ratio)); config ratio 1 is V4.1's C1A
        self.dsv4_kind = LayerKind.SWA if self.compress_ratio <= 1 else LayerKind.from_ratio(self.compress_ratio)
        self.dsv4_planner = planner_for(self, vllm_config)

    def forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                    output: torch.Tensor) -> None:
        from vllm.forward_context import get_forward_context

        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:  # profiling / dummy run
            self.dsv4_planner.reserve(q.device)
            output.zero_()
            return
        if not isinstance(attn_metadata, dict):
            raise ValueError(f"attn_metadata: got {type(attn_metadata).__name__}; allowed: one dict per "
                             "step (dual-batch overlap is not supported by dsv4_attn)")
        kind = self.dsv4_kind
        comp_md = attn_metadata.get(self.prefix) if kind.has_comp_scope else None
        if kind.has_comp_scope and comp_md is None:
            raise ValueError(f"attn_metadata: has no entry for {self.prefix}; allowed: the compressed-cache "
                             f"metadata of this {kind.name} layer")
        mla, plan = self.dsv4_planner.plan(attn_metadata, attn_metadata[self.swa_cache_layer.prefix],
                                           comp_md, kind.ratio, q.shape[0])
        if q.shape[1] < output.shape[1]:  # FlashInfer-SM120 base: q arrives at the live head count
            q = F.pad(q, (0, 0, 0, output.shape[1] - q.shape[1]))
        mla.forward(plan, kind, q, self.swa_cache_layer.kv_cache,
                    self.kv_cache if kind.has_comp_scope else None,
                    c4a_topk=self.topk_indices_buffer if kind is LayerKind.C4A else None,
                    sink=self.attn_sink, out=output)


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
    """Why dsv4_attn cannot serve this vLLM layer / configuration ([] = it can)."""
    reasons = []
    if layer.kv_cache_dtype != "fp8_ds_mla":
        reasons.append(f"--kv-cache-dtype: got {layer.kv_cache_dtype!r}; allowed: fp8 / fp8_ds_mla "
                       "(the fp8_ds_mla layout)")
    ratio = layer.compress_ratio
    block_size = vllm_config.cache_config.block_size
    if ratio > 1 and block_size % ratio:
        reasons.append(f"--block-size: got {block_size}; allowed: a multiple of {ratio} (the ratio-{ratio} "
                       f"cache holds block_size // {ratio} entries per block)")
    if layer.max_image_tokens:
        reasons.append("vision variant (vision_max_n_token > 0): in-image bidirectional SWA windows are "
                       "not modelled by dsv4_attn")
    spec = vllm_config.speculative_config
    if spec is not None and spec.use_dspark():
        reasons.append("DSpark speculative decoding: non-causal draft windows are not modelled by dsv4_attn")
    parallel = vllm_config.parallel_config
    if parallel.enable_dbo:
        reasons.append("--enable-dbo: dual-batch overlap hands per-ubatch metadata lists; not supported")
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            reasons.append(f"{name}: got {getattr(parallel, name)}; allowed: 1 (context-parallel KV sharding "
                           "is not modelled by dsv4_attn)")
    return reasons


# ---- one plan per step, shared by all layers ----------------------------------------------------
_planners: dict[tuple, "StepPlanner"] = {}


def planner_for(layer, vllm_config) -> "StepPlanner":
    """The planner shared by every layer with the same setup (created, and logged, once)."""
    topk = layer.topk_indices_buffer
    spec = ModelSpec(
        num_heads=layer.n_local_heads,
        c4a_topk=topk.shape[-1] if topk is not None else vllm_config.model_config.hf_config.index_topk,
        max_model_len=layer.max_model_len,
        window=layer.window_size,
        softmax_scale=layer.scale,
    )
    sched = vllm_config.scheduler_config
    max_tokens = sched.max_num_batched_tokens
    # gfx942 writes the SWA cache in FNUZ fp8 and the compressed cache in OCP (docs/semantics.md "FP8 dialects").
    key = (spec, max_tokens, max(sched.max_num_seqs, max_tokens), probe().fp8_dialect,
           vllm_config.cache_config.block_size)
    if key not in _planners:
        _planners[key] = StepPlanner(*key)
        _planners[key].log(type(layer))
    return _planners[key]


class StepPlanner:
    """Per-step StepPlans for every layer of a model that shares one setup (spec, format, ...).

    A step is one ``attn_metadata`` dict (vLLM builds a new one per forward, and every layer of
    the forward sees the same one). Within a step there is one plan per distinct pair (SWA
    metadata, compressed metadata or None), i.e. per pair of KV-cache groups, reused by every
    layer with that pair. Each pair of a step gets its own SparseMLA ("slot": a plan lives until
    its SparseMLA plans again), created on first need and reused by later steps. Plan buffers per
    slot: ``max_tokens * (W + c128a_width) * 4`` bytes of int32 rows.
    """

    def __init__(self, spec: ModelSpec, max_tokens: int, max_reqs: int, swa_dialect: Fp8Dialect,
                 block_size: int) -> None:
        self.spec, self.max_tokens, self.max_reqs = spec, max_tokens, max_reqs
        self.swa_dialect, self.block_size = swa_dialect, block_size
        self.slots: list[SparseMLA] = [self._new_slot()]  # backend refusals surface here: engine start
        self.plans_built = 0
        self._step: dict | None = None
        self._plans: dict[tuple[int, int], tuple[SparseMLA, StepPlan]] = {}

    def _new_slot(self) -> SparseMLA:
        return SparseMLA(self.spec, KVFormat.MODEL1_FP8, max_tokens=self.max_tokens, max_reqs=self.max_reqs,
                         swa_dialect=self.swa_dialect, comp_dialect=Fp8Dialect.OCP)

    def plan(self, attn_metadata: dict, swa_md, comp_md, ratio: int, num_tokens: int
             ) -> tuple[SparseMLA, StepPlan]:
        """The step's plan for a layer whose SWA / compressed metadata are ``swa_md`` / ``comp_md``
        (``ratio`` = the layer's compression ratio); built on the first layer that asks."""
        if attn_metadata is not self._step:  # a new step; the dict is held until the next one
            self._step, self._plans = attn_metadata, {}
        key = (id(swa_md), id(comp_md))
        if key not in self._plans:
            if len(self._plans) == len(self.slots):
                self.slots.append(self._new_slot())
            mla = self.slots[len(self._plans)]
            self._plans[key] = (mla, mla.plan(self.step_batch(swa_md, comp_md, ratio, num_tokens)))
            self.plans_built += 1
        return self._plans[key]

    def step_batch(self, swa_md, comp_md, ratio: int, num_tokens: int) -> StepBatch:
        """vLLM's DeepseekSparseSWAMetadata (+ DeepseekV4FlashMLAMetadata) -> StepBatch."""
        return StepBatch(
            query_start_loc=swa_md.query_start_loc,
            seq_lens=swa_md.seq_lens,
            num_decode_tokens=swa_md.num_decode_tokens,
            swa_block_table=swa_md.block_table,
            swa_block_size=swa_md.block_size,
            comp_block_tables={} if comp_md is None else {ratio: comp_md.block_table},
            block_size=self.block_size if comp_md is None else comp_md.block_size,
            max_model_len=self.spec.max_model_len,
            num_tokens=num_tokens,
        )

    def reserve(self, device: torch.device) -> None:
        """Dummy run: allocate slot 0's plan buffers on ``device`` now (vLLM's memory profile)."""
        if self._step is None:
            empty = StepBatch.from_lists([], [], torch.zeros(0, 1, dtype=torch.int32), 64,
                                         max_model_len=self.spec.max_model_len, device=device)
            self.slots[0].plan(empty)

    def log(self, layer_cls: type) -> None:
        mla = self.slots[0]
        choice = {f"{k.name} {p.value}": mla.backend_for(k, p) for k in mla.spec.kinds for p in Phase}
        names = sorted(set(choice.values()))
        logger.info("dsv4_attn: DeepSeek-V4 attention runs on dsv4_attn through %s (%s, %s, %d heads per "
                    "rank, backend %s)", layer_cls.__name__, mla.platform.arch, KVFormat.MODEL1_FP8.value,
                    self.spec.num_heads, names[0] if len(names) == 1 else choice)
