"""The suite's fixtures and hooks only (helpers shared by test modules live in tests/kit/).

- ``gen``: a seeded torch.Generator per test (seed derived from the test's name, so a test's
  inputs are reproducible and independent of which other tests ran).

Without a GPU, Triton kernels run under its CPU interpreter: ``TRITON_INTERPRET=1`` is set here,
before any test module defines a kernel (the interpreter is chosen per process).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def gen(request) -> torch.Generator:
    """A torch.Generator seeded from the test's node id (stable across runs and orderings)."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
