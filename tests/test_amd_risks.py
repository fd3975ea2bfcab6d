"""tests/gpu_scripts/amd_risks.py (issue 28 item 5: run by amd_run.sh on a ROCm GPU with real
AITER) without a GPU: its checks run on the AITER emulator, on the CPU and at small sizes, to show
they pass on a right AITER and FAIL on a wrong one (a stage 2 that drops a split's partial), and
that any failed or raising check makes the verdict FAIL with exit status 1. EMULATED: nothing here
says how real AITER behaves; the script itself refuses the emulator."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dsv4_attn import emulation
from dsv4_attn.emulation import decode as emulated_decode
from dsv4_attn.emulation.attend import stage2_merge
from dsv4_attn.rocm.aiter_api import load_aiter

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu_scripts"))

import amd_risks  # noqa: E402

LENS = [1, 2, 17, 65, 129, 300]  # one row per length: 1 to 3 splits' worth of keys at mgc 128 / S 3


@pytest.fixture
def on_the_emulator(monkeypatch):
    monkeypatch.setattr(amd_risks, "DEV", torch.device("cpu"))
    emulation.enable("gfx950", "0.1.20")
    yield
    emulation.disable()


def _drop_last_split(part_out, part_lse, count):
    """A wrong stage 2: merges one partial fewer than stage 1 wrote (rows of 2+ splits lose keys)."""
    return stage2_merge(part_out, part_lse, (count - 1).clamp_min(1))


def test_the_split_check_passes_a_right_aiter_and_fails_a_wrong_stage2(on_the_emulator, monkeypatch, gen):
    api = load_aiter()
    rel, lse_err = amd_risks._raw_split(api.mla_decode_fwd, 16, 3, LENS, gen)
    assert rel <= amd_risks.BF16_CONTRACT and lse_err <= 1e-2, (rel, lse_err)
    monkeypatch.setattr(emulated_decode, "stage2_merge", _drop_last_split)
    rel, lse_err = amd_risks._raw_split(api.mla_decode_fwd, 16, 3, LENS, gen)
    assert rel > amd_risks.BF16_CONTRACT and lse_err > 1e-2, (rel, lse_err)


def test_the_persistent_check_passes_on_the_emulator(on_the_emulator, gen):
    ok, text = amd_risks.persistent(gen)
    assert ok, text
    assert text.startswith("T=1 512 keys 64 heads fp8 persistent on gfx950: rel L2 ")


@pytest.mark.parametrize("broken", ["fails", "raises"])
def test_one_bad_check_makes_the_verdict_fail(monkeypatch, capsys, broken):
    def bad(gen):
        if broken == "raises":
            raise RuntimeError("HIP error")
        return False, "wrong"

    monkeypatch.setattr(amd_risks, "load_aiter", lambda: type("API", (), dict(
        error=None, emulated=False, arch="gfx950", version="0.1.20.post1"))())
    monkeypatch.setattr(amd_risks, "persistent", lambda gen: (True, "fine"))
    monkeypatch.setattr(amd_risks, "split_sweep", bad)
    monkeypatch.setattr(amd_risks, "capacity", lambda gen: (True, "fine"))
    monkeypatch.setattr(sys, "argv", ["amd_risks.py"])
    assert amd_risks.main() == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("VERDICT dsv4_attn amd_risks gfx950 AITER 0.1.20.post1") and ": FAIL (" in last
    assert "split-sweep FAIL" in last and "persistent pass" in last


def test_the_script_refuses_the_emulator(on_the_emulator, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["amd_risks.py"])
    assert amd_risks.main() == 2
    assert "needs real AITER on a ROCm GPU" in capsys.readouterr().out
