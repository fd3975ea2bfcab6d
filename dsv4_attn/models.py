"""The attention fields of released DeepSeek-V4 models' config.json, in one place: the bench's
whole-step models (``dsv4-attn bench --mode step``), the example (examples/run_step.py) and the
tests build their ``ModelSpec`` from these through ``ModelSpec.from_hf_config``.

Only the fields ``from_hf_config`` reads are here (heads, head dim, indexer top-k, window,
positions, the layer list and its compression rates, the MTP layer count).
"""

from __future__ import annotations

from dataclasses import dataclass

CSA = "compressed_sparse_attention"  # V4's C4A layers (ratio 4, indexer top-k)
HCA = "heavily_compressed_attention"  # V4's C128A layers (ratio 128, every entry)
SWA = "sliding_attention"  # window-only layers


def v4_config(heads: int, topk: int, layer_types: list[str]) -> dict:
    """The attention fields of a DeepSeek-V4 config.json with layers ``layer_types`` (plus one MTP
    draft layer, as the released models have)."""
    return {"model_type": "deepseek_v4", "num_attention_heads": heads, "head_dim": 512, "qk_rope_head_dim": 64,
            "index_topk": topk, "sliding_window": 128, "max_position_embeddings": 1048576,
            "num_hidden_layers": len(layer_types), "num_nextn_predict_layers": 1, "layer_types": list(layer_types),
            "compress_rates": {CSA: 4, HCA: 128}}


def alternating(first: list[str], num_layers: int) -> list[str]:
    """V4's layer pattern: ``first``, then C4A on even and C128A on odd layer indices up to
    ``num_layers``."""
    return first + [CSA if i % 2 == 0 else HCA for i in range(len(first), num_layers)]


@dataclass(frozen=True)
class ModelPreset:
    """A released model's attention config (``config``, config.json's fields) and where its layer
    pattern comes from (``source``)."""

    name: str
    config: dict
    source: str


V4_FLASH = ModelPreset("v4-flash", v4_config(64, 512, alternating([SWA] * 2, 43)),
                       "DeepSeek-V4-Flash's public model card: 43 layers, 0-1 window only, then C4A (even) / "
                       "C128A (odd); 64 heads, top-k 512")
V4_PRO = ModelPreset("v4-pro", v4_config(128, 1024, alternating([HCA] * 2, 61)),
                     "third-party summaries of DeepSeek-V4-Pro's config (not its config.json): 61 layers, 0-1 "
                     "C128A, then C4A (even) / C128A (odd); 128 heads, top-k 1024")
PRESETS = {p.name: p for p in (V4_FLASH, V4_PRO)}


def tensor_parallel(preset: ModelPreset, ranks: int) -> ModelPreset:
    """What one rank of ``preset`` runs under ``--tensor-parallel-size ranks``: its heads split over
    the ranks (the caches, top-k and layers unchanged), named ``<name>-tp<ranks>``."""
    heads = preset.config["num_attention_heads"]
    return ModelPreset(f"{preset.name}-tp{ranks}", {**preset.config, "num_attention_heads": heads // ranks},
                       f"one rank of {preset.name} under tensor parallelism {ranks}: {heads // ranks} of its {heads} "
                       "heads")


# the ranks' shards the engines run by default on one 8-GPU node: V4-Flash 8 heads, V4-Pro 16
TP8_PRESETS = {p.name: p for p in (tensor_parallel(V4_FLASH, 8), tensor_parallel(V4_PRO, 8))}
