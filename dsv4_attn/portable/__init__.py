"""Backends that run anywhere: torch (any device) and triton (any GPU)."""
