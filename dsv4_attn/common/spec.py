"""Model-level constants and the per-model attention spec of DeepSeek-V4.

Facts from spec/dsv4-semantics.md §1: every attention row (K = V, one latent KV head) is
512 wide, the last 64 dims carry GPT-J RoPE, the first 448 are "NoPE". Layers come in three
kinds by compression ratio: sliding window only (SWA), C4A (ratio 4, indexer top-k of the
compressed entries) and C128A (ratio 128, all compressed entries).
"""

from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass

HEAD_DIM = 512
ROPE_DIM = 64
NOPE_DIM = HEAD_DIM - ROPE_DIM  # 448
QUANT_TILE = 64  # NoPE dims sharing one UE8M0 scale in the MODEL1 cache
NUM_QUANT_TILES = NOPE_DIM // QUANT_TILE  # 7
MODEL1_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576: e4m3 NoPE then bf16 RoPE
MODEL1_SCALE_BYTES = NUM_QUANT_TILES + 1  # 8: seven exponents and one zero pad byte
MODEL1_TOKEN_BYTES = MODEL1_DATA_BYTES + MODEL1_SCALE_BYTES  # 584
MODEL1_PAGE_ALIGN = 576  # a block's bytes are padded to a multiple of this
DEFAULT_WINDOW = 128
MAX_HEADS = 128


class LayerKind(enum.IntEnum):
    """Attention layer kind, valued by its compression ratio."""

    SWA = 1
    C4A = 4
    C128A = 128

    @property
    def ratio(self) -> int:
        return int(self)

    @property
    def has_comp_scope(self) -> bool:
        return self is not LayerKind.SWA

    @classmethod
    def parse(cls, value: "LayerKind | int | str") -> "LayerKind":
        """Accept a LayerKind, its ratio (1/4/128) or its name ("swa", "c4a", "c128a")."""
        if isinstance(value, LayerKind):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
        elif not isinstance(value, bool):
            try:  # operator.index: ints (numpy ints too) but never 4.5 -> 4
                return cls(operator.index(value))
            except (ValueError, TypeError):
                pass
        raise ValueError(
            f"kind: got {value!r}; allowed: LayerKind.SWA/C4A/C128A, 1/4/128 or 'swa'/'c4a'/'c128a'"
        )


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def cdiv(x: int, y: int) -> int:
    return -(-x // y)


def _check_positive_int(name: str, value, allowed: str = "a positive int") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: got {value!r}; allowed: {allowed}")


@dataclass(frozen=True)
class ModelSpec:
    """What a DSv4 attention layer looks like to the kernels (per tensor-parallel rank).

    num_heads      query heads on this rank (1..128); kernels may pad them (FlashMLA to 64/128).
    c4a_topk       width of the C4A indexer top-k row (V4-Flash 512, V4-Pro 1024).
    max_model_len  longest sequence served; fixes the C128A row width (never batch dependent).
    window         sliding-window length W (128 in released models).
    softmax_scale  defaults to head_dim ** -0.5 (no YaRN mscale in DSv4).
    """

    num_heads: int
    c4a_topk: int = 512
    max_model_len: int = 65536
    head_dim: int = HEAD_DIM
    rope_dim: int = ROPE_DIM
    window: int = DEFAULT_WINDOW
    softmax_scale: float | None = None

    def __post_init__(self) -> None:
        _check_positive_int("num_heads", self.num_heads)
        if self.num_heads > MAX_HEADS:
            raise ValueError(f"num_heads: got {self.num_heads}; allowed: 1..{MAX_HEADS} per rank")
        _check_positive_int("c4a_topk", self.c4a_topk)
        _check_positive_int("max_model_len", self.max_model_len)
        _check_positive_int("window", self.window)
        if self.head_dim != HEAD_DIM:
            raise ValueError(f"head_dim: got {self.head_dim}; allowed: {HEAD_DIM} (DeepSeek-V4)")
        if self.rope_dim != ROPE_DIM:
            raise ValueError(f"rope_dim: got {self.rope_dim}; allowed: {ROPE_DIM} (DeepSeek-V4)")
        if self.softmax_scale is not None:
            s = self.softmax_scale
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
                raise ValueError(f"softmax_scale: got {s!r}; allowed: a finite float > 0 or None")

    @property
    def scale(self) -> float:
        """The softmax scale actually used."""
        return float(self.softmax_scale) if self.softmax_scale is not None else self.head_dim**-0.5

    @property
    def c128a_width(self) -> int:
        """C128A row width: round_up(cdiv(max_model_len, 128), 128), fixed per model."""
        return round_up(cdiv(self.max_model_len, LayerKind.C128A.ratio), 128)

    def comp_width(self, kind: LayerKind) -> int:
        """Width of the compressed-scope row of a layer kind (0 for SWA-only layers)."""
        kind = LayerKind.parse(kind)
        return {LayerKind.SWA: 0, LayerKind.C4A: self.c4a_topk, LayerKind.C128A: self.c128a_width}[kind]
