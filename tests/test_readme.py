"""The README is part of the product: its support matrix is the backends' declared capabilities,
and CI's commands are the ones it shows."""

from __future__ import annotations

import subprocess
from pathlib import Path

from dsv4_attn.common.registry import support_matrix

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _between(start: str, stop: str) -> str:
    return README.split(start, 1)[1].split(stop, 1)[0].strip()


def test_readme_support_matrix_is_rendered_from_capabilities():
    table = _between("<!-- support-matrix -->", "<!-- /support-matrix -->")
    assert table == support_matrix().strip(), "README support matrix is stale: paste support_matrix() output"
    assert "emulated" in table and "contract tests only" in table


def test_ci_runs_the_readme_commands():
    """.ci/run's own extraction (awk over the markers) finds the README's install and test blocks:
    torch (CPU build, in the supported range) before the package, then the package with its test
    tools; the test block runs the linter, the type check, the example, the suite, the vLLM and
    SGLang shim tests, the packaging check, the torch 2.15 pass (its venv installed in the
    background from the block's start) and the offline compiles under Triton 3.6 and 3.9 (their side
    installs prefetched the same way)."""
    script = (ROOT / ".ci" / "run").read_text()
    extract = script.split("readme_block() {", 1)[1].split("\n}", 1)[0]
    got = {}
    for marker in ("install-command", "test-command"):
        res = subprocess.run(["bash", "-c", f"cd {ROOT} && readme_block() {{ {extract}\n}}; readme_block {marker}"],
                             capture_output=True, text=True, check=True)
        got[marker] = res.stdout.strip().splitlines()
    assert got["install-command"] == ["pip install torch==2.13.0",
                                      'pip install -e ".[test]" "triton==3.8.0"']
    assert got["test-command"] == ["bash ci/torch-next.sh --prefetch", "bash ci/compile-matrix.sh --prefetch",
                                   "ruff check .", "mypy",
                                   "python examples/run_step.py", "python -m pytest -q -n 2 tests",
                                   "bash ci/vllm-tests.sh", "bash ci/sglang-tests.sh", "bash ci/wheel-check.sh",
                                   "bash ci/torch-next.sh", "bash ci/compile-matrix.sh --quick"]
    assert "dsv4-attn parity" in README and "dsv4-attn probe" in README
