"""CLI smoke tests through subprocesses: `python -m dsv4_attn probe | parity`, as a user runs them
(the console script `dsv4-attn` too when the package is installed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_parity import TINY

REPO = Path(__file__).resolve().parent.parent


def _run(*args: str, cwd: Path | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("DSV4_ATTN_BACKEND", None)
    return subprocess.run([sys.executable, "-m", "dsv4_attn", *args], cwd=cwd or REPO, env=env, text=True,
                          capture_output=True, timeout=timeout)


def test_probe_prints_the_platform_and_the_choice():
    res = _run("probe")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.startswith("dsv4-attn ") and "platform   " in out and "libraries" in out
    assert "vendor binaries" in out and "explain()" in out and "index front end:" in out
    assert "vllm plugin" in out and "sglang plugin" in out and "DSV4_ATTN_SGLANG" in out
    for line in ("SWA/decode", "C4A/prefill", "C128A/decode"):
        assert line in out


def test_probe_json():
    res = _run("probe", "--json", "--heads", "128", "--format", "bfloat16")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["platform"]["torch_version"] and set(info["vendor_binaries"]) == {"flashmla", "flashinfer", "aiter"}
    assert info["selection"]["heads"] == 128 and len(info["selection"]["choices"]) == 6
    assert info["vllm_plugin"]["vllm plugin"].startswith(("off", "available", "on", "refused"))
    assert info["sglang_plugin"]["sglang plugin"].startswith(("off", "available", "on", "refused"))
    if info["platform"]["vendor"] == "cpu":
        assert all(c["backend"] == "torch" for c in info["selection"]["choices"].values())


def test_probe_bad_argument_is_exit_2():
    res = _run("probe", "--format", "fp4")
    assert res.returncode == 2 and "fmt" in res.stderr


def test_parity_run_then_merge(tmp_path):
    matrix = tmp_path / "tiny.yaml"
    matrix.write_text(TINY)
    res = _run("parity", "--matrix", str(matrix), "--backends", "torch", "--cases", "tiny.c4a.*,tiny.swa.*.edge",
               "--out", str(tmp_path / "a"), "--device", "cpu")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| tiny.c4a.h16.fp8_ds_mla.mixed.short | pass" in res.stdout
    assert "| torch | 6 | 0 | 0 | 0 |" in res.stdout
    assert "6/6" in res.stderr  # the progress bar
    report = tmp_path / "a" / "parity-cpu-cpu.json"
    assert json.loads(report.read_text())["summary"]["torch"]["pass"] == 6
    res = _run("parity", "--merge", str(report), str(report), "--out", str(tmp_path / "m"))
    assert res.returncode == 0, res.stderr
    assert "| torch@cpu#1 | torch@cpu#2 | 6 | 6 | 0.0e+00 |" in res.stdout
    assert (tmp_path / "m" / "merged.json").is_file()


def test_parity_bad_arguments_are_exit_2(tmp_path):
    res = _run("parity", "--cases", "no-such-case", "--out", str(tmp_path))
    assert res.returncode == 2 and "matches none" in res.stderr


@pytest.mark.skipif(shutil.which("dsv4-attn") is None, reason="dsv4-attn console script not installed "
                    "(pip install -e . installs it)")
def test_console_script_lists_the_packaged_matrix(tmp_path):
    res = subprocess.run(["dsv4-attn", "parity", "--list"], cwd=tmp_path, text=True, capture_output=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    names = res.stdout.split()
    assert "core.c128a.h128.fp8_ds_mla.mtp.long" in names and len(names) > 400


def test_bench_without_gpu_is_exit_2_and_rocm_times_aiter_first(monkeypatch):
    from dsv4_attn import bench
    from dsv4_attn.common import platform

    if not torch.cuda.is_available():
        res = _run("bench", "--mode", "decode")
        assert res.returncode == 2 and "needs a CUDA/ROCm GPU" in res.stderr
    rocm = platform.Platform("rocm", "gfx950", "AMD Instinct MI355X", torch.__version__)
    monkeypatch.setattr(platform, "probe", lambda refresh=False: rocm)
    assert bench.default_backends() == ["aiter", "triton"]
    monkeypatch.setattr(platform, "probe", lambda refresh=False: platform.Platform("cuda", "sm90", "H100", "2.13"))
    assert bench.default_backends() == ["triton"]
