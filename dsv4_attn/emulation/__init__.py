"""The AITER EMULATOR — a torch model of the AITER kernels the `aiter` backend calls. NOT AITER.

Why it ships inside the package: checking the AMD path on any machine is a user-facing feature
(``dsv4-attn parity --emulate-aiter``, ``DSV4_ATTN_AITER_EMULATOR``; docs/rocm.md), and the
tests and an H100 CUDA-graph run use the same model. What keeps it honest: it is never selected
by auto (it is not a backend; the `aiter` backend runs on it only after :func:`enable` or the
environment variable switched it on), every result it serves is labelled EMULATED (the backend's
``label()`` and ``emulated``, the parity matrix's cells), and it imports nothing of the package
(a leaf: tests/test_imports.py). Layout, one job per module: :mod:`.releases` (what each AITER
release ships), :mod:`.contract` (the argument checks), :mod:`.planner` (AITER's split and work
planners, ported), :mod:`.attend` (the arithmetic), :mod:`.metadata` / :mod:`.decode` /
:mod:`.v4_nm` / :mod:`.sparse` (one entry point each), :mod:`.emulator` (one installation),
:mod:`.switch` (on / off).

There is no AMD GPU in CI, so the `aiter` backend (``dsv4_attn/rocm/aiter.py``) is proven
against this emulator. It models what the KERNELS do, not what the docs say, as read from AITER
v0.1.20.post1 (= main ``e4048607``: same ``aiter/mla.py``, ``csrc/py_itfs_cu/asm_mla.cu`` and
``hsa/*/mla/mla_asm.csv``) and its shipped code objects, disassembled (docs/rocm.md, "Evidence"):

* ``mla_decode_fwd`` code objects read 576-element rows: the per-head q stride is the constant
  576 elements (0x240 bytes fp8, 0x480 bf16) and each KV row is 576 elements read from
  ``index * stride(0)`` of ``kv_buffer`` (the launcher only checks ``q.shape[2] == kv.shape[3]``);
  V is the row's first 512 elements. 512-wide q or rows are misread, silently.
* Every index inside a key range is read; there is no -1 sentinel. KV rows are addressed with
  64-bit products on the gfx950 objects rebuilt in AITER #4452 and with 24-bit row numbers and
  32-bit byte offsets everywhere else (row ``index & 0xFFFFFF``, offset mod 2^32).
* FP8 q (a8w8 objects): softmax probabilities are rounded to the arch's fp8 before P·V (AITER's
  own reference does the same; the denominator keeps the unrounded sum).
* The final LSE: split mode writes it in the Triton stage-2 reduce (natural log; ``-inf`` and NaN
  output for rows with no key); a one-split FP8 call skips stage 2 and leaves it unwritten.
  Persistent mode writes it only from code objects that load the LSE pointer: the gfx950 32-head
  ``*_lse_ps`` object has the non-LSE one's code (.text), so its LSE stays unwritten. Rows with
  no key get ``+inf`` LSE and NaN output there. "Unwritten" memory reads as :data:`STALE`.
* Split mode with FP8 operands: stage 1 runs ``min(S, ceil(L / block))`` splits of a row (block
  128 keys at 16 heads, 32 at 128) while stage 2 reads ``min(S, ceil(L / mgc))`` (mgc 64 / 32):
  an explicit ``num_kv_splits`` above AITER's fp8 cap makes stage 2 read unwritten partials.
* Per call, persistent ``mla_decode_fwd`` allocates fp32 partials sized by the work buffers
  (``reduce_partial_map.size(0) * heads * 513`` floats), recorded in ``call_bytes``.
* Modules load on first use (asm code objects, Triton stage 2 per constexpr set, the reduce and
  metadata kernels); loading one while a graph is being captured fails. ``simulate_capture``
  makes CPU tests see a capture.

``mla_decode_fwd_v4_nm`` (AITER >= 0.1.18, gfx950 code object only) follows AITER's own torch
golden (``op_tests/test_mla_v4_nm.py``): packed FP8 rows (448 e4m3 NoPE, 14 e8m0 bytes: half-tile
``j`` of 32 columns is scaled by byte ``448 + j``, so each tile's scale is written twice), bf16
RoPE in separate tensors, softmax scale fixed at 1/sqrt(512), sink in the kernel (joining the
first split), split-K partials merged by stage 2, no final LSE. ``sparse_mla_fwd`` (flavor
"sparse") is the keyword set vLLM 0.33 calls; no AITER release has it (a side branch does,
gfx950-only, without sink / extra scope).

Flavors: "0.1.7" (the PyPI wheel: no ``return_lse``), "0.1.20" (the default: a real release),
"sparse" ("0.1.20" plus ``sparse_mla_fwd``). Every call validates its arguments and raises
:class:`AiterContractError` naming the one AITER would reject or misread; value checks that read
device memory are skipped while a CUDA graph is being captured. Switch it on with ``enable()``
or ``DSV4_ATTN_AITER_EMULATOR`` (``1``, ``gfx942``, ``gfx950:0.1.7``, ``gfx950:sparse``).
"""

from __future__ import annotations

from .contract import AiterContractError
from .emulator import AiterEmulator
from .planner import meta_splits, plan_works
from .releases import AITER_COMMIT, ARCHS, FLAVORS
from .switch import ENV_EMULATOR, active, disable, enable, parse_env

__all__ = ["AITER_COMMIT", "ARCHS", "ENV_EMULATOR", "FLAVORS", "AiterContractError", "AiterEmulator", "active",
           "disable", "enable", "meta_splits", "parse_env", "plan_works"]
