"""`dsv4-attn bench`: decode and prefill benchmarks with the roofline and FlashMLA side by side.

For every case it times our backend (default ``triton``) and, in the same run, FlashMLA when it
can be loaded, and prints µs, TFLOP/s, GB/s, the roofline floor (from the copy bandwidth and
the bf16 matrix rate measured at the start of the run), time / floor, FlashMLA's µs and our
speed-up over it. Timing: CUDA-graph replay (or eager launches with ``--no-graph``), one event
pair per run, the L2 flushed before every run, median of ``--reps`` runs.

Bytes of a case = every valid KV row once, in its cache's record (V4 fp8 584 B, V4.1 MXFP8 528 B,
NVFP4 288 B, BF16 1024 B, FP8 per-tensor 512 B) + q + out; FLOPs = 4 · H · valid keys · 512 per
token (Q·Kᵀ and P·V). The floor is what those bytes and FLOPs cost at the measured ceilings.

Configs: V4 (C4A / C128A layers, ``h64-c4a512`` ...) and V4.1 (C1A / C2A top-k layers,
``h64-c1a512`` ...; ``v41-`` prefill). ``--format`` takes several KV formats; a config runs in
every format its model stores (V4.1 records: V4.1 configs only), e.g. the V4.1 configs in
``fp8_ds_mla`` (vLLM's record for V4.1 on SM90, FlashMLA side by side) and in ``mxfp8_ds_mla`` /
``nvfp4_ds_mla`` (SM100 records: the Triton kernels' software dequantization vs the floor).

``--guard-cost`` also times each Triton kernel this GPU runs (Gluon on sm_90 for fp8_ds_mla, the
portable one everywhere) compiled with and without its index range checks (out-of-range entries
skipped, never read: docs/bad-input.md) on the same case, interleaved A-B-B-A, and prints the
checks' cost in percent (target < 1 %) and whether both builds gave the same bits.

``--mode step`` times one whole decode step of DeepSeek-V4-Flash (``v4-flash``: 64 heads, top-k
512, 43 layers: 0-1 window only, then C4A on even and C128A on odd layers, per the public model
card) and DeepSeek-V4-Pro (``v4-pro``: 128 heads, top-k 1024, 61 layers: 0-1 C128A, then C4A /
C128A alternating; from third-party summaries of its config, not its config.json), the layer
list built by ``ModelSpec.from_hf_config`` (the MTP draft layer left out: it runs in the
drafter's own forward). One step = ``plan()`` once + every attention layer, captured as ONE
graph, for ``auto`` (``SparseMLA(backend="auto")``), each ``--backends`` name and FlashMLA driven
the way vLLM 0.33 drives it (``flashmla_vllm_step_runner``: its per-step metadata, a C4A layer's
top-k translation and the raw ``sparse_decode_fwd`` per layer); it prints µs per step and per
layer and each one's speed-up over FlashMLA-as-vLLM (target: auto >= 1.2x). Every layer owns
its SWA cache and C128A cache; the C4A layers share one compressed cache (memory), each with
its own top-k and q. On ``--device cpu`` it runs the torch backend at context lengths <= 2048.

FlashMLA is timed through ``SparseMLA(..., backend="flashmla")`` when that backend is usable
(so its adapter is timed too); otherwise through the raw op ``torch.ops._flashmla_C`` from
``$DSV4_ATTN_FLASHMLA_LIB`` or ``.flashmla/_flashmla_C.abi3.so`` (noted in the output: raw
prefill then times the kernel on a ready bf16 workspace, without the gather).

    dsv4-attn bench --mode decode --batches 2 64 128 256 --json out.json --png out.png
    dsv4-attn bench --mode step --backends triton flashmla --batches 64 128 256 --json step.json
    dsv4-attn bench --configs v41 --format fp8_ds_mla mxfp8_ds_mla nvfp4_ds_mla --json v41.json

Modules: ``configs`` (the shapes), ``timing`` (ceilings, flush, graph replay), ``cases`` (random
inputs), ``runners`` (the public API and FlashMLA's three ways), ``layer`` (one-layer cases),
``step`` (whole steps), ``report`` (table, CSV, plot) and ``cli`` (arguments and the run).
"""

from __future__ import annotations

from . import cases, cli, configs, layer, report, runners, step, timing
from .cases import Case, StepCase, StepLayer, fill_random, make_decode_case, make_prefill_case, make_step_case
from .cli import default_backends, main
from .configs import (
                      DECODE_CONFIGS,
                      PREFILL_CONFIGS,
                      STEP_CPU_MAX_MODEL_LEN,
                      STEP_MAX_MODEL_LEN,
                      STEP_MODELS,
                      DecodeConfig,
                      PrefillConfig,
                      StepModel,
                      runs_in,
                      select_configs,
)
from .layer import case_work, run_case, uncapturable
from .report import CSV_COLUMNS, auto_gaps, step_auto_gaps
from .runners import api_step_runner, flashmla_vllm_step_runner, vllm_c128a_width
from .step import run_step_case
from .timing import L2Flush, Timing, host_us, measure_ceilings, time_callable

__all__ = ["CSV_COLUMNS", "DECODE_CONFIGS", "PREFILL_CONFIGS", "STEP_CPU_MAX_MODEL_LEN", "STEP_MAX_MODEL_LEN",
           "STEP_MODELS", "Case", "DecodeConfig", "L2Flush", "PrefillConfig", "StepCase", "StepLayer", "StepModel",
           "Timing", "api_step_runner", "auto_gaps", "case_work", "cases", "cli", "configs", "default_backends",
           "fill_random", "flashmla_vllm_step_runner", "host_us", "layer", "main", "make_decode_case",
           "make_prefill_case",
           "make_step_case", "measure_ceilings", "report", "run_case", "run_step_case", "runners", "runs_in",
           "select_configs", "step", "step_auto_gaps", "time_callable", "timing", "uncapturable",
           "vllm_c128a_width"]
