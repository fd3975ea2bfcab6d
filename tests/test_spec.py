"""common/spec.py: constants, LayerKind, ModelSpec (expected values worked out by hand)."""

from __future__ import annotations

import pickle

import pytest

from dsv4_attn.common import spec as S
from dsv4_attn.common.spec import V4_KINDS, Layer, LayerKind, ModelSpec, Selection


def test_constants_match_the_model1_byte_budget():
    # 448 e4m3 NoPE bytes + 64 bf16 RoPE values = 576 data bytes; 7 exponents + 1 pad = 8.
    assert (S.HEAD_DIM, S.ROPE_DIM, S.NOPE_DIM) == (512, 64, 448)
    assert (S.QUANT_TILE, S.NUM_QUANT_TILES) == (64, 7)
    assert (S.MODEL1_DATA_BYTES, S.MODEL1_SCALE_BYTES, S.MODEL1_TOKEN_BYTES) == (576, 8, 584)
    assert S.MODEL1_PAGE_ALIGN == 576 and S.DEFAULT_WINDOW == 128 and S.MAX_HEADS == 128


def test_round_up_and_cdiv():
    assert [S.round_up(x, 576) for x in (1, 576, 577, 37376, 1168)] == [576, 576, 1152, 37440, 1728]
    assert [S.cdiv(x, 128) for x in (1, 127, 128, 129, 65536)] == [1, 1, 1, 2, 512]


@pytest.mark.parametrize("value, kind", [
    (LayerKind.C4A, LayerKind.C4A), (0, LayerKind.SWA), (2, LayerKind.C2A), (4, LayerKind.C4A),
    (128, LayerKind.C128A), ("swa", LayerKind.SWA), ("C4A", LayerKind.C4A), ("c128a", LayerKind.C128A),
    ("c1a", LayerKind.C1A), (" C2A ", LayerKind.C2A), ((4, "topk"), LayerKind.C4A), ((1, "topk"), LayerKind.C1A),
    ((0, "none"), LayerKind.SWA),
])
def test_layer_kind_parse(value, kind):
    assert LayerKind.parse(value) is kind


def test_layer_kinds_are_ratio_selection_pairs_and_interned():
    table = [(LayerKind.SWA, 0, Selection.NONE, "SWA"), (LayerKind.C1A, 1, Selection.TOPK, "C1A"),
             (LayerKind.C2A, 2, Selection.TOPK, "C2A"), (LayerKind.C4A, 4, Selection.TOPK, "C4A"),
             (LayerKind.C128A, 128, Selection.ALL, "C128A")]
    for kind, ratio, selection, name in table:
        assert (kind.ratio, kind.selection, kind.name) == (ratio, selection, name)
        assert LayerKind(ratio, selection.value) is kind
        assert kind.has_comp_scope == (selection is not Selection.NONE)
        assert kind.uses_topk == (selection is Selection.TOPK)
        assert kind.attends_all == (selection is Selection.ALL)
        assert pickle.loads(pickle.dumps(kind)) is kind
        assert repr(kind) == f"LayerKind.{name}"
    assert V4_KINDS == (LayerKind.SWA, LayerKind.C4A, LayerKind.C128A)
    other = LayerKind(8, "all")
    assert other.name == "C8A-all" and repr(other) == "LayerKind(8, 'all')"
    with pytest.raises(AttributeError):
        LayerKind.C4A.ratio = 8


@pytest.mark.parametrize("bad", [3, "c8a", None, 4.5, True, "4", (4, "some"), (0, "topk"), (4, "none"), -1])
def test_layer_kind_parse_rejects(bad):
    with pytest.raises(ValueError, match=r"(kind|ratio|selection): got .*allowed"):
        LayerKind.parse(bad)


def test_layer_kind_parse_refuses_the_ambiguous_ratio_1():
    # vLLM's V4 code numbers window-only layers 1; V4.1 configs mean C1A by 1: name it instead.
    with pytest.raises(ValueError, match=r"kind: got 1, which is ambiguous.*allowed: LayerKind.C1A / LayerKind.SWA"):
        LayerKind.parse(1)


