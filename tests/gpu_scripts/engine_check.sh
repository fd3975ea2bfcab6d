#!/usr/bin/env bash
# Does dsv4_attn serve DeepSeek-V4 in YOUR engine? Run unchanged on a GPU machine with vLLM 0.33
# (or SGLang 0.5.23) and dsv4-attn installed; paste the verdict it prints into an issue.
#
#   bash tests/gpu_scripts/engine_check.sh                      # vLLM, deepseek-ai/DeepSeek-V4-Flash
#   ENGINE=sglang MODEL=/models/DeepSeek-V4-Flash TP=8 bash tests/gpu_scripts/engine_check.sh
#
# Five engine starts, each with the engine's DEFAULT flags (only the tensor-parallel size, and
# where named, MTP or eager mode, are set), on a fixed prompt set (short prompts and one of ~64k
# tokens), greedy, 64 tokens each (tests/gpu_scripts/engine_run.py):
#   on        plugin on (DSV4_ATTN_VLLM=1 / DSV4_ATTN_SGLANG=1), CUDA graphs as the engine defaults
#   off       plugin off: the engine's own attention
#   on-eager  plugin on, eager (vLLM --enforce-eager, SGLang --disable-cuda-graph)
#   on-mtp    plugin on, MTP with 2 speculative tokens
#   off-mtp   plugin off, MTP with 2 speculative tokens
# and checks (tests/gpu_scripts/engine_verdict.py): every worker logged that its layers run on
# dsv4_attn in the "on" runs and none did in the "off" runs; greedy tokens on == off (each prompt's
# first 8 tokens, and at least half of all 64, agree); MTP acceptance on >= off - 0.05 and MTP
# tokens == on tokens (the same agreement rule); eager tokens == graph tokens (all 64); no plugin
# buffer allocated after the memory profile (the plugin's own warning) and GPU memory reserved
# after the graphs were captured grows no more with the plugin than without it.
# Exit status 0 only for PASS. The plugin off, or attention that is wrong, FAILs.
#
# ENGINE_CHECK_RUNNER replaces engine_run.py (a command taking the same arguments): how the script's
# own flow is tested without a GPU (tests/test_engine_check.py).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
engine=${ENGINE:-vllm}
model=${MODEL:-deepseek-ai/DeepSeek-V4-Flash}
tp=${TP:-$(nvidia-smi -L 2>/dev/null | wc -l)}
out=${OUT_DIR:-engine-check-$(date +%Y%m%d-%H%M%S)}
runner=${ENGINE_CHECK_RUNNER:-python3 $here/engine_run.py}
case $engine in
  vllm) switch=DSV4_ATTN_VLLM ;;
  sglang) switch=DSV4_ATTN_SGLANG ;;
  *) echo "ENGINE: got '$engine'; allowed: vllm or sglang" >&2; exit 2 ;;
esac
[[ $tp -ge 1 ]] || { echo "TP: got '$tp' (no GPU found by nvidia-smi); allowed: the number of GPUs to use" >&2; exit 2; }
mkdir -p "$out"
echo "engine_check: $engine, $model, TP $tp; results in $out"
for run in on off on-eager on-mtp off-mtp; do
  plugin=${run%%-*}
  opts=()
  [[ $run == *eager ]] && opts+=(--eager)
  [[ $run == *mtp ]] && opts+=(--mtp 2)
  echo "  run $run ..."
  if [[ $plugin == on ]]; then
    env "$switch=1" $runner --engine "$engine" --model "$model" --tp "$tp" "${opts[@]}" --out "$out/$run.json" \
      > "$out/$run.log" 2>&1
  else
    env -u "$switch" $runner --engine "$engine" --model "$model" --tp "$tp" "${opts[@]}" --out "$out/$run.json" \
      > "$out/$run.log" 2>&1
  fi
  echo "    exit $? (log: $out/$run.log)"
done
python3 "$here/engine_verdict.py" --engine "$engine" --tp "$tp" "$out"
