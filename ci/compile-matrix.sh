#!/usr/bin/env bash
# Every Triton kernel the package launches, compiled offline (no GPU) under the lowest and the
# highest Triton the package supports (3.6: torch 2.11's; 3.9: torch 2.15's), for every target it
# serves: the Gluon Hopper kernel (sm_90a), the portable kernel (sm_80, sm_90, sm_100, gfx942,
# gfx950), the split combine and the index front end (tests/gpu_scripts/compile_matrix.py says
# which variants). Fails on a compile error, or on scratch (spills to memory) / LDS past the limit on AMD; prints per Triton x
# target x kernel the registers, spills and scratch (docs/testing.md "Compile matrix: Triton 3.6 to 3.9" holds them).
#
# A Triton other than the one installed goes into its own folder with `pip install --target` and is
# put first on PYTHONPATH for the compile only (the installed one is untouched).
#
#   bash ci/compile-matrix.sh                               # 3.6.0 and 3.9.0
#   TRITON_VERSIONS="3.8.0" bash ci/compile-matrix.sh --full  # extra args go to compile_matrix.py
#   bash ci/compile-matrix.sh --prefetch                    # only install the side Tritons, in the background
#
# --prefetch (CI's first lines, as torch-next.sh's): the side installs are downloads (~250 MB a
# Triton), network time the suite can overlap; a later plain call waits for them (a lock) and
# installs whatever the prefetch did not.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=${TRITON_VERSIONS:-3.6.0 3.9.0}
side=${TRITON_SIDE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4-attn/tritons}
out=${COMPILE_MATRIX_OUT:-${TMPDIR:-/tmp}/dsv4-compile-matrix}
mkdir -p "$side"

side_triton() {  # the folder to put first on PYTHONPATH for Triton $1 ('' = the installed one), installed
  local v=$1 path=$side/$1
  if python -c "import sys, triton; sys.exit(triton.__version__ != '$v')" 2>/dev/null; then return; fi
  if [[ ! -f $path/triton/__init__.py ]]; then
    rm -rf "$path.partial"
    python -m pip install -q --no-deps --target "$path.partial" "triton==$v" >&2 || return 1
    rm -rf "$path" && mv "$path.partial" "$path" || return 1
  fi
  echo "$path"
}

if [[ ${1:-} == --prefetch ]]; then
  exec 9>"$side.lock"
  flock 9  # held by the background installs below (they inherit fd 9) until they end
  ( for v in $versions; do side_triton "$v" > /dev/null || echo "Triton $v: install failed"; done ) > "$side.log" 2>&1 &
  echo "compile-matrix: installing Triton $versions in the background (log: $side.log)"
  exit 0
fi

flock "$side.lock" true  # a prefetch still installing: wait for it
mkdir -p "$out"
status=0
for v in $versions; do
  path=$(side_triton "$v") || { echo "Triton $v: the side install failed" >&2; exit 1; }
  t0=$SECONDS
  env -u TRITON_INTERPRET PYTHONPATH="${path:+$path:}$PWD" \
    python tests/gpu_scripts/compile_matrix.py --jobs "${COMPILE_JOBS:-2}" --json "$out/triton-$v.json" "$@" \
    || status=1
  echo "=== Triton $v: $((SECONDS - t0)) s (rows: $out/triton-$v.json)"
done
exit $status
