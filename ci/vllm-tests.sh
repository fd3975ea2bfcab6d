#!/usr/bin/env bash
# The vLLM shim tests (tests/test_vllm_shim.py) against the real vLLM 0.33.0, on a CPU machine.
#
# Builds a venv layered on the Python that runs this script (a .pth file adds that Python's
# site-packages: its torch, dsv4-attn's dependencies and pytest are reused, so run it from the
# environment the README's install command made), installs vllm==0.33.0 WITHOUT its dependencies
# (they pin torch==2.14.0, a multi-GB CUDA wheel) plus only what vLLM's imported modules need
# (tests/vllm_env/requirements.txt, found by running these tests in a bare venv), installs this
# checkout into it, and runs the tests. The main test run skips these tests with a reason (vllm
# is not importable there).
#
#   bash ci/vllm-tests.sh              # venv in ~/.cache/dsv4-attn/vllm-venv (reused when present)
#   VLLM_VENV=/tmp/v bash ci/vllm-tests.sh -k reference   # extra args go to pytest
#
# Measured on the 2-core CI-size machine: fresh venv + installs ~1.5 min, tests ~2 min (V4 and V4.1;
# 3.4 min in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4-attn/vllm-venv}
reqs=tests/vllm_env/requirements.txt
if [[ ! -x $venv/bin/python ]]; then
  mkdir -p "$(dirname "$venv")"
  python -m venv "$venv"
fi
py=$venv/bin/python
# Rewritten on every run, so a reused venv follows the environment it is called from. addsitedir
# (not a bare path) also runs that site-packages' own .pth files (editable installs).
caller_site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
venv_site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$caller_site')" > "$venv_site/dsv4-attn-caller.pth"
"$py" -m pip install -q --no-warn-conflicts --no-deps "$(grep -m1 '^vllm==' "$reqs")"
"$py" -m pip install -q --no-warn-conflicts -r <(grep -v '^vllm==' "$reqs")
"$py" -m pip install -q --no-deps --no-build-isolation -e .
"$py" -c "import torch; print('torch', torch.__version__)"
# two workers: each test builds its own vLLM stack, and the CI machine has two cores
exec "$py" -m pytest -q -n 2 -m vllm tests/test_vllm_shim.py "$@"