def test_from_ratio_reads_config_ratios():
    assert [LayerKind.from_ratio(r) for r in (0, 1, 2, 4, 128)] == [
        LayerKind.SWA, LayerKind.C1A, LayerKind.C2A, LayerKind.C4A, LayerKind.C128A]
    assert LayerKind.from_ratio(16, all_ratios=(16,)) is LayerKind(16, "all")


def test_model_spec_defaults_and_widths():
    spec = ModelSpec(num_heads=64)
    assert spec.scale == 512**-0.5
    # round_up(cdiv(65536, 128), 128) = 512
    assert spec.c128a_width == 512
    assert spec.comp_width(LayerKind.SWA) == 0
    assert spec.comp_width("c4a") == 512
    assert spec.comp_width(128) == 512
    assert ModelSpec(num_heads=1, softmax_scale=0.5).scale == 0.5
    # default layers: one of each V4 kind, each owning its compressed cache
    assert spec.kinds == V4_KINDS and spec.comp_ratios == (4, 128)
    assert spec.layers == (Layer(0, LayerKind.SWA), Layer(1, LayerKind.C4A, 1), Layer(2, LayerKind.C128A, 2))


def test_topk_width():
    assert ModelSpec(num_heads=8, topk=1024).topk == 1024
    spec = ModelSpec(num_heads=8, topk=64, layers=["swa", "c1a", "c2a"])
    assert [spec.comp_width(k) for k in spec.kinds] == [0, 64, 64]
    assert spec.comp_ratios == (1, 2)
    with pytest.raises(ValueError, match=r"^kind: got C4A; allowed: this model's kinds \['SWA', 'C1A', 'C2A'\]"):
        spec.check_kind("c4a")


def test_all_width_per_ratio():
    # round_up(cdiv(1000, r), 128)
    spec = ModelSpec(num_heads=8, max_model_len=1000)
    assert [spec.all_width(r) for r in (1, 4, 128)] == [1024, 256, 128]


@pytest.mark.parametrize("max_model_len, width", [(1, 128), (128, 128), (16384, 128), (16385, 256),
                                                  (40960, 384), (1 << 20, 8192)])
def test_c128a_width_is_a_fixed_multiple_of_128(max_model_len, width):
    assert ModelSpec(num_heads=8, max_model_len=max_model_len).c128a_width == width


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_heads=0), "num_heads"), (dict(num_heads=129), "num_heads"), (dict(num_heads=True), "num_heads"),
    (dict(num_heads=8.0), "num_heads"),
    (dict(num_heads=8, topk=0), "topk"), (dict(num_heads=8, layers=[]), "layers"),
    (dict(num_heads=8, layers=["c8a"]), "kind"),
    (dict(num_heads=8, max_model_len=-1), "max_model_len"), (dict(num_heads=8, window=0), "window"),
    (dict(num_heads=8, head_dim=576), "head_dim"), (dict(num_heads=8, rope_dim=32), "rope_dim"),
    (dict(num_heads=8, softmax_scale=0.0), "softmax_scale"),
    (dict(num_heads=8, softmax_scale=float("nan")), "softmax_scale"),
    (dict(num_heads=8, softmax_scale=float("inf")), "softmax_scale"),
])
def test_model_spec_rejects_bad_values_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}: got .*allowed"):
        ModelSpec(**kwargs)


def _v41_config(**over):
    """A V4.1 config.json's attention fields, the text model nested as V4.1 checkpoints with a
    vision tower nest it."""
    text = dict(num_attention_heads=64, num_hidden_layers=6, num_nextn_predict_layers=1, index_topk=512,
                sliding_window=128, head_dim=512, qk_rope_head_dim=64, max_position_embeddings=131072,
                compress_ratios=[0, 1, 2, 2, 1, 0], kv_source_layer_ids=[1, 2, 4])
    text.update(over)
    return {"model_type": "deepseek_v41", "text_config": text, "vision_config": {"num_hidden_layers": 2}}


