"""Model-level constants and the per-model attention spec of DeepSeek-V4 and V4.1.

Every attention row (K = V, one latent KV head) is 512 wide; the last 64 dims carry GPT-J RoPE,
the first 448 are "NoPE" (docs/semantics.md). A layer attends a sliding window of its own recent
tokens and, unless it is window-only, a compressed scope: entries of a compressed cache that
pools ``ratio`` consecutive tokens into one entry, chosen either by the indexer's top-k or all at
once. So a layer kind is (compression ratio, selection):

    model   kind    ratio  selection   HF config
    both    SWA     0      none        compress_ratios 0 / layer_types "sliding_attention"
    V4      C4A     4      topk        "compressed_sparse_attention"
    V4      C128A   128    all         "heavily_compressed_attention"
    V4.1    C1A     1      topk        compress_ratios 1
    V4.1    C2A     2      topk        compress_ratios 2
"""

from __future__ import annotations

import enum
import functools
import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

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
ALL_WIDTH_MULTIPLE = 128  # rows of an "all" layer are padded to a multiple of this


class Selection(str, enum.Enum):
    """How a layer's compressed scope is chosen."""

    NONE = "none"  # no compressed scope: the window only
    TOPK = "topk"  # the indexer's top-k of the visible compressed entries
    ALL = "all"  # every visible compressed entry


class LayerKind:
    """An attention layer kind: ``(ratio, selection)``; immutable and interned, so
    ``LayerKind(4, "topk") is LayerKind.C4A``.

    ratio       tokens pooled into one compressed entry (0 for window-only layers)
    selection   Selection.NONE (ratio 0), TOPK or ALL (ratio >= 1)

    Named kinds: ``SWA``, ``C1A``, ``C2A``, ``C4A``, ``C128A`` (module docstring).
    """

    __slots__ = ("ratio", "selection")
    _interned: dict[tuple[int, Selection], LayerKind] = {}
    # class attributes filled in below the class
    SWA: LayerKind
    C1A: LayerKind
    C2A: LayerKind
    C4A: LayerKind
    C128A: LayerKind

    ratio: int
    selection: Selection

    def __new__(cls, ratio: int, selection: Selection | str) -> LayerKind:
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 0:
            raise ValueError(f"ratio: got {ratio!r}; allowed: an int >= 0 (0 = window only)")
        try:
            selection = Selection(selection)
        except ValueError:
            raise ValueError(f"selection: got {selection!r}; allowed: 'none', 'topk' or 'all'") from None
        if (ratio == 0) != (selection is Selection.NONE):
            raise ValueError(f"selection: got {selection.value!r} with ratio {ratio}; allowed: 'none' exactly "
                             "when ratio is 0 (a window-only layer), else 'topk' or 'all'")
        key = (ratio, selection)
        kind = cls._interned.get(key)
        if kind is None:
            kind = super().__new__(cls)
            object.__setattr__(kind, "ratio", ratio)
            object.__setattr__(kind, "selection", selection)
            cls._interned[key] = kind
        return kind

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("LayerKind is immutable")

    def __reduce__(self):
        return LayerKind, (self.ratio, self.selection.value)

    def __repr__(self) -> str:
        return f"LayerKind.{self.name}" if self.name in _NAMES.values() else \
            f"LayerKind({self.ratio}, {self.selection.value!r})"

    @property
    def name(self) -> str:
        """"SWA", "C4A", ... ; other (ratio, selection) pairs read "C{ratio}A-{selection}"."""
        return _NAMES.get((self.ratio, self.selection), f"C{self.ratio}A-{self.selection.value}")

    @property
    def has_comp_scope(self) -> bool:
        return self.selection is not Selection.NONE

    @property
    def uses_topk(self) -> bool:
        """True when the engine hands this layer the indexer's local top-k."""
        return self.selection is Selection.TOPK

    @property
    def attends_all(self) -> bool:
        """True when the compressed scope is every visible entry (rows built once per step)."""
        return self.selection is Selection.ALL

    @classmethod
    def from_ratio(cls, ratio: int, *, all_ratios: Iterable[int] = (128,)) -> LayerKind:
        """The kind of a Hugging Face config's compression ratio: 0 = window only; ratios in
        ``all_ratios`` (V4's 128) attend every entry; other ratios (4, 1, 2) attend the top-k."""
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 0:
            raise ValueError(f"ratio: got {ratio!r}; allowed: an int >= 0 (0 = window only)")
        if ratio == 0:
            return cls.SWA
        return cls(ratio, Selection.ALL if ratio in tuple(all_ratios) else Selection.TOPK)

    @classmethod
    def parse(cls, value: LayerKind | str | int | tuple[int, str]) -> LayerKind:
        """A LayerKind, a name ("swa", "c1a", "c2a", "c4a", "c128a"), a (ratio, selection) pair,
        or a config compression ratio (0, 2, 4, 128). The ratio 1 is refused as ambiguous: it
        is V4.1's C1A in configs but was V4's window-only layer inside vLLM's V4 model code."""
        if isinstance(value, LayerKind):
            return value
        if isinstance(value, str):
            kind = _BY_NAME.get(value.strip().upper())
            if kind is not None:
                return kind
        elif isinstance(value, tuple) and len(value) == 2:
            return cls(*value)
        elif not isinstance(value, bool):
            try:
                ratio = operator.index(value)  # ints (numpy ints too), never 4.5 -> 4
            except TypeError:
                ratio = None
            if ratio == 1:
                raise ValueError("kind: got 1, which is ambiguous (V4.1's C1A, or V4's window-only layer as "
                                 "vLLM's V4 code numbers it); allowed: LayerKind.C1A / LayerKind.SWA or "
                                 "'c1a' / 'swa'")
            if ratio in (0, 2, 4, 128):
                return cls.from_ratio(ratio)
        raise ValueError(f"kind: got {value!r}; allowed: a LayerKind, one of the names "
                         f"{sorted(n.lower() for n in _BY_NAME)}, a (ratio, selection) pair, or 0/2/4/128")


