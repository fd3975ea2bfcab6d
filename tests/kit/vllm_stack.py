"""vLLM 0.33's DeepSeek-V4 attention stack, built for real on a CPU, for the shim tests.

What is vLLM's own here (nothing of it is re-implemented): the layers' ``__init__`` (through
the plugin's class selection), the KV-cache specs, grouping, sizing and allocation
(``get_kv_cache_spec`` -> ``get_global_kv_cache_groups`` -> ``get_kv_cache_configs`` ->
``init_attn_backend`` -> ``init_kv_cache``, as the engine core and the v2 GPU worker call them),
the metadata builders (``build_attn_metadata``; their Triton kernels run under the
interpreter), the fp8_ds_mla cache writer (``quantize_and_insert_k_cache``), the draft
speculator's in-place metadata update, and vLLM's own ``forward_mqa`` for the comparison.

What stands in for the machine: vLLM sees an SM90 CUDA device whose tensors live on the CPU
(``get_device_capability``, ``device_type``), and FlashMLA's three entry points -- the
scheduler-metadata holder and the decode / prefill kernels -- are replaced by float64
implementations of their documented semantics (FlashMLA's ``flash_mla_interface.py``, bundled
with vLLM). The batch itself (block ids, slot mappings, positions) is what vLLM's scheduler
and input preparation would hand over, written out here.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dsv4_attn.common import layout
from dsv4_attn.integrations import vllm as shim

# A small DeepSeek-V4: one layer of each kind plus a second C4A and a second C128A layer, and one MTP
# layer. vLLM groups their SWA caches as (0, 3), (1, 4), (2): two plans per step with C128A layers,
# over the one ratio-128 table.
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention", "heavily_compressed_attention"]
HEADS, TOPK, MAX_MODEL_LEN, WINDOW = 8, 16, 4096, 128
MAX_TOKENS, MAX_SEQS, NUM_SPEC_TOKENS = 256, 16, 3
KV_CACHE_BYTES = 48 << 20


# A small DeepSeek-V4.1 (compress_ratios: 0 window only, 1 C1A, 2 C2A): each compressed ratio has
# a KV + index source and a layer sharing both; vLLM's V4.1 has no classic MTP (DSpark only).
V41_RATIOS, V41_SOURCES = [0, 1, 1, 2, 2, 0], [1, 3]


def _v4_config(num_layers: int, layer_types: list[str], heads: int = HEADS, o_groups: int = 2):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        hidden_size=256, num_hidden_layers=num_layers, num_attention_heads=heads, q_lora_rank=128,
        o_lora_rank=64, o_groups=o_groups, index_n_heads=4, index_topk=TOPK, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, vocab_size=256, layer_types=layer_types, mlp_layer_types=["moe"] * num_layers,
        max_position_embeddings=MAX_MODEL_LEN, num_nextn_predict_layers=1)


def write_model_config(directory: Path, heads: int = HEADS, o_groups: int = 2) -> None:
    """``heads``, ``o_groups``: the whole model's (a tensor-parallel rank gets 1/tp of each)."""
    config = _v4_config(len(LAYER_TYPES), LAYER_TYPES, heads, o_groups)
    config.architectures = ["DeepseekV4ForCausalLM"]
    config.save_pretrained(directory)


def write_v41_model_config(directory: Path, heads: int = HEADS, o_groups: int = 2) -> None:
    """V4.1's config.json: the text model nested under ``text_config`` (vLLM's DeepseekV41Config
    flattens it), V4's fields plus the V4.1 topology."""
    n = len(V41_RATIOS)
    text = _v4_config(n, ["sliding_attention"] * n, heads, o_groups).to_dict()
    for key in ("layer_types", "compress_rates", "mlp_layer_types", "model_type", "architectures",
                "transformers_version"):
        text.pop(key, None)
    text.update(compress_ratios=V41_RATIOS, kv_source_layer_ids=V41_SOURCES, index_source_layer_ids=V41_SOURCES,
                num_nextn_predict_layers=0)
    config = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "text_config": text}
    (directory / "config.json").write_text(json.dumps(config))


