"""Checkers for notebooks 04-07 (blocks, GPT, training, sampling, KV cache, Hugging Face)."""
__all__: list[str] = []
