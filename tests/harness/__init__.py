"""Test harness that drives vLLM's real KV cache code on a CPU."""
