#!/usr/bin/env python3
"""Which of upstream's scheduler test directories vLLM's CI runs for a change.

vLLM's Buildkite pipeline (.buildkite/test-pipeline.yaml, from 0.3x on also
.buildkite/test_areas/*.yaml) gives each step `source_file_dependencies`:
path prefixes (a leading "!" excludes one); the step runs when a changed
file starts with one of them and with none of the excluded, and a step
without the key runs for every change. `make export` runs, of
tests/v1/core and tests/v1/simple_kv_offload, those that a step running
`pytest ... v1/core` (or v1/simple_kv_offload) would run for the files the
patch changes; in 0.33.0 both follow every change under vllm/v1/, so for
this fork's patches that is both, as before. When the pipeline cannot be
read, all of them run.

The pipeline is YAML with anchors; this file reads it with PyYAML, so it
runs in the release's test environment (vLLM requires pyyaml):
`python ci_selection.py TREE DIR,DIR FILE...` prints the selection as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path


def steps(node: object) -> Iterator[dict]:
    """Every mapping with commands in a pipeline document, groups included."""
    if isinstance(node, dict):
        if "commands" in node or "command" in node:
            yield node
        for value in node.values():
            yield from steps(value)
    elif isinstance(node, list):
        for item in node:
            yield from steps(item)


def runs_dir(step: dict, test_dir: str) -> bool:
    """Whether a pytest command of `step` runs `test_dir` (tests/v1/core),
    given as CI does from tests/ (v1/core) or from the repository root."""
    commands = step.get("commands") or step.get("command") or []
    if isinstance(commands, str):
        commands = [commands]
    short = test_dir.removeprefix("tests/")
    pattern = re.compile(rf"(?:^|\s)(?:tests/)?{re.escape(short)}(?:/\S*)?(?:\s|$|;|&)")
    return any("pytest" in c and pattern.search(c) for c in map(str, commands))


def triggered(step: dict, changed: list[str]) -> bool:
    deps = step.get("source_file_dependencies")
    if deps is None:
        return True
    deps = [str(d) for d in deps]
    include = [d for d in deps if not d.startswith("!")]
    exclude = [d[1:] for d in deps if d.startswith("!")]
    return any(
        any(f.startswith(d) for d in include)
        and not any(f.startswith(d) for d in exclude)
        for f in changed
    )


def selection(tree: Path, changed: list[str], test_dirs: list[str]) -> dict:
    """{"dirs": the test dirs CI runs for `changed`, "steps": the labels of
    the steps that run them, "read": whether any step ran any of them}."""
    import yaml  # the release's test environment has it (see the docstring)

    chosen: dict[str, list[str]] = {d: [] for d in test_dirs}
    seen = False
    for path in sorted((tree / ".buildkite").rglob("*.yaml")):
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except (yaml.YAMLError, OSError):
            continue
        for step in steps(docs):
            for d in test_dirs:
                if not runs_dir(step, d):
                    continue
                seen = True
                if triggered(step, changed):
                    chosen[d].append(str(step.get("label") or step.get("key") or "?"))
    return {
        "dirs": [d for d in test_dirs if chosen[d]],
        "steps": sorted({s for labels in chosen.values() for s in labels}),
        "read": seen,
    }


def main() -> int:
    # Standard library and PyYAML only: it runs in the release's environment,
    # without the project's lib/ (whose parser the other scripts share).
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("tree", type=Path, help="a vLLM source tree with .buildkite/")
    p.add_argument("dirs", help="test directories, comma-separated")
    p.add_argument("files", nargs="*", help="the changed files")
    args = p.parse_args()
    chosen = selection(args.tree, args.files, args.dirs.split(","))
    print(json.dumps(chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
