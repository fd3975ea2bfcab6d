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

The package, one file per job: :mod:`.gates` (opt-in, version, platform, status),
:mod:`.registration` (the entry point, the hooks into vLLM's model modules), :mod:`.sizing`
(engine start: refusals and the limits sized from vLLM's config), :mod:`.metadata` (vLLM's
per-step metadata -> StepBatch, which layers share a plan), :mod:`.layer` (the layer mixins),
:mod:`.planner` (one plan per KV-cache group and step), :mod:`.memory` (the buffers reserved
in vLLM's profiling run). What every engine plugin shares is in :mod:`dsv4_attn.integrations.base`.
"""

from .gates import (
    BACKEND_NAME,
    ENV_ENABLE,
    TESTED_VLLM_SERIES,
    check_vllm_version,
    enabled_for,
    env_enabled,
    is_tested_version,
    names_our_backend,
    status,
    vllm_platform,
    vllm_version,
)
from .layer import V41_KINDS, DSv4AttnLayerMixin, DSv4AttnRocmLayerMixin, DSv41AttnLayerMixin
from .memory import _buffer_bytes
from .metadata import PlanGroup, plan_groups, predicted_plan_groups
from .planner import StepPlanner
from .registration import (
    _patch_cuda_model,
    _patch_rocm_model,
    _patch_v41_cuda_model,
    _patch_v41_rocm_model,
    carry_env_to_ray_actors,
    layer_class_for,
    register,
    v41_layer_class_for,
)
from .sizing import planner_for, resolved_block_size, unsupported_reasons

__all__ = [
    "BACKEND_NAME", "ENV_ENABLE", "TESTED_VLLM_SERIES", "V41_KINDS", "DSv4AttnLayerMixin", "DSv4AttnRocmLayerMixin",
    "DSv41AttnLayerMixin", "PlanGroup", "StepPlanner", "_buffer_bytes", "_patch_cuda_model", "_patch_rocm_model",
    "_patch_v41_cuda_model", "_patch_v41_rocm_model", "carry_env_to_ray_actors", "check_vllm_version",
    "enabled_for", "env_enabled", "is_tested_version", "layer_class_for", "names_our_backend", "plan_groups",
    "planner_for", "predicted_plan_groups", "register", "resolved_block_size", "status", "unsupported_reasons",
    "v41_layer_class_for", "vllm_platform", "vllm_version",
]
