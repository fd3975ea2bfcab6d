"""Backend `flashmla`: FlashMLA's sparse kernels (NVIDIA SM90 / SM100) on DeepSeek's packed caches.

Records (docs/semantics.md "Cache records"): the V4 record (``fp8_ds_mla``, 584 B) on SM90 and
SM100, for V4's layer kinds and V4.1's alike (what vLLM 0.33 runs on SM90); the V4.1 records
(``mxfp8_ds_mla``: 528 B in both caches; ``nvfp4_ds_mla``: 528 B SWA + 288 B NVFP4 compressed)
on SM100 only, where FlashMLA's sparse decode reads them -- the same ops, the record detected
from the bytes per token. The V4.1 records are CONTRACT-TESTED ONLY (no SM100 GPU here).

Decode tokens go to ``sparse_decode_fwd``, which reads both caches in place: the SWA cache is
the main scope, the compressed cache the ``extra`` scope of the same softmax, and the sink goes
in through ``attn_sink``. Tokens are flattened to ``b = T, s_q = 1`` because FlashMLA takes ONE
``topk_length`` per batch row, so MTP tokens keep their own lengths. The tile-scheduler metadata
is planned by the first decode layer of each kind in a step (inside a CUDA-graph capture when
the step is captured) and reused by the others (docs/nvidia.md, "Decode").

Prefill tokens go to ``sparse_prefill_fwd``, which wants bf16 rows ``kv [s_kv, 1, 512]``. Per
chunk of tokens the adapter gathers the DISTINCT rows the chunk's tokens select (never a
request's whole history), dequantizes them (any record) into a bf16 workspace and rewrites the
indices to workspace rows. Entries outside the caches are -1 in what the kernels get
(docs/bad-input.md). Bounds (see docs/nvidia.md): the workspace holds at most ``workspace_bytes``
(default 256 MiB; a chunk whose distinct rows would exceed it is halved), a chunk has at most
``index_keys`` (token, key) pairs (default 2**24: ~0.6 GiB of index temporaries), and rows are
dequantized ``_GATHER_ROWS`` at a time (~0.5 GiB of float32 temporaries). The distinct-row count
is read back once per scope and chunk (a host sync), so prefill is not graph-capturable.

Heads are padded to 64 or 128 through per-step staging buffers (padded sinks -inf); a caller that
already hands 64/128 contiguous heads pays no copy. The FlashMLA library is found in this order:
the ``flash_mla`` package, vLLM's bundled ``vllm._flashmla_C``, ``sgl_kernel.flash_mla``, then a
shared library named by ``DSV4_ATTN_FLASHMLA_LIB``; its op schemas are checked before first use.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch

from .. import envs
from ..common.backend import Backend, Capabilities, LayerInputs, LayerShape, Phase, PlatformSupport
from ..common.heads import LazyStaging, padded_heads, stage
from ..common.indices import bounded_rows
from ..common.layout import CacheGeometry, KVFormat, Record, gather_rows
from ..common.plan import StepPlan
from ..common.platform import Platform, dist_version
from ..common.spec import HEAD_DIM, MODEL1_DATA_BYTES, LayerKind, ModelSpec

ENV_LIB = envs.FLASHMLA_LIB.name
# Index rows are padded with -1 columns to a multiple of this: decode needs each scope's width a
# multiple of the kernel's B_TOPK (64 in the V4 kernels; the V4.1 SM100 kernel checks a value it
# does not publish) and reads the extra scope in whole blocks; SM90 prefill needs topk % 128 == 0.
TOPK_BLOCK = 128
V41_FORMATS = (KVFormat.MXFP8, KVFormat.NVFP4)
# FlashMLA's SM100 kernels address a cache as rows of this many bytes (int32 TMA coordinates):
# the V4 record's 576 data bytes, the interleaved V4.1 records' whole tokens
SM100_ROW_BYTES = {Record.V4_FP8: MODEL1_DATA_BYTES, Record.MXFP8: Record.MXFP8.layout.token_bytes,
                   Record.NVFP4: Record.NVFP4.layout.token_bytes}
# An op FlashMLA added in the release that also made the V4.1 records interleaved (2026-09-30,
# the FlashMLA vLLM 0.33 bundles); a library without it would misread those caches
V41_RELEASE_OP = "fused_norm_rope_attn_rope_cast_decode"
DECODE_MAX_ROWS = 8192  # the decode scheduler kernel keeps 20*b+4 B in shared memory: b <~ 11k
_GATHER_ROWS = 1 << 16  # rows dequantized per gather call (bounds the float32 temporaries)

# Op schemas this adapter is written against (docs/vendor-apis.md "Builds and op schemas"). Compared
# by argument names and types and by return types (alias annotations ignored); anything else is refused.
_VLLM_DECODE = (
    "sparse_decode_fwd(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
    "Tensor(a)? tile_scheduler_metadata, Tensor(b)? num_splits, Tensor? extra_kv, Tensor? extra_indices, "
    "Tensor? extra_topk_length, int d_v, float sm_scale, Tensor(c!)? out_=None, "
    "bool enable_batch_invariant=False) -> (Tensor(c!), Tensor, Tensor(a)?, Tensor(b)?)"
)
_VLLM_PREFILL = (
    "sparse_prefill_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, Tensor? attn_sink, "
    "Tensor? topk_length, Tensor(a!)? out_) -> Tensor[]"
)
_UPSTREAM_DECODE = (
    "sparse_decode_fwd(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
    "Tensor? tile_scheduler_metadata, Tensor? num_splits, Tensor? extra_kv, Tensor? extra_indices, "
    "Tensor? extra_topk_length, int d_v, float sm_scale) -> (Tensor, Tensor, Tensor?, Tensor?)"
)
_UPSTREAM_PREFILL = (
    "sparse_prefill_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, Tensor? attn_sink, "
    "Tensor? topk_length) -> Tensor[]"
)
_SGL_DECODE = (
    "sparse_decode_fwd(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
    "Tensor? tile_scheduler_metadata, Tensor? num_splits, Tensor? extra_kv, Tensor? extra_indices, "
    "Tensor? extra_topk_length, int d_v, float sm_scale, str? kv_format=None) -> (Tensor, Tensor, Tensor?, Tensor?)"
)


@dataclass(frozen=True)
class _Dialect:
    """One known op signature family. ``has_out``: the ops write a caller's ``out``; otherwise
    the result is copied into it. ``kv_format``: decode takes a trailing ``str? kv_format``."""

    name: str
    namespace: str
    decode_schema: str
    prefill_schema: str
    has_out: bool
    kv_format: bool = False

    def decode_tail(self, out: torch.Tensor) -> tuple:
        if self.has_out:
            return (out, False)  # out_, enable_batch_invariant (split-KV allowed: SM90 has no unsplit path)
        return (None,) if self.kv_format else ()  # kv_format None: detected from the 584-byte rows


_DIALECTS = (
    _Dialect("vllm", "_flashmla_C", _VLLM_DECODE, _VLLM_PREFILL, has_out=True),
    _Dialect("upstream", "_flashmla_C", _UPSTREAM_DECODE, _UPSTREAM_PREFILL, has_out=False),
    _Dialect("sgl_kernel", "sgl_kernel", _SGL_DECODE, _UPSTREAM_PREFILL, has_out=False, kv_format=True),
)

# (label, module to import, distributions that may carry its version, op namespace)
_SOURCES = (
    ("flash_mla", "flash_mla", ("flash-mla", "flash_mla"), "_flashmla_C"),
    ("vllm", "vllm._flashmla_C", ("vllm",), "_flashmla_C"),
    ("sgl_kernel", "sgl_kernel.flash_mla", ("sglang-kernel", "sgl-kernel"), "sgl_kernel"),
)


class _Sched:
    """FlashMLA tile-scheduler metadata of one decode launch shape in one step: empty until the
    first layer's call plans it (tile_scheduler_metadata int32 [parts, n], num_splits int32 [b+1])."""

    tile: torch.Tensor | None = None
    splits: torch.Tensor | None = None


