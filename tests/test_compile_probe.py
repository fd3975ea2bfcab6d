"""The `triton` backend picks only kernels that compile with the installed Triton (issue 23): the
Gluon Hopper kernel falls back to the portable kernel when it does not compile, and a layer whose
portable kernel does not compile is refused with the compile error, so auto moves on and a forced
backend raises at SparseMLA's construction, before any step.

No GPU here: a fake sm_90 platform, and ``build.compile_error`` (the one place that compiles)
replaced by a fake compiler that fails the kernels a test names. The real compiles are
tests/test_compile_matrix.py's and ci/compile-matrix.sh's.
"""

from __future__ import annotations

import pytest

import dsv4_attn as dsv4
from dsv4_attn import api
from dsv4_attn.common import registry as bm
from dsv4_attn.common.layout import KVFormat
from dsv4_attn.common.platform import Platform
from dsv4_attn.common.spec import LayerKind, ModelSpec
from dsv4_attn.portable.kernels import build, ops

SPEC = ModelSpec(num_heads=64)
SM90 = Platform("cuda", "sm90", "fake H100", "2.x")
GLUON_ERROR = "CompilationError: at 228:8: AttributeError(\"module 'gluon' has no attribute 'thread_barrier'\")"
PORTABLE_ERROR = "CompilationError: at 12:4: ValueError('make_block_ptr was removed')"


@pytest.fixture
def failing(monkeypatch):
    """fail(kernel, ...): those kernels ('gluon', 'portable') fail to compile; returns the calls made."""
    calls = []

    def fail(*kernels):
        def fake(arch, kernel, variant, options=()):
            calls.append((arch, kernel, dict(variant)))
            if kernel not in kernels:
                return ""
            error = GLUON_ERROR if kernel == "gluon" else PORTABLE_ERROR
            return f"the {kernel} kernel does not compile for {arch} with Triton 9.9: {error}"

        monkeypatch.setattr(build, "compile_error", fake)
        return calls

    return fail


def _triton():
    return bm.get_backend("triton")


def test_gluon_chosen_where_it_compiles(failing):
    calls = failing()
    why = _triton().choice(SM90, SPEC, KVFormat.MODEL1_FP8, LayerKind.C4A, dsv4.Phase.DECODE, bm.OCP_CACHES)
    assert why.startswith("Gluon Hopper kernel"), why
    # the compiled variant is the layer's: the top-k walk (COMP 2) of the Gluon kernel on sm90
    assert ("sm90", "gluon") in {(a, k) for a, k, _ in calls}
    assert {v["COMP"] for a, k, v in calls if k == "gluon"} == {2}


def test_gluon_compile_failure_falls_back_to_portable_with_the_error(failing):
    failing("gluon")
    backend = _triton()
    why = backend.choice(SM90, SPEC, KVFormat.MODEL1_FP8, LayerKind.C4A, dsv4.Phase.DECODE, bm.OCP_CACHES)
    assert why.startswith("portable kernel, 64 heads x 64 keys"), why
    assert "the gluon kernel does not compile for sm90 with Triton 9.9" in why and "thread_barrier" in why
    # the portable kernel compiles: the layer is served, nothing refused
    assert bm.reasons_for("triton", SM90, SPEC, KVFormat.MODEL1_FP8, LayerKind.C4A, dsv4.Phase.DECODE) == []
    assert bm.select(SM90, SPEC, KVFormat.MODEL1_FP8, LayerKind.C4A, dsv4.Phase.PREFILL) == "triton"


def test_launcher_follows_the_same_fallback(failing, monkeypatch):
    """ops.use_gluon (what the launch asks) says no when the Gluon kernel does not compile, and a
    KernelConfig(impl='gluon') that insists raises with the compile error."""
    failing("gluon")
    monkeypatch.setattr(ops, "device_arch", lambda device: "sm90")
    records = (KVFormat.MODEL1_FP8.swa_record, KVFormat.MODEL1_FP8.comp_record)
    assert not ops.use_gluon("cuda", records, bm.OCP_CACHES, ops.DEFAULT_CONFIG, comp_mode=2)
    with pytest.raises(ValueError, match="config.impl: got 'gluon'.*thread_barrier"):
        ops.use_gluon("cuda", records, bm.OCP_CACHES, ops.KernelConfig(impl="gluon"), comp_mode=2)
    failing()
    assert ops.use_gluon("cuda", records, bm.OCP_CACHES, ops.DEFAULT_CONFIG, comp_mode=2)


def test_portable_compile_failure_refuses_the_layer_and_auto_moves_on(failing):
    failing("gluon", "portable")
    reasons = bm.reasons_for("triton", SM90, SPEC, KVFormat.BF16, LayerKind.C4A, dsv4.Phase.PREFILL)
    # bf16 caches never take the Gluon kernel: the one reason is the portable kernel's error
    assert reasons == ["the portable kernel does not compile for sm90 with Triton 9.9: " + PORTABLE_ERROR]
    v4 = bm.reasons_for("triton", SM90, SPEC, KVFormat.MODEL1_FP8, LayerKind.C4A, dsv4.Phase.PREFILL)
    assert len(v4) == 2 and "gluon kernel does not compile" in v4[0] and "portable kernel does not" in v4[1]
    # auto (prefill on sm90: triton first) moves to the next backend; here none can run, and the
    # refusal lists triton's compile error among every backend's reasons
    with pytest.raises(dsv4.BackendUnavailableError) as info:
        bm.select(SM90, SPEC, KVFormat.BF16, LayerKind.C4A, dsv4.Phase.PREFILL)
    assert "`triton` is not supported because:" in str(info.value) and "make_block_ptr was removed" in str(info.value)


def test_forced_backend_raises_at_construction_with_the_compile_error(failing, monkeypatch):
    failing("gluon", "portable")
    monkeypatch.setattr(api.SparseMLA, "platform", property(lambda self: SM90))
    with pytest.raises(dsv4.BackendUnavailableError) as info:
        dsv4.SparseMLA(SPEC, "bfloat16", backend="triton", device="cpu", max_tokens=4, max_reqs=2)
    message = str(info.value)
    assert "backend 'triton'" in message and "make_block_ptr was removed" in message


def test_explain_names_the_compile_error(failing, monkeypatch):
    failing("gluon")
    monkeypatch.setattr(api.SparseMLA, "platform", property(lambda self: SM90))
    text = dsv4.SparseMLA(SPEC, "fp8_ds_mla", backend="triton", device="cpu", max_tokens=4, max_reqs=2).explain()
    triton_lines = [line for line in text.splitlines() if line.startswith("triton ")]
    assert triton_lines and all("chosen" in line for line in triton_lines), text
    assert all("portable kernel" in line and "thread_barrier" in line for line in triton_lines), text


def test_no_compile_under_the_interpreter():
    """On CPU the kernels run under Triton's interpreter: there is nothing to compile (no error)."""
    assert build.compile_error("cpu", "portable", ()) == ""
