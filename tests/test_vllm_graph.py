"""The vLLM shim's planning + attention inside CUDA graphs, on vLLM-shaped persistent buffers.

vLLM's FULL CUDA graphs (its default for uniform decode batches) and its fused MTP draft loop
record ``forward_mqa`` -- the shim's planning included -- once, then replay it after the runner
rewrote its persistent buffers (query_start_loc, seq_lens, block tables, slot mappings, top-k).
vLLM cannot be installed on the GPU machine (its torch pin), so this module builds those buffers
as vLLM's runner holds them (fixed addresses, padded batch sizes, zero-length padding requests)
and hands the shim metadata objects with the fields vLLM's DeepseekSparseSWAMetadata /
DeepseekV4FlashMLAMetadata give it (tests/test_vllm_shim.py checks the real ones on CPU).

The GPU tests capture one uniform decode step over every layer kind (two SWA-cache groups, one
compressed group, as vLLM groups DeepSeek-V4) and a two-step draft loop whose sequence lengths
advance inside the graph, then replay them on new batches -- fewer real requests, other lengths,
tables, keys, top-k and queries -- against the float64 reference with keys written out here. The
same steps run eagerly on the CPU (torch backend), which checks this module's bookkeeping in CI.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dsv4_attn.common import layout, reference
from dsv4_attn.common.backend import BackendUnavailableError
from dsv4_attn.common.layout import Fp8Dialect
from dsv4_attn.common.spec import LayerKind, ModelSpec
from dsv4_attn.integrations import vllm as shim

from kit.compare import compare

HEADS, TOPK, MAX_MODEL_LEN, W = 64, 128, 8192, 128
MAX_REQS, MAX_TOKENS, NUM_BLOCKS = 8, 32, 96
SWA_BS, BS = 64, 256  # SWA block (tokens); compressed-cache block (uncompressed tokens)
# (layer prefix, ratio, SWA-cache group): vLLM 0.33 puts DeepSeek-V4's SWA caches into two
# groups and every compressed cache into one (tests/test_vllm_shim.py builds the real ones). Both
# SWA groups hold a C128A layer: their two plans share one C128A row set.
LAYERS = [("model.layers.0.attn", LayerKind.SWA, "swa_a"), ("model.layers.1.attn", LayerKind.C4A, "swa_b"),
          ("model.layers.2.attn", LayerKind.C128A, "swa_a"), ("model.layers.3.attn", LayerKind.C4A, "swa_b"),
          ("model.layers.4.attn", LayerKind.C128A, "swa_b")]
MTP = ("model.layers.5.attn", LayerKind.SWA, "swa_b")


class Engine:
    """vLLM-shaped persistent state for ``LAYERS`` + the MTP layer on ``device``: request
    buffers, block tables per KV-cache group, the shared top-k buffer, caches, sinks, and the
    shim's planner (profiled) with layer stand-ins."""

    def __init__(self, device: torch.device, gen: torch.Generator) -> None:
        self.device, self.gen = device, gen
        i32 = dict(dtype=torch.int32, device=device)
        self.qsl = torch.zeros(MAX_REQS + 1, **i32)
        self.seq_lens = torch.zeros(MAX_REQS, **i32)
        self.tables = {g: torch.zeros(MAX_REQS, -(-MAX_MODEL_LEN // bs), **i32)
                       for g, bs in (("swa_a", SWA_BS), ("swa_b", SWA_BS), ("comp", BS))}
        self.topk = torch.full((MAX_TOKENS, TOPK), -1, **i32)
        spec = ModelSpec(num_heads=HEADS, topk=TOPK, max_model_len=MAX_MODEL_LEN)
        groups = {}
        self.planner = shim.StepPlanner(spec, MAX_TOKENS, MAX_REQS, Fp8Dialect.OCP,
                                        predict=lambda layers: shim.plan_groups(layers, groups.__getitem__)[1],
                                        block_size=lambda: BS)
        self.layers = [self._layer(*entry, draft=False) for entry in LAYERS]
        self.mtp = self._layer(*MTP, draft=True)
        for layer in self.layers + [self.mtp]:
            groups[layer.swa_cache_layer.prefix] = layer.swa_group
            groups[layer.prefix] = "comp"
            self.planner.add_layer(layer)

    def _layer(self, prefix: str, kind: LayerKind, swa_group: str, draft: bool) -> SimpleNamespace:
        sink = torch.full((HEADS,), -math.inf)
        sink[: HEADS - 8] = torch.randn(HEADS - 8, generator=self.gen)  # the last 8 heads: padding
        layer = SimpleNamespace(
            prefix=prefix, dsv4_kind=kind, dsv4_comp_prefix=prefix, is_draft_layer=draft, swa_group=swa_group,
            swa_cache_layer=SimpleNamespace(prefix=f"{prefix}.swa_cache",
                                            kv_cache=layout.new_cache("fp8_ds_mla", NUM_BLOCKS, SWA_BS, self.device)),
            kv_cache=(layout.new_cache("fp8_ds_mla", NUM_BLOCKS, BS // kind.ratio, self.device)
                      if kind.has_comp_scope else torch.tensor([], device=self.device)),
            topk_indices_buffer=self.topk if kind.uses_topk else None,
            attn_sink=sink.to(self.device))
        layer.dsv4_comp_cache = lambda: layer.kv_cache  # the layer's own compressed cache (V4)
        return layer

    # ---- a batch, written into the persistent buffers ------------------------------------------
    def load(self, query_lens: list[int], seq_lens: list[int], num_reqs: int, extra: int = 0) -> list:
        """Write a decode batch of len(query_lens) requests padded to ``num_reqs`` (zero-length
        requests, query_start_loc repeating its last offset), fresh block ids, keys for every
        row it reads (and ``extra`` positions past each sequence), top-k rows and sinks.
        Returns the real tokens as (request, position)."""
        gen, R = self.gen, len(query_lens)
        qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
        self.qsl.copy_(torch.tensor(qsl + [qsl[-1]] * (MAX_REQS - R), dtype=torch.int32))
        self.seq_lens.copy_(torch.tensor(seq_lens + [0] * (MAX_REQS - R), dtype=torch.int32))
        for group, bs in (("swa_a", SWA_BS), ("swa_b", SWA_BS), ("comp", BS)):
            table = torch.zeros_like(self.tables[group], device="cpu")
            ids = torch.randperm(NUM_BLOCKS, generator=gen)
            for r, s in enumerate(seq_lens):
                n = -(-(s + extra) // bs)
                table[r, :n], ids = ids[:n].int(), ids[n:]
            self.tables[group].copy_(table)
        window = [range(max(0, s - q - W + 1), s + extra) for q, s in zip(query_lens, seq_lens)]
        for layer in self.layers + [self.mtp]:
            self._write_keys(layer.swa_cache_layer.kv_cache, self.tables[layer.swa_group], window)
            if layer.dsv4_kind.has_comp_scope:
                entries = [range((s + extra) // layer.dsv4_kind.ratio) for s in seq_lens]
                self._write_keys(layer.kv_cache, self.tables["comp"], entries)
            layer.attn_sink[: HEADS - 8] = torch.randn(HEADS - 8, generator=gen).to(self.device)
        toks = [(r, s - q + i) for r, (q, s) in enumerate(zip(query_lens, seq_lens)) for i in range(q)]
        topk = torch.full((MAX_TOKENS, TOPK), -1, dtype=torch.int32)
        for t, (_, p) in enumerate(toks):
            n = min((p + 1) // 4, TOPK)
            topk[t, :n] = torch.randperm((p + 1) // 4, generator=gen)[:n].int()
        self.topk.copy_(topk)
        return toks

    def _write_keys(self, cache, table, rows: list[range]) -> None:
        """Fresh keys at the cache rows ``rows[r]`` (positions, or entries of a compressed cache)
        of each request r."""
        bs = cache.shape[1]
        cpu_table = table.cpu()
        slots = torch.tensor([int(cpu_table[r, e // bs]) * bs + e % bs for r, es in enumerate(rows) for e in es])
        keys = (torch.randn(slots.shape[0], 512, generator=self.gen) * 2).bfloat16()
        layout.insert(cache, "fp8_ds_mla", slots.to(self.device), keys.to(self.device))

    def metadata(self, num_reqs: int, num_tokens: int) -> dict:
        """A step's ``attn_metadata``: the fields of vLLM's DeepseekSparseSWAMetadata (one object
        per SWA group) and DeepseekV4FlashMLAMetadata (one per compressed layer type) the shim
        reads, as views of the persistent buffers (uniform decode: every token a decode)."""
        swa = {g: SimpleNamespace(query_start_loc=self.qsl[: num_reqs + 1], seq_lens=self.seq_lens[:num_reqs],
                                  num_decode_tokens=num_tokens, block_table=self.tables[g][:num_reqs],
                                  block_size=SWA_BS) for g in ("swa_a", "swa_b")}
        comp = {r: SimpleNamespace(block_table=self.tables["comp"][:num_reqs], block_size=BS) for r in (4, 128)}
        md = {}
        for layer in self.layers + [self.mtp]:
            md[layer.swa_cache_layer.prefix] = swa[layer.swa_group]
            if layer.dsv4_kind.has_comp_scope:
                md[layer.prefix] = comp[layer.dsv4_kind.ratio]
        return md

    # ---- the reference -----------------------------------------------------------------------------
    def expected(self, layer, q: torch.Tensor, toks: list, seq_shift: int = 0) -> torch.Tensor:
        """float64 [T, HEADS, 512] from rows written out here (positions shifted by ``seq_shift``)."""
        T, kind = q.shape[0], layer.dsv4_kind
        ratio = kind.ratio
        tables = {g: t.cpu() for g, t in self.tables.items()}
        topk = self.topk.cpu()
        width = TOPK if kind.uses_topk else -(-MAX_MODEL_LEN // max(ratio, 1))
        swa, comp = torch.full((T, W), -1, dtype=torch.int32), torch.full((T, width), -1, dtype=torch.int32)
        swa_lens, comp_lens = torch.zeros(T, dtype=torch.int32), torch.zeros(T, dtype=torch.int32)
        for t, (r, p) in enumerate(toks):
            p += seq_shift
            window = [int(tables[layer.swa_group][r, k // SWA_BS]) * SWA_BS + k % SWA_BS
                      for k in range(max(0, p - W + 1), p + 1)]
            swa[t, : len(window)], swa_lens[t] = torch.tensor(window, dtype=torch.int32), len(window)
            entries = ([int(c) for c in topk[t, : min((p + 1) // ratio, TOPK)]] if kind.uses_topk
                       else list(range((p + 1) // ratio)) if kind.attends_all else [])
            cbs = BS // max(ratio, 1)
            keys = [int(tables["comp"][r, e // cbs]) * cbs + e % cbs for e in entries]
            if keys:
                comp[t, : len(keys)] = torch.tensor(keys, dtype=torch.int32)
            comp_lens[t] = len(keys)
        has_comp = layer.dsv4_kind.has_comp_scope
        out, _ = reference.sparse_mla(q.cpu(), layer.swa_cache_layer.kv_cache.cpu(), swa, swa_lens,
                                      layer.kv_cache.cpu() if has_comp else None, comp if has_comp else None,
                                      comp_lens if has_comp else None, layer.attn_sink.cpu(), 512**-0.5,
                                      "fp8_ds_mla")
        return out

    def queries(self, num_tokens: int) -> torch.Tensor:
        q = torch.zeros(num_tokens, HEADS, 512, dtype=torch.bfloat16)
        q[:, : HEADS - 8] = torch.randn(num_tokens, HEADS - 8, 512, generator=self.gen).bfloat16()
        return q.to(self.device)


def check(out: torch.Tensor, ref: torch.Tensor, num_real: int) -> dict:
    """Live heads of the real tokens match the float64 reference; padding tokens are zero."""
    assert not out.isnan().any(), "output elements left unwritten"
    err = compare(out[:num_real, : HEADS - 8], ref[:num_real, : HEADS - 8])
    assert err["rel_l2"] < 2e-2 and err["cosine"] > 0.9995, err
    assert not out[num_real:].any()
    return err


# ---- the steps (eager on any device; captured on a GPU) ----------------------------------------
class Forward:
    """A forward pass, as vLLM's ForwardContext: the planner keeps a step's plans while it lives."""


def decode_step(engine: Engine, md: dict, qs: list, outs: list) -> None:
    forward = Forward()
    for layer, q, out in zip(engine.layers, qs, outs):
        engine.planner.attend(layer, md, q, out, forward)


def draft_loop(engine: Engine, md: dict, qs: list, outs: list) -> None:
    """Two draft steps over the MTP layer; between them vLLM advances every (padded) request's
    sequence length in place (update_draft_inputs), inside the same graph."""
    for k in range(2):
        if k:
            engine.seq_lens.add_(1)
        engine.planner.attend(engine.mtp, md, qs[k], outs[k], Forward())


BATCHES = [  # (query lens, seq lens) of the real requests; the graphs are captured for MAX_REQS
    ([1] * MAX_REQS, [5, 60, 129, 300, 700, 1100, 64, 2000]),
    ([1] * 3, [3000, 17, 256]),
    ([1] * 6, [130, 131, 132, 4000, 1, 800]),
]


def run_batches(engine: Engine, step, q_len: int, num_outputs: int, extra: int = 0,
                replay: SimpleNamespace | None = None):
    """Every batch of BATCHES, ``q_len`` tokens per request, through ``step`` eagerly or through
    ``replay`` (a captured graph with its static queries and outputs): fresh queries, outputs
    poisoned with NaN. Yields (real tokens, queries, outputs) after each batch."""
    T = MAX_REQS * q_len
    if replay is None:
        qs = [engine.queries(T) for _ in range(num_outputs)]
        outs = [torch.empty(T, HEADS, 512, dtype=torch.bfloat16, device=engine.device) for _ in range(num_outputs)]
    else:
        qs, outs = replay.qs, replay.outs
    for query_lens, seq_lens in BATCHES:
        toks = engine.load([q_len] * len(query_lens), [s + q_len - 1 for s in seq_lens], MAX_REQS, extra)
        for q in qs:
            q.copy_(engine.queries(T))
        for out in outs:
            out.fill_(float("nan"))
        if replay is None:
            step(engine, engine.metadata(MAX_REQS, T), qs, outs)
        else:
            replay.graph.replay()
            torch.cuda.synchronize()
        yield toks, qs, outs


def run_decode(engine: Engine, q_len: int, replay: SimpleNamespace | None = None) -> list[dict]:
    """The decode step over every layer on every batch; the errors against the reference."""
    return [check(out.cpu(), engine.expected(layer, q, toks), len(toks))
            for toks, qs, outs in run_batches(engine, decode_step, q_len, len(LAYERS), replay=replay)
            for layer, q, out in zip(engine.layers, qs, outs)]


def run_draft_loop(engine: Engine, replay: SimpleNamespace | None = None) -> list[dict]:
    """The two-step draft loop on every batch (one token per request); draft step k attends at
    the positions advanced k times."""
    return [check(outs[k].cpu(), engine.expected(engine.mtp, qs[k], toks, seq_shift=k), len(toks))
            for toks, qs, outs in run_batches(engine, draft_loop, 1, 2, extra=1, replay=replay)
            for k in range(2)]


def test_plan_groups_follow_the_kv_cache_groups():
    """Per SWA-cache group one plan per compressed group of each ratio; two C4A caches in
    different groups (not vLLM 0.33's V4 grouping, where one group holds them all) need two."""
    def layer(prefix, kind):
        return SimpleNamespace(prefix=prefix, dsv4_kind=kind, dsv4_comp_prefix=prefix,
                               swa_cache_layer=SimpleNamespace(prefix=f"{prefix}.swa"))

    layers = [layer("a", LayerKind.SWA), layer("b", LayerKind.C4A), layer("c", LayerKind.C4A),
              layer("d", LayerKind.C128A), layer("e", LayerKind.C4A), layer("f", LayerKind.C128A)]
    group_of = {"a.swa": "S1", "b.swa": "S1", "c.swa": "S1", "d.swa": "S2", "e.swa": "S2", "f.swa": "S1",
                "b": "C1", "c": "C2", "d": "C3", "e": "C1", "f": "C3"}
    index, groups = shim.plan_groups(layers, group_of.__getitem__)
    assert groups == [shim.PlanGroup("a.swa", ((4, "b"), (128, "f"))), shim.PlanGroup("a.swa", ((4, "c"),)),
                      shim.PlanGroup("d.swa", ((128, "d"), (4, "e")))]
    assert index == {"a": 0, "b": 0, "c": 1, "d": 2, "e": 2, "f": 0}
    assert [g.has_c128a for g in groups] == [True, False, True]
    assert [g.c128a_table for g in groups] == ["C3", None, "C3"]  # two plans, one ratio-128 table: one row set


def test_plan_groups_of_shared_compressed_caches():
    """DeepSeek-V4.1: a layer reads its KV source's compressed cache, so its plan is keyed by the
    source's metadata; readers of one source share the source's plan."""
    def layer(prefix, kind, source):
        return SimpleNamespace(prefix=prefix, dsv4_kind=kind, dsv4_comp_prefix=source,
                               swa_cache_layer=SimpleNamespace(prefix=f"{prefix}.swa"))

    layers = [layer("a", LayerKind.SWA, "a"), layer("b", LayerKind.C1A, "b"), layer("c", LayerKind.C1A, "b"),
              layer("d", LayerKind.C2A, "d"), layer("e", LayerKind.C2A, "d")]
    group_of = {f"{p}.swa": "S" for p in "abcde"} | {"b": "C1", "d": "C2"}
    index, groups = shim.plan_groups(layers, group_of.__getitem__)
    assert groups == [shim.PlanGroup("a.swa", ((1, "b"), (2, "d")))]
    assert index == {p: 0 for p in "abcde"}


def test_vllm_shaped_decode_steps_eager(gen, monkeypatch):
    """The batches of the graph test (2 tokens per request, as in MTP verification), eagerly on
    the CPU (torch backend, also on a GPU machine); one-token steps run in the draft loop below."""
    monkeypatch.setenv("DSV4_ATTN_BACKEND", "torch")
    engine = Engine(torch.device("cpu"), gen)
    engine.planner.reserve(engine.device)
    slot_a, slot_b = (engine.planner.slots[i]._buffers.all_rows[128][0] for i in (0, 1))
    assert slot_a is slot_b  # one C128A row set for both plans of a step
    errors = run_decode(engine, 2)
    assert len(errors) == len(BATCHES) * len(LAYERS)
    assert engine.planner.plans_built == len(BATCHES) * 2  # one plan per SWA group and step


def test_vllm_shaped_draft_loop_eager(gen, monkeypatch):
    monkeypatch.setenv("DSV4_ATTN_BACKEND", "torch")
    engine = Engine(torch.device("cpu"), gen)
    engine.planner.reserve(engine.device)
    assert len(run_draft_loop(engine)) == 2 * len(BATCHES)
    assert engine.planner.plans_built == 2 * len(BATCHES)  # a plan per draft step


# ---- captured and replayed on a GPU -------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for CUDA-graph capture")


def gpu_engine(backend: str, gen, monkeypatch) -> Engine:
    """The engine on the GPU with ``backend`` forced, profiled (every plan buffer reserved)."""
    monkeypatch.setenv("DSV4_ATTN_BACKEND", backend)
    try:
        engine = Engine(torch.device("cuda"), gen)
    except BackendUnavailableError as exc:
        pytest.skip(f"backend {backend} cannot run here: {exc}")
    engine.planner.reserve(engine.device)
    return engine


def capture(engine: Engine, step, q_len: int, num_outputs: int) -> SimpleNamespace:
    """Warm up eagerly on a first batch (compiles), then capture ``step`` with a fresh
    ``attn_metadata`` dict, as vLLM builds one per step: the plans are built inside the capture."""
    T = MAX_REQS * q_len
    engine.load([q_len] * MAX_REQS, BATCHES[0][1], MAX_REQS, extra=1)
    qs = [engine.queries(T) for _ in range(num_outputs)]
    outs = [torch.empty(T, HEADS, 512, dtype=torch.bfloat16, device="cuda") for _ in range(num_outputs)]
    seq_lens = engine.seq_lens.clone()
    step(engine, engine.metadata(MAX_REQS, T), qs, outs)
    torch.cuda.synchronize()
    engine.seq_lens.copy_(seq_lens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(engine, engine.metadata(MAX_REQS, T), qs, outs)
    engine.seq_lens.copy_(seq_lens)
    return SimpleNamespace(graph=graph, qs=qs, outs=outs)


def plan_bytes(engine: Engine) -> int:
    return shim._buffer_bytes(*engine.planner.slots, engine.planner.draft_slot)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "flashmla"])
@pytest.mark.parametrize("q_len", [1, 2], ids=["decode", "mtp-verify"])
def test_gpu_decode_step_captured_and_replayed_on_new_batches(backend, q_len, monkeypatch, gen):
    engine = gpu_engine(backend, gen, monkeypatch)
    reserved = plan_bytes(engine)
    errors = run_decode(engine, q_len, capture(engine, decode_step, q_len, len(LAYERS)))
    assert len(errors) == len(BATCHES) * len(LAYERS)
    assert plan_bytes(engine) == reserved == engine.planner.reserved_bytes  # nothing allocated after profiling
    worst = max(e["rel_l2"] for e in errors)
    print(f"{backend} q_len={q_len}: worst rel L2 {worst:.2e} over {len(errors)} layer steps")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "flashmla"])
def test_gpu_draft_loop_captured_and_replayed_on_new_batches(backend, monkeypatch, gen):
    """The fused draft loop's graph: two draft steps, sequence lengths advanced in place between
    them inside the graph; every replayed draft step attends at its own positions."""
    engine = gpu_engine(backend, gen, monkeypatch)
    reserved = plan_bytes(engine)
    errors = run_draft_loop(engine, capture(engine, draft_loop, 1, 2))
    assert len(errors) == 2 * len(BATCHES)
    assert plan_bytes(engine) == reserved
    print(f"{backend} draft loop: worst rel L2 {max(e['rel_l2'] for e in errors):.2e} over {len(errors)} steps")
