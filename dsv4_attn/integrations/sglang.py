"""SGLang plugin: run SGLang 0.5.23's DeepSeek-V4 / V4.1 attention on dsv4_attn.

Enable it (nothing changes otherwise): ``DSV4_ATTN_SGLANG=1`` in the environment, or
``--attention-backend dsv4_attn``. Docs: docs/sglang.md.

How it hooks in. ``register()`` is the ``sglang.srt.plugins`` entry point, which SGLang runs in
every process before it parses arguments. It makes ``dsv4_attn`` a known ``--attention-backend``
name and, when the plugin is on, wraps SGLang's DeepSeek-V4 backend factories
(``deepseek_v4_trtllm_backend.create_deepseek_v4_attn_backend`` and
``create_deepseek_v4_multistep_backend``, with SGLang's own HookRegistry) so they build our
subclasses of ``DeepseekV4AttnBackend`` / ``DeepseekV4MultiStepBackend``. The subclass keeps all
of SGLang's backend -- cache writes, compressor, indexer, metadata builders, CUDA-graph state,
MTP -- and replaces only ``_forward_attention``, where SGLang calls FlashMLA: one
:class:`~dsv4_attn.common.rows.StepRows` plan per forward pass, ``SparseMLA.forward`` per layer.
What it cannot serve is refused when the backend is created (engine start), because SGLang only
logs a plugin that raises while loading. ``--attention-backend dsv4_attn`` turns the plugin on
for the processes SGLang starts (it sets ``DSV4_ATTN_SGLANG=1`` before they spawn); SGLang's
DeepSeek-V4 override then resolves the backend name to its own ``dsv4``, so SGLang's DSv4 paths
(page size 256, MTP draft backends) stay as they are.

SGLang metadata -> StepRows (``DSV4AttnMetadata``, every forward mode; rows are global slots):

===============================  ===========================================================
StepRows                         SGLang 0.5.23
===============================  ===========================================================
swa_rows int32 [T, 128]          ``swa_page_indices`` (req_to_token -> full_to_swa mapping;
                                 under V4.1 decoder SWA bounded replay SGLang floors them at
                                 the replay start: the StepBatch.swa_start of the vLLM plugin)
swa_lens                         ``swa_topk_lengths``
positions int32 [T]              ``positions_casual``
comp[4] GlobalRows               ``c4_sparse_page_indices`` (the indexer writes each C4A
                                 layer's top-k there, in place) / ``c4_sparse_topk_lengths``
comp[128] GlobalRows             ``c128_page_indices`` / ``c128_topk_lengths_clamp1``
comp[1], comp[2] (V4.1)          ``c1_/c2_sparse_page_indices`` / ``_sparse_topk_lengths``
num_decode_tokens                T in decode, target-verify and draft-extend modes, else 0
num_tokens                       ``q.shape[0]`` (rows past the metadata's are zero output)
===============================  ===========================================================

Lengths SGLang clamps to at least 1 over a -1 entry read nothing (docs/semantics.md#out-of-range-entries).
Caches are SGLang's page buffers viewed as ``[pages, page_size, bytes_per_token]`` without a copy.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from typing import Any

import torch

from .. import envs
from ..api import SparseMLA
from ..common.layout import KVFormat
from ..common.plan import StepPlan
from ..common.rows import GlobalRows, StepRows, TopkTable
from ..common.spec import MAX_HEADS, LayerKind, ModelSpec, model_layer_kinds
from .base import EngineGate, StepPlannerBase, describe_backends, reason, refuse

BACKEND_NAME = "dsv4_attn"  # the --attention-backend name this plugin adds
TESTED_SGLANG_VERSIONS = ("0.5.23",)  # SGLang internals the hooks touch move between releases
GATE = EngineGate(
    engine="SGLang", dist="sglang", entry_group="sglang.srt.plugins", switch=envs.SGLANG, backend_name=BACKEND_NAME,
    tested=TESTED_SGLANG_VERSIONS, series=False, allowed=", ".join(TESTED_SGLANG_VERSIONS),
    why_pinned="it subclasses SGLang's DeepSeek-V4 attention backend, whose internals change between releases")
ENV_ENABLE = GATE.env_name
FACTORY_MODULE = "sglang.srt.layers.attention.deepseek_v4_trtllm_backend"
SWA_WINDOW = 128  # SGLang's DeepSeek-V4 window (deepseek_v4_backend.SWA_WINDOW)

logger = logging.getLogger("sglang.dsv4_attn")  # under SGLang's logger, so its config prints it


# ---- opt-in and version gates ----------------------------------------------------------------
def env_enabled() -> bool:
    """``DSV4_ATTN_SGLANG`` parsed (1/on or 0/off; anything else raises ValueError naming it)."""
    return GATE.env_enabled()


def sglang_version() -> str:
    import sglang

    return sglang.__version__


def is_tested_version(version: str) -> bool:
    return GATE.is_tested(version)


def check_sglang_version(version: str) -> None:
    GATE.check_version(version)


def status() -> dict[str, str]:
    """The plugin's state for ``dsv4-attn probe`` (reads package metadata; imports no SGLang code)."""
    return GATE.status("DeepSeek-V4 attention runs on dsv4_attn")


