"""AMD vendor backend: AITER (gfx942/gfx950)."""
