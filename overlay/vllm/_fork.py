# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Marks a vLLM tree that carries the vllm-fork patch series.

`python -m vllm._fork` is the fork's self-check, for an editable tree
(`make apply`), the wheel (`make wheel`) and a container image (`make
overlay`, `make image`) alike. It names the release and the series the
package was built from (with the series' digest), and checks

- every file under vllm/ the series changes against the sha256 recorded at
  build time in `_fork_digests.json` next to this file (and that the files
  the series deletes are gone), and
- that the modules Python imports are the patched ones (names only the
  patched modules define).

It exits 0 when all hold; otherwise 1, naming each file that differs and
the make command that rebuilds what was installed.
"""

import hashlib
import importlib
import json
import sys
from functools import reduce
from pathlib import Path

FORK = "vllm-fork"
DIGESTS = "_fork_digests.json"

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
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # a dependency missing: said, not a traceback
            missing.append(f"cannot import: {module_name} ({e!r})")
            continue
        try:
            reduce(getattr, path.split("."), module)
        except AttributeError:
            missing.append(
                f"not patched: {module_name}.{path} (imported from {module.__file__})"
            )
    return missing


def package_dir() -> Path:
    """The directory of the vllm package this module belongs to."""
    return Path(__file__).resolve().parent


def build_record(package: Path | None = None) -> dict | None:
    """What the build recorded (release, series, digests), or None."""
    path = (package or package_dir()) / DIGESTS
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def describe(record: dict) -> str:
    """The release and series, as the first line says them."""
    return (
        f"vLLM {record['release']} with the series {record['series']}/ "
        f"({record['patches']} patches, series digest {record['fingerprint']})"
    )


def file_problems(record: dict, package: Path | None = None) -> list[str]:
    """Each file that is not as the build left it, with what differs."""
    root = (package or package_dir()).parent
    problems = []
    for path, want in sorted(record["files"].items()):
        file = root / path
        try:
            have = hashlib.sha256(file.read_bytes()).hexdigest()
        except OSError:
            problems.append(f"missing: {path} ({file})")
            continue
        if have != want:
            problems.append(
                f"changed: {path} ({file}): sha256 {have[:16]}, built {want[:16]}"
            )
    for path in record.get("deleted", []):
        if (root / path).exists():
            problems.append(f"present: {path} ({root / path}): the series deletes it")
    return problems


def fix(record: dict | None, package: Path | None = None) -> str:
    """The make command that rebuilds what is installed, run in the fork's
    checkout: the tree for an editable install, else the wheel or image."""
    package = package or package_dir()
    variable = f" {record['make_variable']}" if record else ""
    tree = package.parent
    if (tree / ".git").exists():  # an editable install of a `make apply` tree
        where = "" if tree.name == "vllm" else f" TREE={tree}"
        return (
            f"make apply{variable}{where} (it rebuilds the tree; edits of "
            f"your own: commit them, then make refresh{variable}{where})"
        )
    return (
        f"make wheel{variable} and pip install --force-reinstall --no-deps the "
        f"wheel it writes in dist/; for an image, make overlay{variable} and "
        "build it again"
    )


def main() -> int:
    record = build_record()
    if record is None:
        print(
            f"{FORK}: {package_dir() / DIGESTS} is missing or unreadable: this "
            f"vllm was not built by the fork's tools. Fix: {fix(None)}",
            file=sys.stderr,
        )
        return 1
    print(f"{FORK}: {describe(record)}")
    problems = file_problems(record)
    for problem in problems:
        print(f"{FORK}: {problem}", file=sys.stderr)
    missing = missing_markers()
    for marker in missing:
        print(f"{FORK}: {marker}", file=sys.stderr)
    unimportable = [m for m in missing if m.startswith("cannot import")]
    if problems or len(missing) > len(unimportable):
        found = []
        if problems:
            found.append(
                f"{len(problems)} of {len(record['files'])} files differ from the build"
            )
        if missing:
            found.append(
                f"{len(missing)} of {len(MARKERS)} patched modules are not imported"
            )
        print(f"{FORK}: {'; '.join(found)}. Fix: {fix(record)}", file=sys.stderr)
        return 1
    if unimportable:
        print(
            f"{FORK}: the files are as built, but vllm cannot be imported in "
            f"{sys.executable}: install vLLM's dependencies there",
            file=sys.stderr,
        )
        return 1
    print(
        f"{FORK}: all {len(record['files'])} files the series changes match "
        f"their build digests ({package_dir()}); all {len(MARKERS)} patched "
        "modules are imported"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
