"""The verdict of tests/gpu_scripts/engine_check.sh, from the five runs it made (``<run>.json``
written by engine_run.py and ``<run>.log``, the engine's output, per run: on, off, on-eager,
on-mtp, off-mtp). Prints one line per check and one verdict line to paste into an issue; exits 0
only for PASS.

    python3 tests/gpu_scripts/engine_verdict.py --engine vllm --tp 8 engine-check-20261126-120000
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RUNS = ("on", "off", "on-eager", "on-mtp", "off-mtp")
# The line each worker logs when it builds its attention layers on dsv4_attn.
WORKER_LINE = {"vllm": re.compile(r"dsv4_attn: DeepSeek-V4 attention layers of class \S+ run on dsv4_attn"),
               "sglang": re.compile(r"dsv4_attn: SGLang's DeepSeek-V4 attention runs on dsv4_attn")}
# The plugin's warning when a buffer is allocated outside the engine's memory profile.
LATE_ALLOCATION = re.compile(r"dsv4_attn: allocating .* after")
FIRST_TOKENS = 8  # every prompt's first tokens must agree (on vs off, MTP vs not) ...
AGREEMENT = 0.5  # ... and at least this share of all generated tokens (greedy drifts apart on near-ties)
ACCEPTANCE_SLACK = 0.05  # MTP acceptance with the plugin may be this much below the engine's own


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[bool, str]:
    """(agree, detail) of two runs' greedy tokens per prompt: the first FIRST_TOKENS of every
    prompt, and AGREEMENT of all tokens, as common prefixes."""
    if len(a) != len(b):
        return False, f"{len(a)} vs {len(b)} prompts answered"
    prefixes = [common_prefix(x, y) for x, y in zip(a, b)]
    first_ok = all(p >= min(FIRST_TOKENS, len(x), len(y)) for p, x, y in zip(prefixes, a, b))
    share = sum(prefixes) / max(1, sum(max(len(x), len(y)) for x, y in zip(a, b)))
    return first_ok and share >= AGREEMENT, f"common prefixes {prefixes} ({share:.0%} of tokens)"


def check(engine: str, tp: int, directory: Path) -> list[tuple[str, bool, str]]:
    """[(check, passed, detail)]."""
    results, logs = {}, {}
    for run in RUNS:
        path, log = directory / f"{run}.json", directory / f"{run}.log"
        logs[run] = log.read_text(errors="replace") if log.exists() else ""
        if path.exists():
            results[run] = json.loads(path.read_text())
    checks = [("engine start, default flags", len(results) == len(RUNS),
               "all runs generated" if len(results) == len(RUNS)
               else f"no results from {[r for r in RUNS if r not in results]} (see their logs)")]
    on_lines = {run: len(WORKER_LINE[engine].findall(logs[run])) for run in RUNS if run.startswith("on")}
    off_lines = {run: len(WORKER_LINE[engine].findall(logs[run])) for run in RUNS if run.startswith("off")}
    checks.append(("per-worker log line", all(n >= tp for n in on_lines.values()) and not any(off_lines.values()),
                   f"plugin-on runs {on_lines} (need >= {tp} each), plugin-off runs {off_lines} (need 0)"))
    if "on" in results and "off" in results:
        ok, detail = agreement(results["on"]["tokens"], results["off"]["tokens"])
        checks.append(("greedy tokens plugin on == off", ok, detail))
    if "on-mtp" in results and "off-mtp" in results and "on" in results:
        on_acc, off_acc = results["on-mtp"]["acceptance"], results["off-mtp"]["acceptance"]
        ok = on_acc is not None and off_acc is not None and on_acc >= off_acc - ACCEPTANCE_SLACK
        checks.append(("MTP acceptance on vs off", ok, f"on {on_acc}, off {off_acc} (on >= off - {ACCEPTANCE_SLACK})"))
        ok, detail = agreement(results["on-mtp"]["tokens"], results["on"]["tokens"])
        checks.append(("MTP tokens == plugin-on tokens", ok, detail))
    if "on-eager" in results and "on" in results:
        same = results["on-eager"]["tokens"] == results["on"]["tokens"]
        checks.append(("CUDA-graph tokens == eager tokens", same,
                       "identical" if same else agreement(results["on-eager"]["tokens"], results["on"]["tokens"])[1]))
    late = sum(len(LATE_ALLOCATION.findall(logs[run])) for run in RUNS if run.startswith("on"))
    growth = {run: _growth(results[run]) for run in ("on", "off") if run in results}
    if None in growth.values() or len(growth) < 2:
        checks.append(("no allocation after capture", late == 0,
                       f"{late} plugin allocation warning(s); per-worker memory not reported by this engine"))
    else:
        checks.append(("no allocation after capture", late == 0 and growth["on"] <= growth["off"],
                       f"{late} plugin allocation warning(s); reserved memory grew by {growth['on'] / 2**20:.0f} MiB "
                       f"after capture with the plugin, {growth['off'] / 2**20:.0f} MiB without"))
    return checks


def _growth(result: dict) -> int | None:
    before, after = result.get("reserved_after_capture"), result.get("reserved_after")
    if not before or not after:
        return None
    return max(b - a for a, b in zip(before, after))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=sorted(WORKER_LINE), required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    checks = check(args.engine, args.tp, args.directory)
    for name, ok, detail in checks:
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}")
    version = next((json.loads(p.read_text()).get("version") for p in sorted(args.directory.glob("*.json"))), "?")
    failed = [name for name, ok, _ in checks if not ok]
    print(f"engine_check verdict: {'FAIL' if failed else 'PASS'} ({args.engine} {version}, TP {args.tp}"
          + (f"; failed: {', '.join(failed)})" if failed else ")"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
