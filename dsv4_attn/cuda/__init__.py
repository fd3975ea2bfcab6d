"""NVIDIA vendor backends: FlashMLA (SM90/SM100) and FlashInfer TRTLLM-gen (SM100)."""
