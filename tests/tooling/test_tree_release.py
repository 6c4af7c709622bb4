"""The release is chosen once (issue 41): the tree records what it was built
from, make's targets default to it, another choice is said out loud, and
the installed package says which release and series it is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Upstream, git

from keep.apply import apply_series
from keep.tree_release import (
    Holding,
    announce_choice,
    pick_arguments,
    stale_install,
    tree_holds,
)
from lib.paths import DEFAULT_SERIES, ROOT
from lib.series import Series
from ship.install import fork_version

# The fake trees' commits need an identity whatever the machine's git says.
pytestmark = pytest.mark.usefixtures("git_identity")


def make_n(*args: str) -> str:
    """The commands `make` would run, without running them (PICK's
    $(shell ...) does run: that is what is tested)."""
    return subprocess.run(
        ["make", "-s", "-n", "-C", str(ROOT), f"PYTHON={sys.executable}", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def fake_build(tree: Path, release: str, series_dir: str = "") -> None:
    """A tree whose HEAD is an overlay commit recording `release`, as
    `make apply` writes it (no vLLM files needed to read it back)."""
    git(tree.parent, "init", "-q", "-b", f"fork/v{release}", str(tree))
    message = (
        "fork: overlay (1 files)\n\nFiles the fork owns outright.\n\n"
        f"Series-Release: {release}\n"
        + (f"Series-Dir: {series_dir}\n" if series_dir else "")
        + "Series-Fingerprint: 0123456789abcdef\n"
    )
    git(tree, "commit", "-q", "--allow-empty", "-m", message)


def test_a_build_records_its_release_and_series(upstream: Upstream):
    upstream.add_patch("vllm/v1/core/new.py", "x = 1\n", "Add new.py")
    held = tree_holds(upstream.tree)
    assert held.release == "9.9.9" and held.complete
    assert held.fingerprint == upstream.series.fingerprint()
    assert Path(held.series_dir) == upstream.series.dir
    # A series of its own (not a release's patches/v<release>/) is named by
    # its directory; make's targets get it back as --series.
    assert pick_arguments(upstream.tree) == ["--series", str(upstream.series.dir)]


def test_make_targets_default_to_the_release_the_tree_holds(tmp_path):
    """Issue 41: after `make apply VERSION=0.28.0`, a plain `make install`
    rebuilt vllm/ as 0.20.2. Every target now picks what the tree holds."""
    tree = tmp_path / "vllm"
    fake_build(tree, "0.28.0", "patches/v0.28.0")
    t = f"TREE={tree}"
    assert "apply.py --version 0.28.0" in make_n("apply", t)
    assert "apply.py --version 0.28.0" in make_n("install", t)  # install: apply
    for target, script in [
        ("refresh", "refresh.py"),
        ("wheel", "repack.py"),
        ("overlay", "container.py"),
        ("image", "image.py"),
        ("fetch", "fetch.py"),
    ]:
        assert f"{script} --version 0.28.0" in make_n(target, t), target
    # An explicit choice wins, and SERIES= too.
    assert "apply.py --version 0.20.2" in make_n("apply", t, "VERSION=0.20.2")
    assert "--series patches/v0.29.0" in make_n("wheel", t, "SERIES=patches/v0.29.0")


def test_version_works_for_every_target_of_the_path(tmp_path):
    t = f"TREE={tmp_path / 'none'}"
    assert "test_releases.py --releases 0.28.0" in make_n(
        "test-releases", "VERSION=0.28.0"
    )
    assert "image.py --version 0.28.0" in make_n("image", "VERSION=0.28.0", t)
    assert "export.py --version 0.28.0" in make_n("export", "VERSION=0.28.0", t)
    assert "e2e.py --release 0.28.0" in make_n("e2e", "VERSION=0.28.0", t)
    # No tree: the default series, as before.
    assert "apply.py --series patches " in make_n("apply", t) + " "


def test_make_help_lists_version():
    out = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "help"], capture_output=True, text=True
    ).stdout
    assert "VERSION=" in next(line for line in out.splitlines() if "Variables" in line)


def test_a_tree_made_before_the_trailers_is_read_from_its_branch(tmp_path):
    tree = tmp_path / "vllm"
    git(tmp_path, "init", "-q", "-b", "fork/v0.27.1", str(tree))
    git(tree, "commit", "-q", "--allow-empty", "-m", "fork: overlay (1 files)")
    assert tree_holds(tree).release == "0.27.1"
    assert pick_arguments(tree) == ["--version", "0.27.1"]


def test_a_release_without_a_series_falls_back_to_the_default(tmp_path):
    tree = tmp_path / "vllm"
    fake_build(tree, "0.99.0")
    assert pick_arguments(tree) == ["--series", "patches"]
    assert pick_arguments(tmp_path / "nothing") == ["--series", "patches"]


def test_another_release_is_said_out_loud(tmp_path, capsys):
    tree = tmp_path / "vllm"
    fake_build(tree, "0.28.0", "patches/v0.28.0")
    announce_choice(Series(DEFAULT_SERIES), "building", tree)
    assert f"{tree}/ holds 0.28.0; building 0.20.2 as asked" in capsys.readouterr().err
    announce_choice(Series(DEFAULT_SERIES / "v0.28.0"), "building", tree)
    assert capsys.readouterr().err == ""


def test_the_install_reports_release_and_series(upstream: Upstream):
    upstream.add_patch("vllm/v1/core/new.py", "x = 1\n", "Add new.py")
    fp = upstream.series.fingerprint()[:8]
    assert fork_version(upstream.tree, "cpu") == f"9.9.9+fork.1.g{fp}.empty"
    assert fork_version(upstream.tree, "cuda") == f"9.9.9+fork.1.g{fp}.precompiled"
    upstream.commit_in_tree("vllm/mine.py", "m = 1\n", "Mine")
    assert fork_version(upstream.tree, "cpu") == f"9.9.9+fork.2.g{fp}.edited.empty"


def install_record(venv: Path, version: str, source: Path) -> None:
    """What `pip install -e` leaves in site-packages."""
    dist = venv / "lib" / "python3.11" / "site-packages" / f"vllm-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    )
    url = {"url": source.as_uri(), "dir_info": {"editable": True}}
    (dist / "direct_url.json").write_text(json.dumps(url))


@pytest.mark.parametrize("installed_as", ["8.8.8+fork.1.g00000000.empty", "old"])
def test_an_editable_install_of_an_older_build_is_named(
    upstream: Upstream, tmp_path, installed_as
):
    """Issue 41: after a re-apply to another release, pip show still said
    the old one. apply now says so, with the command that fixes it."""
    apply_series(upstream.series, upstream.tree, upstream.cache)
    venv = tmp_path / "venv"
    install_record(venv, installed_as, upstream.tree)
    line = stale_install(upstream.tree, venv)
    assert line and installed_as in line and "make install" in line
    assert "9.9.9" in line


def test_an_install_of_this_build_is_not_named(upstream: Upstream, tmp_path):
    apply_series(upstream.series, upstream.tree, upstream.cache)
    venv = tmp_path / "venv"
    fp = upstream.series.fingerprint()[:8]
    install_record(venv, f"9.9.9+fork.0.g{fp}.empty", upstream.tree)
    assert stale_install(upstream.tree, venv) is None
    other = tmp_path / "venv2"
    install_record(other, "1.0.0", tmp_path / "elsewhere")  # not this tree
    assert stale_install(upstream.tree, other) is None


def test_export_says_which_series_and_why(monkeypatch):
    import ship.export_preflight as preflight

    monkeypatch.setattr(preflight, "tree_holds", lambda tree: Holding("0.28.0"))
    line = preflight.why_this_series(Series(DEFAULT_SERIES / "v0.33.0"), False)
    assert "exporting the 0.33.0 series (patches/v0.33.0/), the newest" in line
    assert "pull requests go to upstream main" in line
    assert "holds 0.28.0; `make export VERSION=0.28.0` exports that series" in line
    asked = preflight.why_this_series(Series(DEFAULT_SERIES / "v0.28.0"), True)
    assert asked == "exporting the 0.28.0 series (patches/v0.28.0/), as asked"


def test_a_half_built_tree_picks_what_it_was_becoming(upstream: Upstream, monkeypatch):
    """After an interrupted `make apply VERSION=X`, a plain `make apply` (or
    install) finishes X, not the release the tree held before."""
    import keep.apply

    apply_series(upstream.series, upstream.tree, upstream.cache)
    other = upstream.tree.parent / "other"
    other.mkdir()
    (other / "base.toml").write_text(upstream.release("9.9.10", {}).to_toml())

    def stop(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(keep.apply, "ensure_base", stop)
    with pytest.raises(KeyboardInterrupt):
        apply_series(
            Series(other, upstream.series.overlay), upstream.tree, upstream.cache
        )
    held = tree_holds(upstream.tree)
    assert not held.complete and "interrupted" in held.describe()
    assert pick_arguments(upstream.tree) == ["--series", str(other)]
