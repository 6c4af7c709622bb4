"""Shared test setup.

tests/ is not a package: vLLM's own `tests` package is importable when a
tree is on PYTHONPATH, and the names must not collide. Instead the harness
and the tooling's modules are put on sys.path here.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "scripts")]
