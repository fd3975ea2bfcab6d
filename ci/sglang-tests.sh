#!/usr/bin/env bash
# The SGLang shim tests (tests/test_sglang_shim.py) against the real SGLang 0.5.23, on a CPU machine.
#
# Builds a venv that sees this Python's packages (a .pth naming its site-packages, so a venv parent
# works too: it reuses the installed torch and dsv4-attn's own dependencies), installs
# sglang==0.5.23, compressed-tensors and the torchvision matching the installed torch WITHOUT their
# dependencies (they pin torch==2.14.1, a multi-GB CUDA wheel, and GPU kernel packages), plus only
# what SGLang's imported modules need (tests/sglang_env/requirements.txt, torch held at the
# installed version), installs this checkout into it, and runs the tests. The main test run skips
# these tests with a reason (sglang is not importable there).
#
#   bash ci/sglang-tests.sh              # venv in ~/.cache/dsv4-attn/sglang-venv (reused when present)
#   SGLANG_VENV=/tmp/s bash ci/sglang-tests.sh -k own_forward   # SGLANG_VENV: the venv; extra args go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4-attn/sglang-venv}
env_dir=tests/sglang_env
if [[ ! -x $venv/bin/python ]]; then
  mkdir -p "$(dirname "$venv")"
  python -m venv "$venv"
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  python -c "import site, sysconfig; print('\n'.join(dict.fromkeys(
      [sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib'], *site.getsitepackages()])))" \
    > "$site/_dsv4_attn_parent_site.pth"
  cp "$env_dir/sitecustomize.py" "$site/sitecustomize.py"
fi
py=$venv/bin/python
# one interpreter start checks and reports the versions (importing sglang costs ~10 s of CPU)
versions="import torch, sglang, sys; print('torch', torch.__version__, 'sglang', sglang.__version__); \
sys.exit(sglang.__version__ != '0.5.23')"
if ! "$py" -c "$versions" 2>/dev/null; then
  torch_version=$("$py" -c "import torch; print(torch.__version__)")
  vision=$("$py" -c "import torch; v = torch.__version__.split('+')[0].split('.'); print(f'0.{int(v[1]) + 15}.*')")
  "$py" -m pip install -q --no-warn-conflicts --no-deps sglang==0.5.23 compressed-tensors==0.18.0 "torchvision==$vision"
  "$py" -m pip install -q --no-warn-conflicts -r "$env_dir/requirements.txt" -c <(echo "torch==$torch_version")
  "$py" -c "$versions"
fi
"$py" -m pip install -q --no-deps -e .
exec "$py" -m pytest -q -m sglang tests/test_sglang_shim.py "$@"
