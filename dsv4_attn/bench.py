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
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from .common import choices
from .common.batch import StepBatch
from .common.layout import KVFormat, Record, new_cache
from .common.spec import HEAD_DIM, LayerKind, ModelSpec

# ---- production configurations ----------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    name: str
    heads: int
    kind: LayerKind
    comp_width: int  # top-k width (C4A, C1A, C2A), C128A row width, 0 (SWA: window only)
    seq_len: int = 16384  # top-k kinds: every request; C128A: lengths drawn up to max_model_len
    max_model_len: int = 131072


DECODE_CONFIGS = {
    "h64-c4a512": DecodeConfig("h64-c4a512", 64, LayerKind.C4A, 512),
    "h128-c4a1024": DecodeConfig("h128-c4a1024", 128, LayerKind.C4A, 1024),
    "h64-c128a": DecodeConfig("h64-c128a", 64, LayerKind.C128A, 1024),
    "h128-c128a": DecodeConfig("h128-c128a", 128, LayerKind.C128A, 1024),
    # window-only layers (V4-Flash's first two layers; V4.1's ratio-0 layers): timed so that auto
    # has a measurement, with its per-step cost, for them too
    "h64-swa": DecodeConfig("h64-swa", 64, LayerKind.SWA, 0),
    "h128-swa": DecodeConfig("h128-swa", 128, LayerKind.SWA, 0),
    # V4.1 top-k layers (same heads and top-k widths; a ratio-1 / ratio-2 compressed cache)
    "h64-c1a512": DecodeConfig("h64-c1a512", 64, LayerKind.C1A, 512),
    "h128-c1a1024": DecodeConfig("h128-c1a1024", 128, LayerKind.C1A, 1024),
    "h64-c2a512": DecodeConfig("h64-c2a512", 64, LayerKind.C2A, 512),
    "h128-c2a1024": DecodeConfig("h128-c2a1024", 128, LayerKind.C2A, 1024),
}


@dataclass(frozen=True)
class PrefillConfig:
    name: str
    heads: int
    s_q: int
    s_kv: int
    topk: int  # total keys per token: 128 SWA + (topk - 128) top-k entries
    kind: LayerKind = LayerKind.C4A


def _prefill(h: int, sq: int, skv: int, tk: int, kind: LayerKind = LayerKind.C4A) -> PrefillConfig:
    prefix = "" if kind is LayerKind.C4A else f"v41-{kind.name.lower()}-"
    return PrefillConfig(f"{prefix}h{h}-q{sq // 1024}k-kv{skv // 1024}k-top{tk}", h, sq, skv, tk, kind)


PREFILL_CONFIGS = {c.name: c for c in [
    *(_prefill(h, sq, skv, tk) for h in (64, 128)
      for sq, skv, tk in ((4096, 8192, 640), (4096, 32768, 1152), (8192, 65536, 1152), (4096, 32768, 2048))),
    *(_prefill(h, 4096, 32768, 1152, kind) for kind in (LayerKind.C1A, LayerKind.C2A) for h in (64, 128)),
]}
V41_KINDS = (LayerKind.C1A, LayerKind.C2A)
V41_RECORDS = (Record.MXFP8, Record.NVFP4)


def runs_in(kind: LayerKind, fmt: KVFormat) -> bool:
    """Whether a config of ``kind`` is benchmarked in ``fmt``: the V4.1 records only with V4.1 kinds
    (no engine stores V4 layers in them)."""
    return kind in V41_KINDS or not {fmt.swa_record, fmt.comp_record} & set(V41_RECORDS)


# --configs groups: which configs each takes
# (a whole-step model has no single kind: the V4 models are 'v4')
CONFIG_GROUPS = {"v4": lambda cfg: getattr(cfg, "kind", None) not in V41_KINDS,
                 "v41": lambda cfg: getattr(cfg, "kind", None) in V41_KINDS}


def select_configs(table: dict, names: list[str] | None) -> list[str]:
    """Config names from ``--configs``: names, or the groups 'v4' / 'v41' (default: all)."""
    if not names:
        return list(table)
    out = []
    for name in names:
        members = [n for n, c in table.items() if CONFIG_GROUPS[name](c)] if name in CONFIG_GROUPS else [name]
        out += [n for n in members if n in table and n not in out]
    return out


SWA_BLOCK = 64
COMP_BLOCK = 256  # uncompressed tokens per compressed-cache block (vLLM)


# ---- device ceilings --------------------------------------------------------------------------


def warm_up(device: torch.device, seconds: float = 2.0) -> None:
    """Keep the GPU busy with matrix products for ``seconds`` so clocks leave idle before the
    ceilings and the first case are timed (a cold first case read 10x slow)."""
    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        for _ in range(10):
            torch.mm(x, x)
        torch.cuda.synchronize(device)
    del x


def measure_ceilings(device: torch.device) -> dict:
    """Copy bandwidth (bytes read + written per second) and the bf16 matrix rate, measured (on a
    CPU at small sizes: a second, not a minute)."""
    cpu = device.type == "cpu"
    n = 1 << (26 if cpu else 30)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_(0, 255)
    reps = 5 if cpu else 20
    copy_s = statistics.median(_samples(functools.partial(b.copy_, a), reps=reps, flush=None, device=device))
    del a, b
    m = 512 if cpu else 8192
    x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_s = statistics.median(_samples(functools.partial(torch.mm, x, y), reps=reps, flush=None, device=device))
    del x, y
    if not cpu:
        torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * n / copy_s, "bf16_flops_per_s": 2 * m**3 / mm_s}


# ---- timing -----------------------------------------------------------------------------------


class L2Flush:
    def __init__(self, device: torch.device, nbytes: int = 256 << 20) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


@dataclass(frozen=True)
class Timing:
    """Seconds per run of a timed callable over ``runs`` runs: median, fastest and 90th percentile
    (the spread: how much slower one run in ten was), and how it ran ('graph' | 'eager')."""

    median: float
    min: float
    p90: float
    runs: int
    how: str

    @classmethod
    def of(cls, samples: list[float], how: str) -> Timing:
        p90 = statistics.quantiles(samples, n=10, method="inclusive")[-1] if len(samples) > 1 else samples[0]
        return cls(statistics.median(samples), min(samples), p90, len(samples), how)

    def as_us(self) -> dict:
        """The JSON record: µs (median), µs_min, µs_p90, runs, timing."""
        return {"us": self.median * 1e6, "us_min": self.min * 1e6, "us_p90": self.p90 * 1e6, "runs": self.runs,
                "timing": self.how}


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.cuda.synchronize()


def _samples(fn, reps: int, flush, warmup: int = 3, device: torch.device | None = None) -> list[float]:
    """Seconds of each of ``reps`` runs of ``fn`` (``flush()`` before each): one CUDA event pair
    per run on a GPU, the host clock around a finished run on the CPU."""
    device = device or torch.device("cuda")
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cpu":
        out = []
        for _ in range(reps):
            if flush is not None:
                flush()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)]


def time_callable(fn, reps: int, flush, graph: bool, device: torch.device | None = None,
                  uncapturable: str | None = None) -> Timing:
    """``reps`` timed runs of ``fn``: CUDA-graph replays when ``graph`` (eager launches when the
    capture fails, or at once when ``uncapturable`` says why it cannot be captured), else eager
    calls; on the CPU always eager, with no flush and one warm-up run."""
    device = device or torch.device("cuda")
    if device.type == "cpu":
        return Timing.of(_samples(fn, reps, None, warmup=1, device=device), "eager")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph and uncapturable:
        print(f"  ({uncapturable}; timing eager launches)", file=sys.stderr)
    elif graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            torch.cuda.synchronize()
            return Timing.of(_samples(g.replay, reps, flush, warmup=2), "graph")
        except Exception as exc:  # capture unsupported by this callable: time eager launches
            print(f"  (graph capture failed: {type(exc).__name__}: {str(exc)[:120]}; timing eager launches)",
                  file=sys.stderr)
            torch.cuda.synchronize()
    return Timing.of(_samples(fn, reps, flush), "eager")


# ---- random caches ----------------------------------------------------------------------------