_NAMES = {(0, Selection.NONE): "SWA", (1, Selection.TOPK): "C1A", (2, Selection.TOPK): "C2A",
          (4, Selection.TOPK): "C4A", (128, Selection.ALL): "C128A"}
for (_ratio, _sel), _name in _NAMES.items():
    setattr(LayerKind, _name, LayerKind(_ratio, _sel))
_BY_NAME = {name: LayerKind(r, s) for (r, s), name in _NAMES.items()}

V4_KINDS = (LayerKind.SWA, LayerKind.C4A, LayerKind.C128A)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def cdiv(x: int, y: int) -> int:
    return -(-x // y)


def _check_positive_int(name: str, value, allowed: str = "a positive int") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: got {value!r}; allowed: {allowed}")


@dataclass(frozen=True)
class Layer:
    """One attention layer of a model (MTP layers included).

    index        layer id as the engine numbers it (MTP layers follow the backbone)
    kind         its LayerKind
    comp_source  index of the layer that owns the compressed cache it reads (itself when it owns
                 one; an earlier layer when V4.1 shares the cache); None for window-only layers
    mtp          True for a multi-token-prediction (draft) layer
    """

    index: int
    kind: LayerKind
    comp_source: int | None = None
    mtp: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"Layer.index: got {self.index!r}; allowed: an int >= 0")
        object.__setattr__(self, "kind", LayerKind.parse(self.kind))  # a name ("c4a") becomes its LayerKind
        source = self.comp_source
        if self.kind.has_comp_scope != (source is not None):
            raise ValueError(f"Layer.comp_source: got {source!r} for a {self.kind.name} layer; allowed: "
                             + ("the index of the layer owning its compressed cache" if self.kind.has_comp_scope
                                else "None (a window-only layer reads no compressed cache)"))
        if source is not None and (isinstance(source, bool) or not isinstance(source, int) or source < 0):
            raise ValueError(f"Layer.comp_source: got {source!r}; allowed: a layer index >= 0 or None")

    @property
    def shares_comp_cache(self) -> bool:
        return self.comp_source is not None and self.comp_source != self.index