# ---- FlashMLA in float64 --------------------------------------------------------------------------
def dequantize(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """float64 [n, 512] keys of the fp8_ds_mla records at ``slots`` (int [n], all >= 0) of a
    vLLM cache [num_blocks, block_size, 584] uint8 with any block stride: per block, the data
    rows (448 e4m3 then 64 bf16) first, then the scale rows (7 UE8M0 exponents, 1 pad)."""
    nb, bs, _ = cache.shape
    raw = cache.view(torch.uint8)
    data = raw.as_strided((nb, bs, 576), (cache.stride(0), 576, 1), raw.storage_offset())
    scale = raw.as_strided((nb, bs, 8), (cache.stride(0), 8, 1), raw.storage_offset() + bs * 576)
    block, offset = slots.long() // bs, slots.long() % bs
    rec, exps = data[block, offset], scale[block, offset, :7].double()
    nope = rec[:, :448].contiguous().view(torch.float8_e4m3fn).double()
    nope = nope * torch.pow(2.0, exps - 127).repeat_interleave(64, dim=1)
    rope = rec[:, 448:].contiguous().view(torch.bfloat16).double()
    return torch.cat([nope, rope], dim=1)


def attend_f64(q: torch.Tensor, keys: torch.Tensor, scale: float, sink: torch.Tensor) -> torch.Tensor:
    """One token: q [H, 512], keys float64 [n, 512] -> float64 [H, 512], sink in the denominator,
    0 without keys."""
    if keys.shape[0] == 0:
        return torch.zeros(q.shape, dtype=torch.float64)
    s = (q.double() @ keys.T) * scale
    m = torch.maximum(s.amax(dim=1), sink.double())
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m[:, None])
    return (p @ keys) / (p.sum(dim=1) + torch.exp(sink.double() - m))[:, None]


def _live(indices: torch.Tensor, length) -> torch.Tensor:
    row = indices if length is None else indices[: int(length)]
    return row[row >= 0]


class SchedMeta:
    """FlashMLA's tile-scheduler holder: planned at its first decode call, then reused."""

    have_initialized = False


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                           attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None, out=None, enable_batch_invariant=False):
    """FlashMLA's sparse fp8 decode: q [b, s_q, h, 512]; ``indices`` [b, s_q, topk] slots of
    ``k_cache`` (first ``topk_length[b]`` read, -1 skipped), the same for the extra cache."""
    assert isinstance(tile_scheduler_metadata, SchedMeta) and is_fp8_kvcache and indices is not None
    tile_scheduler_metadata.have_initialized = True
    b, s_q = q.shape[:2]
    sink = attn_sink if attn_sink is not None else torch.full((q.shape[2],), -math.inf)
    for i in range(b):
        for j in range(s_q):
            keys = [dequantize(k_cache.squeeze(2), _live(indices[i, j], None if topk_length is None
                                                           else topk_length[i]))]
            if extra_k_cache is not None:
                keys.append(dequantize(extra_k_cache.squeeze(2), _live(
                    extra_indices_in_kvcache[i, j], None if extra_topk_length is None else extra_topk_length[i])))
            out[i, j] = attend_f64(q[i, j], torch.cat(keys), softmax_scale, sink).to(out.dtype)
    return out, None


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, out=None):
    """FlashMLA's sparse prefill: q [s_q, h, 512], kv bf16 [s_kv, 1, 512]; ``indices`` [s_q, 1,
    topk] rows of kv (first ``topk_length`` read; -1 or >= s_kv skipped)."""
    sink = attn_sink if attn_sink is not None else torch.full((q.shape[1],), -math.inf)
    for t in range(q.shape[0]):
        rows = _live(indices[t, 0], None if topk_length is None else topk_length[t])
        rows = rows[rows < kv.shape[0]]
        out[t] = attend_f64(q[t], kv[rows.long(), 0].double(), sm_scale, sink).to(out.dtype)
    return out, None, None


