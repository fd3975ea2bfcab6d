"""The Gluon Hopper kernel for V4.1 records (``kernels/hopper_records.py``: MXFP8, and MXFP8 SWA +
NVFP4 compressed): which layers take it (``ops.kernel_choice``, ``ops.v41_codes``,
``build.hopper_kernel``), and on an sm_90 GPU that it matches the float64 reference: fresh random
caches, NaN-poisoned outputs, 8 / 16 / 64 / 128 heads, empty rows, rows of one key, lengths that are
not a multiple of the 64-key tile, -1 entries, a +inf and a -inf sink, the LSE, with and without a
key split, a padded block stride and 48-token compressed blocks (not a power of two), and the
production top-k layers (C1A / C2A) through SparseMLA eagerly and across CUDA-graph replays."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dsv4_attn.common.layout import Fp8Dialect, KVFormat, Record
from dsv4_attn.portable.kernels import attention as K
from dsv4_attn.portable.kernels import build, ops

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
OCP, FNUZ = Fp8Dialect.OCP, Fp8Dialect.FNUZ
MX, FP4, V4 = Record.MXFP8, Record.NVFP4, Record.V4_FP8


@pytest.mark.parametrize("records,dialects,impl,says", [
    ((MX,), (OCP,), "gluon", "V4.1 records (mxfp8) in OCP e4m3: hopper_records"),
    ((MX, MX), (OCP, OCP), "gluon", "hopper_records"),
    ((MX, FP4), (OCP, OCP), "gluon", "V4.1 records (mxfp8/nvfp4) in OCP e4m3: hopper_records"),
    ((MX, FP4), (FNUZ, OCP), "portable", "OCP e4m3 only, not FNUZ"),  # gfx942's MXFP8 bytes
    ((V4, V4), (OCP, OCP), "gluon", "V4 records in OCP e4m3"),
    ((Record.BF16,), (OCP,), "portable", "or the V4.1 records (mxfp8, nvfp4), not bf16"),
])
def test_which_records_take_a_gluon_kernel_on_sm90(records, dialects, impl, says):
    got, why = ops.kernel_choice("sm90", records, dialects)
    assert (got, says in why) == (impl, True), why


def test_v41_records_stay_portable_off_sm90_and_when_asked():
    assert ops.kernel_choice("sm100", (MX, FP4), (OCP, OCP))[0] == "portable"
    assert ops.kernel_choice("gfx950", (MX, FP4), (OCP, OCP))[0] == "portable"
    assert ops.kernel_choice("sm90", (MX, FP4), (OCP, OCP), ops.KernelConfig(impl="triton")) == \
        ("portable", "KernelConfig(impl='triton')")


@pytest.mark.parametrize("records,codes", [
    ((MX,), (K.FMT_MXFP8, K.FMT_MXFP8)), ((MX, MX), (K.FMT_MXFP8, K.FMT_MXFP8)),
    ((MX, FP4), (K.FMT_MXFP8, K.FMT_NVFP4)), ((V4, V4), None), ((Record.BF16,), None), ((), None),
])
def test_v41_codes(records, codes):
    assert ops.v41_codes(records) == codes


def test_record_constexprs_name_the_records_kernel():
    from dsv4_attn.portable.kernels import hopper, hopper_records

    const = build.hopper_constexprs(K.COMP_C4A_LOCAL, write_lse=True, records=(K.FMT_MXFP8, K.FMT_NVFP4))
    assert (const["FMT_A"], const["FMT_B"]) == (K.FMT_MXFP8, K.FMT_NVFP4)
    fn, options = build.hopper_kernel(const)
    assert fn is hopper_records.sparse_mla_fwd_hopper_records
    assert options == dict(num_warps=hopper.NUM_WARPS, maxnreg=hopper.MAXNREG)
    assert build.hopper_kernel(build.hopper_constexprs(K.COMP_C4A_LOCAL))[0] is hopper.sparse_mla_fwd_hopper
    assert build.ctas_per_sm(0) == 1  # the records kernel: one program per SM, as the 64-head kernel


def test_where_the_records_kernel_does_not_compile_the_portable_kernel_runs(monkeypatch):
    """Selection asks the compiler with the records' constexprs; a compile error sends the layer to
    the portable kernel with the error as the reason."""
    asked = []

    def fake_error(arch, kernel, variant, options=()):
        asked.append(dict(variant))
        return "the Gluon Hopper kernel does not compile for sm90 with Triton X: E" if kernel == "gluon" else ""

    monkeypatch.setattr(build, "compile_error", fake_error)
    monkeypatch.setattr(ops, "_gluon_importable", lambda: True)
    impl, why = ops.resolved_kernel("sm90", (MX, FP4), (OCP, OCP), K.COMP_C4A_LOCAL, 64)
    assert impl == "portable" and why.endswith("with Triton X: E"), why
    assert (asked[0]["FMT_A"], asked[0]["FMT_B"]) == (K.FMT_MXFP8, K.FMT_NVFP4)


def test_compile_matrix_compiles_the_records_kernel_for_each_pair_selection_gives_it():
    """ci/compile-matrix.sh's hopper jobs hold the records kernel for every (layer kind, record
    pair) that ``ops.kernel_choice`` sends to it on sm_90, derived from selection (no hand list)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    script = root / "tests" / "gpu_scripts" / "compile_matrix.py"
    res = subprocess.run([sys.executable, str(script), "--targets", "sm90", "--kernels", "hopper", "--list"],
                         capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    labels = {r["label"] for r in json.loads(res.stdout)}
    assert {"records mxfp8/mxfp8 top-k lse", "records mxfp8/mxfp8 top-k split merge lse",
            "records mxfp8/nvfp4 top-k lse", "records mxfp8/nvfp4 top-k split merge lse"} <= labels, labels


# ---- GPU: against the float64 reference ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="the Gluon kernels need an sm_90 GPU")
@pytest.mark.parametrize("fmt", ["mxfp8_ds_mla", "nvfp4_ds_mla"])
@pytest.mark.parametrize("heads,split", [(8, 0), (16, 1), (64, 0), (64, 1), (128, 0)])
def test_gpu_records_kernel_matches_the_reference(fmt, heads, split, gen):
    """Raw kernel entry, global rows in both scopes. Tokens: full rows of 200 SWA + 300
    compressed keys (4 + 5 tiles, the last ones partial, -1 entries among them), one SWA key and
    no compressed key, no valid key at all (output 0, LSE -inf), 130 / 65 / 64 keys, one
    compressed key alone. split 0: the launcher's (a key split here: few tokens), 1: none."""
    from dsv4_attn.common import layout, reference
    from dsv4_attn.portable.kernels.ops import KernelConfig, sparse_mla_fwd
    from dsv4_attn.testing.steps import filled_cache

    from kit.compare import assert_close, compare

    dev = "cuda"
    T, W, KW = 7, 200, 300
    rec = KVFormat.parse(fmt)
    stride = layout.default_block_stride(rec.swa_record, 64) + 1024  # other layers' pages between blocks
    swa = filled_cache(rec.swa_record, 8, 64, gen, block_stride=stride, device=dev)
    comp = filled_cache(rec.comp_record, 12, 48, gen, device=dev)
    rows = torch.randint(0, 8 * 64, (T, W), generator=gen).int()
    rows[:, 7] = -1
    rows[2] = -1
    lens = torch.tensor([200, 1, 200, 130, 65, 64, 0], dtype=torch.int32)
    crows = torch.randint(0, 12 * 48, (T, KW), generator=gen).int()
    crows[0, ::5] = -1
    clens = torch.tensor([300, 0, 0, 129, 63, 64, 1], dtype=torch.int32)
    q = torch.randn(T, heads, 512, generator=gen).bfloat16()
    sink = torch.randn(heads, generator=gen)
    sink[0], sink[1] = -math.inf, math.inf  # no sink weight / all weight on the sink (output 0)
    rows, lens, crows, clens, q, sink = (x.to(dev) for x in (rows, lens, crows, clens, q, sink))
    ref, ref_lse = reference.sparse_mla(q, swa, rows, lens, comp, crows, clens, sink, 512**-0.5, fmt)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((T, heads), float("nan"), device=dev)
    sparse_mla_fwd(q, out, fmt, swa, rows, lens, comp, crows, clens, sink=sink, lse=lse,
                   config=KernelConfig(impl="gluon", split=split))
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    for t in range(T):
        if t != 2:
            assert_close(compare(out[t], ref[t]), max_abs=False, what=(fmt, heads, split, t))
    assert out[2].abs().max() == 0 and torch.isinf(lse[2]).all() and (lse[2] < 0).all()
    assert out[:, 1].abs().max() == 0  # the +inf sink
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max() < 1e-3
    assert torch.equal(torch.isfinite(lse).cpu(), fin.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="the Gluon kernels need an sm_90 GPU")
@pytest.mark.parametrize("cfg,fmt,heads,batch,mtp", [
    ("h64-c1a512", "mxfp8_ds_mla", 64, 3, 1),      # split
    ("h128-c2a1024", "nvfp4_ds_mla", 128, 40, 1),  # 80 programs
    ("h64-c2a512", "nvfp4_ds_mla", 16, 5, 2),      # MTP, 16 of a program's 64 heads
    ("h64-c1a512", "nvfp4_ds_mla", 8, 2, 1),       # 8 heads: the split merged in the kernel
])
def test_gpu_top_k_layers_match_the_reference_across_graph_replays(cfg, fmt, heads, batch, mtp):
    """Production top-k layers (local entries translated through the block table in the kernel)
    through SparseMLA with the triton backend's automatic choice, which takes the records kernel
    here; eager and across three CUDA-graph replays, NaN poison before each."""
    from dsv4_attn import SparseMLA, bench
    from dsv4_attn.common.registry import register_backend
    from dsv4_attn.portable.triton_backend import TritonBackend

    from kit.compare import assert_close, metrics
    from kit.layers import eager_then_replays

    register_backend("triton-records-test", TritonBackend(ops.KernelConfig()))
    config = dataclasses.replace(bench.DECODE_CONFIGS[cfg], heads=heads)
    case = bench.make_decode_case(config, batch, mtp, torch.device("cuda"), KVFormat.parse(fmt),
                                  seed=batch * 5 + heads)
    case.sink[0], case.sink[1] = math.inf, -math.inf
    mla = SparseMLA(case.spec, case.fmt, backend="triton-records-test", max_tokens=case.q.shape[0])
    assert "hopper_records" in mla.explain(), mla.explain()
    plan = mla.plan(case.batch)
    out = torch.empty_like(case.q)

    def run():
        mla.forward(plan, case.kind, case.q, case.swa_cache, case.comp_cache, topk=case.topk, sink=case.sink, out=out)

    want = case.reference(plan)

    def check(what):
        torch.cuda.synchronize()
        err = metrics(out, want)
        assert_close(err, max_abs=False, what=f"{what} {cfg} {fmt} H={heads} b={batch}")
        assert float(out[:, 0].abs().max()) == 0.0

    eager_then_replays(run, out, check)
