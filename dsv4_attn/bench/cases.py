"""The bench's cases on random, production-like inputs: one layer (``LayerCase``: decode or prefill)
or a whole decode step (``ModelStep``: every layer of a model), over shuffled block tables and
caches filled in every record's byte layout."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..common.batch import StepBatch
from ..common.layout import KVFormat, Record, new_cache
from ..common.spec import LayerKind, ModelSpec
from ..testing.steps import fill_topk_prefix
from .configs import COMP_BLOCK, STEP_MAX_MODEL_LEN, SWA_BLOCK, V41_KINDS, DecodeConfig, PrefillConfig, StepModel

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
class LayerCase:
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
    topk = torch.full((positions.shape[0], width), -1, dtype=torch.int32)
    return fill_topk_prefix(gen, topk, positions.cpu(), ratio).to(positions.device)


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
                     seed: int = 0) -> LayerCase:
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
    return LayerCase(f"{cfg.name} b={b} s_q={s_q}", cfg.kind, spec, batch, q, swa_cache, comp_cache, topk, sink, fmt,
                     R, s_q, "decode", {"config": cfg.name, "batch": b, "format": fmt.value})


def make_prefill_case(cfg: PrefillConfig, device, fmt: KVFormat = KVFormat.MODEL1_FP8, seed: int = 0) -> LayerCase:
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
    return LayerCase(cfg.name, cfg.kind, spec, batch, q, swa_cache, comp_cache, topk, sink, fmt, 1, T, "prefill",
                     {"config": cfg.name, "s_q": T, "s_kv": s_kv, "topk": cfg.topk, "format": fmt.value})



# ---- whole decode steps -------------------------------------------------------------------------


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
class ModelStep:
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
        tokens = self.batch.num_tokens
        if tokens is None:  # make_model_step gives every batch its token count
            raise ValueError("batch.num_tokens: got None; allowed: the step's token count")
        return tokens


def make_model_step(model: StepModel, b: int, s_q: int, device, fmt: KVFormat = KVFormat.MODEL1_FP8,
                    seed: int = 0, max_model_len: int = STEP_MAX_MODEL_LEN) -> ModelStep:
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
    return ModelStep(f"{model.name} b={b} s_q={s_q}", model, spec, batch, fmt, layers, b, s_q,
                     {"config": model.name, "batch": b, "format": fmt.value})

