"""The environment vLLM source trees are tested in on a CPU-only machine.

- the tree itself on PYTHONPATH (nothing is installed);
- tests/upstream_env on PYTHONPATH: a pytest plugin that skips vLLM's
  accelerator cleanup fixture, and a platform plugin selecting the CPU;
- an offline Hugging Face cache holding only the config.json of the hub
  models the tests name (no weights), built from tests/upstream_env.
  facebook/opt-125m, which vLLM's create_scheduler tokenizes with, also
  has a one-token vocab.json and an empty merges.txt: transformers 5
  builds exactly that tokenizer when the files are missing, but 4.x (0.19.0
  pins it) cannot build any, and every scheduler test failed there for it.
"""

from __future__ import annotations

import os
import re
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lib.paths import ROOT, WORK
from lib.proc import run

UPSTREAM_ENV = ROOT / "tests" / "upstream_env"
HF_CONFIGS = UPSTREAM_ENV / "hf_configs"
PYTEST_PLUGIN = "fork_upstream_plugin"
FAKE_REVISION = "0" * 40


def build_hf_cache(dest: Path = WORK / "hf") -> Path:
    """Lay the config files out as a Hugging Face hub cache under `dest`."""
    for cfg_dir in sorted(p for p in HF_CONFIGS.glob("*/*") if p.is_dir()):
        repo = dest / "hub" / f"models--{cfg_dir.parent.name}--{cfg_dir.name}"
        snapshot = repo / "snapshots" / FAKE_REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(FAKE_REVISION)
        for f in cfg_dir.iterdir():
            shutil.copyfile(f, snapshot / f.name)
    return dest


def tree_env(tree: Path, hf_home: Path | None = None) -> dict[str, str]:
    """Environment variables for running Python against `tree`."""
    env = package_env(hf_home)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env["PYTHONPATH"]])
    env["VLLM_FORK_TREE"] = str(tree)
    return env


