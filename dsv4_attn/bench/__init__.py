"""`dsv4-attn bench`: decode, prefill and whole-step timings beside the roofline floor and FlashMLA
(the tool's manual: ``dsv4_attn.bench.cli``, or ``dsv4-attn bench --help``).

Modules: ``configs`` (the shapes), ``timing`` (ceilings, flush, graph replay), ``cases`` (random
inputs), ``runners`` (the public API and FlashMLA's three ways), ``layer`` (one-layer cases),
``step`` (whole steps), ``report`` (table, CSV, plot) and ``cli`` (arguments and the run);
``host`` (``python -m dsv4_attn.bench.host``): host us per eager layer call, split into checks,
dispatch and launch.
"""

from __future__ import annotations

from . import cases, cli, configs, layer, report, runners, step, timing
from .cases import LayerCase, ModelStep, StepLayer, fill_random, make_decode_case, make_model_step, make_prefill_case
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
           "STEP_MODELS", "DecodeConfig", "L2Flush", "LayerCase", "ModelStep", "PrefillConfig", "StepLayer",
           "StepModel",
           "Timing", "api_step_runner", "auto_gaps", "case_work", "cases", "cli", "configs", "default_backends",
           "fill_random", "flashmla_vllm_step_runner", "host_us", "layer", "main", "make_decode_case",
           "make_prefill_case",
           "make_model_step", "measure_ceilings", "report", "run_case", "run_step_case", "runners", "runs_in",
           "select_configs", "step", "step_auto_gaps", "time_callable", "timing", "uncapturable",
           "vllm_c128a_width"]
