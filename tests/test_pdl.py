"""Programmatic dependent launch (PDL) of the Gluon Hopper kernels and the combine launch after
them (``KernelConfig.pdl``, ``ops.pdl_launches``): which launches carry Triton's ``launch_pdl``
option and the kernels' ``PDL`` constexpr (their griddepcontrol), that nothing else does (the
portable kernel, Triton's CPU interpreter, other GPUs, V4.1 records), that the bound launch keeps
them, that bad settings are refused, that every global load and store of the compiled kernels comes
after their wait for the previous kernel; and on an sm_90 GPU that layers launched so match the
float64 reference eagerly and across CUDA-graph replays, one layer alone and three in a row (a
programmatic launch starts before the previous kernel completes: the call after writes the split
partials the call before is still merging)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from dsv4_attn.common.spec import LayerKind
from dsv4_attn.portable.kernels import ops

from kit.layers import check_config_against_reference

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton missing")


@pytest.mark.parametrize("setting,gluon,v41,combine,expected", [
    (2, True, False, True, (True, True)),
    (2, True, False, False, (True, False)),   # the in-kernel merge or no split: no combine launch
    (1, True, False, True, (True, False)),
    (1, True, False, False, (True, False)),
    (0, True, False, True, (False, False)),
    (2, False, False, True, (False, False)),  # the portable kernel (interpreter, CPU, other GPUs, FNUZ)
    (2, True, True, True, (False, False)),    # the V4.1 records' kernel has no griddepcontrol
    (-1, False, False, True, (False, False)),
])
def test_which_launches_are_programmatic(setting, gluon, v41, combine, expected):
    assert ops.pdl_launches(ops.KernelConfig(pdl=setting), gluon, v41, combine) == expected


@pytest.mark.parametrize("heads_n,heads,combine,expected", [
    (0, 64, True, (True, True)),     # the 64-head kernel, one head block: the combine's launch too
    (0, 16, True, (True, True)),
    (0, 128, True, (True, False)),   # two head blocks: measured slower with the combine's
    (16, 16, True, (True, False)),   # heads-on-N (two programs per SM): measured slower with it
    (8, 8, False, (True, False)),    # merged in the kernel
])
def test_auto_takes_what_was_measured_faster(heads_n, heads, combine, expected):
    assert ops.pdl_launches(ops.KernelConfig(), True, False, combine, heads_n, heads) == expected
    assert ops.pdl_launches(ops.KernelConfig(), False, False, combine, heads_n, heads) == (False, False)


def test_pdl_setting_is_checked():
    with pytest.raises(ValueError, match=r"pdl: got 3; allowed: -1 \(auto\), 0 \(off\)"):
        ops.KernelConfig(pdl=3)


@pytest.fixture
def case(gen):
    from dsv4_attn.testing.steps import make_step

    return make_step(gen, [1, 3], [40, 90], kinds=(LayerKind.SWA, LayerKind.C4A), topk=16, max_model_len=1024)


def _launches(case, config: ops.KernelConfig):
    """The launches of the case's C4A layer under ``config`` (nothing launched)."""
    import dsv4_attn as dsv4

    kind = LayerKind.C4A
    plan = dsv4.SparseMLA(case.spec, "fp8_ds_mla", backend="torch").plan(case.batch)
    return ops.layer_launches(
        case.q, torch.empty_like(case.q), "fp8_ds_mla", case.caches["swa"], plan.swa_rows, plan.swa_lens,
        comp_cache=case.caches[kind], comp_rows=case.topks[kind],
        c4a=(case.batch.comp_block_table(kind), plan.token_to_req, plan.positions), topk_ratio=kind.ratio,
        sink=case.sink, config=config)


def _programmatic(layer) -> list[bool]:
    return [one.options.get("launch_pdl", False) for one in layer.launches]


