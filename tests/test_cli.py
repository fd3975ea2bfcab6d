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

from kit.parity_tiny import TINY

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
    assert info["platform"]["torch_version"]
    assert set(info["vendor_binaries"]) == {"flashmla", "flashinfer-trtllm", "aiter"}  # the backends with a binary
    assert info["selection"]["heads"] == 128 and len(info["selection"]["choices"]) == 6
    assert info["vllm_plugin"]["vllm plugin"].startswith(("off", "available", "on", "refused"))
    assert info["sglang_plugin"]["sglang plugin"].startswith(("off", "available", "on", "refused"))
    if info["platform"]["vendor"] == "cpu":
        assert all(c["backend"] == "torch" for c in info["selection"]["choices"].values())


def test_probe_locates_a_library_by_its_file_or_its_first_namespace_dir(monkeypatch, tmp_path):
    from dsv4_attn.common.platform import LibraryInfo, _library_info

    (tmp_path / "regular_pkg").mkdir()
    (tmp_path / "regular_pkg" / "__init__.py").write_text("")
    (tmp_path / "namespace_pkg").mkdir()  # no __init__.py: no file, only search directories
    monkeypatch.syspath_prepend(str(tmp_path))
    regular = _library_info("regular", "regular_pkg", "no-such-dist-dsv4")
    assert (regular.found, regular.version) == (True, None)
    assert regular.location == str(tmp_path / "regular_pkg" / "__init__.py")
    assert _library_info("ns", "namespace_pkg", "no-such-dist-dsv4").location == str(tmp_path / "namespace_pkg")
    assert _library_info("absent", "no_such_module_dsv4", "no-such-dist-dsv4") == LibraryInfo("absent", False)


def test_probe_says_each_vendor_status_in_words_with_each_reason_once(monkeypatch):
    from dsv4_attn import probe_cli

    monkeypatch.setenv("DSV4_ATTN_AITER_EMULATOR", "gfx942")  # a found AITER that lacks two paths
    text = probe_cli.render(probe_cli.collect(device="cpu"))
    section = text.split("vendor binaries", 1)[1].split("\nvllm plugin", 1)[0]
    assert "[ok]" not in section and "None" not in section and "False" not in section
    lines = [line.strip() for line in section.splitlines()[1:] if line.strip()]
    assert lines[0].startswith("flashmla          not found: flash_mla: not installed")
    assert lines[1].startswith("flashinfer-trtllm not used: ")
    assert lines[2] == "aiter             found: AITER 0.1.20.post1 on gfx942 (fp8 dialect fnuz, EMULATED)"
    assert "serves: mla_decode_fwd (split) (bf16 compute)" in section  # the a8w8 paths are opt-in (docs/rocm.md)
    assert "lacks (mla_decode_fwd (persistent)): available (heads [64]; fp8 compute, off: opt in with " in section
    assert "lacks (sparse_mla_fwd): " in section and "lacks (mla_decode_fwd_v4_nm): no v4 nm code object" in section
    monkeypatch.delenv("DSV4_ATTN_AITER_EMULATOR")
    text = probe_cli.render(probe_cli.collect(device="cpu"))
    assert text.count("needs a ROCm GPU (gfx942/gfx950)") == 2  # the aiter line and explain()'s decode row
    explain = text.split("explain()\n", 1)[1]
    assert len([line for line in explain.splitlines() if line.startswith("aiter ")]) == 2  # decode, prefill


def test_probe_bad_argument_is_exit_2():
    res = _run("probe", "--format", "fp4")
    assert res.returncode == 2 and "fmt" in res.stderr


def test_parity_run_then_merge(tmp_path):
    matrix = tmp_path / "tiny.yaml"
    matrix.write_text(TINY)
    res = _run("parity", "--matrix", str(matrix), "--backends", "torch", "--cases", "tiny.c4a.*,tiny.swa.*.edge",
               "--out", str(tmp_path / "a"), "--device", "cpu")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| torch | 6 | 0 | 0 | 0 |" in res.stdout and "| tiny.c4a." not in res.stdout  # summary only
    assert "6/6" in res.stderr and "<00:00" in res.stderr  # the progress bar, with its ETA
    report = tmp_path / "a" / "parity-cpu-cpu-torch.json"
    assert json.loads(report.read_text())["summary"]["torch"]["pass"] == 6
    assert "| tiny.c4a.h16.fp8_ds_mla.mixed.short | pass" in report.with_suffix(".md").read_text()
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


def test_rocm_bench_times_aiter_first(monkeypatch):
    from dsv4_attn import bench
    from dsv4_attn.common import platform

    rocm = platform.Platform("rocm", "gfx950", "AMD Instinct MI355X", torch.__version__)
    monkeypatch.setattr(platform, "probe", lambda refresh=False: rocm)
    assert bench.default_backends() == ["aiter", "triton"]
    monkeypatch.setattr(platform, "probe", lambda refresh=False: platform.Platform("cuda", "sm90", "H100", "2.13"))
    assert bench.default_backends() == ["triton"]


