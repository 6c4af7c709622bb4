"""The resolution store: diffs, not whole files; shared where releases agree;
rebuilt byte for byte; pruned to what the series use."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from keep import resolutions as res

UPSTREAM = "".join(f"line {i}\n" for i in range(1, 201))


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def release_tree(tmp: Path, text: str = UPSTREAM, version: str = "9.9.10") -> Path:
    """A tree holding one upstream file, tagged as the tree's release ref."""
    tree = tmp / "tree"
    if not tree.exists():
        tree.mkdir()
        git(tree, "init", "-q")
    (tree / "pool.py").write_text(text)
    git(tree, "add", "pool.py")
    git(
        tree,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        version,
    )
    git(tree, "update-ref", f"refs/remotes/upstream/v{version}", "HEAD")
    return tree


def conflicted(text: str) -> tuple[bytes, bytes]:
    """rerere's preimage and postimage of a conflict at line 100."""
    pre = text.replace("line 100\n", "<<<<<<<\nline C\n=======\nline D\n>>>>>>>\n")
    post = text.replace("line 100\n", "line C and D\n")
    return pre.encode(), post.encode()


def record(tree: Path, conflict_id: str, pre: bytes, post: bytes, n: int = 0):
    entry = res.rr_cache(tree) / conflict_id
    entry.mkdir(parents=True, exist_ok=True)
    (entry / res.image_name("pre", n)).write_bytes(pre)
    (entry / res.image_name("post", n)).write_bytes(post)


@pytest.mark.parametrize(
    "before,after",
    [
        (b"", b"new file\n"),
        (b"a\nb\n", b"a\nB\n"),
        (b"no newline", b"no newline at all"),
        (b"same\n", b"same\n"),
    ],
)
def test_a_diff_rebuilds_the_text(before, after):
    assert res.apply_diff(before, res.text_diff(before, after)) == after


def test_a_conflict_is_stored_as_diffs_and_rebuilt_byte_for_byte(tmp_path):
    tree = release_tree(tmp_path)
    pre, post = conflicted(UPSTREAM)
    record(tree, "a" * 40, pre, post)
    store = tmp_path / "store"
    name = res.save_conflict(
        tree, store, "a" * 40, 0, "pool.py", "refs/remotes/upstream/v9.9.10"
    )
    entry = store / name
    stored = sum(f.stat().st_size for f in entry.iterdir())
    assert stored < len(pre) / 2  # a few hunks, not the file twice
    meta = json.loads((entry / res.RERERE_META).read_text())
    assert meta == {
        "id": "a" * 40,
        "path": "pool.py",
        "blob": git(tree, "rev-parse", "HEAD:pool.py"),
    }
    # A fresh rr-cache gets the same images back, dated for `used_conflicts`.
    git(tree, "rm", "-q", "-r", "--cached", ".")  # nothing else is needed
    shutil.rmtree(res.rr_cache(tree))
    assert res.seed_conflicts(tree, store, 1000.0) == {"a" * 40: "pool.py"}
    ((got_pre, got_post),) = res.variants(res.rr_cache(tree) / ("a" * 40)).values()
    assert (got_pre.read_bytes(), got_post.read_bytes()) == (pre, post)
    assert res.used_conflicts(tree, 2000.0) == []
    assert res.used_conflicts(tree, 500.0) == [("a" * 40, 0)]
    # Seeding again adds no second copy of the same variant.
    res.seed_conflicts(tree, store, 1000.0)
    assert len(res.variants(res.rr_cache(tree) / ("a" * 40))) == 1


def test_neighbouring_releases_share_an_entry_where_they_agree(tmp_path):
    tree = release_tree(tmp_path, version="9.9.10")
    release_tree(tmp_path, version="9.9.11")  # the same file: one blob
    pre, post = conflicted(UPSTREAM)
    record(tree, "b" * 40, pre, post)
    store = tmp_path / "store"
    names = {
        res.save_conflict(
            tree, store, "b" * 40, 0, "pool.py", f"refs/remotes/upstream/v{v}"
        )
        for v in ("9.9.10", "9.9.11")
    }
    assert len(names) == 1
    # A release that changed the file gets its own entry.
    changed = UPSTREAM.replace("line 3\n", "line three\n")
    release_tree(tmp_path, changed, version="9.9.12")
    pre12, post12 = conflicted(changed)
    record(tree, "b" * 40, pre12, post12, n=1)
    other = res.save_conflict(
        tree, store, "b" * 40, 1, "pool.py", "refs/remotes/upstream/v9.9.12"
    )
    assert other not in names
    assert len(list((store / res.RERERE).iterdir())) == 2


