"""make overlay: a build context that turns upstream's image into the fork's.

No Docker engine runs here. The context's content and Dockerfile are
checked without one, and the image build is simulated: the Dockerfile's own
COPY and RUN lines run against an environment where the upstream-like wheel
is installed, as vllm is in upstream's image.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lib.errors import ForkError
from lib.paths import OUTPUT_MARKER, ROOT
from ship.changes import base_content, package_changes, sha256_hex
from ship.container import (
    BASE_ARG,
    PAYLOAD,
    check_context,
    instructions,
    write_context,
)
from shipenv import patch_paths


@pytest.fixture
def context(series, tree, tmp_path) -> Path:
    return write_context(series, tree, tmp_path / "ctx")


def test_context_holds_the_series_files_and_passes_the_dry_check(series, tree, context):
    version = series.base().version
    assert check_context(context, version) == []
    steps = instructions((context / "Dockerfile").read_text())
    # The base image is a build argument (make image builds on a stand-in),
    # upstream's image by default: `docker build` alone builds on it.
    assert steps[0] == ("ARG", f"{BASE_ARG}=vllm/vllm-openai:v{version}")
    assert steps[1] == ("FROM", f"${{{BASE_ARG}}}")
    manifest = json.loads((context / PAYLOAD / "manifest.json").read_text())
    package = {p for p in patch_paths(series) if p.startswith("vllm/")}
    assert {f["path"] for f in manifest["files"]} == package
    for f in manifest["files"]:
        if f["action"] == "delete":
            continue
        shipped = (context / PAYLOAD / "files" / f["path"]).read_bytes()
        assert shipped == (tree / f["path"]).read_bytes()
        assert sha256_hex(shipped) == f["sha256"]
    installer = context / PAYLOAD / "install.py"
    assert (
        installer.read_bytes() == (ROOT / "scripts/ship/image_install.py").read_bytes()
    )
    # Only the payload and the Dockerfile: nothing to compile.
    assert sorted(p.name for p in context.iterdir()) == sorted(
        ["Dockerfile", PAYLOAD, OUTPUT_MARKER]
    )


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda d: d.replace(":v0", ":v9"), "want one stage, FROM"),
        (lambda d: d.replace("=vllm/vllm-openai", "=ubuntu"), "want one stage"),
        (lambda d: d.replace("ARG BASE_IMAGE=", "ARG OTHER="), "want one stage"),
        (lambda d: d.replace("FROM ${BASE_IMAGE}", "RUN true"), "start with FROM"),
        (lambda d: d + "FROM ubuntu:24.04\n", "want one stage"),
        (lambda d: d + "RUN pip install vllm\n", "RUN uses pip"),
        (lambda d: d + "RUN cmake -B build\n", "RUN uses cmake"),
        (lambda d: d + "COPY wheels/ /tmp/\n", "COPY wheels/: not in the context"),
        (lambda d: d + "COPY ../etc /tmp/\n", "COPY ../etc: not in the context"),
        (lambda d: d + "FOO bar\n", "unknown instruction FOO"),
        (lambda d: re.sub(r" && python3 -B -m vllm._fork", "", d), "checks them"),
        (lambda d: d + "RUN true \\\n", "line continuation"),
    ],
)
def test_dry_check_catches_a_broken_dockerfile(series, context, edit, problem):
    dockerfile = context / "Dockerfile"
    dockerfile.write_text(edit(dockerfile.read_text()))
    problems = check_context(context, series.base().version)
    assert any(problem in p for p in problems), problems


def test_dry_check_catches_a_changed_payload(series, context):
    manifest = json.loads((context / PAYLOAD / "manifest.json").read_text())
    first = next(f for f in manifest["files"] if f["action"] != "delete")
    (context / PAYLOAD / "files" / first["path"]).write_text("# not the fork's\n")
    problems = check_context(context, series.base().version)
    assert problems == [
        f"{context / PAYLOAD / 'files' / first['path']}: content does not match "
        "the manifest"
    ]


def test_never_empties_a_directory_it_did_not_write(series, tree, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    with pytest.raises(ForkError, match="was not written by vllm-fork"):
        write_context(series, tree, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    # Its own output it replaces, leaving nothing stale behind.
    ours = write_context(series, tree, tmp_path / "ours")
    (ours / "stale").write_text("from an older run")
    write_context(series, tree, ours)
    assert not (ours / "stale").exists()


def simulate_build(context: Path, python: Path, env) -> subprocess.CompletedProcess:
    """Run the Dockerfile's RUN lines, its COPY destinations mapped back to
    the context and python3 to `python`, as `docker build` would in the image."""
    copies: dict[str, Path] = {}
    script = []
    for keyword, args in instructions((context / "Dockerfile").read_text()):
        if keyword == "COPY":
            src, dest = shlex.split(args)
            copies[dest.rstrip("/")] = context / src.rstrip("/")
        elif keyword == "RUN":
            for dest, src in copies.items():
                args = args.replace(dest, str(src))
            script.append(args.replace("python3", f"{python} -P"))
    return env.run_shell(" && ".join(script))


def pyc_source_size(pyc: Path) -> int:
    """The source size a (timestamp-based) .pyc was compiled from."""
    return int.from_bytes(pyc.read_bytes()[12:16], "little")


# A fresh venv, a wheel installed and compiled: 45 s of make test's budget
# (make test-slow runs it; make image builds the real thing there too).
@pytest.mark.slow
def test_image_build_lays_the_files_over_upstream(
    series, tree, upstream_like_wheel, context, make_env
):
    image = make_env("image")
    image.pip_install(upstream_like_wheel)
    changes = package_changes(tree, series)
    core = image.site / "vllm" / "v1" / "core"
    compiled = image.run("-m", "compileall", "-q", str(core))
    assert compiled.returncode == 0, compiled.stderr
    before = image.run("-m", "vllm._fork")
    assert before.returncode != 0  # upstream's image is not the fork's

    # A file that is not the release's own: refused, and nothing changes.
    victim = image.site / changes.replaced[0]
    original = victim.read_bytes()
    victim.write_bytes(original + b"# local change\n")
    refused = simulate_build(context, image.python, image)
    assert refused.returncode != 0
    assert f"{victim} (replace;" in refused.stderr
    assert "nothing was changed" in refused.stderr
    for path in changes.replaced[1:]:
        assert (image.site / path).read_bytes() == base_content(tree, changes, path)
    assert not any((image.site / p).exists() for p in changes.added)
    victim.write_bytes(original)

    built = simulate_build(context, image.python, image)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "patched modules are imported" in built.stdout
    assert f"vLLM {series.base().version} with the series" in built.stdout
    assert "files the series changes match their build digests" in built.stdout
    for path in changes.shipped:
        assert (image.site / path).read_bytes() == (tree / path).read_bytes()
    for path in changes.replaced:
        # No stale bytecode: it was compiled again from the new source.
        src = image.site / path
        for pyc in (src.parent / "__pycache__").glob(f"{src.stem}.*.pyc"):
            assert pyc_source_size(pyc) == src.stat().st_size, pyc
    assert image.record_problems() == []
    installer = context / PAYLOAD / "install.py"
    again = image.run(str(installer), str(context / PAYLOAD))
    assert again.returncode == 0, again.stderr
    assert f"0 of {len(changes.shipped) + len(changes.deleted)} files" in again.stdout
    # A file changed in the image after the build: the self-check names it.
    victim = image.site / changes.replaced[0]
    victim.write_bytes(victim.read_bytes() + b"# changed in the image\n")
    tampered = image.run("-B", "-m", "vllm._fork")
    assert tampered.returncode == 1
    assert f"changed: {changes.replaced[0]}" in tampered.stderr
    assert "make overlay VERSION=" in tampered.stderr


def test_installer_refuses_another_vllm_version(
    series, upstream_like_wheel, context, make_env
):
    image = make_env("image")
    image.pip_install(upstream_like_wheel)
    manifest_path = context / PAYLOAD / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["version"] = "0.99.0"
    manifest_path.write_text(json.dumps(manifest))
    proc = image.run(str(context / PAYLOAD / "install.py"), str(context / PAYLOAD))
    assert proc.returncode == 1
    assert f"this image has vllm {series.base().version}" in proc.stderr


def test_cli_help():
    proc = subprocess.run(
        [sys.executable, ROOT / "scripts" / "ship" / "container.py", "--help"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "docker build" in proc.stdout
    installer = subprocess.run(
        [sys.executable, ROOT / "scripts" / "ship" / "image_install.py", "--help"],
        capture_output=True,
        text=True,
    )
    assert installer.returncode == 0 and "manifest.json" in installer.stdout
