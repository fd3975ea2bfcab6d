"""Triton kernels of the `triton` backend (imported only when Triton is installed)."""
