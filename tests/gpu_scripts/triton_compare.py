"""Side-by-side table of several `dsv4-attn bench --json` runs of the triton backend (kernel
variants timed one after the other in one device call), with FlashMLA raw from each run, and
the variant with the lowest geometric-mean time over the rows with batch >= 64.

    python tests/gpu_scripts/triton_compare.py new=bench_new.json old=bench_old.json [--best-file F]
"""

from __future__ import annotations

import argparse
import json
import math


def load(path: str) -> dict[str, tuple[float, float]]:
    """case -> (ours µs, FlashMLA raw µs or nan) of one bench JSON."""
    with open(path) as f:
        results = json.load(f)["results"]
    return {r["case"]: (r["backends"]["triton"]["us"], r.get("flashmla_raw", {}).get("us", math.nan))
            for r in results if "error" not in r}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+", help="label=path of a bench JSON")
    p.add_argument("--best-file", default=None, help="write the best label here")
    args = p.parse_args()
    runs = {label: load(path) for label, path in (s.split("=", 1) for s in args.runs)}
    cases = list(next(iter(runs.values())))
    labels = list(runs)
    print("| case | " + " | ".join(f"{lb} µs" for lb in labels) + " | " +
          " | ".join(f"FlashMLA raw ({lb} run)" for lb in labels) + " |")
    print("|---" * (1 + 2 * len(labels)) + "|")
    for case in cases:
        ours = [f"{runs[lb][case][0]:.1f}" if case in runs[lb] else "n/a" for lb in labels]
        raw = [f"{runs[lb][case][1]:.1f}" if case in runs[lb] else "n/a" for lb in labels]
        print(f"| {case} | " + " | ".join(ours) + " | " + " | ".join(raw) + " |")
    big = [c for c in cases if int(c.split("b=")[1].split()[0]) >= 64]
    score = {lb: math.exp(sum(math.log(runs[lb][c][0]) for c in big) / len(big)) for lb in labels
             if all(c in runs[lb] for c in big)}
    for lb, s in score.items():
        print(f"{lb}: geometric mean over b >= 64: {s:.2f} µs")
    best = min(score, key=score.get)
    print(f"best: {best}")
    if args.best_file:
        with open(args.best_file, "w") as f:
            f.write(best)


if __name__ == "__main__":
    main()