@needs_triton
@pytest.mark.parametrize("setting,merge,expected", [
    (2, 0, [True, True]),
    (1, 0, [True, False]),
    (0, 0, [False, False]),
    (-1, 0, [True, True]),  # 16 heads in the 64-head kernel (a split of 2 short rows): one head block
    (2, 1, [True]),   # merged in the kernel: no combine launch
    (1, 1, [True]),
])
def test_the_option_reaches_the_gluon_launches(case, monkeypatch, setting, merge, expected):
    """The Gluon launch as on an sm_90 GPU (nothing launched): ``launch_pdl`` where ``pdl_launches``
    says, both kernels' PDL constexpr (griddepcontrol) wherever a launch of the layer is
    programmatic, and the bound launch's parameters still complete."""
    from dsv4_attn.portable.kernels import launch

    if not ops._gluon_importable():
        pytest.skip("this Triton's Gluon does not import the Hopper kernel")
    monkeypatch.setattr(ops, "use_gluon", lambda *args, **kwargs: True)
    layer = _launches(case, ops.KernelConfig(split=2, pdl=setting, merge_in_kernel=merge))
    assert "hopper" in layer.launches[0].fn.__module__
    assert _programmatic(layer) == expected
    assert [one.constexprs["PDL"] for one in layer.launches] == [any(expected)] * len(expected)
    assert all(launch.ordered_parameters(one) is not None for one in layer.launches)


@needs_triton
def test_the_pingpong_kernel_is_never_launched_programmatically(case, monkeypatch):
    """The key-tile ping-pong kernel (hopper_prefill) holds no griddepcontrol.wait: a programmatic
    launch of it could read q or the rows before the kernel writing them completed. Where a launch
    takes it (forced here: its auto needs 4096+ tokens), no ``launch_pdl``, even with PDL forced."""
    if not ops._gluon_importable():
        pytest.skip("this Triton's Gluon does not import the Hopper kernel")
    monkeypatch.setattr(ops, "use_gluon", lambda *args, **kwargs: True)
    monkeypatch.setattr(ops, "device_arch", lambda device: "sm90")
    layer = _launches(case, ops.KernelConfig(split=1, pdl=2, pingpong=1, heads_on_n=0))
    assert [one.fn.__module__.rsplit(".", 1)[-1] for one in layer.launches] == ["hopper_prefill"]
    assert _programmatic(layer) == [False] and "PDL" not in layer.launches[0].constexprs


@needs_triton
@pytest.mark.parametrize("arch", ["cpu", "sm100", "sm80"])
def test_no_programmatic_launch_off_sm90(case, monkeypatch, arch):
    """The portable kernel and its combine (Triton's interpreter, CPU, other GPUs) never carry the
    option nor emit griddepcontrol, even where PDL is forced."""
    monkeypatch.setattr(ops, "device_arch", lambda device: arch)
    layer = _launches(case, ops.KernelConfig(split=2, pdl=2))
    assert "hopper" not in layer.launches[0].fn.__module__
    assert len(layer.launches) == 2 and _programmatic(layer) == [False, False]
    assert layer.launches[1].constexprs["PDL"] is False


def _global_accesses_after_wait(ptx: str) -> list[str]:
    """Per code section of ``ptx`` (split at ``ret;``: the default partition, then the warp-specialized
    workers' loop), a complaint for each section whose first global load, store or atomic (not an L2
    prefetch) comes before its first ``griddepcontrol.wait``."""
    bad = []
    for i, section in enumerate(ptx.split("ret;")):
        access = re.search(r"\b(ld\.global|st\.global|atom\.|red\.|cp\.async\.(ca|cg))", section)
        if access is None:
            continue
        wait = section.find("griddepcontrol.wait")
        if wait < 0 or wait > access.start():
            bad.append(f"section {i}: {access.group(0)} before griddepcontrol.wait")
    return bad


def compiled_complaints() -> list[str]:
    """What is wrong in the sm_90a PTX of the split Gluon kernels (64-head, heads-on-N) and of the
    combine, compiled with PDL (and the 64-head one without): run in a child process (this one runs
    Triton's interpreter)."""
    from dsv4_attn.portable.kernels import build

    bad = []
    for heads_n, pdl in ((0, True), (8, True), (0, False)):
        constexprs = dict(build.hopper_constexprs(2, split=True, heads_n=heads_n), PDL=pdl)
        ptx = build.compile_hopper(constexprs).asm["ptx"]
        what = f"heads_n={heads_n} PDL={pdl}"
        if ("griddepcontrol.launch_dependents" in ptx) is not pdl:
            bad.append(f"{what}: launch_dependents {'missing' if pdl else 'present'}")
        if ptx.count("griddepcontrol.wait") != (2 if pdl else 0):  # the prologue's and the producer's
            bad.append(f"{what}: {ptx.count('griddepcontrol.wait')} waits")
        bad += [f"{what}: {b}" for b in (_global_accesses_after_wait(ptx) if pdl else [])]
    combine = build.compile_combine(build.target("sm90"), split=16, block_h=8, pdl=True)
    if not combine.metadata.launch_pdl:
        bad.append("combine: compiled without launch_pdl")
    return bad + [f"combine: {b}" for b in _global_accesses_after_wait(combine.asm["ptx"])]