@dataclass(frozen=True)
class FlashMLAOps:
    """The two FlashMLA ops of one loaded library, called with the dialect's argument list.
    ``reads_v41``: the library reads the interleaved V4.1 records (the vllm dialect's signature
    and the ops of FlashMLA's 2026-09-30 release)."""

    dialect: _Dialect
    ns: Any  # torch.ops.<namespace> (or a test double with the same call signature)

    @property
    def reads_v41(self) -> bool:
        return self.dialect.has_out and hasattr(self.ns, V41_RELEASE_OP)

    def decode(self, q, kv, indices, lens, sink, sched: _Sched, extra, scale: float, out) -> None:
        """q bf16 [b, 1, h, 512]; kv uint8 [nb, bs, 1, token bytes] (584 V4; 528 MXFP8); indices
        int32 [b, 1, k]; lens int32 [b]; sink f32 [h] | None; extra None | (kv [nb', bs', 1, token
        bytes] (584; 528 or 288 NVFP4 beside an MXFP8 kv), indices int32 [b, 1, k2], lens int32
        [b]); out bf16 [b, 1, h, 512] contiguous, written."""
        extra_kv, extra_idx, extra_lens = extra or (None, None, None)
        res = self.ns.sparse_decode_fwd(q, kv, indices, lens, sink, sched.tile, sched.splits, extra_kv, extra_idx,
                                        extra_lens, HEAD_DIM, scale, *self.dialect.decode_tail(out))
        sched.tile, sched.splits = res[2], res[3]
        if not self.dialect.has_out:
            out.copy_(res[0])

    def prefill(self, q, kv, indices, scale: float, sink, out) -> None:
        """q bf16 [s, h, 512]; kv bf16 [s_kv, 1, 512]; indices int32 [s, 1, k] (invalid: -1);
        sink f32 [h] | None; out bf16 [s, h, 512] contiguous, written."""
        tail = (out,) if self.dialect.has_out else ()
        res = self.ns.sparse_prefill_fwd(q, kv, indices, scale, HEAD_DIM, sink, None, *tail)
        if not self.dialect.has_out:
            out.copy_(res[0])


