#!/usr/bin/env python3
"""Run the series' reproducers against the vLLM installed in an image.

Runs inside a build on top of the image `make overlay`'s context makes
(written there by `make image`, scripts/ship/image.py), with only the standard
library and the image's own python3. The check directory it is given (a
read-only bind mount) holds:

  ids.txt        the tests the patches name in their `Reproducer:` trailers
  tests/         tests/conftest.py, tests/harness, the reproducer files and
                 tests/upstream_env, copied from the checkout
  pyproject.toml the project's pytest settings
  hf/            the offline Hugging Face cache (config.json files only)
  wheels/        pytest and the other test tools

It runs `python3 -m vllm._fork` again (the overlay's own RUN may come from
podman's cache); checks that every file the overlay's manifest lists is
world-readable (its directories traversable); installs the test tools into
a temporary directory (never into the image's site-packages), minus every
distribution the image already has, so none of the image's is replaced;
runs pytest on the named tests as an unprivileged user (nobody, 65534:
root would read any file whatever its mode) with the image's vllm; fails
unless every one of them passes and the vllm the tests imported (recorded
inside pytest's process) is the image's, in its site-packages; and removes
everything it wrote, so the build's layer stays empty.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import site
import stat
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

# Printed for scripts/ship/image.py to read back from the build's output.
SUMMARY_PREFIX = "vllm-fork image check:"
# The test tools' own plugin set-up, as scripts/lib/testenv.py runs pytest.
PYTEST_PLUGIN = "fork_upstream_plugin"
# Written into the work directory: records, inside pytest's process, the
# vllm the tests imported.
PROBE_PLUGIN = "fork_image_probe"
PROBE_ENV = "VLLM_FORK_IMAGE_PROBE"
PROBE_SOURCE = f"""\
\"\"\"Written by image_check.py: where the tests' vllm came from.\"\"\"
import json
import os
import sys


def pytest_sessionfinish(session, exitstatus):
    vllm = sys.modules.get("vllm")
    with open(os.environ["{PROBE_ENV}"], "w") as f:
        json.dump({{"vllm": getattr(vllm, "__file__", None)}}, f)
