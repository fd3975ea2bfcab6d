"""common/spec.py: constants, LayerKind, ModelSpec (expected values worked out by hand)."""

from __future__ import annotations

import pytest

from dsv4_attn.common import spec as S
from dsv4_attn.common.spec import LayerKind, ModelSpec


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
    (LayerKind.C4A, LayerKind.C4A), (1, LayerKind.SWA), (4, LayerKind.C4A), (128, LayerKind.C128A),
    ("swa", LayerKind.SWA), ("C4A", LayerKind.C4A), ("c128a", LayerKind.C128A),
])
def test_layer_kind_parse(value, kind):
    assert LayerKind.parse(value) is kind


def test_layer_kind_properties():
    assert [k.ratio for k in LayerKind] == [1, 4, 128]
    assert [k.has_comp_scope for k in LayerKind] == [False, True, True]


@pytest.mark.parametrize("bad", [2, 0, "c8a", None, 4.5, True, "4"])
def test_layer_kind_parse_rejects(bad):
    with pytest.raises(ValueError, match=r"kind: got .*allowed"):
        LayerKind.parse(bad)


def test_model_spec_defaults_and_widths():
    spec = ModelSpec(num_heads=64)
    assert spec.scale == 512**-0.5
    # round_up(cdiv(65536, 128), 128) = 512
    assert spec.c128a_width == 512
    assert spec.comp_width(LayerKind.SWA) == 0
    assert spec.comp_width("c4a") == 512
    assert spec.comp_width(128) == 512
    assert ModelSpec(num_heads=1, softmax_scale=0.5).scale == 0.5


@pytest.mark.parametrize("max_model_len, width", [(1, 128), (128, 128), (16384, 128), (16385, 256),
                                                  (40960, 384), (1 << 20, 8192)])
def test_c128a_width_is_a_fixed_multiple_of_128(max_model_len, width):
    assert ModelSpec(num_heads=8, max_model_len=max_model_len).c128a_width == width


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_heads=0), "num_heads"), (dict(num_heads=129), "num_heads"), (dict(num_heads=True), "num_heads"),
    (dict(num_heads=8.0), "num_heads"), (dict(num_heads=8, c4a_topk=0), "c4a_topk"),
    (dict(num_heads=8, max_model_len=-1), "max_model_len"), (dict(num_heads=8, window=0), "window"),
    (dict(num_heads=8, head_dim=576), "head_dim"), (dict(num_heads=8, rope_dim=32), "rope_dim"),
    (dict(num_heads=8, softmax_scale=0.0), "softmax_scale"),
    (dict(num_heads=8, softmax_scale=float("nan")), "softmax_scale"),
    (dict(num_heads=8, softmax_scale=float("inf")), "softmax_scale"),
])
def test_model_spec_rejects_bad_values_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}: got .*allowed"):
        ModelSpec(**kwargs)
