"""pytest plugin for running vLLM's tests on a machine without accelerators.

vLLM's autouse `cleanup_fixture` (tests/conftest.py) empties the
accelerator cache after each test, which raises where there is none. Tests
marked `skip_global_cleanup` skip it; this marks every collected test.
"""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)