def test_from_hf_config_v41_layers_sharing_and_mtp():
    spec = ModelSpec.from_hf_config(_v41_config(), tp_size=8)
    assert (spec.num_heads, spec.topk, spec.window, spec.max_model_len) == (8, 512, 128, 131072)
    # ratios [0, 1, 2, 2, 1, 0] + one MTP layer past the list (window only); each compressed layer
    # reads the nearest kv source at or below it: 1 -> 1, 2 -> 2, 3 -> 2, 4 -> 4
    assert spec.layers == (Layer(0, LayerKind.SWA), Layer(1, LayerKind.C1A, 1), Layer(2, LayerKind.C2A, 2),
                           Layer(3, LayerKind.C2A, 2), Layer(4, LayerKind.C1A, 4), Layer(5, LayerKind.SWA),
                           Layer(6, LayerKind.SWA, mtp=True))
    assert spec.layers[3].shares_comp_cache and not spec.layers[2].shares_comp_cache
    assert spec.kinds == (LayerKind.SWA, LayerKind.C1A, LayerKind.C2A) and spec.comp_ratios == (1, 2)
    assert ModelSpec.from_hf_config(_v41_config(), max_model_len=4096).max_model_len == 4096


def test_from_hf_config_v4_layer_types():
    cfg = dict(num_attention_heads=128, num_hidden_layers=4, num_nextn_predict_layers=1, index_topk=1024,
               sliding_window=128, layer_types=["sliding_attention", "compressed_sparse_attention",
                                                "heavily_compressed_attention", "compressed_sparse_attention"],
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    spec = ModelSpec.from_hf_config(cfg)
    assert [layer.kind for layer in spec.layers] == [LayerKind.SWA, LayerKind.C4A, LayerKind.C128A, LayerKind.C4A,
                                                     LayerKind.SWA]
    assert [layer.comp_source for layer in spec.layers] == [None, 1, 2, 3, None]
    assert spec.layers[-1].mtp and spec.topk == 1024 and spec.num_heads == 128


@pytest.mark.parametrize("cfg, tp, message", [
    (_v41_config(num_attention_heads=None), 1, r"^config.num_attention_heads: got None; allowed"),
    (_v41_config(), 3, r"^tp_size: got 3; allowed: a divisor of num_attention_heads \(64\)"),
    (_v41_config(compress_ratios=None), 1, r"^config: got neither compress_ratios"),
    (_v41_config(kv_source_layer_ids=[1, 3]), 1,
     r"^kv_source_layer_ids: layer 2 \(C2A\) would share the compressed cache of layer 1 \(C1A\)"),
    (_v41_config(head_dim=576), 1, r"^config.head_dim: got 576; allowed: 512"),
])
def test_from_hf_config_refuses_what_it_cannot_read(cfg, tp, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(cfg, tp_size=tp)


def test_engines_take_the_layer_counts_from_the_config_when_its_kinds_are_theirs():
    """model_layer_kinds: the per-layer list of a V4-Flash-like config (2 window-only layers, C4A
    / C128A alternating, 1 MTP layer) when it names exactly the engine's kinds; else those kinds."""
    from dsv4_attn.common.registry import layers_per_step
    from dsv4_attn.common.spec import model_layer_kinds
    from dsv4_attn.models import V4_FLASH

    v4 = (LayerKind.SWA, LayerKind.C4A, LayerKind.C128A)
    config = V4_FLASH.config
    kinds = model_layer_kinds(config, v4)
    assert len(kinds) == 44 and kinds[:4] == (LayerKind.SWA, LayerKind.SWA, LayerKind.C4A, LayerKind.C128A)
    assert (kinds.count(LayerKind.SWA), kinds.count(LayerKind.C4A), kinds.count(LayerKind.C128A)) == (3, 21, 20)
    assert model_layer_kinds(config, (LayerKind.SWA, LayerKind.C1A)) == (LayerKind.SWA, LayerKind.C1A)  # not its
    assert model_layer_kinds({"model_type": "other"}, v4) == v4  # a config that does not say
    spec = ModelSpec(num_heads=64, layers=kinds)
    assert spec.kinds == v4 and tuple(layers_per_step(spec, kind) for kind in v4) == (3, 21, 20)