# ---- the stack ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_sm90_cpu(mp: pytest.MonkeyPatch) -> None:
    """vLLM sees an SM90 CUDA device whose tensors live on the CPU; FlashMLA is float64."""
    from vllm.models.deepseek_v4.common.ops import cache_utils
    from vllm.models.deepseek_v4.nvidia import flashmla as vllm_flashmla
    from vllm.models.deepseek_v41.common.ops import cache_utils as v41_cache_utils
    from vllm.models.deepseek_v41.nvidia import flashmla as v41_flashmla
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla import sparse_swa

    mp.setattr(current_platform, "get_device_capability", lambda device_id=0: DeviceCapability(9, 0))
    # is_device_capability_family (V4.1's kernel block size) asks the class
    mp.setattr(type(current_platform), "get_device_capability",
               classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)))
    mp.setattr(current_platform, "device_type", "cpu")
    mp.setattr(sparse_swa, "get_mla_metadata", lambda *args, **kwargs: (SchedMeta(), None))
    mp.setattr(vllm_flashmla, "flash_mla_with_kvcache", flash_mla_with_kvcache)
    mp.setattr(vllm_flashmla, "flash_mla_sparse_fwd", flash_mla_sparse_fwd)
    mp.setattr(v41_flashmla, "flash_mla_with_kvcache", flash_mla_with_kvcache)
    mp.setattr(v41_flashmla, "flash_mla_sparse_fwd", flash_mla_sparse_fwd)
    # Programs that share one request's rows, striding by tl.num_programs(1): fewer programs read
    # the same rows, in far less interpreter time.
    mp.setattr(cache_utils.DequantizeAndGatherKCacheKernel, "NUM_WORKERS", 4)
    mp.setattr(cache_utils.CombineTopkSwaIndicesKernel, "NUM_WORKERS", 4)
    mp.setattr(v41_cache_utils, "_GATHER_MIN_WORKERS", 4)
    mp.setattr(v41_cache_utils, "_COMBINE_TOPK_SWA_NUM_WORKERS", 4)
    mp.setattr(shim.gates, "vllm_platform", lambda: "cuda")
    # A CPU build of torch (what CI installs) raises where vLLM, built against a CUDA torch, expects
    # no-ops on a machine without a GPU: its V4 layers create CUDA events for their auxiliary
    # streams (never used here), its workspace manager empties the accelerator's cache as it grows.
    mp.setattr(torch.cuda, "Event", CpuEvent)
    mp.setattr(torch.accelerator, "empty_cache", lambda: None)


class CpuEvent:
    """torch.cuda.Event's interface for a CPU build of torch: nothing to order, all done."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def init_process_state() -> None:
    """vLLM's one-rank distributed state (gloo) and workspace manager, once per process."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    if not model_parallel_is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        initialize_model_parallel(1, 1)
    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device("cpu"))


def vllm_config(model_dir: Path, backend: str | None = shim.BACKEND_NAME, speculative: bool | str = True,
                max_model_len: int = MAX_MODEL_LEN, max_tokens: int = MAX_TOKENS, max_seqs: int = MAX_SEQS,
                num_spec_tokens: int = NUM_SPEC_TOKENS, **cache):
    """A real VllmConfig of the model in ``model_dir``: FlashMLA's class family, vLLM's default
    CacheConfig unless ``cache`` sets fields (``block_size`` unset: vLLM resolves it after
    building the model, :func:`resolve_block_size`), speculative decoding with
    ``num_spec_tokens`` draft tokens (True: MTP; or a method name), and the hybrid KV-cache
    manager on as on CUDA."""
    from vllm.config import (
        AttentionConfig,
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    shim.register()  # vLLM loads plugins before it parses the backend name
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=max_model_len, dtype="bfloat16")
    method = "mtp" if speculative is True else speculative
    spec = SpeculativeConfig(method=method, num_speculative_tokens=num_spec_tokens, target_model_config=model,
                             target_parallel_config=ParallelConfig()) if speculative else None
    config = VllmConfig(
        model_config=model, device_config=DeviceConfig(device="cpu"), speculative_config=spec,
        cache_config=CacheConfig(**cache), attention_config=AttentionConfig(backend=backend),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs,
                                         max_model_len=max_model_len, is_encoder_decoder=False))
    config.scheduler_config.disable_hybrid_kv_cache_manager = False  # what VllmConfig decides on CUDA
    return config


@dataclass
class Step:
    """One forward's inputs as vLLM's runner hands them over (R requests, T tokens)."""

    attn_metadata: dict
    positions: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    block_tables: list[torch.Tensor]  # per KV-cache group, int32 [R, cols]
    slot_mappings: torch.Tensor  # int64 [groups, T]
    reference_metadata: dict | None = None  # vLLM's own path's (its builders'); None: attn_metadata

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


