"""examples/run_step.py, the README's example: its core is the README's snippet, it runs every
layer kind of V4 and V4.1 against the float64 reference, and it notices a wrong or unwritten output.
(The README's test command runs the default V4 step; these run it in-process.)"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest
import torch

import dsv4_attn as dsv4

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "run_step.py"


def _example():
    spec = importlib.util.spec_from_file_location("run_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_snippet_is_the_example_core():
    core = SCRIPT.read_text().split("# ---- the core (the README shows it)", 1)[1].split("\n", 1)[1]
    core = textwrap.dedent(core.split("    # ----", 1)[0])
    readme = (ROOT / "README.md").read_text().split("<!-- example-core -->\n```python\n", 1)[1].split("```", 1)[0]
    assert readme == core, "README example is stale: paste the core of examples/run_step.py"


def test_v41_step_every_layer_matches_the_reference(capsys):
    assert _example().main(["--model", "v41", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    table = out.split("rel L2 vs the float64 reference\n", 1)[1]
    rows = [line.split() for line in table.splitlines() if line[:1].isdigit()]
    assert [r[1] if r[1] != "(MTP)" else r[2] for r in rows] == ["SWA", "C1A", "C2A", "C2A", "C1A", "SWA"]
    assert all("ok" in r for r in rows), table
    assert "reads layer 2's compressed cache" in table and "16 heads" in out
    assert "every layer matches the float64 reference" in out


@pytest.mark.parametrize("damage", ["perturbed", "unwritten"])
def test_a_wrong_or_unwritten_output_fails_the_run(monkeypatch, capsys, damage):
    forward = dsv4.SparseMLA.forward

    def damaged(self, plan, kind, q, *args, out=None, **kwargs):
        forward(self, plan, kind, q, *args, out=out, **kwargs)
        if kind is dsv4.LayerKind.C128A:
            if damage == "perturbed":
                out[-1] += 0.5  # the prefill chunk's last token
            else:
                out[0, 0, 0] = float("nan")  # as if one element had not been written
        return out

    monkeypatch.setattr(dsv4.SparseMLA, "forward", damaged)
    assert _example().main(["--tp", "8"]) == 1
    captured = capsys.readouterr()
    c128a = [line for line in captured.out.splitlines() if " C128A " in line and line[:1].isdigit()]
    assert len(c128a) == 2 and all("MISMATCH" in line for line in c128a)
    assert "FAILED" in captured.err and ("inf" in captured.err) == (damage == "unwritten")


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "tp_size: got 3; allowed: a divisor of num_attention_heads (64)"),
    (["--format", "fp4"], "fmt: got 'fp4'"),
    (["--model", "v5"], "invalid choice: 'v5'"),
])
def test_bad_arguments_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        _example().main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cuda_without_a_gpu_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: --device cuda is valid here")
    with pytest.raises(SystemExit) as exc:
        _example().main(["--device", "cuda"])
    assert exc.value.code == 2 and "torch sees no GPU" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("model", ["v4", "v41"])
def test_example_on_the_gpu(capsys, model):
    assert _example().main(["--device", "cuda", "--model", model]) == 0
    assert "every layer matches the float64 reference" in capsys.readouterr().out
