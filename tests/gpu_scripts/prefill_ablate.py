"""Device script: prefill (and decode) cases of `dsv4-attn bench` timed under several kernel variants
in ONE process (same cases, same run), with FlashMLA's raw op beside. A variant is either a set of
environment variables the launcher reads (``label:VAR=value,VAR=value``; ``base:`` none), e.g. the
ablation switches of an experiment branch (timing only: ablated variants compute wrong outputs), or
a ``KernelConfig`` (``label=field=value,...``, as ``bench --variant``). A case is a prefill config
name or ``DECODE_CONFIG@batch``.

    python tests/gpu_scripts/prefill_ablate.py --configs h64-q4k-kv8k-top640 h64-c4a512@256 \
        --variants base: noload:DSV4_ABLATE=2 pp=pingpong=1 --json $OUT/ablate.json

Prints one markdown row per (config, variant): µs (graph replay, L2 flushed, median), TFLOP/s,
ratio to FlashMLA raw and to the floor (max(bytes / copy rate, FLOPs / bf16 rate), the bench's).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from dsv4_attn import bench
from dsv4_attn.bench.layer import case_work
from dsv4_attn.bench.runners import api_runner, flashmla_raw_runner
from dsv4_attn.bench.timing import L2Flush, measure_ceilings, time_callable, warm_up


def parse_variant(spec: str, backend: str) -> tuple[str, str, dict[str, str]]:
    """``label:VAR=value,...`` -> (label, ``backend``, {VAR: value}); ``label=field=value,...`` ->
    (label, the registered KernelConfig backend, {})."""
    colon, eq = spec.find(":"), spec.find("=")
    if colon >= 0 and (eq < 0 or colon < eq):
        label, _, body = spec.partition(":")
        return label, backend, dict(item.split("=", 1) for item in filter(None, body.split(",")))
    return spec.partition("=")[0], bench.runners.register_variant(spec), {}


def make_case(name: str, device: torch.device):
    if "@" in name:
        cfg, _, batch = name.partition("@")
        return bench.make_decode_case(bench.DECODE_CONFIGS[cfg], int(batch), 1, device)
    return bench.make_prefill_case(bench.PREFILL_CONFIGS[name], device)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", default=["h64-q4k-kv8k-top640", "h128-q4k-kv8k-top640",
                                                    "h64-q4k-kv32k-top1152", "h128-q4k-kv32k-top1152"])
    p.add_argument("--variants", nargs="+", default=["base:"])
    p.add_argument("--backend", default="triton")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    warm_up(device)
    ceilings = measure_ceilings(device)
    flush = L2Flush(device)
    variants = [parse_variant(v, args.backend) for v in args.variants]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 mm {ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    print("| config | variant | µs | TFLOP/s | vs FlashMLA raw | × floor |\n|---|---|---|---|---|---|", flush=True)
    rows = []
    for name in args.configs:
        case = make_case(name, device)
        raw_us = float("nan")
        plan0 = None
        for label, backend, env in variants:
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                run, _, plan = api_runner(case, backend)
                plan0 = plan0 or plan
                us = time_callable(run, args.reps, flush, True, device).median * 1e6
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            flops, nbytes, _ = case_work(case, plan0)
            floor_us = max(nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["bf16_flops_per_s"]) * 1e6
            if raw_us != raw_us:  # FlashMLA's raw op once per config (after the first variant)
                raw, _, _how = flashmla_raw_runner(case, plan0)
                if raw is not None:
                    raw_us = time_callable(raw, args.reps, flush, True, device).median * 1e6
            row = dict(config=name, variant=label, us=us, tflops=flops / us / 1e6, raw_us=raw_us, floor_us=floor_us)
            rows.append(row)
            print(f"| {name} | {label} | {us:.1f} | {row['tflops']:.0f} | {raw_us / us:.2f}x | "
                  f"{us / floor_us:.2f} |", flush=True)
        print(f"| {name} | FlashMLA raw | {raw_us:.1f} | {flops / raw_us / 1e6:.0f} | 1.00x | "
              f"{raw_us / floor_us:.2f} |", flush=True)
        del case
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__, "ceilings": ceilings, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
