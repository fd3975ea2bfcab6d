"""Backend `torch`: vectorized PyTorch, any device (CPU, CUDA, ROCm). The CPU default.

Per chunk of tokens it gathers ONLY the selected rows of both scopes (never a whole cache),
dequantizes them to float32, and runs one float32 softmax over SWA ∪ compressed keys with the
sink in the denominator. Peak extra memory per chunk of C tokens with K = W + K_comp keys
and H heads is about ``C * K * (512 + 3 * H) * 4`` bytes (gathered keys, then scores,
probabilities and a temporary); C is chosen so that this stays under ``chunk_bytes``
(default 256 MiB), with at least one token per chunk.

Bad input gives the reference's answer (docs/bad-input.md): slots outside the cache are skipped
like -1 (never gathered), NaN in a selected key or the sink comes out as NaN, not as zeros.
"""

from __future__ import annotations

import math

import torch

from ..common.backend import Backend, Capabilities, LayerInputs, PlatformSupport
from ..common.indices import attended
from ..common.layout import Fp8Dialect, KVFormat, Record, gather_rows
from ..common.plan import StepPlan


class TorchBackend(Backend):
    name = "torch"
    capabilities = Capabilities(
        platforms=(PlatformSupport("*", label="any torch device (CPU default; CUDA/ROCm when forced)"),),
        formats=tuple(KVFormat),
        kinds=None,
        dialects=(Fp8Dialect.OCP, Fp8Dialect.FNUZ),
        validated="CPU (CI) vs float64 reference",
        notes="slow on GPUs (~30x FlashMLA): never auto-selected there",
    )

    def __init__(self, chunk_bytes: int = 256 << 20) -> None:
        self.chunk_bytes = chunk_bytes

    def forward(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor) -> None:
        T, H = plan.num_tokens, layer.q.shape[1]
        if T == 0:
            return
        fmt = layer.fmt
        scopes = [(layer.swa_cache, plan.swa_rows, plan.swa_lens, layer.swa_dialect, fmt.swa_record, layer.swa_geo)]
        if layer.kind.has_comp_scope:
            comp = layer.compressed(plan)
            scopes.append((comp.cache, comp.rows, comp.lens, layer.comp_dialect, fmt.comp_record, comp.geo))
        keys_per_token = sum(rows.shape[1] for _, rows, *_ in scopes)
        chunk = max(1, self.chunk_bytes // max(1, keys_per_token * (512 + 3 * H) * 4))
        sink = None if layer.sink is None else layer.sink.float()
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            keys, valid = [], []
            for cache, rows, lens, dialect, record, geo in scopes:
                k, v = _scope(cache, record, geo, rows[t0:t1], lens[t0:t1], layer.kv_scale, dialect)
                keys.append(k)
                valid.append(v)
            out[t0:t1] = _attend(layer.q[t0:t1], torch.cat(keys, 1), torch.cat(valid, 1), sink,
                                 layer.softmax_scale).to(out.dtype)


def _scope(cache, record: Record, geo, rows: torch.Tensor, lens: torch.Tensor, kv_scale: float,
           dialect: Fp8Dialect) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys float32 [C, K, 512] and validity bool [C, K] of one scope: the first lens entries that
    are slots of the cache (-1 and any other out-of-range entry skipped, never gathered)."""
    valid = attended(rows, geo.num_slots, lens)
    slots = torch.where(valid, rows, torch.full_like(rows, -1))
    return gather_rows(cache, record, geo, slots, kv_scale, dialect), valid


def _attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """q [C, H, 512], keys [C, K, 512] f32, valid [C, K] -> out float32 [C, H, 512]."""
    scores = torch.bmm(q.float(), keys.transpose(1, 2)).mul_(scale)
    scores.masked_fill_(~valid[:, None, :], -math.inf)
    has_keys = valid.any(dim=1)[:, None, None]
    # the max over the keys only: finite on rows with keys (NaN if a key is NaN, which must show)
    row_max = torch.where(has_keys, scores.amax(dim=-1, keepdim=True), torch.zeros(1, device=q.device))
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    if sink is not None:  # +inf sink: denom inf -> 0 out; NaN sink: NaN out
        denom = denom + torch.exp(sink[None, :, None] - row_max)
    out = torch.bmm(probs, keys) / denom
    return torch.where(has_keys, out, torch.zeros_like(out))
