#!/usr/bin/env bash
# The vLLM shim tests (tests/test_vllm_shim.py) against the real vLLM 0.33.0, on a CPU machine.
#
# Builds a venv on top of this Python (--system-site-packages: it reuses the installed torch and
# dsv4-attn's own dependencies), installs vllm==0.33.0 WITHOUT its dependencies (they pin
# torch==2.14.0, a multi-GB CUDA wheel) plus only what vLLM's imported modules need
# (tests/vllm_env/requirements.txt), installs this checkout into it, and runs the tests.
# The main test run skips these tests with a reason (vllm is not importable there).
#
#   bash ci/vllm-tests.sh              # venv in ~/.cache/dsv4-attn/vllm-venv (reused when present)
#   VLLM_VENV=/tmp/v bash ci/vllm-tests.sh -k reference   # extra args go to pytest
#
# Measured on the 2-core CI-size machine: fresh venv + installs ~1.5 min, tests ~1 min.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4-attn/vllm-venv}
reqs=tests/vllm_env/requirements.txt
if [[ ! -x $venv/bin/python ]]; then
  mkdir -p "$(dirname "$venv")"
  python -m venv --system-site-packages "$venv"
fi
py=$venv/bin/python
if ! "$py" -c "import vllm, sys; sys.exit(vllm.__version__ != '0.33.0')" 2>/dev/null; then
  "$py" -m pip install -q --no-warn-conflicts --no-deps "$(grep -m1 '^vllm==' "$reqs")"
  "$py" -m pip install -q --no-warn-conflicts -r <(grep -v '^vllm==' "$reqs")
fi
"$py" -m pip install -q --no-deps --no-build-isolation -e .
"$py" -c "import torch; print('torch', torch.__version__)"
exec "$py" -m pytest -q -m vllm tests/test_vllm_shim.py "$@"
