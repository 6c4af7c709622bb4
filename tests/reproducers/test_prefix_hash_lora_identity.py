"""Reproducers: a block's hash tells a LoRA adapter from another of its
name and from a cache salt (ledger row prefix-hash-lora-identity).

Up to 0.30.0 a block's hash takes the request's adapter by its name
alone, a bare string among the block's extra keys, as a cache salt is.
An adapter loaded again under its name from another path (a new
checkpoint, vllm-project/vllm#42125) then hits every block its old
weights computed, on the GPU and on SimpleCPUOffload's CPU tier; and a
request with cache salt "X" hits the first block of a prompt an adapter
named "X" computed (vllm#44701). Wrong KV, no error. 0.31.0 adds the
adapter's path and tags every key. The fake model does not run adapters,
so the check is where the request's first chunk starts.
"""

from __future__ import annotations

import pytest

from harness.engine import Engine
from harness.offload_checks import engine_with_cached_prompt, start_of

PROMPT = list(range(100, 148))  # three blocks of 16
EXTENSION = list(range(900, 917))
ADAPTER = ("X", "/adapters/x-v1")
ADAPTER_RELOADED = ("X", "/adapters/x-v2")


def _computed_under(
    adapter: tuple[str, str], on_the_cpu_only: bool, cache_salt: str | None = None
) -> Engine:
    """An engine whose prefix cache holds PROMPT computed under `adapter`
    (with `cache_salt`; on the CPU tier only where asked)."""
    return engine_with_cached_prompt(
        PROMPT, on_the_cpu_only, lora=adapter, cache_salt=cache_salt
    )


def _start(e: Engine, **request: object) -> int:
    return start_of(e, PROMPT + EXTENSION, **request)


@pytest.mark.parametrize("tier", ["gpu", "cpu"])
def test_an_adapter_loaded_again_from_another_path_reads_none_of_the_old_kv(tier):
    e = _computed_under(ADAPTER, on_the_cpu_only=tier == "cpu")
    assert _start(e, lora=ADAPTER_RELOADED) == 0
    # The adapter it replaced still hits its own blocks.
    assert _start(e, lora=ADAPTER) == len(PROMPT)


def test_a_cache_salt_reads_no_kv_of_an_adapter_of_its_name():
    e = _computed_under(ADAPTER, on_the_cpu_only=False)
    assert _start(e, cache_salt=ADAPTER[0]) == 0


def test_an_adapter_s_requests_keep_their_cache_salts_apart():
    """The adapter's key joins the block's other keys, never replaces them:
    two tenants' salts keep the same adapter's KV apart (every release)."""
    e = _computed_under(ADAPTER, on_the_cpu_only=False, cache_salt="tenant-a")
    assert _start(e, lora=ADAPTER, cache_salt="tenant-b") == 0
    assert _start(e, lora=ADAPTER, cache_salt="tenant-a") == len(PROMPT)
