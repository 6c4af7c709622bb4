"""make wheel: upstream's wheel, repacked with the series' files.

The fast tests repack an upstream-like wheel built here from the release's
own vllm/ (plus a fake compiled kernel); test_real_upstream_wheel (slow,
make test-slow) does the same with upstream's 244 MB wheel from PyPI, and
test_installs_and_the_reproducers_pass (slow too) installs the wheel.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lib.errors import ForkError
from lib.proc import git
from lib.series import Series
from ship.changes import package_changes
from ship.install import upstream_wheel
from ship.repack import (
    build_wheel,
    check_against_release,
    compare_wheels,
    local_label,
    verify_record,
)
from shipenv import (
    FAKE_KERNEL,
    commit_files,
    patch_paths,
    reproducer_ids,
    shared_clone,
)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def patched(series, tree, upstream_like_wheel, tmp_path_factory) -> Path:
    out, _, _ = build_wheel(
        series, tree, upstream_like_wheel, tmp_path_factory.mktemp("dist")
    )
    return out


def test_name_and_version_carry_the_fork_label(series, patched):
    version = series.base().version
    label = local_label(series)
    assert label == f"fork.{len(series.patches())}.g{series.fingerprint()[:8]}"
    assert patched.name == (
        f"vllm-{version}+{label}-cp38-abi3-manylinux_2_35_x86_64.whl"
    )
    with zipfile.ZipFile(patched) as zf:
        tops = {n.split("/")[0] for n in zf.namelist()}
        assert tops == {
            "vllm",
            f"vllm-{version}+{label}.dist-info",
            f"vllm-{version}+{label}.data",
        }
        metadata = zf.read(f"vllm-{version}+{label}.dist-info/METADATA").decode()
    assert f"\nVersion: {version}+{label}\n" in metadata


def test_only_the_series_files_change(series, tree, upstream_like_wheel, patched):
    diff = compare_wheels(upstream_like_wheel, patched)
    # Expected from the patch files' own diff headers and the overlay.
    package = {p for p in patch_paths(series) if p.startswith("vllm/")}
    with zipfile.ZipFile(upstream_like_wheel) as zf:
        upstream_names = set(zf.namelist())
    assert set(diff.changed) == (package & upstream_names) | {
        "<dist-info>/METADATA",
        "<dist-info>/RECORD",
    }
    assert set(diff.added) | set(diff.removed) == package - upstream_names
    assert diff.same > 2000
    with zipfile.ZipFile(patched) as zf:
        for path in sorted(package & set(zf.namelist())):
            assert zf.read(path) == (tree / path).read_bytes(), path


def test_compiled_files_are_byte_identical(upstream_like_wheel, patched):
    with zipfile.ZipFile(upstream_like_wheel) as a, zipfile.ZipFile(patched) as b:
        old, new = a.getinfo(FAKE_KERNEL), b.getinfo(FAKE_KERNEL)
        assert a.read(old) == b.read(new)
        assert new.external_attr == old.external_attr  # still executable


def test_record_verifies_and_catches_tampering(patched, tmp_path):
    assert verify_record(patched) == []
    tampered = tmp_path / patched.name
    with zipfile.ZipFile(patched) as src, zipfile.ZipFile(tampered, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "vllm/v1/core/block_pool.py":
                data += b"# changed after RECORD was written\n"
            dst.writestr(info, data)
    assert verify_record(tampered) == [
        "vllm/v1/core/block_pool.py: hash or size differs from RECORD"
    ]


def test_same_series_gives_the_same_bytes(series, tree, upstream_like_wheel, patched):
    again, _, _ = build_wheel(series, tree, upstream_like_wheel, patched.parent / "2")
    assert sha(again) == sha(patched)


# A fresh venv and a pytest run against it: 40 s of make test's budget
# (make test-slow runs it, with the real wheel's test).
@pytest.mark.slow
def test_installs_and_the_reproducers_pass(series, patched, make_env, tmp_path):
    env = make_env()
    env.pip_install(patched)
    assert env.eval("import importlib.metadata as m; print(m.version('vllm'))") == (
        f"{series.base().version}+{local_label(series)}"
    )
    assert env.record_problems() == []
    # The patched modules are the installed ones, not the checkout's.
    assert env.check_patched().is_relative_to(env.site)
    ids = reproducer_ids(series)
    outcomes = env.run_tests(ids, tmp_path / "junit.xml")
    assert outcomes == dict.fromkeys(ids, "passed")


def test_refuses_a_wheel_of_another_release(
    series, tree, upstream_like_wheel, tmp_path
):
    other = tmp_path / upstream_like_wheel.name.replace(series.base().version, "0.1.0")
    shutil.copyfile(upstream_like_wheel, other)
    with pytest.raises(ForkError, match="based on vllm"):
        build_wheel(series, tree, other, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_refuses_a_wheel_whose_files_are_not_the_release(series, tree, tmp_path):
    changes = package_changes(tree, series)
    path = changes.replaced[0]
    odd = tmp_path / "odd.whl"
    with zipfile.ZipFile(odd, "w") as zf:
        zf.writestr(path, (tree / path).read_bytes())  # already patched
    with zipfile.ZipFile(odd) as zf, pytest.raises(ForkError, match="differs from"):
        check_against_release(zf, tree, changes)
    with zipfile.ZipFile(odd, "w") as zf:
        zf.writestr("vllm/__init__.py", b"")
    with zipfile.ZipFile(odd) as zf, pytest.raises(ForkError, match="has no"):
        check_against_release(zf, tree, changes)


def test_refuses_a_bad_label(series, tree, upstream_like_wheel, tmp_path):
    with pytest.raises(ForkError, match="not a version label"):
        build_wheel(series, tree, upstream_like_wheel, tmp_path, label="Fork-1")


def test_refuses_a_series_that_changes_kernel_sources(series, tree, tmp_path):
    clone = shared_clone(tree, tmp_path / "clone")
    kernel = commit_files(
        clone, "HEAD", {"csrc/cache_kernels.cu": "// changed\n"}, "touch a kernel"
    )
    git(clone, "update-ref", "HEAD", kernel)
    with pytest.raises(ForkError, match=r"csrc/cache_kernels\.cu .*compiled"):
        package_changes(clone, series)


def test_refuses_a_tree_not_built_from_the_series(series, tree, tmp_path):
    other = Series(tmp_path / "series")
    shutil.copytree(series.dir, other.dir)
    last = other.patches()[-1].path
    last.write_text(last.read_text() + "\n")
    with pytest.raises(ForkError, match="not built from"):
        build_wheel(other, tree, None, tmp_path / "out")


def test_cli_help_and_error_exit():
    script = Path(__file__).resolve().parents[2] / "scripts" / "ship" / "repack.py"
    helped = subprocess.run(
        [sys.executable, script, "--help"], capture_output=True, text=True
    )
    assert helped.returncode == 0 and "--upstream-wheel" in helped.stdout
    failed = subprocess.run(
        [sys.executable, script, "--upstream-wheel", "/nonexistent.whl"],
        capture_output=True,
        text=True,
    )
    assert failed.returncode == 1
    assert "error: --upstream-wheel /nonexistent.whl: no such file" in failed.stderr


@pytest.mark.slow
def test_real_upstream_wheel(series, tree, make_env, tmp_path):
    """Upstream's released wheel (244 MB for 0.20.2 on x86_64), from PyPI."""
    upstream = upstream_wheel(Path(sys.executable), series.base().version)
    out, _, changes = build_wheel(series, tree, upstream, tmp_path / "dist")
    diff = compare_wheels(upstream, out)
    assert set(diff.changed) == set(changes.replaced) | {
        "<dist-info>/METADATA",
        "<dist-info>/RECORD",
    }
    assert diff.added == changes.added and diff.removed == changes.deleted
    with zipfile.ZipFile(upstream) as a, zipfile.ZipFile(out) as b:
        kernels = [n for n in a.namelist() if n.endswith(".so")]
        assert kernels
        for name in kernels:
            assert a.getinfo(name).CRC == b.getinfo(name).CRC, name
            assert a.read(name) == b.read(name), name
    env = make_env()
    env.pip_install(out)
    assert env.record_problems() == []
    assert env.check_patched().is_relative_to(env.site)
    ids = reproducer_ids(series)
    assert env.run_tests(ids, tmp_path / "junit.xml") == dict.fromkeys(ids, "passed")
