"""Engine integrations (vLLM plugin)."""