# ---- the entry point ---------------------------------------------------------------------------------
def register() -> None:
    """``sglang.srt.plugins`` entry point (every SGLang process, before argument parsing; idempotent).

    On a tested SGLang: adds ``dsv4_attn`` to the ``--attention-backend`` choices (and a registry
    entry that refuses non-DeepSeek-V4 models), watches ``ServerArgs.resolve_once`` for that flag, and wraps the
    DeepSeek-V4 backend factories when ``DSV4_ATTN_SGLANG`` is set. On another SGLang it does
    nothing unless ``DSV4_ATTN_SGLANG`` is set, and then makes creating the DeepSeek-V4 backend
    raise with the version found.
    """
    version = sglang_version()
    if not is_tested_version(version):
        if envs.SGLANG.raw is not None:
            _refuse_dsv4_backend(functools.partial(check_sglang_version, version))
        logger.debug("dsv4_attn: SGLang %s is untested; plugin left off", version)
        return
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    ATTENTION_BACKENDS[BACKEND_NAME] = _not_a_deepseek_v4_model
    HookRegistry.register("sglang.srt.server_args.ServerArgs.resolve_once", _before_resolution, HookType.BEFORE)
    if envs.SGLANG.raw is not None:
        install_factory_hooks()


def _not_a_deepseek_v4_model(model_runner):
    arch = getattr(getattr(model_runner.model_config, "hf_config", None), "architectures", None)
    raise ValueError(f"--attention-backend: got {BACKEND_NAME} for {arch}; allowed: {BACKEND_NAME} with DeepSeek-V4 / "
                     "V4.1 models only (SGLang resolves their attention backend to dsv4, which the plugin serves)")


SPLIT_BACKEND_FLAGS = ("prefill_attention_backend", "decode_attention_backend",
                       "speculative_draft_attention_backend")


def _before_resolution(server_args, *args, **kwargs):
    """``--attention-backend dsv4_attn`` (seen before SGLang resolves the arguments, which the
    launchers do before starting any process): the plugin is on here and in the processes started.
    ``dsv4_attn`` for one phase only (``--decode-attention-backend`` and the like) is refused here:
    SGLang would build that phase's backend from the registry entry beside its DeepSeek-V4 one
    (``attention_backend_setup._build_resolved_backend``), while the plugin serves both phases of
    SGLang's one DeepSeek-V4 backend."""
    for name in SPLIT_BACKEND_FLAGS:
        if getattr(server_args, name, None) == BACKEND_NAME:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag}: got {BACKEND_NAME}; allowed: not {BACKEND_NAME} (the plugin runs prefill, "
                             f"decode and MTP draft attention of SGLang's DeepSeek-V4 backend together). Pass "
                             f"--attention-backend {BACKEND_NAME} (or {ENV_ENABLE}=1) instead of {flag} {BACKEND_NAME}")
    if getattr(server_args, "attention_backend", None) == BACKEND_NAME:
        if envs.SGLANG.raw is not None and not env_enabled():
            raise ValueError(f"{ENV_ENABLE}: got {envs.SGLANG.raw!r} beside --attention-backend {BACKEND_NAME}; "
                             f"allowed: 1 or unset with that flag")
        os.environ[ENV_ENABLE] = "1"
        install_factory_hooks()


