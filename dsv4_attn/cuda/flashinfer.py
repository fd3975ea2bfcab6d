"""Backend `flashinfer-trtllm`: FlashInfer's TRTLLM-gen DSv4 sparse MLA kernel (NVIDIA SM100).

CONTRACT-TESTED ONLY: no SM100 GPU was available. Every tensor this adapter passes is checked in
CI against the documented contract of ``trtllm_batch_decode_sparse_mla_dsv4`` (flashinfer-python
0.7.2.post1, docs/nvidia.md) by a stand-in that also computes the documented math; the kernel
itself has never run here.

DeepSeek-V4 and V4.1 alike (every layer kind: the kernel takes global rows), as vLLM 0.33 runs
both on SM100 (``models/deepseek_v41/nvidia/flashinfer_sparse.py``); plain-row caches only
(bfloat16, or fp8 e4m3 with one per-tensor scale): vLLM has no FlashInfer path for DeepSeek's
packed records on SM100.

The kernel takes ONE merged index row per token: columns [0, 128) are SWA slots, the rest
compressed slots padded with -1 to a multiple of 4 (16-byte rows), all as STORAGE offsets
``block * (stride(0) // 512) + offset`` (``common.indices.merged_rows``; slots outside a cache
become -1 first, docs/bad-input.md). The kernel attends the first ``min(seq_len, 128)`` SWA
columns and the compressed columns up to ``sparse_topk_lens``; whether it skips a -1 there or
loads it as a zero key that still enters the softmax is not documented (SGLang reports the
latter), so each region's keys are moved to its front and the lengths count keys exactly:
``sparse_topk_lens`` = 128 + the compressed key count, and tokens are flattened to ``B = T``
requests of one query token whose ``seq_lens`` is the token's SWA key count (at least 1, the
kernel's floor for one query token; a token whose whole window is out of range gets one -1
column), so the window rule ``clamp(seq_len - (q_len - 1 - q_off), 0, 128)`` selects exactly
its keys and no host sync is needed for ``max_q_len``. Decode and prefill tokens are launched
separately (the split vLLM keeps: the launcher is tuned for uniform-q batches) with separate
workspaces (a workspace shared between a captured decode and an eager prefill corrupted scratch
in vLLM PR #57388). Merged rows of kinds without a top-k (SWA-only, C128A) are built once per
step and reused by every layer of that kind; top-k kinds' rows differ per layer. FP8: q is cast
to e4m3 with q_scale 1.0 and the scales go in as Python floats (the scalar path): bmm1 =
softmax_scale * q_scale * kv_scale, bmm2 = kv_scale.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..common.backend import Backend, Capabilities, LayerInputs, LayerShape, Phase, PlatformSupport
from ..common.heads import LazyStaging, padded_heads, stage
from ..common.indices import bounded_rows, merged_rows
from ..common.layout import CacheGeometry, KVFormat
from ..common.plan import StepPlan
from ..common.platform import Platform, dist_version
from ..common.spec import HEAD_DIM, LayerKind, ModelSpec, round_up

SWA_WIDTH = 128  # the kernel hard-codes a 128-column SWA region (kDsv4SparseMlaSlidingWindowTopK)
WORKSPACE_BYTES = 128 << 20  # vLLM's _FLASHINFER_DSV4_WORKSPACE_BUFFER_SIZE
Q_SCALE = 1.0  # q is cast to e4m3 unscaled, as vLLM does
_FUNCTION = "trtllm_batch_decode_sparse_mla_dsv4"
_MODULES = ("flashinfer.decode", "flashinfer.mla")  # vLLM imports it from flashinfer.decode
# keyword arguments of the 0.7.2.post1 signature this adapter passes
_REQUIRED_PARAMS = ("query", "swa_kv_cache", "workspace_buffer", "sparse_indices", "compressed_kv_cache",
                    "sparse_topk_lens", "seq_lens", "out", "bmm1_scale", "bmm2_scale", "sinks", "kv_layout",
                    "backend", "sparse_indices_are_storage_offsets", "multi_ctas_kv_counter_buffer")


def _cubin_reason(version: str | None) -> str | None:
    """TRTLLM-gen cubins come from FLASHINFER_CUBIN_DIR or a flashinfer-cubin of the SAME version;
    otherwise FlashInfer downloads them at first use (docs/vendor-apis.md "JIT and cubins")."""
    cubin_dir = os.environ.get("FLASHINFER_CUBIN_DIR")
    if cubin_dir and os.path.isdir(cubin_dir) and os.listdir(cubin_dir):
        return None
    cubin = dist_version("flashinfer-cubin")
    if cubin is not None and cubin == version:
        return None
    return (f"TRTLLM-gen cubins missing: flashinfer-cubin {cubin or 'not installed'} does not match "
            f"flashinfer-python {version} and FLASHINFER_CUBIN_DIR is unset or empty (FlashInfer would download "
            "them at first use)")


def _jit_reason() -> str | None:
    """The launcher is JIT-compiled unless flashinfer-jit-cache ships it: nvcc is needed."""
    if dist_version("flashinfer-jit-cache") is not None or shutil.which("nvcc"):
        return None
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.isfile(os.path.join(cuda_home, "bin", "nvcc")):
        return None
    return "no nvcc (PATH / CUDA_HOME) and no flashinfer-jit-cache: FlashInfer cannot build its TRTLLM-gen launcher"


@functools.lru_cache(maxsize=1)
def load_flashinfer() -> tuple[Callable | None, str | None, tuple[str, ...]]:
    """(kernel function, flashinfer version, reasons it cannot be used). Imports flashinfer; call
    only on an SM100 machine. Never raises."""
    try:
        found = importlib.util.find_spec("flashinfer") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return None, None, ("flashinfer (flashinfer-python) is not installed",)
    version = dist_version("flashinfer-python")
    fn, errors = None, []
    for module in _MODULES:
        try:
            fn = getattr(importlib.import_module(module), _FUNCTION)
            break
        except Exception as exc:
            errors.append(f"{module}.{_FUNCTION}: {type(exc).__name__}: {exc}")
    if fn is None:
        return None, version, (f"flashinfer {version} has no usable {_FUNCTION} ({'; '.join(errors)})",)
    missing = [p for p in _REQUIRED_PARAMS if p not in inspect.signature(fn).parameters]
    reasons = [f"flashinfer {version} {_FUNCTION} lacks parameters {missing} (written against 0.7.2.post1)"] \
        if missing else []
    reasons += [r for r in (_cubin_reason(version), _jit_reason()) if r]
    return (fn if not reasons else None), version, tuple(reasons)


def _pool(cache: torch.Tensor, geo: CacheGeometry, name: str) -> torch.Tensor:
    """The plain-row cache (checked by SparseMLA: ``geo``) as the kernel takes it (HND 3-D
    ``[pages, page, 512]``, token stride 512, page stride from the geometry). Host-only checks of
    what the kernel adds, no copy (FNUZ caches are refused at backend selection)."""
    if geo.block_stride % HEAD_DIM:
        raise ValueError(f"{name}: got block stride {geo.block_stride} elements; allowed: a multiple of "
                         f"{HEAD_DIM} (the token stride)")
    if cache.data_ptr() % 16:
        raise ValueError(f"{name}: got base address {cache.data_ptr():#x}; allowed: 16-byte aligned (TMA)")
    if geo.num_blocks * (geo.block_stride // HEAD_DIM) > 2**31:
        raise ValueError(f"{name}: got {geo.num_blocks} blocks of {geo.block_stride // HEAD_DIM} token slots; "
                         "allowed: storage offsets below 2**31 (the kernel's int32 token coordinates)")
    return cache.as_strided((geo.num_blocks, geo.block_size, HEAD_DIM), (geo.block_stride, HEAD_DIM, 1))


def storage_offsets(rows: torch.Tensor, geo: CacheGeometry) -> torch.Tensor:
    """Global slots ``block * bs + offset`` -> storage offsets ``block * span + offset`` with
    ``span = block_stride // 512`` (int32, -1 kept; the same tensor when span == bs)."""
    span = geo.block_stride // HEAD_DIM
    if span == geo.block_size:
        return rows
    r = rows.long()
    offsets = torch.div(r, geo.block_size, rounding_mode="floor") * span + r.remainder(geo.block_size)
    return torch.where(rows < 0, torch.full_like(offsets, -1), offsets).to(torch.int32)


