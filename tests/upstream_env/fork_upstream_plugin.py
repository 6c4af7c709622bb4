"""pytest plugin for running vLLM's tests on a machine without accelerators.

vLLM's autouse `cleanup_fixture` (tests/conftest.py) empties the
accelerator cache after each test, which raises where there is none. Tests
marked `skip_global_cleanup` skip it; this marks every collected test.

It also skips the few upstream tests that cannot pass on such a machine and
cost the most time failing: they fail on the base as on the series, so
`make test` could never count them, and they took about two minutes of each
0.33.0 tree's five (2026-12-05 measurement: the engine test 76 s, the
multimodal ones 47 s). Each is skipped only while what it lacks is missing,
with the reason in pytest's report.
"""

import importlib.util
from collections.abc import Callable

import pytest


def _weights_missing(repo: str) -> Callable[[], bool]:
    def missing() -> bool:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, "model.safetensors")
        return not isinstance(found, str)

    return missing


def _no_torchvision() -> bool:
    # vLLM inspects a multimodal architecture in a subprocess (about 2 s)
    # that imports torchvision; PyPI's build does not load beside the CPU
    # torch the project installs.
    return importlib.util.find_spec("torchvision") is None


# test (a file, or file::name) -> (why it cannot run here, whether that holds now)
CANNOT_RUN_HERE: dict[str, tuple[str, Callable[[], bool]]] = {
    "tests/v1/core/test_reset_prefix_cache_e2e.py": (
        "runs Qwen/Qwen3-0.6B in a real engine: its weights are not here",
        _weights_missing("Qwen/Qwen3-0.6B"),
    ),
    "tests/v1/core/test_priority_scheduler_random.py::test_priority_scheduling_blast": (
        "a Qwen2.5-VL model config: inspecting it needs torchvision",
        _no_torchvision,
    ),
    "tests/v1/core/test_scheduler.py::test_schedule_multimodal_requests": (
        "a LLaVA model config: inspecting it needs torchvision",
        _no_torchvision,
    ),
}


def _matches(nodeid: str, name: str) -> bool:
    """`name` (a file, or file::test) is this item's file or test, with any
    parameters; not a longer test name that starts the same."""
    return nodeid == name or nodeid.startswith((f"{name}::", f"{name}["))


def _reasons(items) -> dict[str, str]:
    """The skip reason of each test some item is and whose lack holds
    (each condition is checked once, and only if a test needs it)."""
    reasons = {}
    for name, (why, lacking) in CANNOT_RUN_HERE.items():
        if any(_matches(i.nodeid, name) for i in items) and lacking():
            reasons[name] = f"cannot run on this machine: {why}"
    return reasons


def pytest_collection_modifyitems(config, items):
    reasons = _reasons(items)
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)
        for name, reason in reasons.items():
            if _matches(item.nodeid, name):
                item.add_marker(pytest.mark.skip(reason=reason))
