"""The production shapes the bench times: one-layer decode and prefill configs, the whole-step
models (``dsv4_attn.models``' presets), the ``--configs`` groups and the block sizes of the caches
it builds (vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass

from ..common.layout import KVFormat, Record
from ..common.spec import LayerKind
from ..models import PRESETS, TP8_PRESETS, ModelPreset


@dataclass(frozen=True)
class DecodeConfig:
    name: str
    heads: int
    kind: LayerKind
    comp_width: int  # top-k width (C4A, C1A, C2A), C128A row width, 0 (SWA: window only)
    seq_len: int = 16384  # top-k kinds: every request; C128A: lengths drawn up to max_model_len
    max_model_len: int = 131072


DECODE_CONFIGS = {
    "h64-c4a512": DecodeConfig("h64-c4a512", 64, LayerKind.C4A, 512),
    "h128-c4a1024": DecodeConfig("h128-c4a1024", 128, LayerKind.C4A, 1024),
    "h64-c128a": DecodeConfig("h64-c128a", 64, LayerKind.C128A, 1024),
    "h128-c128a": DecodeConfig("h128-c128a", 128, LayerKind.C128A, 1024),
    # window-only layers (V4-Flash's first two layers; V4.1's ratio-0 layers): timed so that auto
    # has a measurement, with its per-step cost, for them too
    "h64-swa": DecodeConfig("h64-swa", 64, LayerKind.SWA, 0),
    "h128-swa": DecodeConfig("h128-swa", 128, LayerKind.SWA, 0),
    # V4.1 top-k layers (same heads and top-k widths; a ratio-1 / ratio-2 compressed cache)
    "h64-c1a512": DecodeConfig("h64-c1a512", 64, LayerKind.C1A, 512),
    "h128-c1a1024": DecodeConfig("h128-c1a1024", 128, LayerKind.C1A, 1024),
    "h64-c2a512": DecodeConfig("h64-c2a512", 64, LayerKind.C2A, 512),
    "h128-c2a1024": DecodeConfig("h128-c2a1024", 128, LayerKind.C2A, 1024),
    # tensor-parallel shards (``--configs tp``, not in the default set): what a rank of V4-Flash (8
    # heads at -tp 8) or V4-Pro (16 at -tp 8, 32 at -tp 4) runs, and V4.1's top-k layers at those
    # head counts; FlashMLA pads them to 64 heads
    **{f"h{h}-{tag}": DecodeConfig(f"h{h}-{tag}", h, kind, width) for h in (8, 16, 32)
       for tag, kind, width in (("c4a512", LayerKind.C4A, 512), ("c4a1024", LayerKind.C4A, 1024),
                                ("c128a", LayerKind.C128A, 1024), ("swa", LayerKind.SWA, 0),
                                ("c1a512", LayerKind.C1A, 512), ("c2a1024", LayerKind.C2A, 1024))},
}


@dataclass(frozen=True)
class PrefillConfig:
    name: str
    heads: int
    s_q: int
    s_kv: int
    topk: int  # total keys per token: 128 SWA + (topk - 128) top-k entries
    kind: LayerKind = LayerKind.C4A


def _prefill(h: int, sq: int, skv: int, tk: int, kind: LayerKind = LayerKind.C4A) -> PrefillConfig:
    prefix = "" if kind is LayerKind.C4A else f"v41-{kind.name.lower()}-"
    return PrefillConfig(f"{prefix}h{h}-q{sq // 1024}k-kv{skv // 1024}k-top{tk}", h, sq, skv, tk, kind)


PREFILL_CONFIGS = {c.name: c for c in [
    *(_prefill(h, sq, skv, tk) for h in (64, 128)
      for sq, skv, tk in ((4096, 8192, 640), (4096, 32768, 1152), (8192, 65536, 1152), (4096, 32768, 2048))),
    *(_prefill(h, 4096, 32768, 1152, kind) for kind in (LayerKind.C1A, LayerKind.C2A) for h in (64, 128)),
]}
V41_KINDS = (LayerKind.C1A, LayerKind.C2A)
V41_RECORDS = (Record.MXFP8, Record.NVFP4)


def runs_in(kind: LayerKind, fmt: KVFormat) -> bool:
    """Whether a config of ``kind`` is benchmarked in ``fmt``: the V4.1 records only with V4.1 kinds
    (no engine stores V4 layers in them)."""
    return kind in V41_KINDS or not {fmt.swa_record, fmt.comp_record} & set(V41_RECORDS)


def config_heads(cfg) -> int:
    """Query heads of a decode or prefill config, or of a whole-step model's preset."""
    return cfg.heads if hasattr(cfg, "heads") else int(cfg.config["num_attention_heads"])


def is_shard(cfg) -> bool:
    """A tensor-parallel shard's config (fewer than 64 heads): timed only when asked for (``--configs
    tp`` or by name), which keeps the default run to the full models; ``--write-choices`` files the
    shards under their own head counts (``common.choices.heads_bucket``)."""
    return config_heads(cfg) < 64


# --configs groups: which configs each takes
# (a whole-step model has no single kind: the V4 models are 'v4'; the shards, V4.1's too, are 'tp' only)
CONFIG_GROUPS = {"v4": lambda cfg: getattr(cfg, "kind", None) not in V41_KINDS and not is_shard(cfg),
                 "v41": lambda cfg: getattr(cfg, "kind", None) in V41_KINDS and not is_shard(cfg),
                 "tp": is_shard}


def select_configs(table: dict, names: list[str] | None) -> list[str]:
    """Config names from ``--configs``: names, or the groups 'v4' / 'v41' / 'tp' (default: all but the
    tensor-parallel shards)."""
    if not names:
        return [n for n, c in table.items() if not is_shard(c)]
    out = []
    for name in names:
        members = [n for n, c in table.items() if CONFIG_GROUPS[name](c)] if name in CONFIG_GROUPS else [name]
        out += [n for n in members if n in table and n not in out]
    return out


SWA_BLOCK = 64
COMP_BLOCK = 256  # uncompressed tokens per compressed-cache block (vLLM)



# ---- whole decode steps (--mode step): the released models' presets ---------------------------

StepModel = ModelPreset  # a model whose whole decode step ``--mode step`` times
STEP_MODELS: dict[str, ModelPreset] = {**PRESETS, **TP8_PRESETS}
STEP_MAX_MODEL_LEN = 131072  # context lengths are drawn up to this (on the CPU: STEP_CPU_MAX_MODEL_LEN)
STEP_CPU_MAX_MODEL_LEN = 2048
# What the layers of a step read: the L2 is flushed before each replay, but layers sharing a cache
# would find each other's rows in it, so every layer owns its SWA cache and (C128A layers, which
# read every entry) its compressed cache; top-k layers share one compressed cache (each is a
# quarter of the context: 5 GB per layer at b=256) and each reads it through its own top-k.
STEP_CACHES = "own SWA cache per layer; own C128A cache per layer; one C4A cache shared by the C4A layers (own top-k)"

