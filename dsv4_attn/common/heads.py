"""Query heads as the vendor decode kernels take them: 64 or 128 contiguous heads (FlashMLA's
sparse kernels, FlashInfer's TRTLLM-gen cubins). A layer with fewer heads, or strided q / sink,
is staged into per-step buffers: q zero-padded, out, sink -inf on the padded heads (their
probabilities are then 0 and their output is dropped). Vendor-free: the CUDA adapters share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import HEAD_DIM


def padded_heads(num_heads: int) -> int:
    """The head count a 64/128-head kernel runs for ``num_heads`` query heads."""
    return 64 if num_heads <= 64 else 128


@dataclass
class HeadStaging:
    """One step's staging: q [T, hp, 512] (zeroed; ``q_dtype``), out bf16 [T, hp, 512], sink
    float32 [hp] (-inf)."""

    q: torch.Tensor
    out: torch.Tensor
    sink: torch.Tensor

    @classmethod
    def allocate(cls, num_tokens: int, hp: int, device: torch.device,
                 q_dtype: torch.dtype = torch.bfloat16) -> HeadStaging:
        return cls(torch.zeros(num_tokens, hp, HEAD_DIM, dtype=q_dtype, device=device),
                   torch.empty(num_tokens, hp, HEAD_DIM, dtype=torch.bfloat16, device=device),
                   torch.full((hp,), float("-inf"), dtype=torch.float32, device=device))


class LazyStaging:
    """The step's head staging, allocated by the first layer that needs it (most callers hand
    64/128 contiguous heads and need none)."""

    def __init__(self, num_tokens: int, hp: int, device: torch.device, q_dtype: torch.dtype = torch.bfloat16) -> None:
        self._args = (num_tokens, hp, device, q_dtype)
        self._staging: HeadStaging | None = None

    def get(self) -> HeadStaging:
        if self._staging is None:
            self._staging = HeadStaging.allocate(*self._args)
        return self._staging


def stage(staging: LazyStaging, q: torch.Tensor, sink: torch.Tensor | None, out: torch.Tensor,
          cast: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, HeadStaging | None]:
    """(q, out, sink, staging) as a 64/128-head kernel takes them: the caller's tensors when they
    fit already (and ``cast`` is False: q's dtype is the kernel's), else the staging's with q and
    sink copied in (q cast to the staging's dtype: e4m3 saturates at ±448); then the caller copies
    ``staging.out[:, :H]`` into ``out`` after the launch."""
    H = q.shape[1]
    if not cast and H == padded_heads(H) and q.is_contiguous() and (sink is None or sink.is_contiguous()):
        return q, out, sink, None
    buffers = staging.get()
    buffers.q[:, :H].copy_(q)
    if sink is not None:
        buffers.sink[:H].copy_(sink)
    return buffers.q, buffers.out, (None if sink is None else buffers.sink), buffers