@dataclass(frozen=True)
class Model:
    """A small model of one version: its config writer, vLLM's CUDA model module (whose
    ``_select_dsv4_attn_cls`` the plugin hooks), its attention module (which reads the
    tensor-parallel size), layer count, whether it has an MTP layer, the speculative method and
    vLLM's FlashMLA layer class of that version."""

    name: str
    write_config: Callable[..., None]
    module: str
    attention_module: str
    num_layers: int
    mtp: bool
    speculative: bool | str
    flashmla_class: str


V4 = Model("v4", write_model_config, "vllm.models.deepseek_v4.nvidia.model", "vllm.models.deepseek_v4.attention",
           len(LAYER_TYPES), True, True, "vllm.models.deepseek_v4.nvidia.flashmla:DeepseekV4FlashMLAAttention")
# V4.1 verifies n-gram drafts (multi-token decode queries).
V41 = Model("v41", write_v41_model_config, "vllm.models.deepseek_v41.nvidia.model",
            "vllm.models.deepseek_v41.attention", len(V41_RATIOS), False, "ngram",
            "vllm.models.deepseek_v41.nvidia.flashmla:DeepseekV4FlashMLAAttention")


def resolve_block_size(config) -> None:
    """What vLLM's executors do right after ``load_model`` (``v1/executor/multiproc_executor.py``,
    ``uniproc_executor.py``): resolve ``cache_config.block_size`` from the built layers'
    attention backends (the CUDA platform inherits ``Platform.update_block_size_for_backend``)."""
    from vllm.platforms import current_platform

    current_platform.update_block_size_for_backend(config)


def import_attr(path: str):
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


