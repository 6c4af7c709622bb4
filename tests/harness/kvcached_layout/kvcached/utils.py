"""kvcached.utils as far as the series looks at it: the error kvcached's
elastic pool raises when a colocated engine took the physical pages that
the free count promised (kvcached >= 0.1.6, its PR #453)."""


class KVCachePoolExhausted(ValueError):
    """Not enough free KV cache pages in the shared pool."""
