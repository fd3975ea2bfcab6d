#!/usr/bin/env bash
# The one command of docs/rocm.md "What an MI355X (gfx950) / MI300X (gfx942) run must check": on a ROCm machine with
# AITER installed (no emulator), run the hardware checks, the parity matrix per AITER path and the
# decode benchmarks, and write everything to OUT (default ./amd-<arch>):
#
#   bash tests/gpu_scripts/amd_run.sh [OUT]
#
#   OUT/probe.json                 platform, AITER version, which AITER paths are enabled and why not
#   OUT/pytest.xml, pytest.log     real AITER vs the emulator's kernel model (tests/test_aiter_hardware.py),
#                                  the HIP-graph capture test, the FNUZ Triton decode
#   OUT/parity-<path>/parity-rocm-<arch>.json   the full parity matrix: auto (aiter, triton, torch),
#                                  then aiter forced to each AITER entry point / mode
#   OUT/bench-<format>[-<path>].json  decode timings, aiter next to triton
#
# Merge with other machines' results: dsv4-attn parity --merge OUT/parity-*/parity-rocm-*.json
# h100/parity-cuda-sm90.json ... The script goes on after a failing step and exits non-zero.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset DSV4_ATTN_AITER_EMULATOR DSV4_ATTN_AITER_PATH DSV4_ATTN_AITER_PERSISTENT_MAX_BATCH
PY=${PYTHON:-python}
arch=$($PY -c 'from dsv4_attn.common.platform import probe; print(probe().arch)')
OUT=${1:-amd-$arch}
mkdir -p "$OUT"
failed=0
step() {  # step NAME CMD...: run, log, remember a failure
    echo "== $1" | tee -a "$OUT/log.txt"
    shift
    "$@" 2>&1 | tee -a "$OUT/log.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
}

$PY -m dsv4_attn probe --json > "$OUT/probe.json" || failed=1
step "hardware checks" $PY -m pytest -q -m gpu -rs --junitxml "$OUT/pytest.xml" tests/test_aiter_hardware.py \
    tests/test_aiter_graph.py tests/test_triton_kernels.py -k "hardware or graph or fnuz"
step "parity (auto)" $PY -m dsv4_attn parity --full --backends aiter triton torch --out "$OUT/parity-auto"
for path in mla_decode_fwd_v4_nm mla_decode_fwd; do
    step "parity (aiter: $path)" env DSV4_ATTN_AITER_PATH=$path \
        $PY -m dsv4_attn parity --full --backends aiter --out "$OUT/parity-$path"
done
step "parity (aiter: mla_decode_fwd split only)" env DSV4_ATTN_AITER_PATH=mla_decode_fwd \
    DSV4_ATTN_AITER_PERSISTENT_MAX_BATCH=0 $PY -m dsv4_attn parity --full --backends aiter --out "$OUT/parity-split"
for fmt in fp8_ds_mla bfloat16 fp8_e4m3; do
    step "bench $fmt" $PY -m dsv4_attn bench --mode decode --format $fmt --backends aiter triton \
        --json "$OUT/bench-$fmt.json"
done
for mode in persistent split; do  # where the persistent/split crossover lies (persistent_max_batch)
    limit=$([ $mode = persistent ] && echo 1000000 || echo 0)
    step "bench fp8_ds_mla mla_decode_fwd $mode" env DSV4_ATTN_AITER_PATH=mla_decode_fwd \
        DSV4_ATTN_AITER_PERSISTENT_MAX_BATCH=$limit $PY -m dsv4_attn bench --mode decode --format fp8_ds_mla \
        --backends aiter --json "$OUT/bench-fp8_ds_mla-mla_decode_fwd-$mode.json"
done
echo "results in $OUT (failed steps: $failed)"
exit $failed