@dataclass(frozen=True, init=False)
class ModelSpec:
    """What the attention layers of a DeepSeek-V4 / V4.1 model look like to the kernels (per
    tensor-parallel rank).

    num_heads      query heads on this rank (1..128); kernels may pad them (FlashMLA to 64/128).
    topk           width of the indexer's top-k row (V4-Flash 512, V4-Pro 1024); every top-k layer
                   of the model uses it.
    max_model_len  longest sequence served; fixes the row width of "all" layers (C128A).
    window         sliding-window length W (128 in released models).
    softmax_scale  defaults to head_dim ** -0.5 (no YaRN mscale in DSv4).
    layers         the model's layers (``Layer`` records, or LayerKinds numbered in order);
                   default: one layer of each V4 kind (SWA, C4A, C128A). ``from_hf_config``
                   builds the real list.
    """

    num_heads: int
    topk: int
    max_model_len: int
    head_dim: int
    rope_dim: int
    window: int
    softmax_scale: float | None
    layers: tuple[Layer, ...]

    def __init__(self, num_heads: int, topk: int = 512, max_model_len: int = 65536,
                 head_dim: int = HEAD_DIM, rope_dim: int = ROPE_DIM, window: int = DEFAULT_WINDOW,
                 softmax_scale: float | None = None, layers: Iterable[Layer | LayerKind | str] | None = None) -> None:
        _check_positive_int("num_heads", num_heads)
        if num_heads > MAX_HEADS:
            raise ValueError(f"num_heads: got {num_heads}; allowed: 1..{MAX_HEADS} per rank")
        _check_positive_int("topk", topk)
        _check_positive_int("max_model_len", max_model_len)
        _check_positive_int("window", window)
        if head_dim != HEAD_DIM:
            raise ValueError(f"head_dim: got {head_dim}; allowed: {HEAD_DIM} (DeepSeek-V4)")
        if rope_dim != ROPE_DIM:
            raise ValueError(f"rope_dim: got {rope_dim}; allowed: {ROPE_DIM} (DeepSeek-V4)")
        if softmax_scale is not None:
            s = softmax_scale
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
                raise ValueError(f"softmax_scale: got {s!r}; allowed: a finite float > 0 or None")
        values = dict(num_heads=num_heads, topk=topk, max_model_len=max_model_len, head_dim=head_dim,
                      rope_dim=rope_dim, window=window, softmax_scale=softmax_scale,
                      layers=_layers(V4_KINDS if layers is None else layers))
        for name, value in values.items():
            object.__setattr__(self, name, value)

    # ---- derived ------------------------------------------------------------------------
    @property
    def scale(self) -> float:
        """The softmax scale actually used."""
        return float(self.softmax_scale) if self.softmax_scale is not None else self.head_dim**-0.5

    @functools.cached_property  # asked at every layer call (check_kind): a 61-layer scan each time
    def kinds(self) -> tuple[LayerKind, ...]:
        """The distinct layer kinds of the model, in order of first appearance."""
        return tuple(dict.fromkeys(layer.kind for layer in self.layers))

    @property
    def comp_ratios(self) -> tuple[int, ...]:
        """Compression ratios of the model's compressed caches (the keys of a StepBatch's
        ``comp_block_tables``), ascending."""
        return tuple(sorted({k.ratio for k in self.kinds if k.has_comp_scope}))

    def all_width(self, ratio: int) -> int:
        """Row width of an "all" layer of ``ratio``: round_up(cdiv(max_model_len, ratio), 128),
        fixed per model (never batch dependent, so captured graphs keep their strides)."""
        return round_up(cdiv(self.max_model_len, ratio), ALL_WIDTH_MULTIPLE)

    @property
    def c128a_width(self) -> int:
        """C128A row width (``all_width(128)``)."""
        return self.all_width(LayerKind.C128A.ratio)

    def comp_width(self, kind: LayerKind | str | int) -> int:
        """Width of the compressed-scope row of a layer kind (0 for window-only layers)."""
        kind = LayerKind.parse(kind)
        if kind.uses_topk:
            return self.topk
        return self.all_width(kind.ratio) if kind.attends_all else 0

    def check_kind(self, kind: LayerKind | str | int) -> LayerKind:
        """``kind`` parsed; ValueError when the model has no such layer."""
        kind = LayerKind.parse(kind)
        if kind not in self.kinds:
            raise ValueError(f"kind: got {kind.name}; allowed: this model's kinds "
                             f"{[k.name for k in self.kinds]} (ModelSpec.layers)")
        return kind

    # ---- Hugging Face configs -------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any, tp_size: int = 1,
                       max_model_len: int | None = None) -> ModelSpec:
        """The spec of a DeepSeek-V4 or V4.1 Hugging Face config (a dict, e.g. config.json, or a
        config object), per rank of ``tp_size``.

        V4.1 lists ``compress_ratios`` per layer, MTP layers included (0 window only, 1 C1A, 2 C2A;
        layers past the list are window-only MTP layers), and shares each compressed cache from
        the nearest ``kv_source_layer_ids`` entry at or below the layer. V4 names ``layer_types``
        mapped through ``compress_rates`` (4 C4A, 128 C128A, absent 0), and its
        ``num_nextn_predict_layers`` MTP layers are window-only. Both nest the text model under
        ``text_config`` when they carry a vision tower.
        """
        cfg = _as_dict(config)
        if cfg.get("text_config") is not None:  # V4.1 with a vision tower nests the text model
            cfg = {**cfg, **_as_dict(cfg["text_config"])}
        heads = _config_int(cfg, "num_attention_heads")
        _check_positive_int("tp_size", tp_size)
        if heads % tp_size:
            raise ValueError(f"tp_size: got {tp_size}; allowed: a divisor of num_attention_heads ({heads})")
        num_hidden = _config_int(cfg, "num_hidden_layers")
        num_mtp = _config_int(cfg, "num_nextn_predict_layers", 0, minimum=0)
        ratios = _config_ratios(cfg, num_hidden, num_mtp)
        sources = sorted(_config_ints(cfg, "kv_source_layer_ids", 0, len(ratios) - 1, default=()))
        layers = []
        for index, ratio in enumerate(ratios):
            kind = LayerKind.from_ratio(ratio)
            source = None
            if kind.has_comp_scope:
                below = [s for s in sources if s <= index]
                source = below[-1] if below else index
            layers.append(Layer(index, kind, source, mtp=index >= num_hidden))
        for layer in layers:
            owner = layers[layer.comp_source] if layer.comp_source is not None else layer
            if owner.kind.ratio != layer.kind.ratio:
                raise ValueError(f"kv_source_layer_ids: layer {layer.index} ({layer.kind.name}) would share the "
                                 f"compressed cache of layer {owner.index} ({owner.kind.name}); allowed: sources "
                                 "of the same ratio")
        for name, want in (("head_dim", HEAD_DIM), ("qk_rope_head_dim", ROPE_DIM)):
            if name in cfg and _config_int(cfg, name) != want:
                raise ValueError(f"config.{name}: got {cfg[name]}; allowed: {want} (DeepSeek-V4 attention)")
        mml = max_model_len if max_model_len is not None else _config_int(cfg, "max_position_embeddings", 65536)
        return cls(num_heads=heads // tp_size, topk=_config_int(cfg, "index_topk", 512), max_model_len=mml,
                   window=_config_int(cfg, "sliding_window", DEFAULT_WINDOW), layers=layers)


