"""The environment step on a full disk: a clear error before pip starts,
and pip's buried ENOSPC named when the disk fills during an install."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lib import venv
from lib.errors import ForkError


def test_a_new_environment_on_a_full_disk_is_refused_before_pip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    ran: list[object] = []
    monkeypatch.setattr(venv, "free_bytes", lambda path: 200_000_000)
    monkeypatch.setattr(venv, "run", lambda *a, **k: ran.append(a))
    common = tmp_path / "common.txt"
    common.write_text("numpy\n")
    target = tmp_path / "envs" / "vllm-9.9.9"
    with pytest.raises(ForkError) as info:
        venv.ensure_venv("test", common, venv=target)
    msg = str(info.value)
    assert "0.2 GB free" in msg and "make clean" in msg, msg
    assert ran == [] and not target.exists()


def test_pip_failing_on_a_full_disk_says_the_disk_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(venv, "run", lambda *a, **k: SimpleNamespace(returncode=1))
    monkeypatch.setattr(venv, "free_bytes", lambda path: 10_000_000)
    with pytest.raises(ForkError, match="the disk is full"):
        venv.pip_install(tmp_path / ".venv", ["six"])
    monkeypatch.setattr(venv, "free_bytes", lambda path: 50_000_000_000)
    with pytest.raises(ForkError, match="the output above says which package"):
        venv.pip_install(tmp_path / ".venv", ["six"])


def test_free_bytes_reads_the_nearest_existing_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Which path is read, not the bytes: other tests write to the same disk
    # between two reads (make test runs them in parallel).
    asked: list[Path] = []

    def disk_usage(path: Path) -> SimpleNamespace:
        asked.append(path)
        return SimpleNamespace(free=7)

    monkeypatch.setattr(venv.shutil, "disk_usage", disk_usage)
    assert venv.free_bytes(tmp_path / "not" / "yet") == 7
    assert asked == [tmp_path]
