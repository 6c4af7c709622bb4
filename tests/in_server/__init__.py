"""Code that runs inside a real `vllm serve` for make e2e (scripts/e2e.py)."""
