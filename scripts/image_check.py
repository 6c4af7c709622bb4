#!/usr/bin/env python3
"""Run the series' reproducers against the vLLM installed in an image.

Runs inside a build on top of the image `make overlay`'s context makes
(written there by `make image`, scripts/image.py), with only the standard
library and the image's own python3. The check directory it is given (a
read-only bind mount) holds:

  ids.txt        the tests the patches name in their `Reproducer:` trailers
  tests/         tests/conftest.py, tests/harness, the reproducer files and
                 tests/upstream_env, copied from the checkout
  pyproject.toml the project's pytest settings
  hf/            the offline Hugging Face cache (config.json files only)
  wheels/        pytest and the other test tools

It runs `python3 -m vllm._fork` again (the overlay's own RUN may come from
podman's cache), installs the test tools into a temporary directory (never
into the image's site-packages), runs pytest on the named tests with the image's
vllm, fails unless every one of them passes and vllm came from the image,
and removes everything it wrote, so the build's layer stays empty.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

# Printed for scripts/image.py to read back from the build's output.
SUMMARY_PREFIX = "vllm-fork image check:"
# The test tools' own plugin set-up, as scripts/testenv.py runs pytest.
PYTEST_PLUGIN = "fork_upstream_plugin"


class CheckError(Exception):
    pass


def junit_test_id(case: ET.Element) -> str:
    """file::[Class::]name of a JUnit testcase (scripts/testenv.py's ids)."""
    classname = case.get("classname", "")
    file = case.get("file") or classname.replace(".", "/") + ".py"
    if not classname:
        return file
    module = file.removesuffix(".py").replace("/", ".")
    cls = classname[len(module) + 1 :] if classname.startswith(module + ".") else ""
    return "::".join(filter(None, [file, cls, case.get("name")]))


def read_junit(path: Path) -> dict[str, str]:
    """Test id -> passed / failed / error / skipped."""
    outcomes: dict[str, str] = {}
    if not path.is_file():
        return outcomes
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag
        outcomes[junit_test_id(case)] = outcome
    return outcomes


def verdict(ids: list[str], outcomes: dict[str, str]) -> list[str]:
    """What is wrong: each named test must have run and passed."""
    problems = []
    for test_id in ids:
        got = outcomes.get(test_id)
        if got != "passed":
            problems.append(f"{test_id}: {got or 'not run'}")
    return problems


def installed_vllm() -> Path:
    """Where the image's vllm package lies, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise CheckError(f"no vllm package is installed for {sys.executable}")
    return Path(list(spec.submodule_search_locations)[0])


def run_check(check_dir: Path, work: Path) -> str:
    ids = [
        line.strip()
        for line in (check_dir / "ids.txt").read_text().splitlines()
        if line.strip()
    ]
    if not ids:
        raise CheckError(f"{check_dir / 'ids.txt'} names no test")
    vllm_dir = installed_vllm()
    # The overlay's own check again: its RUN may come from podman's cache.
    fork = subprocess.run(
        [sys.executable, "-B", "-m", "vllm._fork"], capture_output=True, text=True
    )
    print(fork.stdout, end="", flush=True)
    if fork.returncode != 0:
        raise CheckError(f"python3 -m vllm._fork failed:\n{fork.stderr[-3000:]}")
    tools, tree = work / "tools", work / "check"
    # The test tools go into a directory of their own: the image's
    # site-packages is what is under test and stays as the overlay left it.
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-index",
            "--find-links",
            str(check_dir / "wheels"),
            "--target",
            str(tools),
            "-r",
            str(check_dir / "wheels" / "requirements.txt"),
        ],
        capture_output=True,
        text=True,
    )
    if pip.returncode != 0:
        raise CheckError(f"installing the test tools failed:\n{pip.stderr[-3000:]}")
    # pytest and hypothesis write next to the tests; the mount is read-only.
    shutil.copytree(check_dir, tree, ignore=shutil.ignore_patterns("wheels"))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tools), str(tree / "tests/upstream_env")]),
        "HF_HOME": str(tree / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    junit = work / "junit.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            PYTEST_PLUGIN,
            "-p",
            "no:cacheprovider",
            "-q",
            "--tb=short",
            "-o",
            "junit_family=xunit1",
            f"--junitxml={junit}",
            *ids,
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    print(proc.stdout[-4000:], end="", flush=True)
    outcomes = read_junit(junit)
    problems = verdict(ids, outcomes)
    if problems:
        raise CheckError(
            f"{len(problems)} of {len(ids)} reproducer tests did not pass against "
            f"the vllm in {vllm_dir}:\n  "
            + "\n  ".join(problems)
            + f"\n{proc.stderr[-3000:]}"
        )
    # The tests ran against the image's vllm, not a copy in the check dir.
    where = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__file__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    imported = Path(where.stdout.strip() or "?").parent
    if where.returncode != 0 or imported != vllm_dir:
        raise CheckError(
            f"the tests imported vllm from {imported}, not the image's {vllm_dir}"
        )
    files = len({i.split("::")[0] for i in ids})
    return (
        f"{SUMMARY_PREFIX} {len(ids)} of {len(ids)} reproducer tests passed "
        f"({files} files) against {vllm_dir}, Python {sys.version.split()[0]}"
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "check_dir",
        type=Path,
        nargs="?",
        default=Path(__file__).resolve().parent,
        help="directory with ids.txt, tests/, hf/ and wheels/ (default: this file's)",
    )
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vllm-fork-check-"))
    try:
        print(run_check(args.check_dir, work), flush=True)
    except CheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
