"""Backend selection: priority lists per platform, forced backends refused loudly with every
reason, the override context manager and environment variable, lazy vendor imports."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

import dsv4_attn as dsv4
from dsv4_attn.common import registry as bm
from dsv4_attn.common.backend import Capabilities, PlatformSupport
from dsv4_attn.common.layout import KVFormat
from dsv4_attn.common.platform import Platform
from dsv4_attn.common.spec import LayerKind, ModelSpec

SPEC = ModelSpec(num_heads=64)


class _Fake(dsv4.Backend):
    """A backend whose verdict is fixed by the test (it declares every platform, format and kind)."""

    def __init__(self, name, reasons=(), phases=(dsv4.Phase.DECODE, dsv4.Phase.PREFILL)):
        self.name, self._reasons = name, list(reasons)
        self.capabilities = Capabilities(platforms=(PlatformSupport("*"),), formats=tuple(KVFormat),
                                            phases=phases)

    def extra_reasons(self, platform, spec, fmt, kind, phase, dialects):
        return list(self._reasons)


@pytest.fixture
def fakes():
    """Register fake backends into a fake 'cuda' priority list; restore the registry afterwards."""
    saved_registry, saved_priority = dict(bm._REGISTRY), {k: list(v) for k, v in bm.PRIORITY.items()}
    saved_instances = dict(bm._instances)

    def add(name, reasons=(), index=None, **kw):
        bm.register_backend(name, _Fake(name, reasons, **kw),
                            priority=None if index is None else {"cuda": index})

    for key in [k for k in bm.PRIORITY if k == "cuda" or k.startswith("cuda/")]:
        bm.PRIORITY[key] = []
    yield add
    bm._REGISTRY.clear(), bm._REGISTRY.update(saved_registry)
    bm.PRIORITY.clear(), bm.PRIORITY.update(saved_priority)
    bm._instances.clear(), bm._instances.update(saved_instances)
    bm._import_errors.clear()


def _cuda(arch="sm90"):
    return Platform("cuda", arch, "fake GPU", "2.x")


def test_auto_walks_priority_list(fakes):
    fakes("vendor-a", ["needs SM100"], index=0)
    fakes("vendor-b", [], index=1)
    fakes("portable", [], index=2)
    assert bm.select(_cuda(), SPEC, KVFormat.MODEL1_FP8, LayerKind.C4A, dsv4.Phase.DECODE) == "vendor-b"


def test_priority_refined_per_arch_and_phase(fakes):
    """A "vendor/arch/phase" list overrides the vendor's list for that arch and phase only, and
    register_backend(priority=...) inserts into the refinements too."""
    bm.PRIORITY["cuda/sm90/prefill"] = []
    fakes("kernel-lib", [], index=0)
    fakes("portable", [], index=1)
    assert bm.PRIORITY["cuda/sm90/prefill"] == ["kernel-lib", "portable"]
    bm.PRIORITY["cuda/sm90/prefill"].reverse()
    pick = {(arch, phase): bm.select(_cuda(arch), SPEC, KVFormat.MODEL1_FP8, LayerKind.C4A, phase)
            for arch in ("sm90", "sm100") for phase in dsv4.Phase}
    assert pick == {("sm90", dsv4.Phase.DECODE): "kernel-lib", ("sm90", dsv4.Phase.PREFILL): "portable",
                    ("sm100", dsv4.Phase.DECODE): "kernel-lib", ("sm100", dsv4.Phase.PREFILL): "kernel-lib"}


def test_no_backend_lists_every_reason(fakes):
    fakes("vendor-a", ["needs SM100", "no fp8_ds_mla"], index=0)
    fakes("vendor-b", ["library missing"], index=1)
    with pytest.raises(dsv4.BackendUnavailableError) as info:
        bm.select(_cuda(), SPEC, KVFormat.MODEL1_FP8, LayerKind.SWA, dsv4.Phase.PREFILL)
    msg = str(info.value)
    for text in ("`vendor-a` is not supported", "needs SM100", "no fp8_ds_mla", "`vendor-b`", "library missing",
                 "Not in the auto priority list"):
        assert text in msg


def test_forced_backend_refuses_loudly(fakes):
    fakes("vendor-a", ["needs SM100"], index=0)
    fakes("portable", [], index=1)
    with pytest.raises(dsv4.BackendUnavailableError, match=r"(?s)'vendor-a' \(forced by argument\).*needs SM100"):
        bm.select(_cuda(), SPEC, KVFormat.BF16, LayerKind.C128A, dsv4.Phase.DECODE, "vendor-a", "argument")


def test_forced_decode_only_backend_leaves_prefill_to_auto(fakes):
    fakes("decoder", [], index=0, phases=(dsv4.Phase.DECODE,))
    fakes("portable", [], index=1)
    args = (_cuda(), SPEC, KVFormat.BF16, LayerKind.C4A)
    assert bm.select(*args, dsv4.Phase.DECODE, "decoder", "argument") == "decoder"
    assert bm.select(*args, dsv4.Phase.PREFILL, "decoder", "argument") == "portable"


def test_context_manager_and_env_var_force_on_cpu(monkeypatch):
    monkeypatch.delenv(bm.ENV_BACKEND, raising=False)
    mla = dsv4.SparseMLA(ModelSpec(num_heads=8), "bf16")
    assert mla.backend_for("swa", "decode") == "torch"
    with dsv4.backend("flashmla"):
        with pytest.raises(dsv4.BackendUnavailableError, match=r"(?s)'flashmla' \(forced by dsv4_attn.backend\(\)"):
            mla.backend_for("swa", "decode")
    monkeypatch.setenv(bm.ENV_BACKEND, "flashinfer-trtllm")
    with pytest.raises(dsv4.BackendUnavailableError, match="DSV4_ATTN_BACKEND environment variable"):
        dsv4.SparseMLA(ModelSpec(num_heads=8), "bf16")
    monkeypatch.setenv(bm.ENV_BACKEND, "nonsense")  # the error names the variable it came from
    with pytest.raises(ValueError, match="DSV4_ATTN_BACKEND: got 'nonsense'; allowed: 'auto' or one of"):
        dsv4.SparseMLA(ModelSpec(num_heads=8), "bf16")
    with pytest.raises(ValueError, match="backend: got 'nonsense'"):
        with dsv4.backend("nonsense"):
            pass


def test_explain_names_the_choice_and_the_refusals():
    text = dsv4.SparseMLA(ModelSpec(num_heads=8), "bf16").explain()
    assert "requested backend: auto" in text
    lines = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert "chosen" in lines["torch"]
    assert "refused" in lines["flashmla"]


def test_unimportable_backend_is_a_reason_not_a_crash(fakes):
    bm.register_backend("broken", "dsv4_attn.no_such_module:Nope", priority={"cuda": 0})
    fakes("portable", [], index=1)
    assert bm.select(_cuda(), SPEC, KVFormat.BF16, LayerKind.SWA, dsv4.Phase.DECODE) == "portable"
    reasons = bm.reasons_for("broken", _cuda(), SPEC, KVFormat.BF16, LayerKind.SWA, dsv4.Phase.DECODE)
    assert reasons and "cannot import dsv4_attn.no_such_module:Nope" in reasons[0]


def test_importing_the_package_imports_no_vendor_library():
    code = ("import sys, dsv4_attn as d; d.SparseMLA(d.ModelSpec(num_heads=8), 'bf16').explain(); "
            "bad = [m for m in ('aiter', 'flashinfer', 'flash_mla', 'vllm', 'sgl_kernel') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_fnuz_caches_only_go_to_backends_that_declare_fnuz(fakes):
    from dsv4_attn.common.layout import Fp8Dialect

    fakes("ocp-only", [], index=0)
    fakes("portable", [], index=1)
    portable = bm.get_backend("portable")
    portable.capabilities = dataclasses.replace(portable.capabilities, dialects=(Fp8Dialect.OCP, Fp8Dialect.FNUZ))
    gfx942_caches = (Fp8Dialect.FNUZ, Fp8Dialect.OCP)  # vLLM on gfx942: SWA FNUZ, compressed OCP
    args = (_cuda(), SPEC, KVFormat.MODEL1_FP8, LayerKind.C4A, dsv4.Phase.DECODE)
    assert bm.select(*args, dialects=gfx942_caches) == "portable"
    assert bm.reasons_for("ocp-only", *args, gfx942_caches) == ["reads ocp fp8 only; the SWA cache is fnuz"]
    assert bm.reasons_for("ocp-only", _cuda(), SPEC, KVFormat.BF16, LayerKind.C4A, dsv4.Phase.DECODE,
                          gfx942_caches) == []  # bf16 caches have no fp8 dialect
