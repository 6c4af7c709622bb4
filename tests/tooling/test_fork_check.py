"""`python -m vllm._fork`: the release, the series and every file it changes
checked against the digests `make apply` records (keep/build_digests.py),
in an editable tree and in an installed copy of the package."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Upstream, git

import keep.apply as apply_mod
import keep.build_digests as digests_mod
from keep.apply import apply_series
from keep.build_digests import DIGESTS_FILE
from keep.refresh import refresh_series
from lib.paths import OVERLAY

# The patched names the real _fork.py looks for, in the synthetic release.
MARKED_UTILS = (
    "def popleft_n(n):\n    assert n\n\n\n"
    "class NoFreeBlocksError(Exception):\n    pass\n\n\n"
    "def is_block_shortage(error):\n    return True\n"
)
MARKED_MANAGER = (
    "class SimpleCPUOffloadScheduler:\n"
    "    def _is_position_hash(self):\n        return True\n"
)
UTILS = "vllm/v1/core/kv_cache_utils.py"
DELETED = "vllm/v1/core/block_pool.py"


@pytest.fixture
def built(upstream: Upstream) -> Upstream:
    """A tree of the synthetic release with the real _fork.py, the markers
    patched in and a file deleted: three patches."""
    up = upstream
    shutil.copy2(OVERLAY / "vllm" / "_fork.py", up.series.overlay / "vllm/_fork.py")
    up.add_patch(UTILS, MARKED_UTILS, "Mark kv_cache_utils")
    up.add_patch(
        "vllm/v1/simple_kv_offload/manager.py", MARKED_MANAGER, "Mark the manager"
    )
    git(up.tree, "rm", "-q", DELETED)
    git(up.tree, "commit", "-q", "-m", "Delete block_pool.py")
    refresh_series(up.series, up.tree)
    apply_series(up.series, up.tree, up.cache)
    return up


def self_check(root: Path) -> subprocess.CompletedProcess[str]:
    """`python -m vllm._fork` with `root` (the tree, or a site dir) first."""
    return subprocess.run(
        [sys.executable, "-B", "-m", "vllm._fork"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_overlay_commit_records_every_changed_file(built: Upstream):
    record = json.loads((built.tree / DIGESTS_FILE).read_text())
    assert record["release"] == "9.9.9"
    assert record["patches"] == 3
    assert record["fingerprint"] == built.series.fingerprint()
    assert record["make_variable"] == f"SERIES={built.series.dir}"
    assert sorted(record["files"]) == sorted(
        [UTILS, "vllm/v1/simple_kv_offload/manager.py", "vllm/_fork.py"]
    )
    assert record["deleted"] == [DELETED]
    overlay_files = git(built.tree, "show", "--name-only", "--format=", "HEAD")
    assert DIGESTS_FILE in overlay_files.split()
    # Refresh right after apply still changes nothing: the file is the tool's.
    before = {p.name: p.path.read_bytes() for p in built.series.patches()}
    refresh_series(built.series, built.tree)
    after = {p.name: p.path.read_bytes() for p in built.series.patches()}
    assert before == after


def test_a_clean_tree_passes_and_names_release_and_series(built: Upstream):
    done = self_check(built.tree)
    assert done.returncode == 0, done.stderr
    fingerprint = built.series.fingerprint()
    assert (
        f"vLLM 9.9.9 with the series {built.series.dir}/ (3 patches, series "
        f"digest {fingerprint})" in done.stdout
    )
    assert "all 3 files the series changes match their build digests" in done.stdout
    assert "all 3 patched modules are imported" in done.stdout


def test_a_tampered_file_fails_and_is_named_with_the_fix(built: Upstream):
    (built.tree / UTILS).write_text(MARKED_UTILS + "# edited\n")
    done = self_check(built.tree)
    assert done.returncode == 1
    assert f"changed: {UTILS}" in done.stderr
    assert f"Fix: make apply SERIES={built.series.dir} " in done.stderr
    # Gone, or back when the series deletes it: named too.
    (built.tree / UTILS).write_text(MARKED_UTILS)
    (built.tree / "vllm/v1/simple_kv_offload/manager.py").unlink()
    (built.tree / DELETED).write_text("line 1\n")
    done = self_check(built.tree)
    assert done.returncode == 1
    assert "missing: vllm/v1/simple_kv_offload/manager.py" in done.stderr
    assert f"present: {DELETED}" in done.stderr


def test_an_installed_copy_is_checked_and_told_to_rebuild_the_wheel(
    built: Upstream, tmp_path: Path
):
    site = tmp_path / "site"
    shutil.copytree(built.tree / "vllm", site / "vllm")  # as a wheel installs it
    done = self_check(site)
    assert done.returncode == 0, done.stderr
    with (site / UTILS).open("a") as f:
        f.write("# edited\n")
    done = self_check(site)
    assert done.returncode == 1
    assert f"changed: {UTILS} ({site / UTILS})" in done.stderr
    variable = f"SERIES={built.series.dir}"
    assert f"Fix: make wheel {variable} and pip install" in done.stderr
    assert f"make overlay {variable}" in done.stderr


def test_without_the_digests_it_fails_and_says_so(built: Upstream, tmp_path: Path):
    site = tmp_path / "site"
    shutil.copytree(built.tree / "vllm", site / "vllm")
    (site / DIGESTS_FILE).unlink()
    done = self_check(site)
    assert done.returncode == 1
    assert "_fork_digests.json is missing" in done.stderr
    assert "Fix: make wheel" in done.stderr


def test_an_interrupt_after_the_digests_are_written_is_finished(
    built: Upstream, monkeypatch: pytest.MonkeyPatch
):
    up = built
    head = git(up.tree, "rev-parse", "HEAD")
    (up.series.overlay / "vllm" / "extra.py").write_text("z = 3\n")
    real = digests_mod.write_digests

    def write_then_stop(*args, **kw):
        real(*args, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(apply_mod, "write_digests", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        apply_series(up.series, up.tree, up.cache)
    monkeypatch.undo()
    assert apply_series(up.series, up.tree, up.cache) is True
    assert git(up.tree, "rev-parse", "HEAD") != head
    assert git(up.tree, "status", "--porcelain", "--untracked-files=all") == ""
    record = json.loads((up.tree / DIGESTS_FILE).read_text())
    assert "vllm/extra.py" in record["files"]
    assert self_check(up.tree).returncode == 0
