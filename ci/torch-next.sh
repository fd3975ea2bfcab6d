#!/usr/bin/env bash
# The CPU tests a second time under the newest torch the package supports (2.15) and the Triton it
# pins (3.9), in a brand-new venv of their own (the main run has the README's torch 2.13 and Triton 3.8).
#
# torch 2.15 for Linux x86_64 on PyPI is the CUDA build (the CPU builds live on download.pytorch.org,
# which CI machines cannot reach): it runs on a CPU, but needs its CUDA libraries to import (libtorch
# links cuBLAS, cuDNN, NCCL, ...; `--no-deps` leaves `import torch` failing on libcudnn.so.9), so
# it installs whole: ~2.6 GB of wheels, measured in docs/testing.md "torch 2.15". The download is
# network time, not CPU time, so CI can start it first (`--prefetch`: the install runs in the background
# and the command returns at once) and runs the main suite meanwhile; the plain call waits for that
# install (a lock on the venv), or installs now when nothing was prefetched. PIP_CONSTRAINT=/dev/null:
# a pip configuration that caps torch (some CI images cap it at the releases they carry) does not
# apply to this venv.
#
#   bash ci/torch-next.sh --prefetch         # start the venv's install in the background
#   bash ci/torch-next.sh                    # (wait for it, then) the subset; venv in
#                                            # ~/.cache/dsv4-attn/torch-next-venv, reused when present
#   TORCH_NEXT_VENV=/tmp/t bash ci/torch-next.sh tests/test_api.py   # other tests than the subset
#   TORCH_NEXT_JOBS=1 bash ci/torch-next.sh                                # one pytest process (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TORCH_NEXT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4-attn/torch-next-venv}
py=$venv/bin/python
mkdir -p "$(dirname "$venv")"

install() {
  [[ -x $py ]] || python3 -m venv "$venv"
  if ! "$py" -c "import sys, torch; sys.exit(not torch.__version__.startswith('2.15.'))" 2>/dev/null; then
    PIP_CONSTRAINT=/dev/null "$py" -m pip install -q "torch==2.15.*"
  fi
  PIP_CONSTRAINT=/dev/null "$py" -m pip install -q -e ".[test]"
}

if [[ ${1:-} == --prefetch ]]; then
  exec 9>"$venv.lock"
  flock 9  # held by the background install below (it inherits fd 9) until it ends
  rm -f "$venv.status"
  ( t0=$SECONDS; rc=0; (set -e; install) || rc=$?
    echo "torch-next install: exit $rc, $((SECONDS - t0)) s"; echo "$rc" > "$venv.status" ) > "$venv.log" 2>&1 &
  echo "torch-next: installing in the background (log: $venv.log)"
  exit 0
fi

flock "$venv.lock" true  # a prefetch still installing: wait for it
if [[ -f $venv.status ]]; then
  cat "$venv.log"
  [[ $(cat "$venv.status") == 0 ]] || exit 1
  rm -f "$venv.status"
else
  install
fi
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# The subset: every test of the public API, the reference, the index builders and the Triton kernels
# under the interpreter (what touches torch and Triton the most); the engine shims, the bench, the CLI,
# the offline compiles and the docs checks run once, in the main run.
subset=(tests/test_api.py tests/test_reference.py tests/test_indices.py tests/test_rows.py tests/test_batch.py
        tests/test_triton_kernels.py tests/test_v41.py tests/test_layout.py tests/test_kv_records.py
        tests/test_merge.py tests/test_golden.py tests/test_compile_probe.py tests/test_metadata_proof.py)
if [[ $# -gt 0 ]]; then subset=("$@"); fi
# on both cores, as the main run (pytest-xdist comes with the test extra): nothing else runs by then
exec "$py" -m pytest -q -n "${TORCH_NEXT_JOBS:-2}" "${subset[@]}"