def fill_random(cache: torch.Tensor, record: Record) -> None:
    """Fill a cache of ``record`` with random, finite, production-like contents (no NaN codes; fp8
    values up to ~28 after their scales), in place, in chunks of blocks (bounded temporaries)."""
    nb, bs, row = cache.shape
    dev = cache.device
    for i0 in range(0, nb, 4096):
        i1 = min(nb, i0 + 4096)
        shape = (i1 - i0, bs)
        if record is Record.V4_FP8:  # split page: data rows, then 8-byte scale rows
            s0, base = cache.stride(0), cache.storage_offset() + i0 * cache.stride(0)
            data = cache.as_strided((*shape, 576), (s0, 576, 1), base)
            scales = cache.as_strided((*shape, 8), (s0, 8, 1), base + bs * 576)
            data[:, :, :448] = _e4m3_bytes((*shape, 448), dev)
            data[:, :, 448:] = (torch.randn(*shape, 64, device=dev) * 2).to(torch.bfloat16).view(torch.uint8)
            exps = torch.randint(118, 124, (*shape, 8), dtype=torch.uint8, device=dev)
            exps[..., 7] = 0
            scales.copy_(exps)
        elif record is Record.MXFP8:  # each token: 512 e4m3 bytes, then 16 UE8M0 scales
            cache[i0:i1, :, :512] = _e4m3_bytes((*shape, 512), dev)
            cache[i0:i1, :, 512:] = torch.randint(118, 124, (*shape, 16), dtype=torch.uint8, device=dev)
        elif record is Record.NVFP4:  # each token: 256 bytes of e2m1 pairs, then 32 e4m3 scales in [0.25, 2)
            cache[i0:i1, :, :256] = torch.randint(0, 256, (*shape, 256), dtype=torch.uint8, device=dev)
            cache[i0:i1, :, 256:] = torch.randint(0x28, 0x40, (*shape, 32), dtype=torch.uint8, device=dev)
        elif record is Record.BF16:
            cache[i0:i1] = torch.randn(cache[i0:i1].shape, device=dev).to(cache.dtype)
        else:
            x = torch.randn(cache[i0:i1].shape, device=dev) * 64
            cache[i0:i1] = x.clamp(-448, 448).to(cache.dtype)


def _e4m3_bytes(shape: tuple[int, ...], device) -> torch.Tensor:
    """Random e4m3 bytes, every finite code (magnitudes 0 .. 0x7E) with either sign."""
    mag = torch.randint(0, 0x7F, shape, dtype=torch.uint8, device=device)
    return mag | (torch.randint(0, 2, shape, dtype=torch.uint8, device=device) << 7)


def row_bytes(record: Record) -> int:
    """Bytes one key row occupies in a cache of ``record`` (what a kernel must read per key)."""
    return record.layout.token_bytes


@dataclass
class Case:
    """Everything one benchmark case needs (on the GPU)."""

    label: str
    kind: LayerKind
    spec: ModelSpec
    batch: StepBatch
    q: torch.Tensor
    swa_cache: torch.Tensor
    comp_cache: torch.Tensor | None
    topk: torch.Tensor | None  # local top-k [T, K] of top-k kinds
    sink: torch.Tensor
    fmt: KVFormat
    num_reqs: int
    s_q: int
    phase: str
    extra: dict = field(default_factory=dict)


def _new_cache(record: Record, nb: int, bs: int, device) -> torch.Tensor:
    cache = new_cache(record, nb, bs, device)
    fill_random(cache, record)
    return cache


def _q_and_sink(T: int, H: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randn(T, H, 512, device=device)
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True))  # RMS-normed, as the model's q
    return q.to(torch.bfloat16), torch.randn(H, device=device)