# ---- the top level: commands with descriptions, --version, usage errors ---------------------------
def test_help_lists_every_command_with_what_it_does():
    res = _run("--help")
    assert res.returncode == 0
    for name in ("probe", "parity", "bench"):
        line = next(line for line in res.stdout.splitlines() if line.strip().startswith(name))
        assert len(line.split()) > 3, line  # a description beside the name
    assert "--version" in res.stdout


def test_version():
    import dsv4_attn

    res = _run("--version")
    assert res.returncode == 0 and res.stdout.startswith(f"dsv4-attn {dsv4_attn.__version__} (torch ")


@pytest.mark.parametrize("argv, message", [((), "a command is required"), (("frobnicate",), "invalid choice")])
def test_no_or_unknown_command_is_exit_2(argv, message):
    res = _run(*argv)
    assert res.returncode == 2 and message in res.stderr


@pytest.mark.parametrize("argv", [["probe", "--json"], ["parity", "--cases", "core.swa.h16"], ["bench"]])
def test_every_command_takes_the_same_device_flag_and_refuses_a_missing_gpu(argv, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: --device cuda is valid here")
    res = _run(*argv, "--device", "cuda", cwd=tmp_path)
    assert res.returncode == 2 and "--device: got 'cuda', but torch sees no GPU" in res.stderr, res.stderr
    assert res.stdout == "" and not any(tmp_path.iterdir())  # nothing ran, nothing written


@pytest.mark.parametrize("command", ["parity", "bench"])
def test_every_command_takes_backends_by_the_same_flag(command, tmp_path):
    res = _run(command, "--backends", "torch,nope", "--out" if command == "parity" else "--no-flashmla",
               *([str(tmp_path)] if command == "parity" else []))
    assert res.returncode == 2 and "--backends: got 'nope'; allowed: 'all' or any of" in res.stderr


def test_bench_takes_auto_among_its_backends():
    """bench also times 'auto' (the dispatcher's pick) beside named backends; parity has no such
    name (each of its cells runs one named backend)."""
    from dsv4_attn.parity.runner import resolve_backends

    assert resolve_backends(["triton,auto", "torch"], also=("auto",)) == ["triton", "auto", "torch"]
    with pytest.raises(ValueError, match=r"--backends: got 'auto'; allowed: 'all' or any of \['torch'"):
        resolve_backends("auto")


# ---- bench: checked before any work, CPU runs of the torch backend, CSV / JSON with spread ---------
def _bench_in_process(monkeypatch, argv):
    """bench.main(argv) with the device ceilings faked (the real ones take seconds to measure)."""
    from dsv4_attn import bench

    ceilings = {"copy_bytes_per_s": 1e10, "bf16_flops_per_s": 1e11}
    monkeypatch.setattr(bench.cli, "measure_ceilings", lambda device: ceilings)
    return bench.main(argv)


@pytest.mark.parametrize("argv, message", [
    (["--configs", "h64-c4a51"], "--configs: got ['h64-c4a51'] (--mode decode); allowed: ['h64-c4a512', "),
    (["--mode", "decode", "--configs", "h64-q4k-kv8k-top640"], "--configs: got ['h64-q4k-kv8k-top640']"),
    (["--batches", "0"], "--batches: got [0]; allowed: positive ints"),
    (["--format", "fp4"], "fmt: got 'fp4'"),
    (["--mode", "step", "--configs", "h64-c4a512"],
     "--configs: got ['h64-c4a512'] (--mode step); allowed: "
     "['v4-flash', 'v4-pro', 'v4-flash-tp8', 'v4-pro-tp8', 'v4', 'tp']"),
    (["--mode", "step", "--mtp", "0"], "--mtp: got [0]; allowed: positive ints"),
])
def test_bench_bad_arguments_are_exit_2_before_any_work(monkeypatch, capsys, argv, message):
    from dsv4_attn import bench

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(bench.cli, "measure_ceilings", no_work)
    assert bench.main(argv + ["--device", "cpu"]) == 2
    assert message in capsys.readouterr().err


def test_bench_png_without_matplotlib_is_exit_2_before_any_work(monkeypatch, capsys):
    import importlib.util

    from dsv4_attn import bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(bench.cli, "measure_ceilings", lambda device: pytest.fail("work started before the check"))
    assert bench.main(["--device", "cpu", "--png", "x.png"]) == 2
    assert "--png: got 'x.png', but matplotlib is not installed" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--mode", "prefill"], "--mode: prefill configs are production-sized"),
    (["--backends", "triton"], "only the torch backend runs on CPU"),
    (["--mode", "step", "--backends", "auto", "flashmla"], "only the torch backend runs on CPU"),
    (["--mode", "all"], "--mode: prefill configs are production-sized"),
    (["--guard-cost"], "--guard-cost: it times Triton kernels"),
    (["--write-choices", "c.json"], "--write-choices: CPU timings choose no GPU backend"),
    (["--update-choices", "c.json"], "--update-choices: CPU timings choose no GPU backend"),
])
def test_bench_on_cpu_refuses_what_only_a_gpu_runs(monkeypatch, capsys, argv, message):
    assert _bench_in_process(monkeypatch, ["--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_on_cpu_times_the_torch_backend_and_writes_csv_and_json(monkeypatch, capsys, tmp_path):
    import csv

    from dsv4_attn import bench

    csv_path, json_path = tmp_path / "b.csv", tmp_path / "b.json"
    rc = _bench_in_process(monkeypatch, ["--device", "cpu", "--configs", "h64-c4a512", "--reps", "3",
                                         "--csv", str(csv_path), "--json", str(json_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU run: the torch backend at small decode shapes, to try the tool")
    assert "h64-c4a512 b=2 s_q=1" in out and " us_p90 " in out
    (row,) = list(csv.DictReader(csv_path.open()))
    assert tuple(row) == bench.CSV_COLUMNS and row["backend"] == "torch" and row["runs"] == "3"
    assert float(row["us_min"]) <= float(row["us"]) <= float(row["us_p90"]) and float(row["us_min"]) > 0
    assert row["valid_keys"] == "1280" and row["flashmla_us"] == ""  # 2 tokens x (128 SWA + 512 top-k)
    (res,) = json.loads(json_path.read_text())["results"]
    assert res["backends"]["torch"]["us_p90"] == pytest.approx(float(row["us_p90"]))


def test_bench_config_groups_and_formats_on_cpu(monkeypatch, capsys, tmp_path):
    """--configs takes the groups 'v4' / 'v41' beside names, --format several formats: one row per
    (config, format) that the format stores (the V4.1 records: V4.1 configs only)."""
    import csv

    from dsv4_attn import bench

    assert bench.main(["--device", "cpu", "--configs", "v5"]) == 2
    assert "'v4', 'v41', 'tp']" in capsys.readouterr().err  # the groups are named among the allowed
    csv_path = tmp_path / "b.csv"
    rc = _bench_in_process(monkeypatch, ["--device", "cpu", "--configs", "h64-c4a512", "h64-c1a512", "--reps", "2",
                                         "--format", "fp8_ds_mla", "mxfp8_ds_mla", "--csv", str(csv_path)])
    assert rc == 0
    rows = [(r["config"], r["kind"], r["format"]) for r in csv.DictReader(csv_path.open())]
    assert rows == [("h64-c4a512", "C4A", "fp8_ds_mla"), ("h64-c1a512", "C1A", "fp8_ds_mla"),
                    ("h64-c1a512", "C1A", "mxfp8_ds_mla")]


def test_bench_step_mode_on_cpu_times_whole_steps_and_writes_csv_and_json(monkeypatch, capsys, tmp_path):
    """--mode step on CPU: one V4-Flash decode step (plan once + 43 layers) through 'auto' (the
    torch backend there), every layer written, µs per step and per layer in the JSON and CSV."""
    import csv

    from dsv4_attn import bench

    csv_path, json_path = tmp_path / "s.csv", tmp_path / "s.json"
    rc = _bench_in_process(monkeypatch, ["--device", "cpu", "--mode", "step", "--configs", "v4-flash", "--backends",
                                         "auto", "--reps", "1", "--csv", str(csv_path), "--json", str(json_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "v4-flash b=2 s_q=1 (43 layers)" in out and "auto picked: SWA torch, C4A torch, C128A torch" in out
    (res,) = json.loads(json_path.read_text())["results"]
    assert (res["phase"], res["layers"], res["tokens"], res["heads"]) == ("step", 43, 2, 64)
    assert res["layer_kinds"] == {"SWA": 2, "C4A": 21, "C128A": 20} and "flashmla_vllm" not in res
    (name, auto), = res["backends"].items()
    assert name == "auto" and auto["layers_written"] == 43 and auto["runs"] == 1
    assert auto["picked"] == {"SWA": "torch", "C4A": "torch", "C128A": "torch"}
    assert auto["us_per_layer"] == pytest.approx(auto["us"] / 43) and auto["us"] > 0
    (row,) = list(csv.DictReader(csv_path.open()))
    assert tuple(row) == bench.CSV_COLUMNS and (row["phase"], row["layers"], row["backend"]) == ("step", "43", "auto")
    assert float(row["us_per_layer"]) == pytest.approx(auto["us_per_layer"]) and row["flashmla_vllm_us"] == ""


def test_timing_spread():
    from dsv4_attn.bench import Timing

    t = Timing.of([4.0, 1.0, 3.0, 2.0, 10.0, 5.0, 6.0, 7.0, 8.0, 9.0, 11.0], "eager")
    assert (t.min, t.median, t.p90, t.runs) == (1.0, 6.0, 10.0, 11)
    assert Timing.of([2.5], "graph").as_us() == {"us": 2.5e6, "us_min": 2.5e6, "us_p90": 2.5e6, "runs": 1,
                                                 "timing": "graph"}
