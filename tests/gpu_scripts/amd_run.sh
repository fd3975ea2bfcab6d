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
#   OUT/risks.json                 issue 28's risks on the hardware (tests/gpu_scripts/amd_risks.py): T=1 / 512
#                                  keys / 64 heads persistent, the ragged split sweep (L 1..2100 x S 2/3/5/8/16 x
#                                  heads 16/128), 3072-token decode steps, the scratch reserve() allocates
#   OUT/parity-<path>/parity-rocm-<arch>.json   the full parity matrix: auto (aiter, triton, torch) and
#                                  aiter in split mode must pass (the bf16 contract); the fp8-compute runs
#                                  (v4 nm, persistent: DSV4_ATTN_AITER_FP8_COMPUTE=1) record their error only
#   OUT/bench-<format>[-<path>].json  decode timings, aiter next to triton
#
# Merge with other machines' results: dsv4-attn parity --merge OUT/parity-*/parity-rocm-*.json
# h100/parity-cuda-sm90.json ... The script goes on after a failing step, prints ONE verdict line
# to paste into an issue (the last line) and exits non-zero on a failure.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset DSV4_ATTN_AITER_EMULATOR DSV4_ATTN_AITER_PATH DSV4_ATTN_AITER_PERSISTENT_MAX_BATCH DSV4_ATTN_AITER_FP8_COMPUTE \
    DSV4_ATTN_AITER_MAX_DECODE_TOKENS
PY=${PYTHON:-python}
arch=$($PY -c 'from dsv4_attn.common.platform import probe; print(probe().arch)')
OUT=${1:-amd-$arch}
mkdir -p "$OUT"
failed=0
failures=()
step() {  # step NAME CMD...: run, log, remember a failure
    local name=$1
    echo "== $name" | tee -a "$OUT/log.txt"
    shift
    "$@" 2>&1 | tee -a "$OUT/log.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { failed=1; failures+=("$name"); }
}
info() {  # info NAME CMD...: run and log; a failure is recorded, not a verdict (fp8 runs miss the contract)
    echo "== $1 (informational)" | tee -a "$OUT/log.txt"
    shift
    "$@" 2>&1 | tee -a "$OUT/log.txt"
}

$PY -m dsv4_attn probe --json > "$OUT/probe.json" || failed=1
step "hardware checks" $PY -m pytest -q -m gpu -rs --junitxml "$OUT/pytest.xml" tests/test_aiter_hardware.py \
    tests/test_aiter_graph.py tests/test_triton_kernels.py -k "hardware or graph or fnuz"
step "portable kernel decoders (pair order, fp32 scaling)" $PY tests/gpu_scripts/decode_check.py
step "risks (issue 28)" $PY tests/gpu_scripts/amd_risks.py --json "$OUT/risks.json"
step "parity (auto)" $PY -m dsv4_attn parity --full --backends aiter triton torch --out "$OUT/parity-auto"
step "parity (aiter: mla_decode_fwd split)" env DSV4_ATTN_AITER_PATH=mla_decode_fwd \
    $PY -m dsv4_attn parity --full --backends aiter --out "$OUT/parity-split"
for path in mla_decode_fwd_v4_nm mla_decode_fwd; do
    info "parity (aiter fp8 compute: $path)" env DSV4_ATTN_AITER_PATH=$path DSV4_ATTN_AITER_FP8_COMPUTE=1 \
        $PY -m dsv4_attn parity --full --backends aiter --out "$OUT/parity-fp8-$path"
done
for fmt in fp8_ds_mla bfloat16 fp8_e4m3; do
    step "bench $fmt" $PY -m dsv4_attn bench --mode decode --format $fmt --backends aiter triton \
        --json "$OUT/bench-$fmt.json"
done
for mode in persistent split; do  # where the persistent/split crossover lies (persistent_max_batch)
    limit=$([ $mode = persistent ] && echo 1000000 || echo 0)
    step "bench fp8_ds_mla mla_decode_fwd $mode" env DSV4_ATTN_AITER_PATH=mla_decode_fwd DSV4_ATTN_AITER_FP8_COMPUTE=1 \
        DSV4_ATTN_AITER_PERSISTENT_MAX_BATCH=$limit $PY -m dsv4_attn bench --mode decode --format fp8_ds_mla \
        --backends aiter --json "$OUT/bench-fp8_ds_mla-mla_decode_fwd-$mode.json"
done
aiter_version=$($PY -c 'import json, sys; print(json.load(open(sys.argv[1]))["vendor_binaries"]["aiter"]["info"]["version"])' \
    "$OUT/probe.json" 2>/dev/null || echo "?")
echo "results in $OUT"
if [ $failed -eq 0 ]; then
    echo "VERDICT dsv4_attn amd_run $arch AITER $aiter_version: PASS (risks, hardware checks, bf16 parity, benches)"
else
    echo "VERDICT dsv4_attn amd_run $arch AITER $aiter_version: FAIL (${failures[*]}; see $OUT/log.txt)"
fi
exit $failed
