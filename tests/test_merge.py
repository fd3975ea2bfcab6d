"""common/merge.py: LSE merge + sink equal ONE softmax over both scopes plus exp(sink) in the
denominator (computed here directly, element by element in float64), NaN-safe empty rows
(FlashMLA reports lse +inf, AITER NaN, others -inf), infinite sinks, base-2 LSE conversion."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_attn.common import merge

from kit.compare import compare

T, H, D = 5, 4, 16


def _scope(gen, K):
    """Scores [T, H, K] and values [T, K, D] of one scope, plus its (out, lse) computed the
    textbook way: out = Σ softmax(s)_j v_j, lse = log Σ exp(s_j)."""
    s = torch.randn(T, H, K, generator=gen, dtype=torch.float64) * 3
    v = torch.randn(T, K, D, generator=gen, dtype=torch.float64)
    w = torch.exp(s)
    out = torch.einsum("thk,tkd->thd", w / w.sum(-1, keepdim=True), v)
    return s, v, out, torch.log(w.sum(-1))


def _joint(scopes, sink):
    """One softmax over every key of every scope, exp(sink[h]) added to the denominator."""
    s = torch.cat([sc[0] for sc in scopes], dim=-1)
    v = torch.cat([sc[1] for sc in scopes], dim=1)
    w = torch.exp(s)
    denom = w.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink.double())[None, :, None]
    return torch.einsum("thk,tkd->thd", w / denom, v), torch.log(w.sum(-1))


def _close(out, ref, tol=2e-6):
    err = compare(out, ref)
    assert err["max_abs"] < tol * max(1.0, ref.abs().max().item()), err


@pytest.mark.parametrize("sink_kind", ["finite", "none", "mixed_inf"])
def test_merge_then_sink_equals_the_joint_softmax(gen, sink_kind):
    a, b = _scope(gen, 7), _scope(gen, 3)
    sink = {"finite": torch.randn(H, generator=gen) * 2, "none": None,
            "mixed_inf": torch.tensor([-math.inf, math.inf, 0.5, -1.0])}[sink_kind]
    out, lse = merge.merge_lse(a[2].float(), a[3].float(), b[2].float(), b[3].float())
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    final = merge.apply_sink(out, lse, sink)
    ref, ref_lse = _joint([a, b], sink)
    _close(lse, ref_lse)
    _close(final, ref)
    if sink_kind == "mixed_inf":  # -inf: no effect; +inf: exactly 0
        assert torch.equal(final[:, 1], torch.zeros(T, D))
        _close(final[:, 0], out[:, 0])


def test_merge_is_symmetric_and_accepts_bf16_outputs(gen):
    a, b = _scope(gen, 4), _scope(gen, 9)
    ab = merge.merge_lse(a[2].bfloat16(), a[3].float(), b[2].bfloat16(), b[3].float())
    ba = merge.merge_lse(b[2].bfloat16(), b[3].float(), a[2].bfloat16(), a[3].float())
    _close(ab[0], ba[0])
    assert compare(ab[0], _joint([a, b], None)[0])["rel_l2"] < 1e-2  # bf16 inputs


@pytest.mark.parametrize("empty_lse", [-math.inf, math.inf, math.nan])
def test_an_empty_scope_is_ignored_whatever_it_reports(gen, empty_lse):
    a, b = _scope(gen, 6), _scope(gen, 5)
    lse_b = b[3].float().clone()
    out_b = b[2].float().clone()
    lse_b[1:3] = empty_lse  # tokens 1 and 2: scope b had no keys
    out_b[1:3] = math.nan  # AITER may emit NaN outputs there
    out, lse = merge.merge_lse(a[2].float(), a[3].float(), out_b, lse_b)
    assert not out.isnan().any() and not lse.isnan().any()
    _close(out[1:3], a[2][1:3].float())
    _close(lse[1:3], a[3][1:3])
    ref, ref_lse = _joint([a, b], None)
    _close(out[[0, 3, 4]], ref[[0, 3, 4]])
    _close(lse[[0, 3, 4]], ref_lse[[0, 3, 4]])


@pytest.mark.parametrize("empty_lse", [-math.inf, math.inf, math.nan])
def test_rows_empty_in_both_scopes_give_zero_and_minus_inf(gen, empty_lse):
    a, b = _scope(gen, 3), _scope(gen, 3)
    la, lb = a[3].float().clone(), b[3].float().clone()
    oa, ob = a[2].float().clone(), b[2].float().clone()
    la[0], lb[0] = empty_lse, empty_lse
    oa[0], ob[0] = math.nan, math.nan
    out, lse = merge.merge_lse(oa, la, ob, lb)
    assert torch.equal(out[0], torch.zeros(H, D)) and (lse[0] == -math.inf).all()
    for sink in (None, torch.randn(H, generator=gen), torch.full((H,), math.inf), torch.full((H,), -math.inf)):
        final = merge.apply_sink(out, lse, sink)
        assert torch.equal(final[0], torch.zeros(H, D)) and not final.isnan().any()


@pytest.mark.parametrize("empty_lse", [-math.inf, math.inf, math.nan])
def test_apply_sink_zeroes_empty_rows_of_a_single_scope_kernel(gen, empty_lse):
    a = _scope(gen, 5)
    out, lse = a[2].float().clone(), a[3].float().clone()
    out[2, 1], lse[2, 1] = math.nan, empty_lse
    sink = torch.randn(H, generator=gen)
    final = merge.apply_sink(out, lse, sink)
    assert torch.equal(final[2, 1], torch.zeros(D))
    ref, _ = _joint([a], sink)
    mask = torch.ones(T, H, dtype=torch.bool)
    mask[2, 1] = False
    _close(final[mask], ref[mask])


def test_sink_dominating_finite_scores_gives_near_zero_without_nan(gen):
    a = _scope(gen, 4)
    final = merge.apply_sink(a[2].float(), a[3].float(), torch.full((H,), 1e4))
    assert not final.isnan().any() and final.abs().max() < 1e-30


def test_base2_conversion(gen):
    s = (torch.randn(20, generator=gen, dtype=torch.float64) * 4).tolist()
    lse_e = math.log(sum(math.exp(x) for x in s))
    lse_2 = math.log2(sum(2.0 ** (x * math.log2(math.e)) for x in s))  # a base-2 kernel's statistic
    got = merge.lse_base2_to_natural(torch.tensor([lse_2], dtype=torch.float64))
    assert abs(got.item() - lse_e) < 1e-12
    back = merge.lse_natural_to_base2(torch.tensor([lse_e], dtype=torch.float64))
    assert abs(back.item() - lse_2) < 1e-12
    assert merge.lse_base2_to_natural(torch.tensor([-math.inf])).item() == -math.inf


def test_remove_sink_from_lse(gen):
    a = _scope(gen, 6)
    sink = torch.randn(H, generator=gen, dtype=torch.float64)
    with_sink = torch.log(torch.exp(a[3]) + torch.exp(sink))  # AITER: sink counted in its LSE
    got = merge.remove_sink_from_lse(with_sink.float(), sink.float())
    assert compare(got, a[3])["max_abs"] < 1e-4
    assert torch.equal(merge.remove_sink_from_lse(a[3].float(), None), a[3].float())
    # a row with no keys reports lse == sink: nothing is left
    empty = merge.remove_sink_from_lse(sink.float()[None, :], sink.float())
    assert (empty == -math.inf).all()
    # sink -inf: the LSE is unchanged
    same = merge.remove_sink_from_lse(a[3].float(), torch.full((H,), -math.inf))
    assert torch.equal(same, a[3].float())


# ---- bad input ------------------------------------------------------------------------------

_O, _L = torch.zeros(T, H, D), torch.zeros(T, H)


@pytest.mark.parametrize("call, name", [
    (lambda: merge.merge_lse(_O, _L[:, :2], _O, _L), "out_a/lse_a"),
    (lambda: merge.merge_lse(_O, _L, _O, _L[1:]), "out_b/lse_b"),
    (lambda: merge.merge_lse(_O, _L.int(), _O, _L), "out_a/lse_a"),
    (lambda: merge.merge_lse(_O, _L, _O[:, :, :8], _L), "out_b"),
    (lambda: merge.merge_lse(_O, _L, _O, _L.to("meta")), "out_b/lse_b"),
    (lambda: merge.apply_sink(_O, _L, torch.zeros(H + 1)), "sink"),
    (lambda: merge.apply_sink(_O, _L, torch.zeros(H, dtype=torch.int32)), "sink"),
    (lambda: merge.apply_sink(_O, _L, [0.0] * H), "sink"),
    (lambda: merge.apply_sink(_O, _L, torch.zeros(H, device="meta")), "sink"),
    (lambda: merge.apply_sink(_O.int(), _L, None), "out/lse"),
    (lambda: merge.remove_sink_from_lse(_L, torch.zeros(H + 1)), "sink"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}: got .*allowed"):
        call()