def install_factory_hooks() -> None:
    """Wrap SGLang's DeepSeek-V4 backend factories (once per process)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for name, hook in (("create_deepseek_v4_attn_backend", _create_backend),
                       ("create_deepseek_v4_multistep_backend", _create_multistep_backend)):
        target = f"{FACTORY_MODULE}.{name}"
        if target not in HookRegistry._patched and not HookRegistry._hooks.get(target):
            HookRegistry.register(target, hook, HookType.AROUND)
    HookRegistry.apply_hooks()
    _refuse_dsv4_backend(_check_platform)


def _refuse_dsv4_backend(check) -> None:
    """Run ``check()`` before SGLang's registry builds its ``dsv4`` backend (every platform) while
    the plugin is on: refusals SGLang's CUDA factories never see (version, HIP, NPU)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    original = ATTENTION_BACKENDS["dsv4"]
    if getattr(original, "_dsv4_attn_check", None) is not None:
        return

    def create_dsv4_backend(runner):
        if env_enabled():
            check()
        return original(runner)

    hooked: Any = create_dsv4_backend  # a function with our marker attribute
    hooked._dsv4_attn_check = check
    ATTENTION_BACKENDS["dsv4"] = hooked


def _check_platform() -> None:
    from sglang.srt.utils import is_cuda

    if not is_cuda():
        raise RuntimeError("dsv4_attn SGLang plugin: got a non-CUDA SGLang platform (HIP / NPU / XPU build "
                           f"the DeepSeek-V4 backend differently); allowed: CUDA. Unset {ENV_ENABLE} there.")


def _create_backend(original, model_runner, **kwargs):
    if not env_enabled():
        return original(model_runner, **kwargs)
    return backend_classes()[0](model_runner, **kwargs)


def _create_multistep_backend(original, model_runner, topk, speculative_num_steps):
    if not env_enabled():
        return original(model_runner, topk, speculative_num_steps)
    return backend_classes()[1](model_runner, topk=topk, speculative_num_steps=speculative_num_steps)


# ---- refusals -------------------------------------------------------------------------------------------
def kv_format_of(pool) -> KVFormat | None:
    """The KV format of SGLang's caches, or None when dsv4_attn has no record for them: the V4
    layout (584 B, both caches) is fp8_ds_mla; the interleaved V4.1 layouts are mxfp8_ds_mla
    (528 B compressed caches) or nvfp4_ds_mla (288 B); SGLang's block-split V4.1 layouts and the
    trtllm uniform-FP8 pool have none."""
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    if getattr(pool, "uniform_fp8", False):
        return None
    swa = pool.get_swa_key_layout()
    comp = {pool.compressed_kv_layout(r) for r in pool.present_ratios}
    if swa is KVLayout.V4 and comp <= {KVLayout.V4}:
        return KVFormat.MODEL1_FP8
    if swa is KVLayout.V41_NEW and comp <= {KVLayout.V41_NEW}:
        return KVFormat.MXFP8
    if swa is KVLayout.V41_NEW and comp and comp <= {KVLayout.V41_FP4_NEW}:
        return KVFormat.NVFP4
    return None


def kernel_heads(model_runner) -> int:
    """Query heads SGLang's DeepSeek-V4 layer hands its attention backend per rank: the local
    heads, padded to 64 -- or all heads above 64 -- under attention tensor parallelism
    (``DeepseekV4Attention._kernel_num_heads``)."""
    from sglang.srt.runtime_context import get_parallel

    heads = model_runner.model_config.hf_text_config.num_attention_heads
    tp = get_parallel().attn_tp_size
    local = heads // tp
    return local if tp == 1 else (64 if local <= 64 else heads)