def model_layer_kinds(config: Mapping[str, Any] | Any, kinds: Iterable[LayerKind]) -> tuple[LayerKind, ...]:
    """Every attention layer's kind in order, read from a DeepSeek-V4 / V4.1 config (dict or config
    object; ``ModelSpec.from_hf_config``), when those are exactly ``kinds`` (the kinds an engine's
    layers run); else ``kinds`` as given. For engines that know their layer kinds but not the
    counts, which auto needs to weigh a backend's per-step work (common/choices.py)."""
    kinds = tuple(kinds)
    try:
        listed = tuple(layer.kind for layer in ModelSpec.from_hf_config(config).layers)
    except (ValueError, TypeError, KeyError, AttributeError):
        return kinds
    return listed if set(listed) == set(kinds) else kinds


def _layers(items: Iterable[Layer | LayerKind | str]) -> tuple[Layer, ...]:
    """Layer records from Layers or kinds (kinds are numbered in order and own their caches)."""
    layers = []
    for index, item in enumerate(items):
        if isinstance(item, Layer):
            layers.append(item)
        else:
            kind = LayerKind.parse(item)
            layers.append(Layer(index, kind, index if kind.has_comp_scope else None))
    if not layers:
        raise ValueError("layers: got an empty list; allowed: at least one layer")
    by_index = {layer.index: layer for layer in layers}
    if len(by_index) != len(layers):
        raise ValueError(f"layers: got indices {[layer.index for layer in layers]}; allowed: each index once")
    for layer in layers:
        owner = by_index.get(layer.comp_source) if layer.comp_source is not None else layer
        if owner is None or owner.kind.ratio != layer.kind.ratio:
            got = "no such layer" if owner is None else f"layer {owner.index} is {owner.kind.name}"
            raise ValueError(f"layers: layer {layer.index} ({layer.kind.name}) reads the compressed cache of layer "
                             f"{layer.comp_source} ({got}); allowed: a layer of the model with the same ratio")
    return tuple(layers)


