"""The plan memory the vLLM shim reserves during vLLM's profiling run, for DeepSeek-V4-Flash- and
V4-Pro-shaped models with one MTP layer, at ``vllm serve``'s defaults on an H100/H200
(max_num_batched_tokens 8192, max_model_len = the model's 1,048,576 positions).

Runs on a CPU in the vLLM test venv that ``bash ci/vllm-tests.sh`` builds:

    ~/.cache/dsv4-attn/vllm-venv/bin/python tests/vllm_env/plan_memory.py [--max-tokens N] [--max-model-len N]

Every attention layer is built by vLLM's own ``__init__`` through the plugin, vLLM groups their
KV caches (``get_global_kv_cache_groups``, as its engine core does), and the shim's profiling
reservation runs on the CPU (the meta device is not a plan device): every buffer, measured. The hidden size and
q-LoRA rank are reduced (they enter no KV-cache spec and no plan buffer); the layer pattern is
transformers' ``DeepseekV4Config`` default (two C128A layers, then C4A / C128A alternating).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: vllm_stack

import pytest  # noqa: E402
import torch  # noqa: E402

from dsv4_attn.integrations import vllm as shim  # noqa: E402

from kit import vllm_stack  # noqa: E402

SHAPES = {"V4-Flash": dict(num_hidden_layers=43, num_attention_heads=64, index_topk=512, o_groups=8),
          "V4-Pro": dict(num_hidden_layers=61, num_attention_heads=128, index_topk=1024, o_groups=16)}


def reserved(shape: dict, max_tokens: int, max_model_len: int) -> tuple[int, list[shim.PlanGroup], int, int]:
    """(bytes reserved, the plans of a target step, KV-cache groups, bytes of vLLM's C128A
    metadata builder) of one model shape."""
    from transformers import DeepseekV4Config
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.models.deepseek_v4.nvidia import model as cuda_model

    with tempfile.TemporaryDirectory() as model_dir:
        config = DeepseekV4Config(hidden_size=256, q_lora_rank=128, o_lora_rank=64, index_n_heads=4,
                                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                  vocab_size=256, max_position_embeddings=max_model_len, num_nextn_predict_layers=1,
                                  **shape)
        config.architectures = ["DeepseekV4ForCausalLM"]
        config.save_pretrained(model_dir)
        vllm_config = vllm_stack.vllm_config(Path(model_dir), max_model_len=max_model_len, max_tokens=max_tokens,
                                             max_seqs=1024)
    n = shape["num_hidden_layers"]
    with set_current_vllm_config(vllm_config):
        vllm_stack.init_process_state()
        cls = cuda_model._select_dsv4_attn_cls(vllm_config)
        topk = torch.empty(max_tokens, shape["index_topk"], dtype=torch.int32, device="meta")
        layers = [cls(vllm_config, prefix=f"model.layers.{i}.attn", topk_indices_buffer=topk) for i in range(n)]
        targets = set(get_layers_from_vllm_config(vllm_config, AttentionLayerBase))
        mtp = cls(vllm_config, prefix=f"model.layers.{n}.attn", topk_indices_buffer=topk)
        for name, layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).items():
            layer.is_draft_layer = name not in targets  # as vLLM's speculator flags the MTP layers
        vllm_stack.resolve_block_size(vllm_config)  # vLLM's default flags: resolved after the model is built
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
        from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

        specs = get_kv_cache_spec(vllm_config)
        layouts = [x.name for x in get_supported_kv_cache_layouts(get_current_attn_backends(vllm_config))]
        resolve_kv_cache_layout(vllm_config, [layouts], list(specs.values()))  # the engine core does this first
        planner = layers[0].dsv4_planner
        assert all(layer.dsv4_planner is planner for layer in layers + [mtp])
        planner.reserve(torch.device("cpu"))
        groups = planner.predict([layer for layer in layers])
        return (planner.reserved_bytes, groups, len(get_global_kv_cache_groups(vllm_config, [specs])),
                c128a_builder_bytes(layers[0], specs, vllm_config))


def c128a_builder_bytes(layer, specs: dict, vllm_config) -> int:
    """Bytes of the tensors vLLM's metadata builder of ``layer`` (a C128A layer, through the
    plugin) allocates: its DeepSeek-V4 builder's C128A row buffers unless the plugin leaves them
    out (integrations/vllm/memory.py)."""
    assert layer.compress_ratio == 128
    builder_cls = layer.get_attn_backend().get_builder_cls()
    builder = builder_cls(specs[layer.prefix], [layer.prefix], vllm_config, torch.device("cpu"))
    return sum(t.numel() * t.element_size() for t in vars(builder).values() if isinstance(t, torch.Tensor))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=8192, help="max_num_batched_tokens (default 8192)")
    parser.add_argument("--max-model-len", type=int, default=1 << 20, help="max_model_len (default 1048576)")
    args = parser.parse_args()
    with pytest.MonkeyPatch.context() as mp:
        vllm_stack.as_sm90_cpu(mp)
        for name, shape in SHAPES.items():
            total, groups, kv_groups, builder = reserved(shape, args.max_tokens, args.max_model_len)
            print(f"{name} (H{shape['num_attention_heads']} per rank, topk {shape['index_topk']}, "
                  f"{shape['num_hidden_layers']} layers + 1 MTP), max_num_batched_tokens {args.max_tokens}, "
                  f"max_model_len {args.max_model_len}: {total / 2**20:.1f} MiB reserved per GPU; "
                  f"{len(groups)} plans per target step ({sum(g.has_c128a for g in groups)} with C128A layers, "
                  f"{len({g.c128a_table for g in groups if g.has_c128a})} C128A row set) "
                  f"+ 1 draft slot; vLLM made {kv_groups} KV-cache groups; vLLM's C128A metadata builder holds "
                  f"{builder / 2**20:.1f} MiB")
            for group in groups:
                print(f"    plan: SWA {group.swa_prefix}, compressed {dict(group.comp_prefixes)}")


if __name__ == "__main__":
    main()
