"""A tiny parity matrix for the tests of ``dsv4-attn parity`` (tests/test_parity.py, tests/test_cli.py)."""

# Three kinds x two mixes x two lengths, one format, small model: 12 cases, a few seconds. Every
# case but the edge ones has tokens that see several compressed entries of both ratios.
TINY = """
version: 1
seed: 7
backends: {cpu: [torch], gpu: [torch]}
model: {topk: 64, max_model_len: 4096, window: 128}
defaults: {swa_block_size: 64, block_size: 256}
output: {full_max: 4096, sample: 256}
tolerances:
  default: {max_abs: 5.0e-2, rel_l2: 1.0e-2, cosine: 0.9999}
  overrides:
    - {backend: loose, format: bfloat16, rel_l2: 0.5}
lengths:
  short: {}
  edge: {sink: inf, pad_heads: 32}
batches:
  mixed:
    short: {query_lens: [1, 1, 3], seq_lens: [9, 600, 20], decode: 2}
    edge:  {query_lens: [1, 0, 3], seq_lens: [1, 8, 130], decode: 1, padding: 2}
  prefill:
    short: {query_lens: [4], seq_lens: [1000]}
    edge:  {query_lens: [3, 2], seq_lens: [3, 129], padding: 1}
sweeps:
  - name: tiny
    kind: [swa, c4a, c128a]
    heads: 16
    format: fp8_ds_mla
    mix: [mixed, prefill]
    length: [short, edge]
"""