def inside_cache(rows: torch.Tensor, geo: CacheGeometry) -> torch.Tensor:
    """rows int32 [T, K] with every slot outside ``[0, num_slots)`` of the cache set to -1 (the
    kernel reads every entry that is not -1). A new tensor."""
    return bounded_rows(rows, geo.num_slots)


@dataclass(frozen=True)
class FlashInferMeta:
    """Per-step metadata of one layer shape (``FlashInferTRTLLMBackend.prepare``).

    staging   the step's head staging (shared by every kind: the window-only shape's)
    counters  uint8 multi-CTA KV counters for the padded heads (shared by every kind)
    rows      a kind without a top-k (SWA, C128A): its merged rows, lens and seq_lens
              (``_rows``), the same for every layer; None for top-k kinds (rows differ per layer)
    """

    staging: LazyStaging
    counters: torch.Tensor
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class FlashInferTRTLLMBackend(Backend):
    name = "flashinfer-trtllm"
    splits_phases = True  # decode and prefill tokens are separate launches
    capabilities = Capabilities(
        platforms=(PlatformSupport("cuda", archs=("sm10*",), label="NVIDIA SM100 family (TRTLLM-gen)"),),
        formats=(KVFormat.BF16, KVFormat.FP8_TENSOR),  # vLLM's SM100 FlashInfer path reads plain rows only
        kinds=None,  # global rows: every (ratio, selection), V4's and V4.1's (vLLM 0.33 serves both)
        windows=(SWA_WIDTH,),  # the kernel hard-codes the window
        platform_need="needs an NVIDIA SM100-family GPU (TRTLLM-gen has no SM90 path)",
        heads_note="padded to 64/128",
        validated="contract tests only (no SM100 GPU here)",
        notes="needs flashinfer-python with matching cubins",
    )

    def __init__(self) -> None:
        self._workspaces: dict[tuple, torch.Tensor] = {}

    def describe_binary(self, platform: Platform) -> tuple[dict | str, list[str]]:
        """Whether flashinfer-python and its TRTLLM-gen DSv4 kernel are usable here (imported only
        where the kernels can run: SM100)."""
        lib = platform.library("flashinfer")
        found = f"flashinfer-python {lib.version} installed; " if lib.found else ""
        cap = platform.capability
        if cap is None or cap[0] < 10:
            why = f"the TRTLLM-gen DSv4 kernels need an NVIDIA SM100-family GPU (this is {platform.arch})"
            return f"not loaded: {why}", [f"not used: {found}{why}"]
        fn, version, reasons = load_flashinfer()
        info = {"usable": fn is not None, "version": version, "reasons": list(reasons)}
        if fn is not None:
            return info, [f"usable: flashinfer-python {version} with its TRTLLM-gen DSv4 kernel"]
        return info, [f"not usable: {found}" + "; ".join(reasons)]

    # ---- capability ---------------------------------------------------------------------------
    def platform_reasons(self, platform: Platform) -> list[str]:
        reasons = super().platform_reasons(platform)
        if reasons:  # say whether the library is there at all: the usual question off SM100
            lib = platform.library("flashinfer")
            have = f"flashinfer {lib.version} installed" if lib.found else "flashinfer not installed"
            reasons = [f"{reasons[0]} ({have})"]
        return reasons

    def extra_reasons(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
                      dialects) -> list[str]:
        return list(load_flashinfer()[2])

    # ---- per-step metadata ------------------------------------------------------------------
    def prepare(self, plan: StepPlan, shape: LayerShape) -> FlashInferMeta:
        if shape.kind is not LayerKind.SWA:  # the window-only shape's staging and counters
            window = replace(self.meta(plan, shape.window_only()), rows=None)
        else:
            hp = padded_heads(shape.num_heads)
            dtype = shape.fmt.cache_dtype(shape.dialects[0]) if shape.fmt is KVFormat.FP8_TENSOR else torch.bfloat16
            window = FlashInferMeta(LazyStaging(plan.num_tokens, hp, plan.device, dtype),
                                    _counters(plan.num_tokens, hp, plan.device))
        if shape.kind.uses_topk:  # the indexer's top-k differs per layer
            return window
        comp_geo = shape.comp_geo or shape.swa_geo  # window-only shapes have none (their rows never index it)
        return replace(window, rows=self._rows(plan, shape.kind, None, shape.swa_geo, comp_geo))

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor) -> None:
        T, nd = plan.num_tokens, plan.num_decode_tokens
        if T == 0:
            return
        if 0 < nd < T:  # a mixed plan handed over directly: decode and prefill launched separately
            for phase, a, b in ((Phase.DECODE, 0, nd), (Phase.PREFILL, nd, T)):
                self.forward(plan.phase_plan(phase), layer.token_slice(a, b), out[a:b])
            return
        fn, _, reasons = load_flashinfer()
        if fn is None:
            raise RuntimeError("flashinfer-trtllm cannot run: " + "; ".join(reasons))
        phase = Phase.DECODE if nd else Phase.PREFILL
        swa_geo = layer.swa_geo
        swa_pool = _pool(layer.swa_cache, swa_geo, "swa_cache")
        if layer.kind.has_comp_scope:
            comp_cache, comp_geo = layer.comp_storage()
            comp_pool = _pool(comp_cache, comp_geo, "comp_cache")
        else:  # the kernel requires a compressed pool; SWA-only rows never index it
            comp_pool, comp_geo = swa_pool, swa_geo
        meta = self.meta(plan, layer.shape)
        indices, lens, window_keys = meta.rows or self._rows(plan, layer.kind, layer.topk, swa_geo, comp_geo)
        q, kout, sink, staging = stage(meta.staging, layer.q, layer.sink, out,
                                       cast=layer.fmt is KVFormat.FP8_TENSOR)  # fp8: q cast unscaled (q_scale 1.0)
        kv_scale = float(layer.kv_scale) if layer.fmt is KVFormat.FP8_TENSOR else 1.0
        fn(
            query=q[:, None],
            swa_kv_cache=swa_pool,
            workspace_buffer=self._workspace(q.device, phase),
            sparse_indices=indices,
            compressed_kv_cache=comp_pool,
            sparse_topk_lens=lens,
            seq_lens=window_keys,
            out=kout[:, None],
            bmm1_scale=float(layer.softmax_scale * Q_SCALE * kv_scale),
            bmm2_scale=kv_scale,
            sinks=sink,
            kv_layout="HND",
            backend="trtllm-gen",
            sparse_indices_are_storage_offsets=True,
            multi_ctas_kv_counter_buffer=meta.counters,
        )
        if staging is not None:
            out.copy_(staging.out[:, : out.shape[1]])

    @staticmethod
    def _rows(plan: StepPlan, kind: LayerKind, topk: torch.Tensor | None, swa_geo: CacheGeometry,
              comp_geo: CacheGeometry):
        """Merged storage-offset rows int32 [T, 128 + round_up(K, 4)] (each region's keys first),
        lens int32 [T] (128 + the compressed key count) and seq_lens int32 [T] (the SWA key count,
        at least 1)."""
        comp_rows, comp_lens = plan.comp_scope(kind, topk)
        comp = None if comp_rows is None else storage_offsets(inside_cache(comp_rows, comp_geo), comp_geo)
        rows, lens = merged_rows(storage_offsets(inside_cache(plan.swa_rows, swa_geo), swa_geo), plan.swa_lens,
                                 comp, comp_lens)
        window_keys = (rows[:, :SWA_WIDTH] >= 0).sum(dim=1).clamp(min=1).to(torch.int32)
        return rows, lens, window_keys

    def _workspace(self, device: torch.device, phase: Phase) -> torch.Tensor:
        """One zeroed 128 MiB split-K workspace per device and phase, allocated on first use
        (make that first call outside a CUDA-graph capture)."""
        key = (device, phase)
        if key not in self._workspaces:
            self._workspaces[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspaces[key]


def _counters(batch: int, heads: int, device: torch.device) -> torch.Tensor:
    """Caller-owned zeroed multi-CTA KV counters (the kernel resets them after use):
    ``round_up(max(batch * heads, sm_count), 8) * 4`` bytes (flashinfer.utils)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return torch.zeros(round_up(max(batch * heads, sms), 8) * 4, dtype=torch.uint8, device=device)