def test_an_entry_made_on_a_file_the_tree_never_had_is_not_seeded(tmp_path):
    tree = release_tree(tmp_path)
    entry = tmp_path / "store" / res.RERERE / ("c" * 40 + "-000000000000")
    entry.mkdir(parents=True)
    meta = {"id": "c" * 40, "path": "pool.py", "blob": "1" * 40}
    (entry / res.RERERE_META).write_text(json.dumps(meta))
    (entry / res.PREIMAGE_DIFF).write_bytes(b"")
    (entry / res.POSTIMAGE_DIFF).write_bytes(b"")
    assert res.seed_conflicts(tree, tmp_path / "store", 1000.0) == {}
    assert not (res.rr_cache(tree) / ("c" * 40)).exists()


def test_the_store_keeps_what_some_series_uses(tmp_path):
    store = tmp_path / "resolutions"
    for name in ("rerere/x-1", "rerere/y-2", "ports/k1", "ports/k2"):
        (store / name).mkdir(parents=True)
    series = tmp_path / "v9.9.10"
    series.mkdir()
    (series / "REBASE.md").write_text(
        f"# report\n\n{res.USED_LINE}ports/k1, rerere/x-1, rerere/gone-3\n"
    )
    assert res.check_store(store, [series]) == [
        f"{series}/REBASE.md names rerere/gone-3, which {store}/ lacks"
    ]
    assert res.prune(store, [series]) == ["rerere/y-2", "ports/k2"]
    assert sorted(str(p.relative_to(store)) for p in store.glob("*/*")) == [
        "ports/k1",
        "rerere/x-1",
    ]


def test_a_port_is_stale_only_on_the_release_it_was_made_for(tmp_path):
    tree = release_tree(tmp_path, version="9.9.10")
    patch = tmp_path / "0001-Fix.patch"
    patch.write_text("diff --git a/pool.py b/pool.py\n")
    (tree / "pool.py").write_text(UPSTREAM.replace("line 5\n", "line five\n"))
    git(tree, "add", "pool.py")
    ref10 = "refs/remotes/upstream/v9.9.10"
    key = res.record_port(tree, patch, "HEAD", ref10)
    git(tree, "reset", "-q", "--hard")
    assert res.stale_port(tree, patch, "HEAD", ref10) is None  # the same patch
    patch.write_text("diff --git a/pool.py b/pool.py\n# changed since\n")
    stale = res.stale_port(tree, patch, "HEAD", ref10)
    assert stale is not None and stale.name == key
    # The same patch's port for another release's files is no stale port.
    release_tree(tmp_path, UPSTREAM.replace("line 9\n", "line nine\n"), "9.9.11")
    assert res.stale_port(tree, patch, "HEAD", "refs/remotes/upstream/v9.9.11") is None


def test_the_committed_store_holds_exactly_what_the_series_use():
    from keep.rebase_finish import series_dirs

    dirs = series_dirs(res.STORE.parent)
    assert res.check_store(res.STORE, dirs) == []
    used = {entry for d in dirs for entry in res.used_by(d)}
    present = {
        f"{kind}/{p.name}"
        for kind in (res.RERERE, res.PORTS)
        for p in (res.STORE / kind).iterdir()
    }
    assert present == used


def test_a_replayed_conflict_is_kept_by_the_path_noted_in_the_tree(tmp_path):
    # rerere replays a resolution without naming its conflict: the path
    # noted beside its images when it was recorded (or seeded) is used.
    tree = release_tree(tmp_path)
    pre, post = conflicted(UPSTREAM)
    record(tree, "d" * 40, pre, post)
    res.note_path(tree, "d" * 40, "pool.py")
    name = res.save_conflict(
        tree, tmp_path / "store", "d" * 40, 0, "", "refs/remotes/upstream/v9.9.10"
    )
    meta = json.loads((tmp_path / "store" / name / res.RERERE_META).read_text())
    assert meta["path"] == "pool.py" and meta["blob"]
    assert len((tmp_path / "store" / name / res.PREIMAGE_DIFF).read_bytes()) < len(pre)


def test_a_broken_entry_is_named(tmp_path):
    tree = release_tree(tmp_path)
    entry = tmp_path / "store" / res.RERERE / ("e" * 40 + "-000000000000")
    entry.mkdir(parents=True)  # interrupted before its files were written
    with pytest.raises(res.ForkError, match=f"{entry.name} is broken"):
        res.seed_conflicts(tree, tmp_path / "store", 1000.0)


def test_prune_removes_nothing_while_a_report_lost_its_used_line(tmp_path):
    store = tmp_path / "resolutions"
    (store / "ports" / "k1").mkdir(parents=True)
    series = tmp_path / "v9.9.10"
    series.mkdir()
    (series / "REBASE.md").write_text(
        "| 0001 | merged | conflict resolved (recorded) |"
    )
    assert res.prune(store, [series]) == []
    assert (store / "ports" / "k1").is_dir()


def test_one_patch_numbered_by_two_series_is_one_patch():
    assert res.same_patch(
        "0006-Store-only-blocks.patch", "0004-Store-only-blocks.patch"
    )
    assert not res.same_patch("0006-Store-only.patch", "0006-Something-else.patch")