def unsupported_reasons(model_runner) -> list[str]:
    """Why dsv4_attn cannot serve this SGLang DeepSeek-V4 backend ([] = it can); each reason names
    the flag (or variable), the value it got and what to pass instead."""
    from sglang.srt.runtime_context import get_exec, get_parallel, get_spec

    reasons = []
    version = sglang_version()
    if not is_tested_version(version):
        reasons.append(f"sglang: got {version}; allowed: {', '.join(TESTED_SGLANG_VERSIONS)} (install "
                       f"sglang=={TESTED_SGLANG_VERSIONS[-1]} or unset {ENV_ENABLE})")
    kernel, features = get_exec().kernel, get_exec().features
    if kernel.dsv4_attn_backend in ("trtllm", "flashmla_mega"):
        reasons.append(f"--dsv4-attn-backend: got {kernel.dsv4_attn_backend} (its caches or fused RoPE/output "
                       "quantization are that kernel's own); allowed: flashmla (pass --dsv4-attn-backend flashmla; "
                       "SGLang's auto picks flashmla_mega only for V4.1 on SM100 without attention TP)")
    pool = model_runner.token_to_kv_pool
    if kv_format_of(pool) is None:
        comp = sorted({pool.compressed_kv_layout(r).value for r in pool.present_ratios})
        reasons.append(f"SGLANG_DSV4_KV_LAYOUT: got SWA {pool.get_swa_key_layout().value}, compressed {comp}; allowed: "
                       "v4 (fp8_ds_mla; SGLang's default), or v41_new with v41_new / v41_fp4_new compressed caches "
                       "(pass SGLANG_DSV4_KV_LAYOUT=v4 or v41_new)")
    heads = kernel_heads(model_runner)
    if heads > MAX_HEADS:
        reasons.append(reason("--tp-size", f"{heads} query heads per rank", f"<= {MAX_HEADS}",
                              "pass a larger --tp-size"))
    algorithm = get_spec().speculative_algorithm
    if algorithm is not None and str(algorithm).upper() != "EAGLE":
        reasons.append(f"--speculative-algorithm: got {algorithm} (DSpark's non-causal draft windows are not modelled "
                       "by dsv4_attn); allowed: EAGLE (MTP, top-k 1; pass --speculative-algorithm EAGLE, or no "
                       "speculative decoding)")
    if model_runner.hisparse_coordinator is not None:
        reasons.append("--enable-hisparse: got on (its swapped-in C4 pages are not modelled); allowed: off (drop "
                       "--enable-hisparse)")
    if get_parallel().attn_cp_size > 1:
        reasons.append(f"--attn-cp-size: got {get_parallel().attn_cp_size} (attention context parallelism is not "
                       "modelled); allowed: 1 (drop --enable-prefill-cp / --attn-cp-size)")
    # Decoder SWA bounded replay (SGLang's default for V4.1 on CUDA) is served: SGLang floors the
    # late layers' SWA rows itself (see StepPlanner.step_rows). Encoder replay swaps the SWA
    # cache for per-request windows (DeepSeekV4TokenToKVPool.request_window) that are not.
    if getattr(features, "enable_encoder_swa_bounded_replay", False):
        reasons.append("--enable-encoder-swa-bounded-replay: got on (its per-request SWA windows are not modelled); "
                       "allowed: off (drop the flag)")
    if getattr(model_runner.server_args, "enable_two_batch_overlap", False):
        reasons.append("--enable-two-batch-overlap: got on (interleaved micro-batches share one backend); allowed: "
                       "off (drop the flag)")
    return reasons


# ---- the backend --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def backend_classes() -> tuple[type, type]:
    """(our DeepseekV4AttnBackend subclass, our DeepseekV4MultiStepBackend subclass), built on
    first use so that this module imports without SGLang."""
    from sglang.srt.layers.attention import deepseek_v4_backend as base

    class DSv4AttnBackend(base.DeepseekV4AttnBackend):
        """SGLang's DeepSeek-V4 attention backend with the attention kernel call on dsv4_attn."""

        def __init__(self, model_runner, *args, **kwargs) -> None:
            refuse("this SGLang DeepSeek-V4 model", unsupported_reasons(model_runner))
            super().__init__(model_runner, *args, **kwargs)
            self.dsv4_planner = planner_for(model_runner)

        def _forward_attention(self, q, k, v, layer, forward_batch, compress_ratio, save_kv_cache=True,
                               attn_sink=None, cos_sin_cache=None, **_):
            if cos_sin_cache is not None:
                raise ValueError("cos_sin_cache: got a tensor (mega attention's fused RoPE); allowed: None")
            if self.mtp_enabled and forward_batch.forward_mode.is_idle():  # as SGLang's backend does
                return q.new_empty((q.shape[0], q.shape[1], layer.v_head_dim))
            core = self.forward_metadata.core_attn_metadata
            if not isinstance(core, base.DSV4AttnMetadata):
                raise NotImplementedError("ragged attention")  # SGLang's backend raises the same
            if save_kv_cache:
                self.store_cache(layer.layer_id, k, forward_batch)
            return self.dsv4_planner.attend(q, layer.layer_id, compress_ratio, core, forward_batch, attn_sink,
                                            self.token_to_kv_pool)

    class DSv4AttnMultiStepBackend(base.DeepseekV4MultiStepBackend):
        """SGLang's MTP draft-decode backend whose per-step backends are ours."""

        def _make_step_backend(self, model_runner, step_id):
            return DSv4AttnBackend(model_runner, speculative_step_id=step_id, topk=self.topk,
                                   speculative_num_steps=self.speculative_num_steps)

    for cls in (DSv4AttnBackend, DSv4AttnMultiStepBackend):
        cls.__module__ = __name__
    return DSv4AttnBackend, DSv4AttnMultiStepBackend