def _local_topk(gen, positions: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """int32 [T, width] local top-k of a decode step: distinct random visible entries, -1 after."""
    visible = (positions.cpu() + 1) // ratio
    topk = torch.full((positions.shape[0], width), -1, dtype=torch.int32)
    for t in range(positions.shape[0]):
        n = int(visible[t])
        k = min(n, width)
        topk[t, :k] = torch.randperm(n, generator=gen)[:k].to(torch.int32)
    return topk.to(positions.device)


def _spec(heads: int, kind: LayerKind, topk: int, max_model_len: int) -> ModelSpec:
    """A model with the layer kind under test (V4.1 kinds: SWA + that kind; V4: V4's kinds)."""
    layers = (LayerKind.SWA, kind) if kind in V41_KINDS else None
    return ModelSpec(num_heads=heads, topk=topk, max_model_len=max_model_len, layers=layers)


def _decode_batch(gen, seq: list[int], s_q: int, ratios: tuple[int, ...], max_model_len: int,
                  device) -> tuple[StepBatch, int, dict[int, int]]:
    """A decode step of requests of lengths ``seq`` (``s_q`` query tokens each) over shuffled
    block tables: each request owns the (distinct) SWA blocks of its last W + s_q positions and
    the compressed blocks of its longest possible history at every ratio. Returns the batch, the
    SWA cache's block count and each ratio's compressed block count."""
    R, W = len(seq), 128
    max_seq = max(seq)
    swa_cols = -(-max_seq // SWA_BLOCK)
    swa_table = torch.zeros(R, swa_cols, dtype=torch.int32)
    tail_blocks = -(-(W + s_q) // SWA_BLOCK) + 1
    perm = torch.randperm(R * tail_blocks, generator=gen).to(torch.int32).view(R, tail_blocks)
    for r, s in enumerate(seq):
        last = (s - 1) // SWA_BLOCK
        first = max(0, last - tail_blocks + 1)
        swa_table[r, first:last + 1] = perm[r, : last - first + 1]
    comp_tables = {}
    for ratio in ratios:
        comp_cols = -(-(max_seq // ratio) // (COMP_BLOCK // ratio))
        comp_tables[ratio] = torch.randperm(R * comp_cols, generator=gen).to(torch.int32).view(R, comp_cols)
    batch = StepBatch.from_lists([s_q] * R, seq, swa_table, SWA_BLOCK, comp_tables, block_size=COMP_BLOCK,
                                 max_model_len=max_model_len, num_decode_tokens=R * s_q, num_tokens=R * s_q,
                                 device=device)  # num_tokens given: plan() needs no sync (graph capture)
    return batch, R * tail_blocks, {ratio: t.numel() for ratio, t in comp_tables.items()}


def make_decode_case(cfg: DecodeConfig, b: int, s_q: int, device, fmt: KVFormat = KVFormat.MODEL1_FP8,
                     seed: int = 0) -> Case:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    torch.manual_seed(seed)
    R, T = b, b * s_q
    if cfg.kind.uses_topk:
        seq = [cfg.seq_len] * R
    else:  # C128A / SWA: lengths spread over the whole model length (C128A's scope has variable lengths)
        seq = torch.randint(s_q + 128, cfg.max_model_len + 1, (R,), generator=gen).tolist()
    ratio = cfg.kind.ratio
    ratios = (ratio,) if cfg.kind.has_comp_scope else ()
    batch, swa_blocks, comp_blocks = _decode_batch(gen, seq, s_q, ratios, cfg.max_model_len, device)
    swa_cache = _new_cache(fmt.swa_record, swa_blocks, SWA_BLOCK, device)
    comp_cache = _new_cache(fmt.comp_record, comp_blocks[ratio], COMP_BLOCK // ratio, device) if ratios else None
    topk = _local_topk(gen, batch.positions, ratio, cfg.comp_width) if cfg.kind.uses_topk else None
    q, sink = _q_and_sink(T, cfg.heads, device, gen)
    spec = _spec(cfg.heads, cfg.kind, cfg.comp_width if cfg.kind.uses_topk else 512, cfg.max_model_len)
    return Case(f"{cfg.name} b={b} s_q={s_q}", cfg.kind, spec, batch, q, swa_cache, comp_cache, topk, sink, fmt,
                R, s_q, "decode", {"config": cfg.name, "batch": b, "format": fmt.value})


def make_prefill_case(cfg: PrefillConfig, device, fmt: KVFormat = KVFormat.MODEL1_FP8, seed: int = 0) -> Case:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    torch.manual_seed(seed)
    T, s_kv, K, ratio = cfg.s_q, cfg.s_kv, cfg.topk - 128, cfg.kind.ratio
    swa_cols = s_kv // SWA_BLOCK
    swa_table = torch.randperm(swa_cols, generator=gen).to(torch.int32).view(1, swa_cols)
    swa_cache = _new_cache(fmt.swa_record, swa_cols, SWA_BLOCK, device)
    bs_c = COMP_BLOCK // ratio
    comp_cols = -(-(s_kv // ratio) // bs_c)
    comp_table = torch.randperm(comp_cols, generator=gen).to(torch.int32).view(1, comp_cols)
    comp_cache = _new_cache(fmt.comp_record, comp_cols, bs_c, device)
    batch = StepBatch.from_lists([T], [s_kv], swa_table, SWA_BLOCK, {ratio: comp_table}, block_size=COMP_BLOCK,
                                 max_model_len=max(s_kv, 65536), num_decode_tokens=0, device=device)
    entries = s_kv // ratio
    visible = (batch.positions + 1) // ratio
    scores = torch.rand(T, entries, device=device)
    scores.masked_fill_(torch.arange(entries, device=device)[None, :] >= visible[:, None], -1.0)
    topk = scores.topk(K, dim=1).indices.to(torch.int32)
    topk = torch.where(torch.arange(K, device=device)[None, :] < visible[:, None].clamp(max=K), topk,
                       torch.full_like(topk, -1))
    del scores
    q, sink = _q_and_sink(T, cfg.heads, device, gen)
    spec = _spec(cfg.heads, cfg.kind, K, max(s_kv, 65536))
    return Case(cfg.name, cfg.kind, spec, batch, q, swa_cache, comp_cache, topk, sink, fmt, 1, T, "prefill",
                {"config": cfg.name, "s_q": T, "s_kv": s_kv, "topk": cfg.topk, "format": fmt.value})


# ---- runners ----------------------------------------------------------------------------------


def _case_mla(case: Case, backend: str):
    """A SparseMLA for ``case`` on ``backend``, sized for its tokens and requests."""
    from .api import SparseMLA

    return SparseMLA(case.spec, case.fmt, backend=backend, device=case.q.device,
                     max_tokens=max(case.q.shape[0], 1), max_reqs=max(case.num_reqs, 1))


def _run_layer(mla, plan, case: Case, out: torch.Tensor) -> None:
    mla.forward(plan, case.kind, case.q, case.swa_cache, case.comp_cache, topk=case.topk, sink=case.sink, out=out)


def api_runner(case: Case, backend: str):
    """A callable running one layer through the public API, and its SparseMLA + plan."""
    mla = _case_mla(case, backend)
    plan = mla.plan(case.batch)
    out = torch.empty_like(case.q)
    return functools.partial(_run_layer, mla, plan, case, out), out, plan


def per_step_us(case: Case, backend: str, layer_us: float, reps: int, flush, graph: bool) -> tuple[float, float]:
    """(the backend's own per-step work in us, the index front end's plan() in us): a fresh step
    of one layer (plan() + the layer; Backend.prepare and its first-call work included) timed
    against plan() alone and the layer alone (``layer_us``: the step's work already done). What
    a step pays once per backend and layer shape however many layers share it (choices.py)."""
    mla = _case_mla(case, backend)
    out = torch.empty_like(case.q)
    step_s = time_callable(lambda: _run_layer(mla, mla.plan(case.batch), case, out), reps, flush, graph,
                           case.q.device).median
    plan_s = time_callable(lambda: mla.plan(case.batch), reps, flush, graph, case.q.device).median
    return max(0.0, (step_s - plan_s) * 1e6 - layer_us), plan_s * 1e6


def _valid_slots(rows: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The slots a launch attends (int32 [T, W] rows, their first ``lens`` entries that are >= 0),
    flattened: one entry per (token, key)."""
    col = torch.arange(rows.shape[1], device=rows.device)[None, :]
    return rows[(rows >= 0) & (col < lens[:, None])]


def case_work(case: Case, plan) -> tuple[float, float, int]:
    """(flops, bytes, valid keys) of a case from the plan's rows: FLOPs per (token, key) pair;
    bytes: each DISTINCT key row once at its cache record's size (tokens of one request share
    most rows: MTP tokens nearly all, prefill tokens their window and many top-k rows, so counting
    pairs would put the floor above what a kernel reading each row once needs), + q and out."""
    scopes = [(_valid_slots(plan.swa_rows, plan.swa_lens), case.fmt.swa_record)]
    if case.kind.has_comp_scope:
        rows, lens = plan.comp_scope(case.kind, case.topk)
        scopes.append((_valid_slots(rows, lens), case.fmt.comp_record))
    T, H, D = case.q.shape
    keys = sum(slots.numel() for slots, _ in scopes)
    flops = 4.0 * H * D * keys
    kv_bytes = sum(torch.unique(slots).numel() * row_bytes(record) for slots, record in scopes)
    nbytes = kv_bytes + 2 * T * H * D * 2
    return flops, nbytes, keys


def _flashmla_lib() -> str | None:
    for path in (os.environ.get("DSV4_ATTN_FLASHMLA_LIB"), ".flashmla/_flashmla_C.abi3.so"):
        if path and os.path.isfile(path):
            return path
    return None


_RAW_LOADED: dict = {}


def raw_flashmla_ops():
    """torch.ops._flashmla_C, loading the library once (None when unavailable)."""
    if "ops" not in _RAW_LOADED:
        lib = _flashmla_lib()
        ops = None
        if lib is not None:
            try:
                torch.ops.load_library(lib)
                ops = torch.ops._flashmla_C
            except Exception as exc:
                print(f"  (FlashMLA library {lib} failed to load: {exc})", file=sys.stderr)
        _RAW_LOADED["ops"] = ops
    return _RAW_LOADED["ops"]


def flashmla_runners(case: Case, plan) -> dict:
    """{'api': (callable, out, how) or (None, None, reason), 'raw': ...} for FlashMLA."""
    return {"api": flashmla_api_runner(case), "raw": flashmla_raw_runner(case, plan)}


def flashmla_api_runner(case: Case):
    """FlashMLA through ``SparseMLA(backend="flashmla")`` (adapter included), or (None, None, why)."""
    try:
        from .common import backend as backend_mod
        from .common.platform import probe

        reasons = backend_mod.reasons_for("flashmla", probe(), case.spec, case.fmt, case.kind,
                                          backend_mod.Phase(case.phase))
    except Exception as exc:
        reasons = [f"{type(exc).__name__}: {exc}"]
    if not reasons:
        try:
            run, out, _ = api_runner(case, "flashmla")
            return run, out, "api"
        except Exception as exc:
            reasons = [f"{type(exc).__name__}: {exc}"]
    return None, None, "; ".join(reasons)


def raw_decode(ops, q, swa_kv, swa_idx, swa_lens, sink, sched: list, comp, scale: float, out) -> None:
    """One ``sparse_decode_fwd`` call as vLLM 0.33 makes it (models/deepseek_v4/nvidia/flashmla.py):
    q bf16 [T, 1, H, 512], swa_kv uint8 [nb, bs, 1, 584], swa_idx int32 [T, 1, W], swa_lens int32
    [T], sink float32 [H]; ``comp`` None (window-only layer) or the extra scope (kv, rows int32
    [T, 1, K], lens int32 [T]); ``sched`` [tile_scheduler_metadata, num_splits]: [None, None]
    makes this call plan them, kept in ``sched`` for the next calls of the same launch shape;
    out bf16 [T, 1, H, 512], written."""
    comp_kv, comp_idx, comp_lens = comp or (None, None, None)
    res = ops.sparse_decode_fwd(q, swa_kv, swa_idx, swa_lens, sink, sched[0], sched[1], comp_kv, comp_idx, comp_lens,
                                512, scale, out, False)  # False: split-KV allowed (enable_batch_invariant)
    sched[0], sched[1] = res[2], res[3]


def flashmla_raw_runner(case: Case, plan):
    """The raw FlashMLA op on the plan's rows (vLLM's call), or (None, None, why)."""
    ops = raw_flashmla_ops()
    if ops is None or case.fmt is not KVFormat.MODEL1_FP8:
        return None, None, "FlashMLA library not found (DSV4_ATTN_FLASHMLA_LIB)" if ops is None else \
            f"raw FlashMLA reads MODEL1 caches only, not {case.fmt.value}"
    T, H, D = case.q.shape
    if H not in (64, 128):
        return None, None, f"FlashMLA needs 64 or 128 heads, got {H}"
    scale = case.spec.scale
    comp_rows, comp_lens = plan.comp_scope(case.kind, case.topk)
    if case.phase == "decode":
        swa_kv = case.swa_cache.unsqueeze(2)
        comp = None if comp_rows is None else (case.comp_cache.unsqueeze(2), comp_rows.view(T, 1, -1), comp_lens)
        q4 = case.q.view(T, 1, H, D)
        idx = plan.swa_rows.view(T, 1, -1)
        out = torch.empty_like(case.q)
        sched: list = [None, None]

        def run():
            raw_decode(ops, q4, swa_kv, idx, plan.swa_lens, case.sink, sched, comp, scale, out.view(T, 1, H, D))

        run()  # plans FlashMLA's tile scheduler once; the timed calls reuse it (as vLLM's later layers of a kind)
        return run, out, "raw op (scheduler planned once, reused)"
    # prefill: kernel only, on a ready bf16 workspace holding the token's keys (dequantized rows)
    from .common.layout import gather

    rows = torch.cat([comp_rows, plan.swa_rows], dim=1)
    lens_c = comp_lens
    valid_c = torch.arange(comp_rows.shape[1], device=rows.device)[None, :] < lens_c[:, None]
    uniq_swa = torch.unique(plan.swa_rows[plan.swa_rows >= 0])
    uniq_comp = torch.unique(comp_rows[(comp_rows >= 0) & valid_c])
    kv = torch.cat([gather(case.comp_cache, case.fmt, uniq_comp), gather(case.swa_cache, case.fmt, uniq_swa)])
    kv = kv.to(torch.bfloat16).view(-1, 1, D)
    comp_map = torch.full((int(comp_rows.max()) + 1,), -1, dtype=torch.int64, device=rows.device)
    comp_map[uniq_comp] = torch.arange(uniq_comp.numel(), device=rows.device)
    swa_map = torch.full((int(plan.swa_rows.max()) + 1,), -1, dtype=torch.int64, device=rows.device)
    swa_map[uniq_swa] = torch.arange(uniq_swa.numel(), device=rows.device) + uniq_comp.numel()
    ci = torch.where((comp_rows >= 0) & valid_c, comp_map[comp_rows.clamp(min=0).long()], -1)
    si = torch.where(plan.swa_rows >= 0, swa_map[plan.swa_rows.clamp(min=0).long()], -1)
    width = -(-(ci.shape[1] + si.shape[1]) // 128) * 128
    idx = torch.full((T, width), -1, dtype=torch.int32, device=rows.device)
    # compressed first, then SWA (vLLM's combine order), valid entries packed to the left
    packed = torch.cat([ci, si], dim=1)
    order = torch.argsort((packed < 0).to(torch.int8), dim=1, stable=True)
    packed = torch.gather(packed, 1, order)
    idx[:, : packed.shape[1]] = packed.to(torch.int32)
    topk_len = (packed >= 0).sum(1).to(torch.int32)
    out = torch.empty_like(case.q)

    def run():
        ops.sparse_prefill_fwd(case.q, kv, idx.view(T, 1, width), scale, 512, case.sink, topk_len, out)

    return run, out, "raw op (kernel only, bf16 workspace ready)"


# ---- the benchmark ----------------------------------------------------------------------------


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.double().flatten(), b.double().flatten()
    rel = float((a - b).norm() / b.norm().clamp_min(1e-30))
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    return {"max_abs": float((a - b).abs().max()), "rel_l2": rel, "cosine": cos}


def uncapturable(backend: str, case: Case, plan) -> str | None:
    """Why ``backend`` (a name, or "auto": what it picks for the case) cannot run the case's phase
    inside a CUDA-graph capture (Backend.uncapturable), or None."""
    from .common.backend import Phase, get_backend

    name = plan.owner.backend_for(case.kind, case.phase, case.q.shape[0]) if backend == "auto" else backend
    impl = get_backend(name)
    why = impl.uncapturable.get(Phase(case.phase)) if impl is not None else None
    return f"{name} {case.phase} cannot be graph-captured: {why}" if why else None


def host_us(run, device: torch.device, calls: int = 50) -> float:
    """Host us per eager call of ``run``: the calling thread's time (checks, backend decision,
    launches; a GPU's queue takes the kernels), what an eager or piecewise engine step pays per
    layer beside the GPU time. On a CPU the work itself is in it."""
    run()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        run()
    elapsed = time.perf_counter() - start
    _sync(device)
    return elapsed / calls * 1e6


def run_case(case: Case, backends: list[str], args, ceilings: dict, flush) -> dict:
    rows = {}
    ref_out = None
    plan0 = None
    for name in backends:
        run, out, plan = api_runner(case, name)
        plan0 = plan0 or plan
        timing = time_callable(run, args.reps, flush, not args.no_graph, case.q.device,
                               uncapturable(name, case, plan))
        run()
        _sync(case.q.device)
        rows[name] = {**timing.as_us(), "host_us": host_us(run, case.q.device)}
        if name == "auto":
            rows[name]["picked"] = plan.owner.backend_for(case.kind, case.phase, case.q.shape[0])
        elif case.phase == "decode":
            rows[name]["per_step_us"], rows[name]["plan_us"] = per_step_us(case, name, rows[name]["us"], args.reps,
                                                                          flush, not args.no_graph)
        if ref_out is None:
            ref_out = out.clone()
        else:
            rows[name]["vs_first"] = _compare(out, ref_out)
    flops, nbytes, keys = case_work(case, plan0)
    floor = max(nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["bf16_flops_per_s"])
    result = {"case": case.label, "phase": case.phase, "kind": case.kind.name, **case.extra, "s_q_per_req": case.s_q,
              "heads": case.q.shape[1], "tokens": case.q.shape[0], "valid_keys": keys, "flops": flops,
              "bytes": nbytes, "floor_us": floor * 1e6, "backends": rows}
    if not args.no_flashmla:
        for key, (run, out, how) in flashmla_runners(case, plan0).items():
            label = "flashmla" if key == "api" else "flashmla_raw"
            if run is None:
                result[label] = {"unavailable": how}
                continue
            try:
                timing = time_callable(run, args.reps, flush, not args.no_graph,
                                       uncapturable=uncapturable("flashmla", case, plan0) if key == "api" else None)
                run()
                torch.cuda.synchronize()
                result[label] = {**timing.as_us(), "via": how, "vs_ours": _compare(ref_out, out)}
            except Exception as exc:
                result[label] = {"unavailable": f"{type(exc).__name__}: {str(exc)[:200]}"}
    for r in rows.values():
        s = r["us"] * 1e-6
        r["tflops"] = flops / s / 1e12
        r["gbps"] = nbytes / s / 1e9
        r["x_floor"] = s / floor
        for label in ("flashmla", "flashmla_raw"):
            fm = result.get(label, {}).get("us")
            if fm:
                r[f"speedup_vs_{label}"] = fm / r["us"]
    return result


def auto_gaps(results: list[dict]) -> list[tuple[float, float, str, str, str]]:
    """Per case timed with ``auto`` and named backends: (the backend auto picked, timed under its
    own name, vs the fastest named backend - 1; auto's own time vs that - 1, the same launches
    timed again: run-to-run spread; case; picked; fastest), worst pick first. A backend's time is
    its layer + its per-step work where measured (decode: a step of one layer of the case's kind,
    what auto orders the case's model by)."""
    gaps = []
    for r in results:
        rows = r.get("backends", {})
        named = {name: b for name, b in rows.items() if name != "auto" and "us" in b}
        cost = {name: b["us"] + b.get("per_step_us", 0.0) for name, b in named.items()}
        auto = rows.get("auto", {})
        if "us" in auto and named:
            best = min(cost, key=cost.__getitem__)
            picked = auto.get("picked", "?")
            pick_layer_us = named[picked]["us"] if picked in named else auto["us"]
            gaps.append((cost.get(picked, auto["us"]) / cost[best] - 1, auto["us"] / pick_layer_us - 1,
                         f"{r['case']} {r.get('format', '')}", picked, best))
    return sorted(gaps, reverse=True)


def print_auto_gaps(results: list[dict]) -> None:
    gaps = auto_gaps(results)
    if not gaps:
        return
    hits = sum(picked == best for *_, picked, best in gaps)
    print(f"auto picked the fastest backend in {hits} of {len(gaps)} cases; worst picks (the picked backend's time "
          "vs the fastest, decode: layer + per-step work; auto's own replay vs the picked backend's):")
    for gap, spread, case, picked, best in gaps[:10]:
        print(f"  {gap * 100:+6.1f} %  ({spread * 100:+5.1f} %)  {case:<40} auto -> {picked:<10} fastest {best}")


# ---- whole decode steps (--mode step) -----------------------------------------------------------

_CSA, _HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def _v4_config(heads: int, topk: int, first: list[str], num_layers: int) -> dict:
    """The attention fields of a DeepSeek-V4 config.json (examples/run_step.py shows them): layers
    ``first``, then C4A on even and C128A on odd layer indices up to ``num_layers``; one MTP layer."""
    layer_types = first + [_CSA if i % 2 == 0 else _HCA for i in range(len(first), num_layers)]
    return {"model_type": "deepseek_v4", "num_attention_heads": heads, "head_dim": 512, "qk_rope_head_dim": 64,
            "index_topk": topk, "sliding_window": 128, "max_position_embeddings": 1048576,
            "num_hidden_layers": num_layers, "num_nextn_predict_layers": 1, "layer_types": layer_types,
            "compress_rates": {_CSA: 4, _HCA: 128}}


@dataclass(frozen=True)
class StepModel:
    """A model whose whole decode step ``--mode step`` times: its config.json's attention fields
    (the layer list through ``ModelSpec.from_hf_config``) and where its layer pattern comes from."""

    name: str
    config: dict
    source: str


STEP_MODELS = {
    "v4-flash": StepModel("v4-flash", _v4_config(64, 512, ["sliding_attention"] * 2, 43),
                          "DeepSeek-V4-Flash's public model card: 43 layers, 0-1 window only, then C4A (even) / "
                          "C128A (odd); 64 heads, top-k 512"),
    "v4-pro": StepModel("v4-pro", _v4_config(128, 1024, [_HCA] * 2, 61),
                        "third-party summaries of DeepSeek-V4-Pro's config (not its config.json): 61 layers, 0-1 "
                        "C128A, then C4A (even) / C128A (odd); 128 heads, top-k 1024"),
}
STEP_MAX_MODEL_LEN = 131072  # context lengths are drawn up to this (on the CPU: STEP_CPU_MAX_MODEL_LEN)
STEP_CPU_MAX_MODEL_LEN = 2048
# What the layers of a step read: the L2 is flushed before each replay, but layers sharing a cache
# would find each other's rows in it, so every layer owns its SWA cache and (C128A layers, which
# read every entry) its compressed cache; top-k layers share one compressed cache (each is a
# quarter of the context: 5 GB per layer at b=256) and each reads it through its own top-k.
STEP_CACHES = "own SWA cache per layer; own C128A cache per layer; one C4A cache shared by the C4A layers (own top-k)"


@dataclass
class StepLayer:
    """One attention layer of a step: q bf16 [T, H, 512], its caches, top-k int32 [T, K] (top-k
    kinds) and sink float32 [H]."""

    index: int
    kind: LayerKind
    q: torch.Tensor
    swa_cache: torch.Tensor
    comp_cache: torch.Tensor | None
    topk: torch.Tensor | None
    sink: torch.Tensor


@dataclass
class StepCase:
    """A whole decode step of a StepModel: one batch, every (non-MTP) layer's inputs."""

    label: str
    model: StepModel
    spec: ModelSpec
    batch: StepBatch
    fmt: KVFormat
    layers: list[StepLayer]
    num_reqs: int
    s_q: int
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens


def make_step_case(model: StepModel, b: int, s_q: int, device, fmt: KVFormat = KVFormat.MODEL1_FP8,
                   seed: int = 0, max_model_len: int = STEP_MAX_MODEL_LEN) -> StepCase:
    """``b`` decode requests of ``s_q`` tokens, lengths drawn uniformly in [s_q + 128,
    ``max_model_len``], every layer of ``model`` but its MTP draft layer (it runs in the drafter's
    own forward), caches as STEP_CACHES says."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    torch.manual_seed(seed)
    spec = ModelSpec.from_hf_config(model.config, max_model_len=max_model_len)
    seq = torch.randint(s_q + 128, max_model_len + 1, (b,), generator=gen).tolist()
    batch, swa_blocks, comp_blocks = _decode_batch(gen, seq, s_q, spec.comp_ratios, max_model_len, device)
    shared = {k.ratio: _new_cache(fmt.comp_record, comp_blocks[k.ratio], COMP_BLOCK // k.ratio, device)
              for k in spec.kinds if k.uses_topk}
    layers = []
    for layer in (la for la in spec.layers if not la.mtp):
        kind = layer.kind
        comp = None
        if kind.has_comp_scope:
            comp = shared.get(kind.ratio) if kind.uses_topk else _new_cache(
                fmt.comp_record, comp_blocks[kind.ratio], COMP_BLOCK // kind.ratio, device)
        topk = _local_topk(gen, batch.positions, kind.ratio, spec.comp_width(kind)) if kind.uses_topk else None
        q, sink = _q_and_sink(b * s_q, spec.num_heads, device, gen)
        layers.append(StepLayer(layer.index, kind, q, _new_cache(fmt.swa_record, swa_blocks, SWA_BLOCK, device),
                                comp, topk, sink))
    return StepCase(f"{model.name} b={b} s_q={s_q}", model, spec, batch, fmt, layers, b, s_q,
                    {"config": model.name, "batch": b, "format": fmt.value})


def api_step_runner(case: StepCase, backend: str):
    """(callable, outs, SparseMLA): one step through the public API, ``plan()`` once and then
    ``forward()`` of every layer into ``outs`` (bf16 [T, H, 512] per layer)."""
    from .api import SparseMLA

    mla = SparseMLA(case.spec, case.fmt, backend=backend, device=case.batch.device, max_tokens=case.num_tokens,
                    max_reqs=case.num_reqs)
    outs = [torch.empty_like(layer.q) for layer in case.layers]

    def run():
        plan = mla.plan(case.batch)
        for layer, out in zip(case.layers, outs):
            mla.forward(plan, layer.kind, layer.q, layer.swa_cache, layer.comp_cache, topk=layer.topk,
                        sink=layer.sink, out=out)

    return run, outs, mla


def vllm_c128a_width(max_seq_len: int, model_width: int) -> int:
    """The C128A row width vLLM 0.33 builds per step (models/deepseek_v4/sparse_mla.py
    ``_build_c128a_metadata``): the next power of two >= the longest request's entries, at least
    128, at most the model's width (``ModelSpec.all_width(128)``)."""
    entries = max(max_seq_len // 128, 1)
    return min(max(1 << (entries - 1).bit_length(), 128), model_width)


def flashmla_vllm_step_runner(case: StepCase):
    """FlashMLA driven the way vLLM 0.33 drives a decode step, or (None, None, why).

    Per step (vLLM: v1/attention/backends/mla/sparse_swa.py ``build`` and
    models/deepseek_v4/sparse_mla.py ``_build_c128a_metadata``): token -> request, token
    validity, the SWA rows and lengths, the C128A global rows at vLLM's width
    (``vllm_c128a_width``) and one empty scheduler holder per layer kind. Here ONE launch of this
    package's step kernel computes them, where vLLM spends several: a lower bound on vLLM's
    metadata work. Per layer (models/deepseek_v4/nvidia/flashmla.py ``_forward_decode``): a C4A
    layer translates its local top-k into global rows in one launch (vLLM's
    ``compute_global_topk_indices_and_lens``; here the front end's equivalent kernel), then
    ``sparse_decode_fwd``; the first layer of each kind plans the tile scheduler for the others."""
    ops = raw_flashmla_ops()
    if ops is None:
        return None, None, "FlashMLA library not found (DSV4_ATTN_FLASHMLA_LIB)"
    if case.fmt is not KVFormat.MODEL1_FP8:
        return None, None, f"vLLM runs FlashMLA on fp8_ds_mla caches, not {case.fmt.value}"
    T, H = case.num_tokens, case.spec.num_heads
    if H not in (64, 128):
        return None, None, f"FlashMLA needs 64 or 128 heads, got {H}"
    from .common.indices import Tokens
    from .portable.kernels.indices import build_step_rows, topk_rows

    batch, dev, i32 = case.batch, case.batch.device, dict(dtype=torch.int32, device=case.batch.device)
    facts = Tokens(torch.zeros(T, dtype=torch.int64, device=dev), torch.zeros(T, **i32),
                   torch.zeros(T, dtype=torch.bool, device=dev))
    swa_rows, swa_lens = torch.empty(T, case.spec.window, **i32), torch.empty(T, **i32)
    c128 = LayerKind.C128A
    has_c128 = c128.ratio in batch.comp_block_tables
    width = vllm_c128a_width(int(batch.seq_lens.max()), case.spec.all_width(c128.ratio))
    c128_rows, c128_lens = torch.empty(T, width, **i32), torch.empty(T, **i32)
    outs = [torch.empty_like(layer.q) for layer in case.layers]

    def run():
        build_step_rows(batch.query_start_loc, batch.seq_lens, T, batch.swa_block_table, batch.swa_block_size,
                        case.spec.window, *facts, swa_rows, swa_lens,
                        batch.comp_block_tables.get(c128.ratio), batch.comp_block_size(c128) if has_c128 else 1,
                        c128_rows if has_c128 else None, c128_lens if has_c128 else None, c128.ratio)
        sched: dict = {}
        for layer, out in zip(case.layers, outs):
            comp = None
            if layer.kind.uses_topk:
                rows, lens = topk_rows(facts, layer.kind.ratio, batch.comp_block_table(layer.kind),
                                       batch.comp_block_size(layer.kind), layer.topk)
                comp = (layer.comp_cache.unsqueeze(2), rows.view(T, 1, -1), lens)
            elif layer.kind.has_comp_scope:
                comp = (layer.comp_cache.unsqueeze(2), c128_rows.view(T, 1, -1), c128_lens)
            raw_decode(ops, layer.q.view(T, 1, H, HEAD_DIM), layer.swa_cache.unsqueeze(2), swa_rows.view(T, 1, -1),
                       swa_lens, layer.sink, sched.setdefault(layer.kind, [None, None]), comp, case.spec.scale,
                       out.view(T, 1, H, HEAD_DIM))

    return run, outs, f"vLLM 0.33's decode step: metadata once + per layer (C4A: translation) + raw op; C128A " \
                      f"rows {width} wide"


def _layers_written(run, outs: list[torch.Tensor], device: torch.device) -> int:
    """Layers whose every output element one more run of ``run`` wrote (NaN-poisoned first)."""
    for out in outs:
        out.fill_(float("nan"))
    run()
    _sync(device)
    return sum(not bool(out.isnan().any()) for out in outs)


def _compare_layers(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> dict:
    """The worst layer's differences between two runs' outputs."""
    per_layer = [_compare(out, ref) for out, ref in zip(outs, refs)]
    return {"max_rel_l2": max(m["rel_l2"] for m in per_layer), "min_cosine": min(m["cosine"] for m in per_layer)}


def run_step_case(case: StepCase, backends: list[str], args, flush) -> dict:
    """Times the whole step for ``auto`` and every named backend, and FlashMLA driven as vLLM
    drives it (unless --no-flashmla), in one run; per backend µs per step and per layer, the
    layers every element of whose output was written, what auto picked per kind, and the worst
    layer's difference from auto's outputs."""
    device, n = case.batch.device, len(case.layers)
    kinds = [layer.kind for layer in case.layers]
    rows, auto_outs = {}, None
    for name in ["auto"] + [b for b in backends if b != "auto"]:
        run, outs, mla = api_step_runner(case, name)
        timing = time_callable(run, args.reps, flush, not args.no_graph, device)
        rows[name] = {**timing.as_us(), "us_per_layer": timing.median * 1e6 / n,
                      "layers_written": _layers_written(run, outs, device),
                      "picked": {k.name: mla.backend_for(k, "decode", case.num_tokens) for k in dict.fromkeys(kinds)}}
        if auto_outs is None:
            auto_outs = outs
        else:
            rows[name]["vs_auto"] = _compare_layers(outs, auto_outs)
    result = {"case": case.label, "phase": "step", **case.extra, "s_q_per_req": case.s_q,
              "heads": case.spec.num_heads, "tokens": case.num_tokens, "layers": n,
              "layer_kinds": {k.name: kinds.count(k) for k in dict.fromkeys(kinds)}, "caches": STEP_CACHES,
              "backends": rows}
    if not args.no_flashmla:
        run, outs, how = flashmla_vllm_step_runner(case)
        if run is None:
            result["flashmla_vllm"] = {"unavailable": how}
        else:
            try:
                timing = time_callable(run, args.reps, flush, not args.no_graph, device)
                result["flashmla_vllm"] = {**timing.as_us(), "us_per_layer": timing.median * 1e6 / n, "via": how,
                                           "layers_written": _layers_written(run, outs, device),
                                           "vs_auto": _compare_layers(outs, auto_outs)}
            except Exception as exc:
                result["flashmla_vllm"] = {"unavailable": f"{type(exc).__name__}: {str(exc)[:200]}"}
    fm = result.get("flashmla_vllm", {}).get("us")
    for r in rows.values():
        if fm:
            r["speedup_vs_flashmla_vllm"] = fm / r["us"]
    return result


STEP_HEADER = (f"{'step (plan once + every layer)':<34} {'format':<12} {'backend':<9} {'us/step':>9} {'us_p90':>9} "
               f"{'us/layer':>8} {'written':>7} {'fmla_vllm':>10} {'speedup':>7}")


def _fmt_step_row(res: dict, name: str) -> str:
    r = res["backends"][name]
    fm = res.get("flashmla_vllm", {})
    vllm = f"{fm['us']:10.1f}" if "us" in fm else f"{'n/a':>10}"
    speedup = f"{r['speedup_vs_flashmla_vllm']:6.2f}x" if "speedup_vs_flashmla_vllm" in r else f"{'':>7}"
    label = f"{res['case']} ({res['layers']} layers)"
    return (f"{label:<34} {res['format']:<12} {name:<9} {r['us']:9.1f} {r['us_p90']:9.1f} {r['us_per_layer']:8.1f} "
            f"{r['layers_written']:>3}/{res['layers']:<3} {vllm} {speedup}")


def print_step_notes(res: dict) -> None:
    """What auto picked per layer kind, how FlashMLA was driven (or why not), and the largest
    difference of any layer from auto's outputs."""
    picked = ", ".join(f"{k} {b}" for k, b in res["backends"]["auto"]["picked"].items())
    print(f"  auto picked: {picked}; layers: {res['layer_kinds']}")
    fm = res.get("flashmla_vllm", {})
    if "unavailable" in fm:
        print(f"  FlashMLA as vLLM: {fm['unavailable'][:160]}")
    elif fm:
        print(f"  FlashMLA as vLLM: {fm['via']}; {fm['us_per_layer']:.1f} us/layer, {fm['layers_written']} layers "
              f"written, vs auto: worst layer rel_l2 {fm['vs_auto']['max_rel_l2']:.1e}")
    for name, r in res["backends"].items():
        if "vs_auto" in r:
            print(f"  {name} vs auto: worst layer rel_l2 {r['vs_auto']['max_rel_l2']:.1e}")


def step_auto_gaps(results: list[dict]) -> list[tuple[float, str, str]]:
    """Per whole step timed with auto and named backends: (auto's step vs the fastest named
    backend's - 1, case, that backend), worst first."""
    gaps = []
    for r in results:
        named = {name: b["us"] for name, b in r.get("backends", {}).items() if name != "auto" and "us" in b}
        auto = r.get("backends", {}).get("auto", {})
        if "us" in auto and named:
            best = min(named, key=named.__getitem__)
            gaps.append((auto["us"] / named[best] - 1, f"{r['case']} {r.get('format', '')}", best))
    return sorted(gaps, reverse=True)


def print_step_auto_gaps(results: list[dict]) -> None:
    gaps = step_auto_gaps(results)
    if gaps:
        print(f"whole steps: auto vs the fastest named backend (auto's own replay), worst {len(gaps[:5])} of "
              f"{len(gaps)}:")
        for gap, case, best in gaps[:5]:
            print(f"  {gap * 100:+6.1f} %  {case:<40} fastest {best}")


def guard_variants(fmt: KVFormat) -> dict[str, tuple[str, str]]:
    """{kernel: (backend with range checks, backend without)} for every Triton kernel this GPU
    runs on ``fmt`` (registered as bench variants)."""
    impls = ["triton"]
    if fmt is KVFormat.MODEL1_FP8 and torch.cuda.get_device_capability() == (9, 0):
        impls.insert(0, "gluon")
    return {impl: (register_variant(f"{impl}-checked=impl={impl}"),
                   register_variant(f"{impl}-unchecked=impl={impl},range_checks=0")) for impl in impls}


def guard_cost(case: Case, variants: dict[str, tuple[str, str]], args, flush) -> dict:
    """Per kernel: median µs with and without the range checks, timed A-B-B-A on ``case``, the
    checks' cost in percent, and whether both builds wrote the same bits."""
    res = {}
    for impl, (checked, unchecked) in variants.items():
        runs = {name: api_runner(case, name) for name in (checked, unchecked)}
        times = {checked: [], unchecked: []}
        for name in (checked, unchecked, unchecked, checked):
            times[name].append(time_callable(runs[name][0], args.reps, flush, not args.no_graph).median)
        for run, _, _ in runs.values():
            run()
        torch.cuda.synchronize()
        with_us, without_us = (statistics.mean(times[n]) * 1e6 for n in (checked, unchecked))
        res[impl] = {"us_checked": with_us, "us_unchecked": without_us, "cost_pct": (with_us / without_us - 1) * 100,
                     "same_bits": bool(torch.equal(runs[checked][1], runs[unchecked][1]))}
    return res


def _fmt_row(res: dict, name: str) -> str:
    r = res["backends"][name]
    cells = []
    for label in ("flashmla", "flashmla_raw"):
        fm = res.get(label, {})
        cells.append(f"{fm['us']:9.1f}" if "us" in fm else f"{'n/a':>9}")
        key = f"speedup_vs_{label}"
        cells.append(f"{r[key]:6.2f}x" if key in r else f"{'':>7}")
    return (f"{res['case']:<30} {res['format']:<12} {name:<9} {r['us']:8.1f} {r['us_p90']:8.1f} {r['tflops']:7.1f} "
            f"{r['gbps']:6.0f} {res['floor_us']:7.1f} {r['x_floor']:6.2f} " + " ".join(cells))


HEADER = (f"{'case':<30} {'format':<12} {'backend':<9} {'us':>8} {'us_p90':>8} {'TFLOP/s':>7} {'GB/s':>6} {'floor':>7} "
          f"{'x_flr':>6} "
          f"{'fmla_api':>9} {'speedup':>7} {'fmla_raw':>9} {'speedup':>7}")

# One CSV row per (case, backend): the case's facts, then its timing (median, fastest, 90th
# percentile), rates against the floor, FlashMLA's timing beside it, and host µs per eager call (host_us).
# A step row (phase "step") times a whole decode step: its layers, µs per layer and FlashMLA driven as
# vLLM drives it beside it; no kind, keys or floor.
CSV_COLUMNS = ("case", "phase", "config", "kind", "format", "batch", "s_q_per_req", "heads", "tokens", "valid_keys",
               "layers", "backend", "timing", "runs", "us", "us_min", "us_p90", "us_per_layer", "tflops", "gbps",
               "floor_us", "x_floor", "flashmla_us", "flashmla_us_p90", "speedup_vs_flashmla", "flashmla_raw_us",
               "flashmla_raw_us_p90", "speedup_vs_flashmla_raw", "flashmla_vllm_us", "flashmla_vllm_us_p90",
               "speedup_vs_flashmla_vllm", "host_us", "error")
FLASHMLA_LABELS = ("flashmla", "flashmla_raw", "flashmla_vllm")


def csv_rows(results: list[dict]) -> list[dict]:
    """The results as CSV rows (``CSV_COLUMNS``; a failed case is one row with its error)."""
    rows = []
    for res in results:
        case = {k: res.get(k) for k in CSV_COLUMNS if k in res}
        if "error" in res:
            rows.append(case)
            continue
        for name, r in res["backends"].items():
            row = {**case, "backend": name, **{k: r.get(k) for k in CSV_COLUMNS if k in r}}
            for label in FLASHMLA_LABELS:
                fm = res.get(label, {})
                row[f"{label}_us"], row[f"{label}_us_p90"] = fm.get("us"), fm.get("us_p90")
            rows.append(row)
    return rows


def write_csv(results: list[dict], path: str) -> None:
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(csv_rows(results))


def plot(results: list[dict], path: str, backend: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[dict]] = {}
    for r in results:
        if r["phase"] == "decode":
            groups.setdefault((r["config"], r["format"], r["s_q_per_req"]), []).append(r)
    if not groups:
        return
    n = len(groups)
    cols = min(n, 4)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(4.5 * cols, 3.6 * ((n + cols - 1) // cols)),
                             squeeze=False)
    for ax, ((cfg, fmt, sq), rs) in zip(axes.flat, sorted(groups.items())):
        rs = sorted(rs, key=lambda r: r["batch"])
        bs = [r["batch"] for r in rs]
        ax.plot(bs, [r["backends"][backend]["us"] for r in rs], "o-", label=f"{backend} (ours)")
        for label, style, text in (("flashmla", "s-", "FlashMLA (API)"), ("flashmla_raw", "^:", "FlashMLA (raw op)")):
            fm = [(r["batch"], r[label]["us"]) for r in rs if "us" in r.get(label, {})]
            if fm:
                ax.plot([b for b, _ in fm], [u for _, u in fm], style, label=text)
        ax.plot(bs, [r["floor_us"] for r in rs], "k--", label="roofline floor")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("µs per layer")
        ax.set_title(f"{cfg} {fmt}, {sq} q/req")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def register_variant(spec_str: str) -> str:
    """Register a TritonBackend with a KernelConfig under 't:<label>'; returns the name."""
    from .common.backend import register_backend
    from .portable.kernels.ops import KernelConfig
    from .portable.triton_backend import TritonBackend

    label, _, body = spec_str.partition("=")
    kw = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        kw[key] = value if key in ("dot_dtype", "impl") else int(value)
    name = f"t:{label}"
    register_backend(name, TritonBackend(KernelConfig(**kw)))
    return name


def default_backends() -> list[str]:
    """What `dsv4-attn bench` times without --backend: the portable kernels, and on ROCm the AITER
    path first."""
    from .common.platform import probe

    return ["aiter", "triton"] if probe().vendor == "rocm" else ["triton"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4-attn bench", description=__doc__.split("\n\n")[0] + " Exit status: 0 every case ran, 1 a case "
        "failed, 2 bad arguments. On a machine without a GPU, --device cpu times the torch backend at small decode "
        "shapes: it exists to try the tool and its outputs, the numbers say nothing about GPU kernels.")
    p.add_argument("--mode", choices=["decode", "prefill", "step", "all"], default="decode",
                   help="decode / prefill: one layer per case; step: one whole decode step of a model (plan once + "
                        "every attention layer) for 'auto', each --backends name and FlashMLA driven as vLLM 0.33 "
                        "drives it, side by side; all: the three")
    p.add_argument("--configs", nargs="+", metavar="NAME", default=None,
                   help=f"decode: {', '.join(DECODE_CONFIGS)}; prefill: {', '.join(PREFILL_CONFIGS)}; step: "
                        + "; ".join(f"{m.name} ({m.source})" for m in STEP_MODELS.values())
                        + "; or the groups 'v4' / 'v41' (default: all of --mode); an unknown name is an error")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="requests per decode case (default 2 64 128 256; on the CPU 2)")
    p.add_argument("--mtp", type=int, nargs="+", default=None,
                   help="query tokens per request, decode (default 1 2; on the CPU 1)")
    p.add_argument("--backends", nargs="+", metavar="NAME", default=None,
                   help="backends to time (names or comma lists; 'all' = every registered backend; 'auto' = what "
                        "the dispatcher picks per case, compared with the named ones). Default: triton; aiter and "
                        "triton on ROCm; torch on the CPU")
    p.add_argument("--backend", nargs="+", dest="backends", help=argparse.SUPPRESS)  # the old name
    p.add_argument("--variant", action="append", default=[],
                   help="development: also time a triton kernel config, e.g. "
                        "'bn64=block_n=64,num_warps=8,num_stages=2,dot_dtype=bf16' (repeatable)")
    p.add_argument("--format", nargs="+", default=["fp8_ds_mla"],
                   help="KV format(s): fp8_ds_mla, bfloat16, fp8_e4m3, mxfp8_ds_mla, nvfp4_ds_mla (V4.1 records: "
                        "V4.1 configs only)")
    p.add_argument("--device", help="cuda (default when torch sees a GPU) or cpu (the torch backend only)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per case (default 50; on the CPU 5)")
    p.add_argument("--no-graph", action="store_true", help="time eager launches instead of CUDA-graph replays")
    p.add_argument("--no-flashmla", action="store_true", help="do not time FlashMLA beside our backends")
    p.add_argument("--guard-cost", action="store_true",
                   help="also time each Triton kernel with and without its index range checks (same case, "
                        "A-B-B-A) and print the checks' cost")
    p.add_argument("--json", metavar="PATH", help="write every result (with min / median / p90) and the run's facts")
    p.add_argument("--csv", metavar="PATH", help="write one row per case and backend (min / median / p90 µs, rates)")
    p.add_argument("--write-choices", metavar="PATH",
                   help="write a measured-choices table (per shape: each backend's us per layer and, for decode, "
                        "its own per-step work; common/choices.py) from this run's backends here; use it with "
                        "DSV4_ATTN_CHOICES=PATH or ship it in dsv4_attn/data/choices/")
    p.add_argument("--png", metavar="PATH", help="plot time vs batch (ours, FlashMLA, floor); needs matplotlib")
    return p


def unknown_configs(names: list[str], mode: str) -> list[str]:
    """The ``--configs`` names that name no config (nor group) of ``mode``."""
    tables = [t for m, t in (("decode", DECODE_CONFIGS), ("prefill", PREFILL_CONFIGS), ("step", STEP_MODELS))
              if mode in (m, "all")]
    return [n for n in names if not any(select_configs(t, [n]) for t in tables)]


def settle(args) -> torch.device:
    """Check the arguments and fill the device-dependent defaults in ``args``, before any work;
    the device to run on. Raises ValueError with what is wrong and what is allowed."""
    from .cli import parse_device
    from .parity.runner import resolve_backends

    device = parse_device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for fmt in args.format:
        KVFormat.parse(fmt)
    if args.configs and unknown_configs(args.configs, args.mode):
        names = (*DECODE_CONFIGS, *PREFILL_CONFIGS, *STEP_MODELS, *CONFIG_GROUPS)
        allowed = [n for n in names if not unknown_configs([n], args.mode)]
        raise ValueError(f"--configs: got {unknown_configs(args.configs, args.mode)} (--mode {args.mode}); "
                         f"allowed: {allowed}")
    if args.png and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"--png: got {args.png!r}, but matplotlib is not installed; allowed: after "
                         "pip install matplotlib (or the package's [bench] extra), or no --png")
    for name in ("batches", "mtp", "reps"):
        values = getattr(args, name)
        if values is not None and min(values if isinstance(values, list) else [values]) < 1:
            raise ValueError(f"--{name}: got {values}; allowed: positive ints")
    cpu = device.type == "cpu"
    args.backends = (resolve_backends(args.backends, also=("auto",)) if args.backends
                     else ["torch"] if cpu else default_backends())
    if cpu:
        refused = {"--mode": args.mode not in ("decode", "step") and
                   "prefill configs are production-sized (4k-8k query tokens)",
                   "--backends": bool(set(args.backends) - {"torch", "auto"}) and
                   f"{args.backends}: only the torch backend runs on CPU ('auto' picks it)",
                   "--guard-cost": args.guard_cost and "it times Triton kernels", "--variant": args.variant and
                   "it times Triton kernels",
                   "--write-choices": args.write_choices and "CPU timings choose no GPU backend"}
        for flag, why in refused.items():
            if why:
                raise ValueError(f"{flag}: {why}; allowed on --device cpu: the torch backend at decode shapes "
                                 "(--mode decode or step)")
        args.no_flashmla, args.no_graph = True, True
    args.batches = args.batches or ([2] if cpu else [2, 64, 128, 256])
    args.mtp = args.mtp or ([1] if cpu else [1, 2])
    args.reps = args.reps or (5 if cpu else 50)
    return device


def _device_facts(device: torch.device) -> dict:
    if device.type == "cpu":
        import platform

        return {"device": platform.processor() or platform.machine() or "cpu", "sms": None}
    props = torch.cuda.get_device_properties(device)
    return {"device": props.name, "sms": props.multi_processor_count}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        device = settle(args)
    except ValueError as exc:
        print(f"dsv4-attn bench: {exc}", file=sys.stderr)
        return 2
    formats = [KVFormat.parse(f) for f in args.format]
    for spec_str in args.variant:
        args.backends.append(register_variant(spec_str))
    t0 = time.time()
    if device.type != "cpu":
        warm_up(device)
    ceilings = measure_ceilings(device)
    flush = L2Flush(device) if device.type != "cpu" else None
    meta = {**_device_facts(device), "torch": torch.__version__, "triton": _version("triton"), "ceilings": ceilings,
            "formats": [f.value for f in formats], "flashmla_lib": _flashmla_lib(), "reps": args.reps,
            "graph": not args.no_graph}
    if device.type == "cpu":
        print("CPU run: the torch backend at small decode shapes, to try the tool and its outputs; the numbers say "
              "nothing about GPU kernels")
    print(f"device {meta['device']}" + (f" ({meta['sms']} SMs)" if meta["sms"] else "") +
          f", torch {torch.__version__}, triton {meta['triton']}; copy {ceilings['copy_bytes_per_s'] / 1e9:.0f} "
          f"GB/s, bf16 mm {ceilings['bf16_flops_per_s'] / 1e12:.2f} TFLOP/s; timing: "
          f"{'graph replay' if not args.no_graph else 'eager'}"
          f"{', L2 flushed' if flush else ''}, median and p90 of {args.reps}")
    results = []
    cases = []
    for fmt in formats:
        if args.mode in ("decode", "all"):
            for name in select_configs(DECODE_CONFIGS, args.configs):
                if runs_in(DECODE_CONFIGS[name].kind, fmt):
                    cases.extend(("decode", name, b, sq, fmt) for sq in args.mtp for b in args.batches)
        if args.mode in ("prefill", "all"):
            cases.extend(("prefill", name, 0, 0, fmt) for name in select_configs(PREFILL_CONFIGS, args.configs)
                         if runs_in(PREFILL_CONFIGS[name].kind, fmt))
        if args.mode in ("step", "all") and runs_in(LayerKind.C4A, fmt):
            cases.extend(("step", name, b, sq, fmt) for name in select_configs(STEP_MODELS, args.configs)
                         for sq in args.mtp for b in args.batches)
    if any(phase != "step" for phase, *_ in cases):
        print(HEADER)
    guards = {fmt: guard_variants(fmt) for fmt in formats} if args.guard_cost else {}
    step_len = STEP_CPU_MAX_MODEL_LEN if device.type == "cpu" else STEP_MAX_MODEL_LEN
    for phase, name, b, sq, fmt in cases:
        if phase == "step" and not any(r.get("phase") == "step" for r in results):
            print(STEP_HEADER)
        try:
            if phase == "step":
                case = make_step_case(STEP_MODELS[name], b, sq, device, fmt, max_model_len=step_len)
                res = run_step_case(case, args.backends, args, flush)
            else:
                case = (make_decode_case(DECODE_CONFIGS[name], b, sq, device, fmt) if phase == "decode"
                        else make_prefill_case(PREFILL_CONFIGS[name], device, fmt))
                res = run_case(case, args.backends, args, ceilings, flush)
            if guards and phase != "step":
                res["guard_cost"] = guard_cost(case, guards[fmt], args, flush)
        except Exception as exc:
            print(f"{phase} {name} b={b} s_q={sq} {fmt.value}: FAILED {type(exc).__name__}: {exc}", file=sys.stderr)
            results.append({"case": f"{name} b={b} s_q={sq}", "phase": phase, "format": fmt.value,
                            "error": f"{type(exc).__name__}: {exc}"})
            continue
        results.append(res)
        if phase == "step":
            for name_b in res["backends"]:
                print(_fmt_step_row(res, name_b), flush=True)
            print_step_notes(res)
        for name_b in args.backends if phase != "step" else ():
            print(_fmt_row(res, name_b), flush=True)
        for label in ("flashmla", "flashmla_raw"):
            if "unavailable" in res.get(label, {}):
                print(f"  {label}: {res[label]['unavailable'][:160]}")
        for impl, g in res.get("guard_cost", {}).items():
            print(f"  range checks, {impl} kernel: {g['us_checked']:.1f} us with, {g['us_unchecked']:.1f} us without: "
                  f"{g['cost_pct']:+.2f} % (same bits: {g['same_bits']})")
        del case
        if device.type != "cpu":
            torch.cuda.empty_cache()
    meta["seconds"] = time.time() - t0
    per_layer = [r for r in results if r.get("phase") != "step"]  # one-layer cases: auto's check, choices, plot
    if "auto" in args.backends:
        print_auto_gaps(per_layer)
    print_step_auto_gaps([r for r in results if r.get("phase") == "step"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    if args.csv:
        write_csv(results, args.csv)
    if args.write_choices:
        from .common.platform import probe

        table = choices.from_bench({"meta": meta, "results": per_layer}, probe().arch)
        with open(args.write_choices, "w") as f:
            json.dump(table, f, indent=1)
        print(f"wrote {len(table['entries'])} measured choices for {table['arch']} to {args.write_choices}")
    if args.png:
        try:
            plot([r for r in per_layer if "error" not in r], args.png, args.backends[0])
        except Exception as exc:
            print(f"plot failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1 if any("error" in r for r in results) else 0


def _version(name: str) -> str | None:
    try:
        import importlib.metadata

        return importlib.metadata.version(name)
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
