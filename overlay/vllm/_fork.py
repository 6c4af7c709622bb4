# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Marks a vLLM tree that carries the vllm-fork patch series.

`python -m vllm._fork` checks that the modules Python imports are the
patched ones, e.g. inside a container image built from upstream's.
"""

import importlib
import sys
from functools import reduce

FORK = "vllm-fork"

# Names that only the patched modules define, in every series of the fork:
# (module, attribute path).
MARKERS = [
    ("vllm.v1.core.kv_cache_utils", "NoFreeBlocksError"),
    ("vllm.v1.core.kv_cache_utils", "is_block_shortage"),
    (
        "vllm.v1.simple_kv_offload.manager",
        "SimpleCPUOffloadScheduler._is_position_hash",
    ),
]


def missing_markers() -> list[str]:
    """Markers absent from the imported modules, with the file each came from."""
    missing = []
    for module_name, path in MARKERS:
        module = importlib.import_module(module_name)
        try:
            reduce(getattr, path.split("."), module)
        except AttributeError:
            missing.append(f"{module_name}.{path} (imported from {module.__file__})")
    return missing


if __name__ == "__main__":
    problems = missing_markers()
    for problem in problems:
        print(f"not patched: {problem}", file=sys.stderr)
    if not problems:
        print(f"{FORK}: all {len(MARKERS)} patched modules are imported")
    sys.exit(1 if problems else 0)
