"""The contract checks every emulated call makes: :class:`AiterContractError` naming the argument
AITER would reject or misread (what it got, what is allowed)."""

from __future__ import annotations

from typing import NoReturn

import torch


class AiterContractError(ValueError):
    """The adapter passed something AITER would reject or misread."""


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def fail(arg: str, got: object, allowed: str) -> NoReturn:
    raise AiterContractError(f"{arg}: got {got}; allowed: {allowed}")


def describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} strides {tuple(t.stride())}"


def check_tensor(arg: str, t, dtype=None, dim=None, device=None, contiguous=False) -> None:
    if not isinstance(t, torch.Tensor):
        fail(arg, type(t).__name__, "a torch.Tensor")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if dtype is not None and t.dtype not in dtypes:
        fail(arg, describe(t), f"dtype in {dtypes}")
    if dim is not None and t.dim() != dim:
        fail(arg, describe(t), f"a {dim}-d tensor")
    if device is not None and t.device != device:
        fail(arg, f"device {t.device}", f"{device} (q's device)")
    if contiguous and not t.is_contiguous():
        fail(arg, describe(t), "a contiguous tensor")


def check_scale(arg: str, s, device) -> None:
    """Per-tensor scales are [1] float32 device tensors (the aiter asm convention), never floats."""
    if not isinstance(s, torch.Tensor):
        fail(arg, repr(s), "a float32 tensor with one element on q's device (not a python number)")
    if s.dtype != torch.float32 or s.numel() != 1 or s.device != device:
        fail(arg, f"{describe(s)} on {s.device}", f"float32 with one element on {device}")



def check_indptr_values(qo_indptr, kv_indptr, last=None) -> None:
        B = qo_indptr.numel() - 1
        if not torch.equal(qo_indptr.cpu(), torch.arange(B + 1, dtype=torch.int32)):
            fail("qo_indptr", qo_indptr.tolist()[:8], "arange(B + 1) (one query token per batch row)")
        if last is not None and not bool((last == 1).all()):
            fail("kv_last_page_lens", last.tolist()[:8], "all 1 (page size 1)")
        if int(kv_indptr[0]) != 0 or bool(((kv_indptr[1:] - kv_indptr[:-1]) < 0).any()):
            fail("kv_indptr", kv_indptr.tolist()[:8], "0 then non-decreasing")

