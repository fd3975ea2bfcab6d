"""One engine step of a DeepSeek-V4-Flash-shaped model through dsv4_attn, every layer checked
against the float64 reference.

    python examples/run_step.py                  # CPU (torch backend), a few seconds
    python examples/run_step.py --device cuda    # a GPU: the backends the probe picks there
    python examples/run_step.py --model v41      # DeepSeek-V4.1 layer kinds (C1A, C2A)

What it builds, the way an engine does (vLLM's layout: SWA blocks of 64 tokens, compressed blocks
of 256 uncompressed tokens):

1. ``ModelSpec.from_hf_config`` on the attention fields of a config.json (64 heads, top-k 512,
   window 128; a short layer list);
2. a mixed step: three decode requests (one token each) and a chunk of prefill, as block tables
   and lengths (``StepBatch``);
3. per layer an SWA cache and a compressed cache (shared where the config shares it), allocated
   with ``dsv4.new_cache`` and filled with ``dsv4.insert`` at the slots the block tables give,
   for every position up to and including this step's tokens;
4. per top-k layer an indexer-like top-k: each token scores the compressed entries it can see
   and keeps the best ``topk`` (their entry numbers, -1 padded);
5. ``plan()`` once, ``forward()`` per layer into a NaN-poisoned output, the float64 reference on
   the same rows, and ``explain()``.

Exit status 0 when every layer matches the reference, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

import torch

import dsv4_attn as dsv4
from dsv4_attn.models import CSA, HCA, SWA, V4_FLASH

# The attention fields of DeepSeek-V4-Flash's config.json (64 heads, indexer top-k 512, window
# 128, 1M positions; dsv4_attn.models holds the released models' fields) with a short layer list:
# the released model has more layers of these kinds.
V4_FLASH_CONFIG = {**V4_FLASH.config, "num_hidden_layers": 5, "layer_types": [SWA, CSA, HCA, CSA, HCA]}
# DeepSeek-V4.1: per-layer compress_ratios (0 window only, 1 C1A, 2 C2A); layer 3 reads layer 2's
# compressed cache (kv_source_layer_ids); the text model nested beside a vision tower.
V41_CONFIG = {
    "model_type": "deepseek_v41",
    "text_config": {**{k: V4_FLASH_CONFIG[k] for k in ("num_attention_heads", "head_dim", "qk_rope_head_dim",
                                                       "index_topk", "sliding_window", "max_position_embeddings")},
                    "num_hidden_layers": 5, "num_nextn_predict_layers": 1,
                    "compress_ratios": [0, 1, 2, 2, 1], "kv_source_layer_ids": [1, 2, 4]},
    "vision_config": {"num_hidden_layers": 2},
}
SWA_BLOCK = 64  # tokens per SWA-cache block
COMP_BLOCK = 256  # uncompressed tokens per compressed-cache block (block_size // ratio entries)
TOLERANCE = 1e-2  # relative L2 error against the float64 reference (bf16 output rounding: ~2e-3)
INDEX_DIM = 128  # the indexer's head dim


def make_step(query_lens: list[int], seq_lens: list[int], ratios: tuple[int, ...], gen: torch.Generator,
              device: torch.device) -> dsv4.StepBatch:
    """A step whose requests own shuffled, distinct blocks of every cache (as a block allocator
    hands them out): one SWA block table and one compressed block table per ratio."""
    def table(block_tokens: int) -> torch.Tensor:
        cols = -(-max(seq_lens) // block_tokens)
        return torch.randperm(len(seq_lens) * cols, generator=gen).int().view(len(seq_lens), cols)

    return dsv4.StepBatch.from_lists(query_lens, seq_lens, table(SWA_BLOCK), SWA_BLOCK,
                                     {r: table(COMP_BLOCK) for r in ratios}, block_size=COMP_BLOCK,
                                     max_model_len=65536, device=device)


def slots(block_table: torch.Tensor, count: int, block_entries: int) -> torch.Tensor:
    """int64 [count]: cache slots of one request's entries 0..count-1 (block * size + offset)."""
    entry = torch.arange(count, device=block_table.device)
    return block_table[entry // block_entries].long() * block_entries + entry % block_entries


def filled_cache(batch: dsv4.StepBatch, fmt: dsv4.KVFormat, ratio: int, window: int,
                 gen: torch.Generator) -> torch.Tensor:
    """The SWA cache (ratio 0) or the compressed cache of ``ratio``, written with random latent
    rows (the model's K = V row: 448 NoPE dims, 64 RoPE dims): every compressed entry of every
    request; in the SWA cache the positions this step's window reaches (an engine frees the
    blocks behind the window), this step's own tokens included."""
    table = batch.swa_block_table if ratio == 0 else batch.comp_block_tables[ratio]
    entries_per_block = SWA_BLOCK if ratio == 0 else COMP_BLOCK // ratio
    record = fmt.swa_record if ratio == 0 else fmt.comp_record
    cache = dsv4.new_cache(record, table.numel(), entries_per_block, batch.device)
    query_lens = batch.query_start_loc.diff().tolist()
    for r, (seq_len, query_len) in enumerate(zip(batch.seq_lens.tolist(), query_lens)):
        if ratio == 0:
            first = max(0, seq_len - query_len - window + 1)
            where = slots(table[r], seq_len, entries_per_block)[first:]
        else:
            where = slots(table[r], seq_len // ratio, entries_per_block)
        kv = torch.randn(where.numel(), 512, generator=gen).bfloat16().to(batch.device)
        dsv4.insert(cache, record, where, kv)
    return cache


def indexer_topk(batch: dsv4.StepBatch, ratio: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [T, topk]: per token the ``topk`` best-scoring compressed entries it can see (entry
    numbers of its own request, the ``(pos + 1) // ratio`` oldest), -1 padded. Scores are an
    indexer's: its query for the token against its key for every visible entry."""
    T = batch.num_tokens
    positions, token_to_req = batch.positions.cpu(), batch.token_to_req.cpu()
    keys = [torch.randn(s // ratio, INDEX_DIM, generator=gen) for s in batch.seq_lens.tolist()]
    out = torch.full((T, topk), -1, dtype=torch.int32)
    for t in range(T):
        visible = int(positions[t] + 1) // ratio
        scores = keys[int(token_to_req[t])][:visible] @ torch.randn(INDEX_DIM, generator=gen)
        best = scores.topk(min(visible, topk)).indices
        out[t, : best.numel()] = best.int()
    return out.to(batch.device)


def layer_inputs(spec: dsv4.ModelSpec, batch: dsv4.StepBatch, fmt: dsv4.KVFormat, gen: torch.Generator) -> list:
    """Per layer: (layer, q bf16 [T, H, 512], SWA cache, compressed cache or None, top-k or None,
    sink float32 [H])."""
    comp_caches: dict[int, torch.Tensor] = {}  # layer index -> the compressed cache it owns
    layers = []
    for layer in spec.layers:
        kind = layer.kind
        comp = None
        if kind.has_comp_scope:
            if layer.comp_source not in comp_caches:
                comp_caches[layer.comp_source] = filled_cache(batch, fmt, kind.ratio, spec.window, gen)
            comp = comp_caches[layer.comp_source]
        q = torch.randn(batch.num_tokens, spec.num_heads, 512, generator=gen)
        q = (q * q.pow(2).mean(-1, keepdim=True).rsqrt()).bfloat16()  # RMS-normed, as the model's q
        topk = indexer_topk(batch, kind.ratio, spec.topk, gen) if kind.uses_topk else None
        sink = torch.randn(spec.num_heads, generator=gen)
        layers.append((layer, q.to(batch.device), filled_cache(batch, fmt, 0, spec.window, gen), comp, topk,
                       sink.to(batch.device)))
    return layers


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, or inf when an element of ``out`` was left unwritten (NaN)."""
    return float((out.double() - ref).norm() / ref.norm()) if not out.isnan().any() else float("inf")


def summary(model: str, spec: dsv4.ModelSpec, mla: dsv4.SparseMLA, batch: dsv4.StepBatch, errors: list[float]) -> str:
    """The model, the step, and per layer the backends that ran it and its error."""
    lines = [f"{model}: {len(spec.layers)} layers, {spec.num_heads} heads, top-k {spec.topk}, format {mla.fmt.value}; "
             f"step: {batch.num_reqs} requests, {batch.num_tokens} tokens ({batch.num_decode_tokens} decode) on "
             f"{batch.device}",
             f"{'layer':<10} {'kind':<6} {'decode on':<18} {'prefill on':<18} rel L2 vs the float64 reference"]
    for layer, err in zip(spec.layers, errors):
        lines.append(f"{layer.index:<2}{' (MTP)' if layer.mtp else '':<8} {layer.kind.name:<6} "
                     f"{mla.backend_for(layer.kind, 'decode'):<18} {mla.backend_for(layer.kind, 'prefill'):<18} "
                     f"{err:.1e} {'ok' if err < TOLERANCE else 'MISMATCH'}"
                     + (f" (reads layer {layer.comp_source}'s compressed cache)" if layer.shares_comp_cache else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["v4", "v41"], default="v4",
                        help="v4: SWA, C4A, C128A layers (default); v41: SWA, C1A, C2A layers")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--format", default="fp8_ds_mla",
                        help="KV format (vLLM's --kv-cache-dtype): fp8_ds_mla (default), bfloat16, fp8_e4m3, ...")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size: heads per rank = 64 / tp")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device: got {args.device!r}, but torch sees no GPU; allowed: cpu")
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    config = V41_CONFIG if args.model == "v41" else V4_FLASH_CONFIG
    try:  # bad --format / --tp: the package's own message, as a usage error
        dsv4.KVFormat.parse(args.format)
        dsv4.ModelSpec.from_hf_config(config, tp_size=args.tp)
    except ValueError as exc:
        parser.error(str(exc))

    # ---- the core (the README shows it) ------------------------------------------------------------
    spec = dsv4.ModelSpec.from_hf_config(config, tp_size=args.tp, max_model_len=65536)  # config.json's dict
    batch = make_step([1, 1, 1, 16], [3000, 700, 100, 2000], spec.comp_ratios, gen, device)  # 3 decodes, 1 prefill
    mla = dsv4.SparseMLA(spec, args.format, device=device)
    plan = mla.plan(batch, validate=True)  # once per step, shared by every layer
    errors = []
    for layer, q, swa_cache, comp_cache, topk, sink in layer_inputs(spec, batch, mla.fmt, gen):
        out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
        mla.forward(plan, layer.kind, q, swa_cache, comp_cache, topk=topk, sink=sink, out=out)
        rows, lens = plan.comp_scope(layer.kind, topk)  # the compressed scope as global slots
        ref, _ = dsv4.reference.sparse_mla(q, swa_cache, plan.swa_rows, plan.swa_lens, comp_cache, rows, lens,
                                           sink, spec.scale, mla.fmt)  # float64
        errors.append(relative_error(out, ref))
    print(mla.explain())  # which backend runs each layer kind and phase, and why the others don't
    # -------------------------------------------------------------------------------------------------
    print()
    print(summary(args.model, spec, mla, batch, errors))
    worst = max(errors)
    if not worst < TOLERANCE:
        print(f"FAILED: a layer's relative L2 error is {worst:.1e} (allowed < {TOLERANCE:g})", file=sys.stderr)
        return 1
    print(f"\nevery layer matches the float64 reference (worst relative L2 error {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
