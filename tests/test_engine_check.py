"""tests/gpu_scripts/engine_check.sh without a GPU: its flow (five engine runs, the plugin switch
set or removed per run, the verdict and exit status) with a stand-in runner that writes what an
engine would, and the verdict's rules. The engines themselves run only on a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "gpu_scripts"
sys.path.insert(0, str(SCRIPTS))

import engine_verdict  # noqa: E402

# What an engine run writes: its greedy tokens, MTP acceptance, per-worker reserved memory; and
# its log: the per-worker line when the plugin is on (FAKE_ENGINE=ignores-plugin: never), tokens
# shifted when the plugin is on and wrong (FAKE_ENGINE=wrong).
RUNNER = textwrap.dedent("""
    import argparse, json, os
    p = argparse.ArgumentParser()
    for a in ("--engine", "--model", "--out"):
        p.add_argument(a)
    p.add_argument("--tp", type=int)
    p.add_argument("--mtp", type=int, default=0)
    p.add_argument("--eager", action="store_true")
    args = p.parse_args()
    mode = os.environ.get("FAKE_ENGINE", "good")
    on = os.environ.get("DSV4_ATTN_VLLM") == "1" and mode != "ignores-plugin"
    for rank in range(args.tp):
        if on:
            print(f"(Worker_TP{rank}) INFO dsv4_attn: DeepSeek-V4 attention layers of class "
                  "DSv4AttnFlashMLAAttention run on dsv4_attn (sm90, fp8_ds_mla, 8 heads per rank, backend triton)")
    tokens = [[(7 * p + i) % 50 for i in range(64)] for p in range(7)]
    if on and mode == "wrong":
        tokens = [[t + 1 for t in row] for row in tokens]
    json.dump({"engine": "vllm", "version": "0.33.0", "tokens": tokens, "acceptance": 0.8 if args.mtp else None,
               "reserved_after_capture": [10] * args.tp, "reserved_after": [10] * args.tp}, open(args.out, "w"))
""")


def run_check(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    runner = tmp_path / "fake_engine.py"
    runner.write_text(RUNNER)
    env = {**os.environ, "ENGINE_CHECK_RUNNER": f"{sys.executable} {runner}", "TP": "2", "MODEL": "fake",
           "OUT_DIR": str(tmp_path / "out"), "FAKE_ENGINE": mode, "DSV4_ATTN_VLLM": "1"}  # set: off runs unset it
    return subprocess.run(["bash", str(SCRIPTS / "engine_check.sh")], env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPTS / "engine_check.sh")]).returncode == 0


def test_a_plugin_that_serves_and_agrees_passes(tmp_path):
    done = run_check(tmp_path, "good")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "engine_check verdict: PASS (vllm 0.33.0, TP 2)" in done.stdout
    assert done.stdout.count("[PASS]") == 7 and "[FAIL]" not in done.stdout


@pytest.mark.parametrize("mode, failed", [
    ("ignores-plugin", "per-worker log line"),  # the plugin never came on: the engine's own attention ran
    ("wrong", "greedy tokens plugin on == off"),  # all plugin-on runs agree with each other, not with vLLM
])
def test_a_plugin_that_is_off_or_wrong_fails(tmp_path, mode, failed):
    done = run_check(tmp_path, mode)
    assert done.returncode == 1
    assert f"engine_check verdict: FAIL (vllm 0.33.0, TP 2; failed: {failed})" in done.stdout


def test_agreement_rule():
    same = [list(range(64))] * 2
    assert engine_verdict.agreement(same, same)[0]
    late_drift = [list(range(40)) + [0] * 24, list(range(64))]  # a near-tie after 40 tokens
    assert engine_verdict.agreement(late_drift, same) == (True, "common prefixes [40, 64] (81% of tokens)")
    early = [[9] + list(range(1, 64)), list(range(64))]  # differs at the first token
    assert not engine_verdict.agreement(early, same)[0]
    assert engine_verdict.agreement(same, same[:1]) == (False, "2 vs 1 prompts answered")


def test_no_results_and_late_allocations_fail(tmp_path):
    (tmp_path / "on.log").write_text("dsv4_attn: allocating plan slot 1 after vLLM's memory profile\n")
    checks = {name: (ok, detail) for name, ok, detail in engine_verdict.check("vllm", 1, tmp_path)}
    assert checks["engine start, default flags"] == (False, f"no results from {list(engine_verdict.RUNS)} "
                                                            "(see their logs)")
    assert checks["no allocation after capture"][0] is False
    json.dumps(checks)  # plain data: what the verdict prints
