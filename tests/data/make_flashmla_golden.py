"""Trim FlashMLA's recorded golden outputs into tests/data/flashmla_golden_small.pt.

Source: flashmla-v4-golden.pt, the untrimmed recording (13.8 MB, not in the repository): 5 cases
recorded on an H100 (torch 2.11) from FlashMLA's sparse_decode_fwd / sparse_prefill_fwd of the
vllm 0.33.0 build, each a dict of CPU tensors with FlashMLA's ``out`` and ``lse_without_sink``
(docs/testing.md "The float64 reference"). Tests must run from a clone alone, so this keeps a
small, still exact, subset:

* heads: the first 4 and the last 4 of each case (head 0 has sink -inf, head 1 a large sink);
  attention is per head, so FlashMLA's numbers for the kept heads are unchanged;
* tokens: a subset per case (per token independent; every empty / one-key / full-row edge kept);
* caches: only the rows some kept token reads, renumbered densely into a smaller cache of the
  same format and block size (MODEL1 bytes copied verbatim: data row at ``t*576``, scale row at
  ``bs*576 + t*8`` of the block, block stride ``stride(0)`` = bs*584 as in the source), with the
  row indices remapped. The keys each token sees, and so FlashMLA's output, are unchanged.

Run: python tests/data/make_flashmla_golden.py PATH/TO/flashmla-v4-golden.pt
(then check the result with DSV4_ATTN_FLASHMLA_GOLDEN=PATH/TO/flashmla-v4-golden.pt pytest tests/test_golden.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

KEEP_TOKENS = [[1, 2, 3, 4, 5], [1, 3], None, [0, 1, 3, 4, 5], [0, 1, 14, 15]]  # None: all
HEADS_EACH_END = 4


def _used_slots(rows: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    col = torch.arange(rows.shape[1])[None, :]
    return torch.unique(rows[(col < lens[:, None].long()) & (rows >= 0)].long())


def _remap(rows: torch.Tensor, lens: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    col = torch.arange(rows.shape[1])[None, :]
    inside = (col < lens[:, None].long()) & (rows >= 0)
    new = torch.searchsorted(used, rows.long().clamp(min=0))
    return torch.where(inside, new, torch.full_like(new, -1)).to(torch.int32)


def _compact_model1(cache: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """Copy the MODEL1 rows at slots ``used`` into a dense new cache (slot i = used[i])."""
    _, bs, _ = cache.shape
    stride = cache.stride(0)
    if stride != bs * 584 or not cache.is_contiguous():
        raise ValueError("expected an unpadded contiguous source cache (stride(0) == bs * 584)")
    raw = cache.reshape(-1)
    nb = -(-used.numel() // bs)
    out = torch.zeros(nb * bs * 584, dtype=torch.uint8)
    for i, s in enumerate(used.tolist()):
        old_block, ot = divmod(s, bs)
        new_block, nt = divmod(i, bs)
        src, dst = old_block * stride, new_block * bs * 584
        out[dst + nt * 576: dst + (nt + 1) * 576] = raw[src + ot * 576: src + (ot + 1) * 576]
        out[dst + bs * 576 + nt * 8: dst + bs * 576 + (nt + 1) * 8] = raw[src + bs * 576 + ot * 8:
                                                                          src + bs * 576 + (ot + 1) * 8]
    return out.view(nb, bs, 584)


def trim(case: dict, tokens: list[int] | None) -> dict:
    H = case["q"].shape[1]
    heads = list(range(HEADS_EACH_END)) + list(range(H - HEADS_EACH_END, H))
    tok = torch.arange(case["q"].shape[0]) if tokens is None else torch.tensor(tokens)
    small = {"kind": case["kind"], "source": case["source"], "scale": case["scale"],
             "original_num_heads": H, "heads": torch.tensor(heads), "tokens": tok,
             "q": case["q"][tok][:, heads].clone(), "out": case["out"][tok][:, heads].clone(),
             "lse_without_sink": case["lse_without_sink"][tok][:, heads].clone(),
             "sink": case["sink"][heads].clone()}
    if case["kind"] == "decode":
        for scope in ("swa", "comp"):
            rows, lens = case[f"{scope}_rows"][tok], case[f"{scope}_lens"][tok]
            used = _used_slots(rows, lens)
            small[f"{scope}_cache"] = _compact_model1(case[f"{scope}_cache"], used)
            small[f"{scope}_rows"] = _remap(rows, lens, used)
            small[f"{scope}_lens"] = lens.clone()
    else:
        rows, lens = case["indices"][tok], case["topk_length"][tok]
        used = _used_slots(rows, lens)
        small["kv"] = case["kv"][used].clone()
        small["indices"] = _remap(rows, lens, used)
        small["topk_length"] = lens.clone()
    return small


def main(src: str) -> None:
    cases = torch.load(src)
    small = [trim(c, keep) for c, keep in zip(cases, KEEP_TOKENS)]
    dst = Path(__file__).with_name("flashmla_golden_small.pt")
    torch.save(small, dst)
    print(f"wrote {dst} ({dst.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} PATH/TO/flashmla-v4-golden.pt")
    main(sys.argv[1])