@needs_triton
@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="this Triton has no NVIDIA backend")
def test_compiled_kernels_wait_before_any_global_access():
    """With PDL the kernels let the next launch start (launch_dependents) and wait for the previous
    kernel (both partitions of the Gluon kernel), and no global load, store or atomic precedes that
    wait in any partition (an early read would race with the previous kernel's writes); without PDL
    no griddepcontrol at all (PDL off is the kernel as before)."""
    if not ops._gluon_importable():
        pytest.skip("this Triton's Gluon does not import the Hopper kernel")
    root = pathlib.Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    code = "import json, test_pdl; print(json.dumps(test_pdl.compiled_complaints()))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []


# ---- on an sm_90 GPU --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="the Gluon kernels need an sm_90 GPU")
@pytest.mark.parametrize("cfg,heads,batch,mtp,extra", [
    ("h64-c4a512", 64, 2, 1, {}),                       # 64-head kernel, split, the combine launch
    ("h128-c4a1024", 128, 1, 1, {}),                    # two head blocks
    ("h64-swa", 64, 64, 1, {}),                         # split 2
    ("h16-c128a", 16, 3, 1, dict(heads_on_n=1)),        # heads-on-N, the combine launch
    ("h8-c4a512", 8, 2, 1, {}),                         # merged in the kernel: the Gluon launch alone
    ("h8-c128a", 8, 4, 2, dict(pair_tokens=1)),         # token pairs
    ("h64-c4a512", 64, 300, 1, {}),                     # no split: two waves of the 64-head kernel
])
def test_gpu_pdl_matches_the_reference_across_graph_replays(cfg, heads, batch, mtp, extra):
    config = ops.KernelConfig(impl="gluon", pdl=2, **extra)
    check_config_against_reference(config, f"triton-pdl-test-{sorted(extra.items())}", cfg, heads, batch, mtp)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="the Gluon kernels need an sm_90 GPU")
@pytest.mark.parametrize("cfg,setting", [("h64-c4a512", 2), ("h64-c4a512", 1), ("h8-c4a512", 2)])
def test_gpu_layers_in_a_row_under_pdl(cfg, setting):
    """Three calls of one layer back to back (different q, one plan), eagerly and across three
    NaN-poisoned graph replays: each call's Gluon kernel may launch before the previous call's
    combine (or merge) completes, and its split partials reuse the freed workspace of the call
    before; each output against its own float64 reference."""
    from dsv4_attn import SparseMLA, bench
    from dsv4_attn.common.registry import register_backend
    from dsv4_attn.portable.triton_backend import TritonBackend

    from kit.compare import assert_close, metrics
    from kit.layers import eager_then_replays

    name = f"triton-pdl-row-test-{setting}"
    register_backend(name, TritonBackend(ops.KernelConfig(impl="gluon", pdl=setting)))
    case = bench.make_decode_case(bench.DECODE_CONFIGS[cfg], 2, 1, torch.device("cuda"), seed=29)
    mla = SparseMLA(case.spec, case.fmt, backend=name, max_tokens=case.q.shape[0])
    plan = mla.plan(case.batch)
    qs = [case.q, case.q.flip(1).contiguous(), (case.q * 0.5).flip(0).contiguous()]
    wants = [dataclasses.replace(case, q=q).reference(plan) for q in qs]
    outs = torch.empty((len(qs), *case.q.shape), dtype=case.q.dtype, device=case.q.device)

    def run():
        for q, out in zip(qs, outs):
            mla.forward(plan, case.kind, q, case.swa_cache, case.comp_cache, topk=case.topk, sink=case.sink, out=out)

    def check(what):
        torch.cuda.synchronize()
        assert not outs.isnan().any(), f"{what}: {int(outs.isnan().sum())} output elements not written"
        for k, (out, want) in enumerate(zip(outs, wants)):
            err = metrics(out, want)
            assert_close(err, max_abs=False, what=f"{what} call {k} {cfg}")
            assert err["max_abs"] <= 1e-2 + 2**-7 * float(want.abs().max()), err

    eager_then_replays(run, outs, check)