class VllmStack:
    """The small model's attention layers (V4: 5 target, 1 MTP) with vLLM's caches and builders,
    built from vLLM's default cache flags (the block size resolved after the layers, as vLLM
    does); ``tp_size``: the layers split the heads as one rank of that tensor-parallel size."""

    def __init__(self, model_dir: Path, gen: torch.Generator, model: Model = V4,
                 num_spec_tokens: int = NUM_SPEC_TOKENS, tp_size: int = 1) -> None:
        import importlib

        from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        self.gen, self.model, self.num_spec_tokens = gen, model, num_spec_tokens
        self.vllm_cls = import_attr(model.flashmla_class)
        self.config = config = vllm_config(model_dir, speculative=model.speculative, num_spec_tokens=num_spec_tokens)
        with set_current_vllm_config(config), pytest.MonkeyPatch.context() as mp:
            init_process_state()
            # The rank's share of the heads (vLLM's attention modules ask the TP group's size).
            mp.setattr(importlib.import_module(model.attention_module), "get_tensor_model_parallel_world_size",
                       lambda: tp_size)
            # the plugin's hook picks our class
            cls = importlib.import_module(model.module)._select_dsv4_attn_cls(config)
            self.topk = torch.empty(MAX_TOKENS, TOPK, dtype=torch.int32)
            self.layers = [cls(config, prefix=f"model.layers.{i}.attn", topk_indices_buffer=self.topk)
                           for i in range(model.num_layers)]
            self.mtp = None
            self.draft_names: set[str] = set()
            if model.mtp:
                # The MTP layer as vLLM's speculator adds it: its own top-k buffer, then every attention
                # layer the draft model added is flagged (DraftModelSpeculator.load_model).
                target_names = set(get_layers_from_vllm_config(config, AttentionLayerBase))
                self.mtp = cls(config, prefix=f"model.layers.{model.num_layers}.attn",
                               topk_indices_buffer=torch.full_like(self.topk, -1))
                layers = get_layers_from_vllm_config(config, AttentionLayerBase)
                self.draft_names = set(layers) - target_names
                for name in self.draft_names:
                    layers[name].is_draft_layer = True
            self.built_with_block_size = config.cache_config.block_size  # vLLM's placeholder while building
            resolve_block_size(config)
        self.heads = self.layers[0].n_local_heads
        for layer in self.all_layers:
            layer.attn_sink.data[:self.heads] = torch.randn(self.heads, generator=self.gen)
        self._init_kv_caches()

    @property
    def all_layers(self) -> list:
        return self.layers + ([self.mtp] if self.mtp is not None else [])

    def _init_kv_caches(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
        from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec, init_attn_backend, init_kv_cache

        config, cpu = self.config, torch.device("cpu")
        specs = get_kv_cache_spec(config)
        layouts = [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(config))]
        resolve_kv_cache_layout(config, [layouts], list(specs.values()))
        self.predicted_groups = shim.predicted_plan_groups(config, self.layers)  # before sizing, as at profiling
        groups = get_global_kv_cache_groups(config, [specs])
        self.kv_cache_config = kv = get_kv_cache_configs(config, [specs], [KV_CACHE_BYTES], groups)[0]
        # Only the attention layers' metadata is built here: the indexer's builder needs a real GPU.
        ours = {n for layer in self.all_layers for n in (layer.dsv4_comp_prefix, layer.swa_cache_layer.prefix)}
        self.target_groups, _, block_sizes = init_attn_backend(kv, config, cpu,
                                                               active_layer_names=ours - self.draft_names)
        self.draft_groups = []
        if self.draft_names:
            self.draft_groups, _, _ = init_attn_backend(kv, config, cpu, active_layer_names=ours & self.draft_names)
        self.reference_groups = {False: self._reference_groups(self.target_groups),
                                 True: self._reference_groups(self.draft_groups)}
        init_kv_cache(config.compilation_config.static_forward_context, kv, cpu, block_sizes, config,
                      attn_groups=[g for groups in self.target_groups + self.draft_groups for g in groups])
        self.block_sizes = [g.kv_cache_spec.block_size for g in kv.kv_cache_groups]
        self.group_of = {name: i for i, g in enumerate(kv.kv_cache_groups) for name in g.layer_names}

    def _reference_groups(self, attn_groups: list) -> list:
        """Per KV-cache group, the attention groups whose builder the plugin replaced (C128A layers:
        without vLLM's C128A rows) with vLLM's own builder, for vLLM's own ``forward_mqa`` (the
        reference), which reads those rows; [] where nothing was replaced."""
        out = []
        for groups in attn_groups:
            refs = []
            for group in groups:
                builder = group.get_metadata_builder(0)
                vllm_builder = getattr(type(builder), "vllm_builder", None)
                if vllm_builder is not None:
                    ref = copy.copy(group)
                    ref.metadata_builders = [vllm_builder(builder.kv_cache_spec, builder.layer_names, self.config,
                                                          builder.device)]
                    refs.append(ref)
            out.append(refs)
        return out

    # ---- a batch ------------------------------------------------------------------------------
    def step(self, query_lens: list[int], seq_lens: list[int], pad_tokens: int = 0, pad_reqs: int = 0,
             draft: bool = False, full_graph: bool = False, replay_start: list[int] | None = None) -> Step:
        """Block tables, slot mappings and positions of a batch (decodes first), vLLM's metadata
        for it (the target's or the draft's builders), fresh keys in every cache row it reads
        and fresh local top-k rows. ``pad_reqs`` zero-length requests and ``pad_tokens`` tokens
        pad it as for a CUDA graph; ``full_graph``: metadata built for the padded sizes.
        ``replay_start`` (V4.1's SWA bounded replay, per request): handed to the SWA builders
        through vLLM's own ``ReplayAttnMetadata``, as its model state does."""
        from vllm.v1.worker.gpu.attn_utils import build_attn_metadata

        gen, R = self.gen, len(query_lens) + pad_reqs
        qsl = torch.zeros(R + 1, dtype=torch.int32)
        qsl[1:len(query_lens) + 1] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        qsl[len(query_lens) + 1:] = qsl[len(query_lens)]
        seq = torch.tensor(seq_lens + [0] * pad_reqs, dtype=torch.int32)
        toks = [(r, s - q + i) for r, (q, s) in enumerate(zip(query_lens, seq_lens)) for i in range(q)]
        T = len(toks) + pad_tokens
        positions = torch.tensor([p for _, p in toks] + [0] * pad_tokens, dtype=torch.int64)
        tables, slots = [], torch.full((len(self.block_sizes), T), -1, dtype=torch.int64)
        # One block pool for every group, as vLLM's: a block holds a page of each layer sharing a
        # KV-cache tensor, so one block id never serves two groups at once.
        pool = torch.randperm(self.kv_cache_config.num_blocks - 1, generator=gen) + 1
        for g, bs in enumerate(self.block_sizes):
            cols = -(-MAX_MODEL_LEN // bs)
            table = torch.zeros(R, cols, dtype=torch.int32)
            used = [-(-s // bs) for s in seq_lens]
            assert sum(used) <= pool.numel(), "the batch needs more blocks than the KV cache holds"
            ids, pool = pool[: sum(used)], pool[sum(used):]
            for r, n in enumerate(used):
                table[r, :n], ids = ids[:n].int(), ids[n:]
            tables.append(table)
            for t, (r, p) in enumerate(toks):
                slots[g, t] = int(table[r, p // bs]) * bs + p % bs
        num_tokens = T if full_graph else len(toks)
        extra = {}
        if replay_start is not None:
            from vllm.models.deepseek_v41.nvidia.model_state import ReplayAttnMetadata

            starts = torch.tensor(replay_start + [0] * (R - len(replay_start)), dtype=torch.int32)
            extra["model_specific_attn_metadata"] = ReplayAttnMetadata(starts)
        args = dict(
            num_reqs=R if full_graph else len(query_lens),
            num_tokens=num_tokens, query_start_loc_gpu=qsl if full_graph else qsl[: len(query_lens) + 1],
            query_start_loc_cpu=qsl.clone() if full_graph else qsl[: len(query_lens) + 1].clone(),
            max_query_len=max(query_lens), seq_lens=seq if full_graph else seq[: len(query_lens)],
            max_seq_len=MAX_MODEL_LEN if full_graph else max(seq_lens), block_tables=tables,
            slot_mappings=slots[:, :num_tokens], kv_cache_config=self.kv_cache_config,
            seq_lens_cpu_upper_bound=seq.clone(), positions=positions[:num_tokens],
            for_cudagraph_capture=full_graph, **extra)
        attn_metadata = build_attn_metadata(attn_groups=self.draft_groups if draft else self.target_groups, **args)
        reference = self.reference_groups[draft]
        step = Step(attn_metadata, positions, qsl, seq, tables, slots,
                    {**attn_metadata, **build_attn_metadata(attn_groups=reference, **args)} if any(reference) else None)
        self.write_keys(step, query_lens, seq_lens, draft, replay_start)
        self.write_topk(step, 4)
        return step

    def write_topk(self, step: Step, ratio: int) -> None:
        """What an indexer of ``ratio`` writes into the shared buffer: LOCAL positions, a valid
        prefix, then -1; padding tokens' rows all -1, as vLLM writes them for position 0 (its
        global top-k kernel masks lanes by row value only)."""
        self.topk.fill_(-1)
        real = int(step.query_start_loc[-1])
        for t, p in enumerate(step.positions[:real].tolist()):
            n = min((p + 1) // ratio, TOPK)
            self.topk[t, :n] = torch.randperm((p + 1) // ratio, generator=self.gen)[:n].int()

    def write_keys(self, step: Step, query_lens: list[int], seq_lens: list[int], draft: bool,
                   replay_start: list[int] | None = None) -> None:
        """Fresh random keys in every cache row the batch reads: the step's own tokens through
        vLLM's writer into the SWA caches (what vLLM's forward writes before attention), the
        history -- each request's earlier window rows (from its ``replay_start``) and its
        compressed entries (in the cache of their owner: V4.1 readers share their KV source's)
        -- through dsv4_attn's writer (byte-identical: test_cache_writers_agree), which is much
        faster under the Triton interpreter."""
        from vllm.models.deepseek_v4.common.ops.cache_utils import quantize_and_insert_k_cache

        starts = replay_start or [0] * len(query_lens)
        for layer in [self.mtp] if draft else self.layers:
            caches = [(layer.swa_cache_layer.prefix, layer.swa_cache_layer.kv_cache, 0)]
            if layer.dsv4_kind.has_comp_scope and layer.dsv4_comp_prefix == layer.prefix:
                caches.append((layer.prefix, layer.kv_cache, layer.dsv4_kind.ratio))
            for name, cache, ratio in caches:
                g = self.group_of[name]
                bs = self.block_sizes[g] // max(ratio, 1)  # entries per block of this cache
                history = []
                for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
                    entries = range(max(0, s - q - WINDOW + 1, starts[r]), s - q) if ratio == 0 else \
                        range(s // ratio)
                    history += [int(step.block_tables[g][r, e // bs]) * bs + e % bs for e in entries]
                if history:
                    layout.insert(cache, "fp8_ds_mla", torch.tensor(history), self.random_keys(len(history)))
            new = step.slot_mappings[self.group_of[layer.swa_cache_layer.prefix]]
            new = new[new >= 0]
            quantize_and_insert_k_cache(self.random_keys(new.shape[0]), layer.swa_cache_layer.kv_cache, new,
                                        layer.swa_cache_layer.kv_cache.shape[1])

    def random_keys(self, n: int) -> torch.Tensor:
        return (torch.randn(n, 512, generator=self.gen) * 2).bfloat16()

    def random_q(self, layer, num_tokens: int) -> torch.Tensor:
        """bf16 [T, padded heads, 512], zero padded heads (vLLM's fused q-norm/RoPE zero-fills them)."""
        q = torch.zeros(num_tokens, layer.padded_heads, 512, dtype=torch.bfloat16)
        q[:, :self.heads] = torch.randn(num_tokens, self.heads, 512, generator=self.gen).bfloat16()
        return q

    # ---- the draft loop -------------------------------------------------------------------------
    def compute_slot_mappings(self, step: Step, num_reqs: int) -> None:
        """What the runner's ``BlockTables.compute_slot_mappings`` writes for a one-token-per-request
        batch, in place into the step's slot-mapping buffer (vLLM's version runs a pointer-table
        Triton kernel the CPU interpreter cannot)."""
        pos = step.positions[:num_reqs]
        for g, bs in enumerate(self.block_sizes):
            blocks = step.block_tables[g][torch.arange(num_reqs), pos // bs].long()
            step.slot_mappings[g, :num_reqs] = blocks * bs + pos % bs

    def run_draft_loop(self, seq_lens: list[int], attend) -> None:
        """vLLM's fused multi-step draft decode (``TargetDependentARSpeculator._generate_fused_drafts``)
        over the MTP layer, one token per request: the draft metadata is built once, then every
        draft step refreshes the slot mappings and runs vLLM's own ``_update_draft_decode_metadata``
        (the builders' ``update_draft_decode_metadata``, in place), writes the new token's key
        (vLLM's writer), calls ``attend(step)`` and advances positions and sequence lengths with
        vLLM's ``update_draft_inputs``."""
        from types import SimpleNamespace

        from vllm.config.compilation import CUDAGraphMode
        from vllm.models.deepseek_v4.common.ops.cache_utils import quantize_and_insert_k_cache
        from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator
        from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import (
            TargetDependentARSpeculator,
            update_draft_inputs,
        )

        R = len(seq_lens)
        step = self.step([1] * R, seq_lens, draft=True)
        hidden = 8
        spec = SimpleNamespace(
            idx_mapping=torch.arange(R, dtype=torch.int32), advance_draft_positions=True,
            input_buffers=SimpleNamespace(positions=step.positions, query_start_loc=step.query_start_loc,
                                          seq_lens=step.seq_lens, input_ids=torch.zeros(R, dtype=torch.int32)),
            block_tables=SimpleNamespace(cp_size=1,
                                         compute_slot_mappings=lambda *args: self.compute_slot_mappings(step, R)),
            attn_groups=self.draft_groups, current_draft_step=torch.zeros((), dtype=torch.int64),
            draft_tokens=torch.zeros(R, self.num_spec_tokens, dtype=torch.int64),
            hidden_states=torch.zeros(R, hidden), sample_src_positions=torch.zeros(R, dtype=torch.int64))
        spec._update_draft_decode_metadata = functools.partial(DraftModelSpeculator._update_draft_decode_metadata, spec)

        def generate_draft(num_reqs, num_tokens_padded, attn_metadata, *args):
            swa = self.mtp.swa_cache_layer
            slots = step.slot_mappings[self.group_of[swa.prefix], :num_reqs]
            quantize_and_insert_k_cache(self.random_keys(num_reqs), swa.kv_cache, slots, swa.kv_cache.shape[1])
            attend(step)
            drafted = torch.randint(0, 256, (num_reqs,), generator=self.gen)
            update_draft_inputs(drafted, spec.current_draft_step, torch.randn(num_reqs, hidden, generator=self.gen),
                                spec.draft_tokens, spec.hidden_states, spec.input_buffers, spec.sample_src_positions,
                                num_reqs, MAX_MODEL_LEN, self.num_spec_tokens)

        spec._generate_draft = generate_draft
        TargetDependentARSpeculator._generate_fused_drafts(spec, R, R, step.attn_metadata, None, None,
                                                           CUDAGraphMode.NONE, self.num_spec_tokens)
