"""The layer: our mixins in front of vLLM's DeepSeek-V4 / V4.1 attention classes.

Each keeps everything of vLLM's layer (projections, RMSNorm/RoPE, cache writes, compressor,
indexer, metadata builders, KV-cache specs) and replaces ``forward_mqa``: the step's plan
(:mod:`.planner`), then ``SparseMLA.forward`` into vLLM's output buffer. Engine-start checks
run at the end of ``__init__`` (:mod:`.sizing`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...common.layout import KVFormat
from ...common.spec import MAX_HEADS, LayerKind
from ..base import reason, refuse
from .memory import without_c128a_rows
from .sizing import planner_for, unsupported_reasons

# The mixins go in front of vLLM's layer classes (not importable here): to the type checker their
# base is any class, at run time object.
_VllmLayer: Any = Any if TYPE_CHECKING else object


class DSv4AttnLayerMixin(_VllmLayer):
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
            raise ValueError(reason("num_attention_heads / tensor_parallel_size", f"{num_heads} query heads per rank",
                                    f"<= {MAX_HEADS} with dsv4_attn", "raise --tensor-parallel-size"))
        return super().get_padded_num_q_heads(num_heads)

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.dsv4_setup(vllm_config)

    def dsv4_setup(self, vllm_config) -> None:
        """Engine-start checks and the shared planner; the end of ``__init__``."""
        refuse(f"{self.prefix} ({type(self).__name__})", unsupported_reasons(self, vllm_config))
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

    def get_attn_backend(self) -> type:
        """vLLM's backend class, whose builder leaves vLLM's own C128A rows out for a C128A layer
        (:func:`.memory.without_c128a_rows`: 2 x 256 MiB at 1M context, never read here)."""
        backend = super().get_attn_backend()
        return without_c128a_rows(backend) if self.compress_ratio == LayerKind.C128A.ratio else backend

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