def package_env(hf_home: Path | None = None) -> dict[str, str]:
    """The same for an installed vllm (a wheel): no tree on PYTHONPATH."""
    hf_home = hf_home or build_hf_cache()
    return {
        "PYTHONPATH": str(UPSTREAM_ENV),
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # Two test runs share two cores; keep torch from oversubscribing.
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def pytest_cmd(python: Path, junit: Path, *args: str) -> list[str]:
    return [
        str(python),
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
        *args,
    ]


def run_pytest(
    python: Path, tree: Path, cwd: Path, junit: Path, args: list[str], log: Path
) -> int:
    """Run pytest against `tree`, output to `log`; return pytest's exit code."""
    junit.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = run(
            pytest_cmd(python, junit, *args),
            cwd=cwd,
            env=tree_env(tree),
            check=False,
            capture=True,
        )
        out.write(proc.stdout + proc.stderr)
    return proc.returncode


def junit_test_id(case: ET.Element) -> str:
    """file::[Class::]name of a JUnit testcase; the file alone for a module
    that failed or skipped collection."""
    classname = case.get("classname", "")
    file = case.get("file") or classname.replace(".", "/") + ".py"
    if not classname:
        return file
    module = file.removesuffix(".py").replace("/", ".")
    cls = classname[len(module) + 1 :] if classname.startswith(module + ".") else ""
    return "::".join(filter(None, [file, cls, case.get("name")]))


def read_junit_details(path: Path) -> dict[str, tuple[str, str]]:
    """Map test id (file::name) to (outcome, message): outcome is passed /
    failed / error / skipped, message the failure's first line ("" if none).
    A collection error appears under the module's id (file::)."""
    results: dict[str, tuple[str, str]] = {}
    if not path.exists():
        return results
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = junit_test_id(case)
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = _first_line(child)
                break
        # A test that passes but errors in teardown appears twice: keep the worst.
        if results.get(test_id, ("",))[0] in ("failed", "error"):
            continue
        results[test_id] = (outcome, message)
    return results


def _first_line(child: ET.Element) -> str:
    """What went wrong, in one line: pytest's message, or for a collection
    error (message "collection failure") the last `E   ` line of the report."""
    message = (child.get("message") or "").strip()
    if message in ("", "collection failure"):
        e_lines = [
            line[1:].strip()
            for line in (child.text or "").splitlines()
            if line.startswith("E ")
        ]
        message = e_lines[-1] if e_lines else message
    return message.splitlines()[0] if message else ""


def read_junit(path: Path) -> dict[str, str]:
    """Map test id (file::name) to passed / failed / error / skipped."""
    return {t: o for t, (o, _) in read_junit_details(path).items()}


def count(outcomes: dict[str, str]) -> dict[str, int]:
    totals = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for outcome in outcomes.values():
        totals[outcome] += 1
    return totals


# A reproducer that fails with one of these did not get to the behaviour it
# checks (a name it uses is gone or changed): no verdict on the bug.
BROKEN_TYPES = {
    "ImportError",
    "ModuleNotFoundError",
    "AttributeError",
    "NameError",
    "TypeError",
}


@dataclass(frozen=True)
class Verdict:
    """A reproducer on a bare release: "fails" (the bug is there), "passes"
    (fixed), "broken" (could not exercise it: see message) or "not run"."""

    state: str
    message: str = ""


def junit_failure_texts(path: Path) -> dict[str, str]:
    """Test id -> the traceback pytest wrote for its failure; none where
    pytest wrote no report (it was killed), as read_junit_details reads it."""
    texts: dict[str, str] = {}
    if not path.exists():
        return texts
    for case in ET.parse(path).getroot().iter("testcase"):
        for child in case:
            if child.tag == "failure":
                texts[junit_test_id(case)] = child.text or ""
    return texts


TEST_TOOLS = {"_pytest", "pytest", "hypothesis", "pluggy"}
FRAME_RE = re.compile(r"^(\S+\.py):\d+: in ", re.M)


def raised_in_package(traceback: str) -> str:
    """The installed package (torch, ...) the failure was raised in, if it
    was: then the environment failed the test (say, a CUDA-only call on a
    CPU machine), not the release's code, and the test says nothing of the
    bug. "" when raised in the test, the harness or vLLM itself."""
    frames = FRAME_RE.findall(traceback)
    if not frames or "/site-packages/" not in frames[-1]:
        return ""
    package = frames[-1].split("/site-packages/", 1)[1].split("/", 1)[0]
    # The test tools' own failures (pytest.raises, hypothesis) are verdicts.
    return "" if package in TEST_TOOLS else package


def exception_type(message: str) -> str:
    return message.split(":", 1)[0].strip().rsplit(".", 1)[-1]


def reproducer_verdicts(
    python: Path,
    tree: Path,
    test_ids: list[str],
    cwd: Path,
    junit: Path,
    log: Path,
    pytest: Callable[..., int] = run_pytest,
) -> dict[str, Verdict]:
    """Run the files holding `test_ids` (relative to `cwd`) against `tree`
    (with `pytest`: run_pytest or one with its signature)."""
    files = sorted({t.split("::")[0] for t in test_ids})
    present = [f for f in files if (cwd / f).is_file()]
    results: dict[str, tuple[str, str]] = {}
    failures: dict[str, str] = {}
    if present:
        junit.unlink(missing_ok=True)
        # One file that no longer imports must not keep the others from running.
        args = ["--continue-on-collection-errors", *present]
        pytest(python, tree, cwd, junit, args, log)
        results = read_junit_details(junit)
        failures = junit_failure_texts(junit)
    verdicts = {}
    for test_id in test_ids:
        file = test_id.split("::")[0]
        if file not in present:
            verdicts[test_id] = Verdict("not run", f"{file} does not exist")
        elif test_id in results:
            outcome, message = results[test_id]
            package = raised_in_package(failures.get(test_id, ""))
            if outcome == "passed":
                verdicts[test_id] = Verdict("passes")
            elif outcome == "failed" and package:
                verdicts[test_id] = Verdict(
                    "broken", f"{message} (raised in {package})"
                )
            elif outcome == "failed" and exception_type(message) not in BROKEN_TYPES:
                verdicts[test_id] = Verdict("fails", message)
            elif outcome == "skipped":
                verdicts[test_id] = Verdict("not run", f"skipped: {message}")
            else:
                verdicts[test_id] = Verdict("broken", message)
        elif file in results:
            verdicts[test_id] = Verdict("broken", results[file][1])
        else:
            verdicts[test_id] = Verdict(
                "not run", f"not collected: see {log}" if results else f"see {log}"
            )
    return verdicts
