"""The vendor tests' presets of the one step builder (``dsv4_attn.testing.steps.make_step``):
the arguments each family of tests draws with by default, as data, not a second builder."""

from __future__ import annotations

from dsv4_attn.testing.steps import StepCase, make_step

# tests/test_flashmla.py and tests/test_flashinfer.py: a 4096-token model, sinks around 2, the
# batch given its token count, the draws for large GPU steps (huge block ids, 32k-token prefills)
NVIDIA_STEP = dict(max_model_len=4096, sink_shift=2.0, pad_tokens=0, fast=True)


def nvidia_step(gen, query_lens, seq_lens, **kwargs) -> StepCase:
    """``make_step`` with ``NVIDIA_STEP``'s defaults (``kwargs`` override them)."""
    return make_step(gen, query_lens, seq_lens, **{**NVIDIA_STEP, **kwargs})


def aiter_step(gen, fmt, heads, query_lens=(1, 1, 1, 2, 1), seq_lens=(3, 130, 700, 1501, 4000), num_pad=1,
               **kwargs) -> StepCase:
    """The AITER tests' decode batch (tests/test_aiter*.py): every token, MTP included, is a decode
    token, plus ``num_pad`` padding tokens inside the decode range (graph padding); caches of
    ``fmt`` filled everywhere, V4's kinds, sink +inf on head 0 and -inf on the last head."""
    decode = sum(query_lens) + num_pad
    return make_step(gen, query_lens, seq_lens, **{"fmt": fmt, "heads": heads, "max_model_len": 8192,
                                                   "pad_tokens": num_pad, "num_decode_tokens": decode,
                                                   "edge_sinks": True, **kwargs})