def _as_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if hasattr(config, "__dict__"):
        return dict(vars(config))
    raise ValueError(f"config: got {type(config).__name__}; allowed: a dict or a Hugging Face config object")


_REQUIRED: Any = object()  # marks a config key without a default


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _config_int(cfg: Mapping[str, Any], name: str, default: Any = _REQUIRED, minimum: int = 1) -> int:
    """``cfg[name]``, an int >= ``minimum`` (``default`` when the key is absent): never a float
    truncated, a None or a string coerced."""
    if name not in cfg and default is not _REQUIRED:
        return default
    value = cfg.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"config.{name}: got {value!r}; allowed: an int >= {minimum}")
    return value


def _config_ints(cfg: Mapping[str, Any], name: str, lo: int, hi: int, default: Any = _REQUIRED) -> list[int]:
    """``cfg[name]``, a list of ints in [lo, hi] (``default`` when absent or None)."""
    value = cfg.get(name)
    if value is None and default is not _REQUIRED:
        return list(default)
    if not isinstance(value, (list, tuple)) or not all(_is_int(v) and lo <= v <= hi for v in value):
        raise ValueError(f"config.{name}: got {value!r}; allowed: a list of ints in [{lo}, {hi}]")
    return list(value)


def _config_ratios(cfg: Mapping[str, Any], num_hidden: int, num_mtp: int) -> list[int]:
    """Per-layer compression ratios, MTP layers included (0 = window only)."""
    if cfg.get("compress_ratios") is not None:
        ratios = _config_ints(cfg, "compress_ratios", 0, 2**31 - 1)
        if not num_hidden <= len(ratios) <= num_hidden + num_mtp:
            raise ValueError(f"config.compress_ratios: got {len(ratios)} entries; allowed: one per layer, "
                             f"{num_hidden} (num_hidden_layers) to {num_hidden + num_mtp} (with the "
                             "num_nextn_predict_layers MTP layers)")
        return ratios + [0] * (num_hidden + num_mtp - len(ratios))
    if cfg.get("layer_types") is not None and cfg.get("compress_rates") is not None:
        types, rates = cfg["layer_types"], cfg["compress_rates"]
        listed = isinstance(types, (list, tuple)) and all(isinstance(t, str) for t in types)
        if not listed or len(types) != num_hidden:
            raise ValueError(f"config.layer_types: got {types!r}; allowed: a list of {num_hidden} layer type names "
                             "(one per num_hidden_layers)")
        if not isinstance(rates, Mapping) or not all(_is_int(r) and r >= 0 for r in rates.values()):
            raise ValueError(f"config.compress_rates: got {rates!r}; allowed: a mapping layer type -> int >= 0")
        return [rates.get(t, 0) for t in types] + [0] * num_mtp
    raise ValueError("config: got neither compress_ratios (V4.1) nor layer_types + compress_rates (V4); allowed: "
                     "a DeepSeek-V4 or V4.1 config")