"""
# The unprivileged user the tests run as (nobody).
NOBODY = 65534
# pytest's exit status when it collected no test.
NO_TESTS = 5


class CheckError(Exception):
    pass


# junit_test_id and read_junit are scripts/lib/testenv.py's, copied: this file
# runs in the image with the standard library alone and cannot import the
# project's scripts. Keep them in step (test_image.py compares the two).
def junit_test_id(case: ET.Element) -> str:
    """file::[Class::]name of a JUnit testcase (scripts/lib/testenv.py's ids)."""
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
        test_id = junit_test_id(case)
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                break
        # A test that passes but errors in teardown appears twice: keep the
        # worst (testenv.py's rule).
        if outcomes.get(test_id) in ("failed", "error"):
            continue
        outcomes[test_id] = outcome
    return outcomes


def verdict(ids: list[str], outcomes: dict[str, str]) -> list[str]:
    """What is wrong: each named test must have run and passed."""
    problems = []
    for test_id in ids:
        got = outcomes.get(test_id)
        if got != "passed":
            problems.append(f"{test_id}: {got or 'not run'}")
    return problems


def imported_vllm_problems(
    probe: Path, image_vllm: Path, site_dirs: list[Path]
) -> list[str]:
    """What is wrong with the vllm pytest's process imported (as the probe
    plugin recorded it): it must be the image's, in its site-packages."""
    if not probe.is_file():
        return ["pytest's process recorded no vllm (the probe plugin did not run)"]
    file = json.loads(probe.read_text()).get("vllm")
    if not file:
        return ["the tests never imported vllm"]
    imported = Path(file).parent
    problems = []
    if imported != image_vllm:
        problems.append(
            f"the tests imported vllm from {imported}, not the image's {image_vllm}"
        )
    if not any(imported.is_relative_to(d) for d in site_dirs):
        problems.append(
            f"the tests' vllm ({imported}) is in none of the image's "
            f"site-packages ({', '.join(map(str, site_dirs))})"
        )
    return problems


def judge(
    ids: list[str],
    junit: Path,
    exit_code: int,
    probe: Path,
    image_vllm: Path,
    site_dirs: list[Path],
) -> list[str]:
    """Everything wrong with a pytest run of `ids` ([] when it passed):
    its JUnit report, its exit status, and the vllm its process imported."""
    problems = verdict(ids, read_junit(junit))
    if exit_code == NO_TESTS:
        problems.insert(0, f"pytest collected no test (exit {NO_TESTS})")
    elif exit_code != 0 and not problems:
        problems.append(f"pytest failed (exit {exit_code}) though every test passed")
    return problems + imported_vllm_problems(probe, image_vllm, site_dirs)


def installed_vllm() -> Path:
    """Where the image's vllm package lies, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise CheckError(f"no vllm package is installed for {sys.executable}")
    return Path(list(spec.submodule_search_locations)[0])


def unreadable(site_dir: Path, manifest: dict) -> list[str]:
    """The overlay's files (and their directories) that users other than
    root cannot read (or traverse): the image runs as any user."""
    problems, seen = [], set()
    for f in manifest["files"]:
        if f["action"] == "delete":
            continue
        path = site_dir / f["path"]
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        if not path.stat().st_mode & stat.S_IROTH:
            problems.append(f"{path}: not world-readable")
        for d in [path.parent, *path.parent.parents]:
            if not d.is_relative_to(site_dir) or d in seen:
                break
            seen.add(d)
            mode = d.stat().st_mode
            if mode & (stat.S_IROTH | stat.S_IXOTH) != stat.S_IROTH | stat.S_IXOTH:
                problems.append(f"{d}/: not world-readable and traversable")
    return problems


def drop_installed(tools: Path) -> list[str]:
    """Remove from `tools` every distribution the image already has (pip
    install --target ignores them): first on PYTHONPATH, they would replace
    the image's own. Returns their names."""
    dropped = []
    for dist in importlib.metadata.distributions(path=[str(tools)]):
        name = dist.metadata["Name"]
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or []:
            path = Path(str(dist.locate_file(f))).resolve()
            if path.is_relative_to(tools.resolve()):
                path.unlink(missing_ok=True)
        dropped.append(name)
    for d in sorted(tools.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    return sorted(dropped)


def chown_tree(root: Path, uid: int) -> None:
    os.chown(root, uid, uid)
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chown(os.path.join(parent, name), uid, uid, follow_symlinks=False)


def as_user_cmd(cmd: list[str]) -> list[str]:
    """`cmd` run as nobody when we are root (in the image build)."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        raise CheckError("setpriv (util-linux) is not in the image")
    ids = [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return ["setpriv", *ids, *cmd]


def run_check(check_dir: Path, work: Path, manifest_path: Path | None) -> str:
    ids = [
        line.strip()
        for line in (check_dir / "ids.txt").read_text().splitlines()
        if line.strip()
    ]
    if not ids:
        raise CheckError(f"{check_dir / 'ids.txt'} names no test")
    vllm_dir = installed_vllm()
    site_dirs = [Path(d) for d in site.getsitepackages()]
    # The overlay's own check again: its RUN may come from podman's cache.
    fork = subprocess.run(
        [sys.executable, "-B", "-m", "vllm._fork"], capture_output=True, text=True
    )
    print(fork.stdout, end="", flush=True)
    if fork.returncode != 0:
        raise CheckError(f"python3 -m vllm._fork failed:\n{fork.stderr[-3000:]}")
    if manifest_path is not None:
        manifest = json.loads(manifest_path.read_text())
        bad = unreadable(vllm_dir.parent, manifest)
        if bad:
            raise CheckError(
                "the overlay's files cannot be read by other users:\n  "
                + "\n  ".join(bad)
            )
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
    dropped = drop_installed(tools)
    if dropped:
        print(f"test tools: the image's own {', '.join(dropped)} kept", flush=True)
    # pytest and hypothesis write next to the tests; the mount is read-only.
    shutil.copytree(check_dir, tree, ignore=shutil.ignore_patterns("wheels"))
    plugins = work / "plugins"
    plugins.mkdir()
    (plugins / f"{PROBE_PLUGIN}.py").write_text(PROBE_SOURCE)
    home = work / "home"
    home.mkdir()
    junit, probe = work / "junit.xml", work / "probe.json"
    if os.geteuid() == 0:
        chown_tree(work, NOBODY)
    path = [tools, tree / "tests/upstream_env", plugins]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(map(str, path)),
        "HOME": str(home),
        "TMPDIR": str(home),
        "HF_HOME": str(tree / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        PROBE_ENV: str(probe),
    }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        PYTEST_PLUGIN,
        "-p",
        PROBE_PLUGIN,
        "-p",
        "no:cacheprovider",
        "-q",
        "--tb=short",
        "-o",
        "junit_family=xunit1",
        f"--junitxml={junit}",
        *ids,
    ]
    proc = subprocess.run(
        as_user_cmd(cmd), cwd=tree, env=env, capture_output=True, text=True
    )
    print(proc.stdout[-4000:], end="", flush=True)
    problems = judge(ids, junit, proc.returncode, probe, vllm_dir, site_dirs)
    if problems:
        raise CheckError(
            f"the reproducer tests did not pass against the vllm in {vllm_dir} "
            f"(run as uid {os.geteuid() or NOBODY}):\n  "
            + "\n  ".join(problems)
            + f"\n{proc.stderr[-3000:]}"
        )
    files = len({i.split("::")[0] for i in ids})
    user = "nobody" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    return (
        f"{SUMMARY_PREFIX} {len(ids)} of {len(ids)} reproducer tests passed "
        f"({files} files, as {user}) against {vllm_dir}, "
        f"Python {sys.version.split()[0]}"
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
    p.add_argument(
        "--manifest",
        type=Path,
        help="the overlay's manifest.json: its files must be world-readable",
    )
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vllm-fork-check-", dir="/tmp"))
    try:
        print(run_check(args.check_dir, work, args.manifest), flush=True)
    except CheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