@dataclass(frozen=True)
class FlashMLALib:
    """Outcome of the library search: ``ops`` is None when nothing usable was found; ``notes``
    says why each source was skipped or refused."""

    ops: FlashMLAOps | None
    source: str | None = None
    version: str | None = None
    location: str | None = None
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.ops is None:
            return "FlashMLA not loaded: " + "; ".join(self.notes)
        return (f"FlashMLA from {self.source} (version {self.version}, {self.location}), "
                f"op schemas match the {self.ops.dialect.name} dialect")


def _schema_key(schema) -> tuple:
    return (tuple((a.name, str(a.type)) for a in schema.arguments), tuple(str(r.type) for r in schema.returns))


def schema_mismatch(ns, namespace: str, op: str, expected: str) -> str | None:
    """None when ``ns.<op>`` has the expected signature, else a refusal reason naming both."""
    try:
        found = getattr(ns, op).default._schema
    except (AttributeError, RuntimeError) as exc:
        return f"{namespace}::{op} is missing ({type(exc).__name__}); expected `{expected}`"
    if _schema_key(found) != _schema_key(torch._C.parse_schema(expected)):
        return f"{namespace}::{op} has schema `{found}`; expected `{expected}`"
    return None


def bind_ops(ns, namespace: str) -> tuple[FlashMLAOps | None, str]:
    """FlashMLAOps for the first dialect of ``namespace`` both of whose schemas match, else the
    mismatch reasons."""
    reasons = []
    for dialect in (d for d in _DIALECTS if d.namespace == namespace):
        bad = [r for op, schema in (("sparse_decode_fwd", dialect.decode_schema),
                                    ("sparse_prefill_fwd", dialect.prefill_schema))
               if (r := schema_mismatch(ns, namespace, op, schema))]
        if not bad:
            return FlashMLAOps(dialect, ns), ""
        reasons.append(f"not the {dialect.name} dialect: " + "; ".join(bad))
    return None, " | ".join(reasons)


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError, AttributeError):  # the parent package failed to import
        return False