def spec_for(model_runner) -> ModelSpec:
    """The model as dsv4_attn sees it per rank: the window and the compression ratios of SGLang's
    pool (ratio 128 attends every entry, others the indexer's top-k), the index top-k, the
    longest sequence SGLang's request table holds (fixes the C128A row width), and how many layers
    of each kind the config lists (what auto weighs per-step work by; common/spec.py
    model_layer_kinds)."""
    from sglang.srt.runtime_context import get_parallel

    cfg = model_runner.model_config.hf_text_config
    ratios = model_runner.token_to_kv_pool.present_ratios
    kinds = [LayerKind.SWA] + [LayerKind.from_ratio(r) for r in ratios]
    heads = cfg.num_attention_heads // get_parallel().attn_tp_size
    return ModelSpec(num_heads=heads, topk=int(getattr(cfg, "index_topk", 512)),
                     max_model_len=model_runner.req_to_token_pool.req_to_token.shape[1], window=SWA_WINDOW,
                     layers=model_layer_kinds(cfg, dict.fromkeys(kinds)))


def step_token_bound(model_runner) -> int:
    """The most query rows one SGLang forward can hand a backend of this process, from SGLang's
    config at engine start (the plan buffers are sized for it, so no step is refused later):

    * an extend: SGLang's prefill buffer ceiling (``sglang/srt/runtime_context.py``
      ``max_prefill_buffer_tokens``: ``--chunked-prefill-size``, which mixed-in decode tokens and
      replay rows share); without chunked prefill a whole prompt (``schedule_policy.PrefillAdder``
      admits the first request above ``--max-prefill-tokens``): the context length or
      ``--max-prefill-tokens``, whichever is larger;
    * decode, target verify, draft extend: every request slot (``req_to_token_pool.size``, at
      most ``--max-running-requests``) times the tokens a request brings (1, the draft tokens, or
      the draft steps + 1);
    * CUDA-graph padding: the decode graphs' largest batch times those tokens; the prefill
      graphs' largest captured size.
    """
    from sglang.srt.runtime_context import get_exec, get_spec, max_prefill_buffer_tokens

    args, spec = model_runner.server_args, get_spec()
    context = int(model_runner.req_to_token_pool.req_to_token.shape[1])
    extend = max_prefill_buffer_tokens() or max(context, int(getattr(args, "max_prefill_tokens", 0) or 0))
    per_request = max(1, int(spec.speculative_num_draft_tokens or 0), int(spec.speculative_num_steps or 0) + 1)
    requests = int(getattr(model_runner.req_to_token_pool, "size", 0) or 0)
    graphs = getattr(get_exec().graph, "cuda_graph_config", None)
    decode_graph = int(getattr(getattr(graphs, "decode", None), "max_bs", 0) or 0)
    prefill_graph = int(getattr(getattr(graphs, "prefill", None), "max_bs", 0) or 0)
    return max(extend, requests * per_request, decode_graph * per_request, prefill_graph, 1)


def planner_for(model_runner) -> StepPlanner:
    spec = spec_for(model_runner)
    fmt = kv_format_of(model_runner.token_to_kv_pool)
    assert fmt is not None  # unsupported_reasons refused the pools without a dsv4_attn format
    planner = StepPlanner(spec, fmt, step_token_bound(model_runner), torch.device(model_runner.device))
    planner.log()
    return planner


