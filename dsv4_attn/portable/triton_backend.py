"""Backend `triton`: portable Triton kernels (NVIDIA through Triton's CUDA backend, AMD through ROCm).

One launch per layer (two when a small batch splits the key range, except on sm_90 with at most 8
heads, where the Gluon kernel merges its splits itself): every token attends its SWA
rows and its compressed rows with one online softmax and the sink, reading the caches in place,
each in its own record (V4 fp8, V4.1 MXFP8 and NVFP4 dequantized in registers, BF16, FP8
per-tensor), local top-k entries translated to global slots inside the kernel. On sm_90 the V4
record runs the Gluon kernel (``kernels/hopper.py``), everything else the portable kernel
(``kernels/attention.py``); ``choice()`` (shown by ``SparseMLA.explain()``) says which and why.

Refusals beyond the declared capabilities: Triton not importable; no GPU (on CPU the kernels only
run under ``TRITON_INTERPRET=1``, which tests use); NVIDIA GPUs older than sm_89 for the fp8
formats (Triton's e4m3 conversions need sm_89+).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import TYPE_CHECKING

import torch

from ..common.backend import Backend, Capabilities, LayerInputs, Phase, PlatformSupport, repeat_sources
from ..common.checks import plan_tensors_key, tensor_signature
from ..common.layout import Fp8Dialect, KVFormat, Record
from ..common.plan import StepPlan, capturing
from ..common.platform import Platform, triton_interpreting
from ..common.spec import LayerKind, ModelSpec

if TYPE_CHECKING:  # the kernels import Triton: only at the first launch (``_kernels``)
    from .kernels.launch import Workspace


class TritonBackend(Backend):
    name = "triton"
    capabilities = Capabilities(
        platforms=(PlatformSupport("cuda", min_capability=(8, 0), label="NVIDIA sm_80+ (fp8 formats sm_89+)"),
                   PlatformSupport("rocm", label="AMD ROCm (through Triton)")),
        formats=(KVFormat.MODEL1_FP8, KVFormat.BF16, KVFormat.FP8_TENSOR, KVFormat.MXFP8, KVFormat.NVFP4),
        kinds=None,  # every (ratio, selection): the kernels take the ratio as a parameter
        dialects=(Fp8Dialect.OCP, Fp8Dialect.FNUZ),
        heads_note="blocks of 16, 32 or 64 heads (16 on AMD); fewer heads padded inside the kernel",
        validated="H100 (hardware); CPU via TRITON_INTERPRET=1 (logic only); AMD: compile-checked offline",
        notes="one launch per layer (+1 small combine when few tokens split the key range; on sm_90 with <= 8 "
              "heads the kernel merges its splits itself)",
    )
    batch_invariant = True  # one program walks a token's keys in order; the mode turns the split off

    def __init__(self, config=None) -> None:
        self._config = config  # kernels.ops.KernelConfig or None (defaults)
        self._replays: dict[tuple, object] = {}  # replay key -> kernels.launch.Replay, or _SEEN (once)
        self._counters: dict[tuple, torch.Tensor] = {}  # (device, stream) -> in-kernel merge counters
        self._workspaces: dict[tuple, Workspace] = {}  # (device, stream) -> kernels.launch.Workspace of its replays
        self._workspace_caps: dict[torch.device, int] = {}  # device -> bytes reserve capped its workspaces at
        self._kept: list[torch.Tensor] = []

    def platform_reasons(self, platform: Platform) -> list[str]:
        if platform.vendor == "cpu":  # the CPU interpreter (tests) is the one non-GPU platform
            return [] if triton_interpreting() else [
                "needs a GPU (NVIDIA sm_80+ or AMD ROCm); on CPU the Triton kernels run only under "
                "TRITON_INTERPRET=1 (slow, for tests): use backend 'torch'"]
        return super().platform_reasons(platform)

    def extra_reasons(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
                      dialects) -> list[str]:
        if importlib.util.find_spec("triton") is None:
            return ["Triton is not installed (pip install triton; on ROCm the pytorch-triton-rocm build)"]
        try:
            import triton  # noqa: F401
        except Exception as exc:  # a broken install is a reason, not a crash
            return [f"Triton failed to import: {type(exc).__name__}: {exc}"]
        cap = platform.capability
        if fmt.uses_fp8 and cap is not None and cap < (8, 9):
            return [f"format {fmt.value} needs fp8 (e4m3) conversions: NVIDIA sm_89 or newer, got {platform.arch}"]
        return self._compile_reasons(platform, spec, fmt, kind, dialects)

    def _kernel(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, dialects):
        """(ops, config, records, COMP, (impl, why)): the kernel the layer runs with, after asking the
        compiler whether the Gluon kernel compiles here (``ops.resolved_kernel``)."""
        from .kernels import ops

        config = self._config or ops.DEFAULT_CONFIG
        kind = LayerKind.parse(kind)
        scopes = 2 if kind.has_comp_scope else 1
        records = (fmt.swa_record, fmt.comp_record)[:scopes]
        comp = ops.comp_mode_of(kind)
        resolved = ops.resolved_kernel(platform.arch, records, tuple(dialects)[:scopes], comp, spec.num_heads, config)
        return ops, config, records, comp, resolved

    def _compile_reasons(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind,
                         dialects) -> list[str]:
        """The compile error of the kernel this layer would run, if it does not compile on this
        platform with the installed Triton (compiled at selection: SparseMLA's construction)."""
        ops, config, records, comp, (impl, why) = self._kernel(platform, spec, fmt, kind, dialects)
        if impl == "gluon":
            return []
        error = ops.compile_reason(platform.arch, "portable", records, comp, spec.num_heads, config)
        if not error:
            return []
        gluon_failed = ops.kernel_choice(platform.arch, records, tuple(dialects)[:len(records)], config)[0] == "gluon"
        return [why, error] if gluon_failed else [error]

    def choice(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
               dialects) -> str:
        """The Triton kernel and tile a layer runs with, and why (shown by ``SparseMLA.explain()``)."""
        ops, config, records, comp, (impl, why) = self._kernel(platform, spec, fmt, kind, dialects)
        if impl == "gluon":
            return (f"Gluon Hopper kernel: {ops.gluon_kernel_names(config, spec.num_heads, comp, records)}; "
                    f"{config.g_block_n} keys per tile ({why}; 16-byte aligned caches)")
        tile = config.tile(platform.arch, spec.num_heads)
        return (f"portable kernel, {tile.block_h} heads x {tile.block_n} keys per tile, {tile.num_warps} warps "
                f"({why})")

    # ---- forward ----------------------------------------------------------------------------
    REPLAYS_LIMIT = 4096  # bound layer calls kept (a few per layer and step shape); cleared when full
    COUNTERS_MIN = 8192  # in-kernel merge counters allocated at least (int32: 32 KiB)

    def forward(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor) -> None:
        launch = _kernels()[1]
        if plan.num_tokens == 0:
            return
        key = self._replay_key(plan, layer, out)
        known = self._replays.get(key) if key is not None else None
        if isinstance(known, launch.Replay) and known():
            return
        launches = self._launches(plan, layer, out)
        if key is None or known is _UNBOUND or capturing(out.device):
            # nothing bound in a capture: a replay's workspace (and the in-kernel merge's counters,
            # then the plan's: ``_merge_counters``) must not come from the capture's pool, which a
            # replay would outlive; the launches' own temporaries do, as the graph needs
            launches.plain()
            return
        # bound at the first call: a later call with these inputs repeats it, one whose tensors
        # only lie elsewhere (the step's next layer of the kind, new activations) relocates it
        known = launch.run(launches, out.device, self._workspace(out.device),
                           repeat_sources(layer.q, out, layer.swa_cache, layer.comp_cache, layer.topk, layer.sink))
        if len(self._replays) >= self.REPLAYS_LIMIT:
            self._replays.clear()
        self._replays[key] = known or _UNBOUND

    def repeat(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor):
        """The Replay bound for this call's inputs (``forward`` binds at the first call with
        them), or None."""
        key = self._replay_key(plan, layer, out)
        known = self._replays.get(key) if key is not None else None
        return known if isinstance(known, _kernels()[1].Replay) else None

    def reserve(self, plan: StepPlan, fmt: KVFormat, num_heads: int, dialects, decode_tokens: int) -> None:
        """Engine start (inside its memory profile):

        * compile every split combine variant (one per power of two of the split,
          ``ops.warm_combines``) the model's layers can launch on this device, so no step compiles
          one mid-serving (the attention kernels take the split unspecialized);
        * allocate the current stream's workspace for bound calls' temporaries, sized for launches
          of up to ``decode_tokens`` tokens (``ops.temporaries_bytes``), and cap every workspace of
          the device there, so none grows after the profile: a larger call (a prefill chunk on the
          portable kernel) is not bound and allocates its temporaries per call."""
        ops, launch = _kernels()
        fmt = KVFormat.parse(fmt)
        config = self._config or ops.DEFAULT_CONFIG
        if plan.batch_invariant:  # one key range per program: no split, no combine to warm
            config = dataclasses.replace(config, split=1)
        need = 0
        for kind in plan.spec.kinds:
            scopes = 2 if kind.has_comp_scope else 1
            # a top-k kind whose rows the plan holds (a StepRows' GlobalRows) launches as global rows
            comp = ops.comp_mode_of(kind) if not kind.uses_topk or plan.translates_topk(kind) else ops.K.COMP_GLOBAL
            layer = ((fmt.swa_record, fmt.comp_record)[:scopes], tuple(dialects)[:scopes], comp, num_heads,
                     plan.swa_rows.shape[1], plan.spec.comp_width(kind))
            if not plan.batch_invariant:
                ops.warm_combines(plan.device, *layer, config)
            need = max(need, ops.temporaries_bytes(plan.device, *layer, decode_tokens, config))
        cap = min(max(need, self._workspace_caps.get(plan.device, 0)), launch.WORKSPACE_LIMIT)
        self._workspace_caps[plan.device] = cap
        for (device, _), workspace in self._workspaces.items():  # other streams': capped, allocated on their own
            if device == plan.device:
                workspace.cap = max(workspace.size, cap)
        workspace = self._workspace(plan.device)
        if workspace is not None:
            workspace.reserve(cap)

    def _replay_key(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor) -> tuple | None:
        """What fixes every argument of this call's launches (``kernels/launch.py``): the checked
        layer inputs (``layer.checked_key``), the plan's tensors, ``out`` and the caches' storage
        offsets (read by ``_check_v4_stride``); None when the layer was not checked by a
        SparseMLA (launched plainly). (The GPU a replay's kernels were loaded on: the Replay
        itself checks it.)"""
        launch = _kernels()[1]
        if layer.checked_key is None or not launch.bindable(out.device):
            return None
        comp_offset = layer.comp_cache.storage_offset() if layer.comp_cache is not None else None
        out_signature = None if layer.checked_out is out else tensor_signature(out)  # else in checked_key
        return (layer.checked_key, plan_tensors_key(plan, layer.kind), out_signature,
                layer.swa_cache.storage_offset(), comp_offset)

    def _launches(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor):
        """The layer call's kernel launches (``ops.layer_launches``), after the backend's own checks."""
        ops = _kernels()[0]
        T = plan.num_tokens
        fmt = KVFormat.parse(layer.fmt)
        self._check_v4_stride("swa_cache", layer.swa_cache, fmt.swa_record, layer.swa_geo.block_stride)
        comp_rows = comp_lens = c4a = None
        comp_cache = None
        if layer.kind.has_comp_scope:
            comp_cache, comp_geo = layer.comp_storage()
            if plan.translates_topk(layer.kind):  # local top-k translated inside the kernel
                if layer.topk is None:
                    raise ValueError(f"topk: got None for a {layer.kind.name} layer; allowed: int32 [T, topk]")
                comp_rows = layer.topk[:T]
                c4a = (plan.batch.comp_block_table(layer.kind), plan.token_to_req, plan.positions)
            else:  # global rows: "all" kinds, or a StepRows' GlobalRows
                scope = layer.compressed(plan)
                comp_rows, comp_lens = scope.rows, scope.lens
            self._check_v4_stride("comp_cache", comp_cache, fmt.comp_record, comp_geo.block_stride)
            if comp_rows.stride(-1) != 1:
                raise ValueError(f"topk: got strides {tuple(comp_rows.stride())}; allowed: last dim contiguous")
        kwargs = {}
        if self._config is not None:
            kwargs["config"] = self._config
        if plan.batch_invariant:  # one key range per program: the split no longer follows the grid size
            kwargs["config"] = dataclasses.replace(self._config or ops.DEFAULT_CONFIG, split=1)
        kwargs["merge_counters"] = lambda n: self._merge_counters(plan, layer.q.device, n)
        kwargs["tokens_per_request"] = _decode_tokens_per_request(plan)
        return ops.layer_launches(
            layer.q, out, fmt, layer.swa_cache, plan.swa_rows, plan.swa_lens,
            comp_cache=comp_cache, comp_rows=comp_rows, comp_lens=comp_lens, c4a=c4a, topk_ratio=layer.kind.ratio,
            sink=layer.sink, scale=layer.softmax_scale, kv_scale=layer.kv_scale,
            swa_fnuz=layer.swa_dialect is Fp8Dialect.FNUZ, comp_fnuz=layer.comp_dialect is Fp8Dialect.FNUZ,
            **kwargs,
        )

    def _merge_counters(self, plan: StepPlan, device: torch.device, n: int) -> torch.Tensor:
        """int32 zeros [n]: the arrival counters of a launch that merges its splits in the kernel,
        which leaves them zero again (``ops.layer_launches``). Outside a CUDA-graph capture, this
        backend's own per stream (kept for its lifetime, so a bound replay's address stays valid;
        launches on one stream run one after another, and a replay bound on one stream does not
        run on another: layers running at once on two streams never share counters). Inside a
        capture, zeros made once per plan (their zeroing a node of the graph: nothing allocated
        inside a capture outlives its graph's pool)."""
        if capturing(device):
            return plan.cached(("merge_counters", n), lambda: torch.zeros(n, dtype=torch.int32, device=device))
        key = (device, _kernels()[1].current_stream(device) if device.type == "cuda" else None)
        counters = self._counters.get(key)
        if counters is None or counters.numel() < n:
            counters = torch.zeros(max(n, self.COUNTERS_MIN), dtype=torch.int32, device=device)
            self._counters[key] = counters
            self._kept.append(counters)  # a larger one replaces it: replays bound to this one keep it alive
        return counters[:n]

    def _workspace(self, device: torch.device):
        """The current stream's ``launch.Workspace`` (the temporaries of the replays bound on it),
        or None where nothing is bound (``launch.bindable``)."""
        launch = _kernels()[1]
        if not launch.bindable(device):
            return None
        key = (device, launch.current_stream(device))
        if key not in self._workspaces:
            # a stream first seen after reserve takes the reserved cap (allocated at its first binding)
            self._workspaces[key] = launch.Workspace(device, self._workspace_caps.get(device))
        return self._workspaces[key]

    @staticmethod
    def _check_v4_stride(name: str, cache: torch.Tensor, record: Record, stride0: int) -> None:
        # the kernel reads the V4 record's bf16 RoPE values (and MXFP8 values, in nvfp4_ds_mla
        # layers) through a 2-byte view of the cache
        if record in (Record.V4_FP8, Record.MXFP8) and (stride0 % 2 or cache.storage_offset() % 2):
            raise ValueError(f"{name}: got block stride {stride0} bytes and storage offset "
                             f"{cache.storage_offset()}; allowed: both even for the triton backend "
                             "(vLLM pages are multiples of 576 bytes)")


@functools.cache
def _kernels():
    """(ops, launch), imported at the first launch: this module imports where Triton does not."""
    from .kernels import launch, ops

    return ops, launch


_UNBOUND = "unbound"  # a replay key whose launches could not be bound: launched plainly


def _decode_tokens_per_request(plan: StepPlan) -> int:
    """Query tokens per request of an all-decode step of a StepBatch (MTP / verify steps: 2+), else
    1: the kernel choice's hint (``ops.pair_tokens``; results are exact either way)."""
    loc = getattr(plan.batch, "query_start_loc", None)
    requests = loc.shape[0] - 1 if loc is not None else 0
    if requests <= 0 or plan.num_decode_tokens != plan.num_tokens:
        return 1
    return max(1, plan.num_tokens // requests)