def _op_namespace(name: str):
    return getattr(torch.ops, name)


def _file_version(path: str) -> str:
    with open(path, "rb") as f:
        return "unversioned build, sha256 " + hashlib.sha256(f.read()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def load_flashmla() -> FlashMLALib:
    """Find FlashMLA (cached): the ``flash_mla`` package, ``vllm._flashmla_C``,
    ``sgl_kernel.flash_mla``, then the library at ``$DSV4_ATTN_FLASHMLA_LIB``. The first source
    that imports AND whose op schemas match wins; never raises."""
    notes = []
    for label, module, dists, namespace in _SOURCES:
        if not _module_exists(module):
            notes.append(f"{label}: not installed")
            continue
        try:
            mod = importlib.import_module(module)
        except Exception as exc:  # a broken install is a reason, not a crash
            notes.append(f"{label}: import failed: {type(exc).__name__}: {exc}")
            continue
        ops, why = bind_ops(_op_namespace(namespace), namespace)
        if ops is not None:
            return FlashMLALib(ops, label, dist_version(*dists) or getattr(mod, "__version__", None),
                               getattr(mod, "__file__", None), tuple(notes))
        notes.append(f"{label}: {why}")
    path = envs.FLASHMLA_LIB.get()
    if not path:
        notes.append(f"{ENV_LIB}: not set")
    elif not os.path.isfile(path):
        notes.append(f"{ENV_LIB}={path}: no such file")
    else:
        try:
            torch.ops.load_library(path)
            ops, why = bind_ops(_op_namespace("_flashmla_C"), "_flashmla_C")
        except Exception as exc:
            ops, why = None, f"cannot load: {type(exc).__name__}: {exc}"
        if ops is not None:
            return FlashMLALib(ops, ENV_LIB, _file_version(path), path, tuple(notes))
        notes.append(f"{ENV_LIB}={path}: {why}")
    return FlashMLALib(None, notes=tuple(notes))


@functools.cache
def _is_sm100(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10


def _check_sm100_rows(cache: torch.Tensor, record: Record, geo: CacheGeometry, name: str) -> None:
    """On SM100, the kernels' row addressing of a cache of ``record`` (checked by SparseMLA:
    ``geo``; FNUZ caches are refused at backend selection). Host-only."""
    if not _is_sm100(cache.device):
        return
    row = SM100_ROW_BYTES[record]
    if cache.data_ptr() % 16:
        raise ValueError(f"{name}: got base address {cache.data_ptr():#x}; allowed on SM100: 16 B aligned")
    if geo.block_stride % row:
        raise ValueError(f"{name}: got block stride {geo.block_stride} B; allowed on SM100: a multiple of {row} B "
                         f"(FlashMLA reads {record.value} caches as rows of {row} B; a block shared with the other "
                         f"cache's pages needs a multiple of both row sizes, docs/nvidia.md)")
    if geo.num_blocks * (geo.block_stride // row) > 2**31 - 1:
        raise ValueError(f"{name}: got {geo.num_blocks} blocks of {geo.block_stride} B = "
                         f"{geo.num_blocks * (geo.block_stride // row)} rows of {row} B; allowed on SM100: at most "
                         "2**31 - 1 rows (FlashMLA's int32 TMA coordinates)")


def _kernel_cache(cache: torch.Tensor, record: Record, geo: CacheGeometry, name: str) -> torch.Tensor:
    """A packed cache as the decode kernel takes it: [nb, bs, 1, token bytes] with stride(1) ==
    token bytes and stride(0) = the block stride (a view, no copy)."""
    _check_sm100_rows(cache, record, geo, name)
    tb = record.layout.token_bytes
    return cache.as_strided((geo.num_blocks, geo.block_size, 1, tb), (geo.block_stride, tb, tb, 1))


def _comp_kernel_rows(plan: StepPlan, layer: LayerInputs,
                      all_idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel's compressed-scope rows (int32 [T, round_up(width, TOPK_BLOCK)], -1 for
    every entry the layer does not attend, slots outside its cache included) and lens int32 [T].
    A top-k layer's local top-k is translated, bounded to the cache and padded by the plan's index
    front end in one pass (one launch on GPUs: ``FrontEnd.topk_rows``); an "all" kind (C128A) has
    ``all_idx``, its rows made once per step (``FlashMLABackend.prepare``)."""
    if plan.translates_topk(layer.kind):
        comp = layer.compressed(plan, bound=True, multiple=TOPK_BLOCK)
        return comp.rows, comp.lens
    comp = layer.compressed(plan)
    return (all_idx if all_idx is not None else bounded_rows(comp.rows, comp.geo.num_slots, multiple=TOPK_BLOCK)), \
        comp.lens


@dataclass(frozen=True)
class FlashMLAMeta:
    """Per-step metadata of one layer shape (``FlashMLABackend.prepare``).

    staging  the step's head staging (shared by every kind: the window-only shape's)
    swa_idx  decode plans: int32 [T, round_up(W, 128)] the decode kernel's SWA rows (shared by
             every kind); None in prefill
    all_idx  decode plans of an "all" kind (C128A): int32 [T, round_up(K, 128)] its compressed
             rows for the decode kernel; None otherwise (top-k rows differ per layer)
    scheds   decode plans: one tile-scheduler slot per launch of DECODE_MAX_ROWS tokens, planned
             by the kind's first layer and reused by the others (FlashMLA's reuse rule: every
             layer of a kind has the same lengths); () in prefill
    """

    staging: LazyStaging
    swa_idx: torch.Tensor | None = None
    all_idx: torch.Tensor | None = None
    scheds: tuple[_Sched, ...] = ()


class FlashMLABackend(Backend):
    name = "flashmla"
    splits_phases = True  # decode and prefill are different FlashMLA kernels
    uncapturable = MappingProxyType({Phase.PREFILL: "its bf16 workspace is sized by the distinct rows of each "
                                                    "chunk (torch.unique: a host sync)"})
    capabilities = Capabilities(
        platforms=(PlatformSupport("cuda", archs=("sm90", "sm10*"), label="NVIDIA SM90, SM100 family"),),
        formats=(KVFormat.MODEL1_FP8,) + V41_FORMATS,  # the V4.1 records on SM100 only (extra_reasons)
        kinds=None,  # FlashMLA takes global rows and lengths: every (ratio, selection), V4.1's too
        platform_need="needs an NVIDIA SM90 (H100/H200/H20) or SM100-family GPU",
        heads_note="padded to 64/128",
        validated="H100 (hardware) vs float64 reference: MODEL1 fp8 with V4 and V4.1 kinds; V4.1 MXFP8 / "
                  "NVFP4 (SM100 only): contract tests only",
        notes="FlashMLA from flash_mla / vllm / sgl_kernel / $DSV4_ATTN_FLASHMLA_LIB; prefill gathers the "
              "selected rows into a bounded bf16 workspace",
    )

    def describe_binary(self, platform: Platform) -> tuple[dict, list[str]]:
        """The FlashMLA library that loaded (source, version, location) or why none did."""
        lib = load_flashmla()
        summary = " ".join(lib.describe().split())
        info = {"loaded": lib.ops is not None, "source": lib.source, "version": lib.version,
                "location": lib.location, "summary": lib.describe()}
        if lib.ops is not None:
            return info, [f"loaded: {summary}"]
        return info, ["not found: " + summary.removeprefix("FlashMLA not loaded: ")]

    def raw_ops(self) -> Any:
        """``torch.ops._flashmla_C`` when the loaded library has vLLM 0.33's op schemas (the calls the
        bench makes as vLLM makes them), else None."""
        lib = load_flashmla()
        return lib.ops.ns if lib.ops is not None and lib.ops.dialect.name == "vllm" else None

    def __init__(self, workspace_bytes: int = 256 << 20, index_keys: int = 1 << 24) -> None:
        self.workspace_bytes = workspace_bytes  # bound of one prefill chunk's bf16 workspace
        self.index_keys = index_keys  # bound of tokens x keys per prefill chunk

    # ---- capability ---------------------------------------------------------------------------
    def extra_reasons(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
                      dialects) -> list[str]:
        lib = load_flashmla()
        if lib.ops is None:
            return [lib.describe()]
        if fmt not in V41_FORMATS:
            return []
        if not platform.arch.startswith("sm10"):
            return [f"reads {fmt.value} (V4.1 records) only on SM100: FlashMLA's SM90 kernels decode the V4 record "
                    "(fp8_ds_mla), which vLLM 0.33 keeps for V4.1 there"]
        if not lib.ops.reads_v41:
            return [f"the loaded FlashMLA ({lib.source}, {lib.ops.dialect.name} dialect) predates the interleaved "
                    f"V4.1 records ({fmt.value}): it lacks the vllm dialect or {V41_RELEASE_OP} of FlashMLA's "
                    "2026-09-30 release, which vLLM 0.33 bundles"]
        return []

    # ---- per-step metadata ------------------------------------------------------------------
    def prepare(self, plan: StepPlan, shape: LayerShape) -> FlashMLAMeta:
        if shape.kind.has_comp_scope:
            window = self.meta(plan, shape.window_only())
        else:
            window = FlashMLAMeta(LazyStaging(plan.num_tokens, padded_heads(shape.num_heads), plan.device))
            if plan.num_decode_tokens:
                swa_idx = bounded_rows(plan.swa_rows, shape.swa_geo.num_slots, multiple=TOPK_BLOCK)
                window = replace(window, swa_idx=swa_idx)
        if not plan.num_decode_tokens:
            return window
        all_idx = None
        if shape.kind.attends_all:
            rows, _ = plan.comp_scope(shape.kind)
            if rows is None or shape.comp_geo is None:  # SparseMLA checked the layer: an "all" kind has both
                raise ValueError(f"comp_cache: got none for a {shape.kind.name} layer; allowed: its compressed cache")
            all_idx = bounded_rows(rows, shape.comp_geo.num_slots, multiple=TOPK_BLOCK)
        scheds = tuple(_Sched() for _ in range(0, plan.num_tokens, DECODE_MAX_ROWS))
        return replace(window, all_idx=all_idx, scheds=scheds)

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor) -> None:
        T, nd = plan.num_tokens, plan.num_decode_tokens
        if T == 0:
            return
        if 0 < nd < T:  # a mixed plan handed over directly: one kernel per phase
            for phase, a, b in ((Phase.DECODE, 0, nd), (Phase.PREFILL, nd, T)):
                self.forward(plan.phase_plan(phase), layer.token_slice(a, b), out[a:b])
            return
        ops = load_flashmla().ops
        if ops is None:
            raise RuntimeError(load_flashmla().describe())
        meta = self.meta(plan, layer.shape)
        q, kout, sink, staging = stage(meta.staging, layer.q, layer.sink, out)
        if nd:
            self._decode(ops, plan, meta, layer, q, sink, kout)
        else:
            self._prefill(ops, plan, layer, q, sink, kout)
        if staging is not None:
            out.copy_(staging.out[:, : out.shape[1]])

    def _decode(self, ops: FlashMLAOps, plan: StepPlan, meta: FlashMLAMeta, layer: LayerInputs, q, sink,
                out) -> None:
        swa_kv = _kernel_cache(layer.swa_cache, layer.fmt.swa_record, layer.swa_geo, "swa_cache")
        has_comp = layer.kind.has_comp_scope
        if has_comp:
            comp_cache, comp_geo = layer.comp_storage()
            comp_kv = _kernel_cache(comp_cache, layer.fmt.comp_record, comp_geo, "comp_cache")
            comp_idx, comp_lens = _comp_kernel_rows(plan, layer, meta.all_idx)
        swa_idx = meta.swa_idx
        if swa_idx is None:  # prepare() builds it for every plan with decode tokens
            raise RuntimeError("flashmla: a decode plan's window rows were not prepared")
        for sched, t0 in zip(meta.scheds, range(0, plan.num_tokens, DECODE_MAX_ROWS)):
            t1 = min(plan.num_tokens, t0 + DECODE_MAX_ROWS)
            extra = (comp_kv, comp_idx[t0:t1, None], comp_lens[t0:t1]) if has_comp else None
            ops.decode(q[t0:t1, None], swa_kv, swa_idx[t0:t1, None], plan.swa_lens[t0:t1], sink, sched, extra,
                       layer.softmax_scale, out[t0:t1, None])

    def _prefill(self, ops: FlashMLAOps, plan: StepPlan, layer: LayerInputs, q, sink, out) -> None:
        scopes = [(layer.swa_cache, layer.fmt.swa_record, layer.swa_geo, plan.swa_rows, plan.swa_lens, "swa_cache")]
        if layer.kind.has_comp_scope:
            comp = layer.compressed(plan)
            scopes.append((comp.cache, layer.fmt.comp_record, comp.geo, comp.rows, comp.lens, "comp_cache"))
        for cache, record, geo, *_, name in scopes:
            _check_sm100_rows(cache, record, geo, name)
        kernel_scopes = [scope[:-1] for scope in scopes]
        width = sum(rows.shape[1] for *_, rows, _ in kernel_scopes)
        step = max(1, self.index_keys // width)
        for t0 in range(0, plan.num_tokens, step):
            self._prefill_chunk(ops, layer, kernel_scopes, t0, min(plan.num_tokens, t0 + step), q, sink, out)

    def _prefill_chunk(self, ops: FlashMLAOps, layer: LayerInputs, scopes, t0: int, t1: int, q, sink, out) -> None:
        """Tokens [t0, t1): distinct selected rows -> bf16 workspace; indices -> workspace rows."""
        parts = []
        for cache, record, geo, rows, lens in scopes:
            r, n = rows[t0:t1], lens[t0:t1]
            keys = bounded_rows(r, geo.num_slots, n)
            uniq, inverse = torch.unique(keys, return_inverse=True)  # syncs: the distinct count sizes the workspace
            parts.append((cache, record, geo, keys, uniq, inverse))
        rows_needed = sum(p[4].numel() for p in parts)
        if rows_needed * HEAD_DIM * 2 > self.workspace_bytes and t1 - t0 > 1:
            mid = (t0 + t1) // 2
            self._prefill_chunk(ops, layer, scopes, t0, mid, q, sink, out)
            self._prefill_chunk(ops, layer, scopes, mid, t1, q, sink, out)
            return
        kv = torch.empty(rows_needed, 1, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
        indices, base = [], 0
        for cache, record, geo, keys, uniq, inverse in parts:
            for r0 in range(0, uniq.numel(), _GATHER_ROWS):  # uniq may start with -1: a zero row, never referenced
                r1 = min(uniq.numel(), r0 + _GATHER_ROWS)
                kv[base + r0 : base + r1, 0].copy_(gather_rows(cache, record, geo, uniq[r0:r1]))
            indices.append(torch.where(keys < 0, torch.full_like(inverse, -1), inverse + base))
            base += uniq.numel()
        idx = bounded_rows(torch.cat(indices, dim=1).to(torch.int32), None, multiple=TOPK_BLOCK)
        ops.prefill(q[t0:t1], kv, idx[:, None, :], layer.softmax_scale, sink, out[t0:t1])