class StepPlanner(StepPlannerBase):
    """One StepRows plan per forward pass of one SGLang backend, shared by its layers.

    A forward pass runs the layers in ascending layer id; a layer id that does not ascend, or
    metadata tensors that are not the ones planned, start a new plan (SGLang rebuilds or refills
    its metadata every forward, also when a breakable CUDA graph replays; the late layers of a
    V4.1 extend under decoder SWA bounded replay switch to SGLang's tail metadata, whose tensors
    differ). Plan buffers, allocated at construction: ``max_tokens * 13`` bytes (dsv4_attn's
    PlanBuffers: positions, requests, validity); the rows are SGLang's, viewed (a StepRows plan
    never allocates the SWA row buffers a StepBatch plan builds its rows in).
    """

    def __init__(self, spec: ModelSpec, fmt: KVFormat, max_tokens: int, device: torch.device) -> None:
        super().__init__()
        self.mla = SparseMLA(spec, fmt, max_tokens=max_tokens)  # backend refusals surface here
        self._allocate(device)
        self._last_layer: int | None = None
        self._planned: tuple = ()
        self._plan: StepPlan | None = None

    def _allocate(self, device: torch.device) -> None:
        """Allocate the plan buffers now (engine start, before SGLang sizes what memory is left)
        by planning an empty step: an out-of-memory shows at start, never at the first forward."""
        none = torch.zeros(0, 1, dtype=torch.int32, device=device)
        self.reserve_buffers(self.mla, StepRows(none, none[:, 0], none[:, 0]), self.mla.max_tokens)

    def step_rows(self, core, num_tokens: int, decode: bool) -> StepRows:
        """SGLang's per-token metadata as StepRows (views; no copy). Under V4.1's decoder SWA
        bounded replay the late layers get SGLang's tail metadata, whose SWA rows SGLang already
        floors at each request's replay start (``BuildCausalSwaPageIndices`` with
        ``swa_replay_start``: -1 below the floor, ``swa_topk_lengths`` cut to match; newest slot
        first): those rows are what vLLM's ``replay_start`` becomes as ``StepBatch.swa_start``."""
        n = min(num_tokens, core.swa_page_indices.shape[0])
        comp: dict[int, GlobalRows | TopkTable] = {}
        for ratio in core.present_ratios:
            rows = core.sparse_page_indices(ratio)
            if rows is not None:
                comp[ratio] = GlobalRows(rows, core.sparse_topk_lengths(ratio))
        return StepRows(core.swa_page_indices, core.swa_topk_lengths, core.positions_casual,
                        num_decode_tokens=n if decode else 0, comp=comp, num_tokens=n)

    def plan(self, layer_id: int, rows: StepRows):
        tensors = [rows.swa_rows, rows.swa_lens, rows.positions] + [t for e in rows.comp.values()
                                                                     if isinstance(e, GlobalRows)
                                                                     for t in (e.rows, e.lens)]
        same = (self._plan is not None and self._last_layer is not None and layer_id > self._last_layer
                and self._plan.num_tokens == rows.num_tokens and len(tensors) == len(self._planned)
                and all(ref() is t for ref, t in zip(self._planned, tensors)))
        if not same:
            self._plan = self.plan_step(self.mla, rows)
            self._planned = tuple(weakref.ref(t) for t in tensors)
        self._last_layer = layer_id
        return self._plan

    def attend(self, q, layer_id: int, compress_ratio: int, core, forward_batch, sink, pool) -> torch.Tensor:
        """One layer: ``q`` bf16 [T, H, 512] -> out bf16 [T, H, 512] (tokens without metadata rows: 0)."""
        mode = forward_batch.forward_mode
        decode = mode.is_decode_or_idle() or mode.is_target_verify() or mode.is_draft_extend_v2()
        rows = self.step_rows(core, q.shape[0], decode)
        plan = self.plan(layer_id, rows)
        kind = LayerKind.SWA if compress_ratio == 0 else LayerKind.from_ratio(compress_ratio)
        n = plan.num_tokens
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        out[n:].zero_()
        self.mla.forward(plan, kind, q[:n], swa_cache_view(pool, layer_id),
                         comp_cache_view(pool, layer_id) if kind.has_comp_scope else None,
                         sink=sink, out=out[:n])
        return out

    def log(self) -> None:
        logger.info("dsv4_attn: SGLang's DeepSeek-V4 attention runs on dsv4_attn %s", describe_backends(self.mla))


def _page_view(buffer: torch.Tensor, page_size: int, bytes_per_token: int) -> torch.Tensor:
    """SGLang's ``[pages, padded page bytes]`` uint8 buffer as ``[pages, page_size, bytes]`` (a view)."""
    return buffer[:, : page_size * bytes_per_token].view(buffer.shape[0], page_size, bytes_per_token)


def swa_cache_view(pool, layer_id: int) -> torch.Tensor:
    return _page_view(pool.get_swa_key_buffer_radix(layer_id), pool.get_swa_key_page_size(),
                      pool.get_swa_key_bytes_per_token())


def comp_cache_view(pool, layer_id: int) -> torch.Tensor:
    return _page_view(pool.get_extra_key_buffer(layer_id), pool.get_extra_key_page_size(layer_id),
                      pool.get_extra_key_bytes_per_token(layer_id))
