"""A whole decode step captured in a CUDA graph at 1M max_model_len with short requests (issue 24):
the C128A rows are captured at the model's width (8192 columns), as in vLLM's full-graph decode.

Prints one JSON line per (model, batch): the graph replay's median us of the step (``plan()`` + every
layer through ``SparseMLA`` on the triton backend), as captured ("graph": the model's width) and,
for reference, captured at the narrow width an eager step of those requests views ("narrow": what a
device-side bound can at best reach). Run it under two trees side by side to compare them:

    PYTHONPATH=<tree> python tests/gpu_scripts/graph_width_step.py [--reps 50] [--batches 2,16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import triton

from dsv4_attn.bench.cases import make_model_step
from dsv4_attn.bench.configs import STEP_MODELS
from dsv4_attn.bench.runners import api_step_runner
from dsv4_attn.bench.timing import L2Flush, time_callable
from dsv4_attn.common import plan as plan_module
from dsv4_attn.common.spec import ModelSpec

MAX_MODEL_LEN = 1 << 20
SHORT = 4096  # request lengths are drawn in [129, SHORT]


def step_case(model_name: str, batch: int):
    """Short requests of ``model_name`` (caches sized for them), planned at 1M max_model_len."""
    model = STEP_MODELS[model_name]
    case = make_model_step(model, batch, 1, "cuda", max_model_len=SHORT)
    spec = ModelSpec.from_hf_config(model.config, max_model_len=MAX_MODEL_LEN)
    return dataclasses.replace(case, spec=spec, batch=dataclasses.replace(case.batch, max_model_len=MAX_MODEL_LEN))


def time_step(case, narrow: bool, reps: int, flush) -> float:
    """Median us of the captured step; ``narrow``: the rows' width bound to the longest request
    (``StepBatch.max_seq_len``) and kept so inside the capture."""
    batch = case.batch
    if narrow:
        batch = dataclasses.replace(batch, max_seq_len=int(batch.seq_lens.max()))
        plan_module._capturing = lambda device: False  # capture the narrow width an eager step views
    run, outs, _ = api_step_runner(dataclasses.replace(case, batch=batch), "triton")
    timing = time_callable(run, reps, flush, True, torch.device("cuda"))
    assert timing.how == "graph", timing.how
    return timing.median * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--batches", default="2,16")
    parser.add_argument("--models", default="v4-flash,v4-flash-tp8")
    parser.add_argument("--narrow", action="store_true", help="also time the narrow capture")
    parser.add_argument("--label", default="", help="names the tree in each line")
    args = parser.parse_args()
    flush = L2Flush(torch.device("cuda"))
    for model in args.models.split(","):
        for b in map(int, args.batches.split(",")):
            case = step_case(model, b)
            row = {"model": model, "batch": b, "layers": len(case.layers), "max_model_len": MAX_MODEL_LEN,
                   "longest": int(case.batch.seq_lens.max()),
                   "graph_us": round(time_step(case, False, args.reps, flush), 1), "tree": args.label,
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
            if args.narrow:
                row["narrow_us"] = round(time_step(case, True, args.reps, flush), 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
