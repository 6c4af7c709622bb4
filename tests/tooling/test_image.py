"""make image: make overlay's context built for real, the reproducers run in it.

The fast tests cover the logic without podman: the stand-in's recipe and its
cache key, the build arguments, the check build's context, the messages when
podman is missing, and the in-image check's reading of pytest's results.
test_make_image (slow, make test-slow) builds the default release's image.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import image
import image_check
from common import ROOT, ForkError
from container import BASE_ARG, arg_defaults, expand_args, instructions, write_context
from image import (
    PODMAN_CONF_TEXT,
    Podman,
    StandIn,
    check_summary,
    containers_conf,
    ensure_tools,
    missing_tools_message,
    overlay_layers,
    write_check_context,
)
from shipenv import reproducer_ids
from testenv import read_junit

REQS = "numpy\ntransformers >= 4.56.0\n"


def test_standin_key_follows_what_goes_into_the_image():
    recipe = StandIn("0.20.2", REQS)
    assert recipe.key() == StandIn("0.20.2", REQS).key()  # stable: cached
    others = [
        StandIn("0.20.3", REQS),
        StandIn("0.20.2", REQS + "msgspec\n"),
        StandIn("0.20.2", REQS, torch="torch==2.12.0"),
        StandIn("0.20.2", REQS, uv="uv==0.1.0"),
        StandIn("0.20.2", REQS, packages=("python3", "python3-pip", "curl")),
        StandIn("0.20.2", REQS, suite="trixie"),
    ]
    assert len({recipe.key(), *(o.key() for o in others)}) == len(others) + 1
    # The root file system depends on Debian's side alone.
    assert StandIn("0.33.0", "x\n", torch="t").rootfs_key() == recipe.rootfs_key()
    assert recipe.tag == f"localhost/vllm-fork-standin:0.20.2-{recipe.key()}"
    assert recipe.rootfs_tag.startswith("localhost/vllm-fork-rootfs:bookworm-")


def test_standin_installs_upstreams_wheel_as_upstreams_dockerfile_does():
    recipe = StandIn("0.20.2", REQS)
    steps = instructions(recipe.dockerfile())
    assert steps[0] == ("ARG", f"ROOTFS={recipe.rootfs_tag}")
    assert steps[1] == ("FROM", "${ROOTFS}")
    runs = [args for keyword, args in steps if keyword == "RUN"]
    assert len(runs) == 1  # one layer
    (run,) = runs
    assert "--mount=type=bind,source=wheels,target=/tmp/wheels" in run
    assert "uv pip install --system" in run and "--no-index" in run
    assert "--no-deps /tmp/wheels/vllm-0.20.2-*.whl" in run
    assert "compileall" in run  # stale bytecode for the overlay to deal with
    assert ("ENTRYPOINT", '["vllm", "serve"]') in steps
    assert recipe.wheelhouse_reqs() == f"{recipe.torch}\n{REQS}"
    cmd = recipe.mmdebstrap_cmd(Path("/tmp/rootfs.tar"))
    assert cmd[:2] == ["mmdebstrap", "--variant=minbase"]
    assert "--include=python3,python3-pip,ca-certificates" in cmd
    assert cmd[-3:] == ["bookworm", "/tmp/rootfs.tar", "http://deb.debian.org/debian"]


def test_overlay_context_takes_the_base_image_as_a_build_arg(series, tree, tmp_path):
    context = write_context(series, tree, tmp_path / "ctx")
    version = series.base().version
    steps = instructions((context / "Dockerfile").read_text())
    assert steps[0] == ("ARG", f"{BASE_ARG}=vllm/vllm-openai:v{version}")
    assert steps[1] == ("FROM", f"${{{BASE_ARG}}}")
    defaults = arg_defaults(steps[:1])
    # docker build without --build-arg: upstream's image.
    assert expand_args(steps[1][1], defaults) == f"vllm/vllm-openai:v{version}"
    # make image: the stand-in.
    standin = "localhost/vllm-fork-standin:x"
    assert expand_args(steps[1][1], {**defaults, BASE_ARG: standin}) == standin
    podman = Podman("vfs", tmp_path / "c.conf", tmp_path / "podman")
    cmd = podman.build_cmd(context, "localhost/t:1", {BASE_ARG: standin})
    assert cmd[:4] == [
        "podman",
        f"--root={tmp_path / 'podman' / 'vfs' / 'storage'}",
        f"--runroot={tmp_path / 'podman' / 'vfs' / 'run'}",
        "--storage-driver=vfs",
    ]
    assert cmd[4:6] == ["build", "--isolation=chroot"]
    assert podman.env() == {"CONTAINERS_CONF": str(tmp_path / "c.conf")}
    assert f"{BASE_ARG}={standin}" in cmd
    assert cmd[-3:] == ["-t", "localhost/t:1", str(context)]


def test_storage_driver_falls_back_to_vfs(monkeypatch, tmp_path):
    tried = []

    def works(self):
        tried.append(self.storage_driver)
        return self.storage_driver == "vfs"

    monkeypatch.setattr(Podman, "works", works)
    assert image.choose_podman("auto", tmp_path / "c.conf").storage_driver == "vfs"
    assert tried == ["overlay", "vfs"]
    with pytest.raises(ForkError, match="storage driver overlay: `podman --root="):
        image.choose_podman("overlay", tmp_path / "c.conf")


def test_expand_args():
    defaults = {"A": "x", "B": "y"}
    assert expand_args("${A}:$B/${C}", defaults) == "x:y/${C}"
    assert arg_defaults([("ARG", "A=1"), ("ARG", "B"), ("ARG", 'C="q"')]) == {
        "A": "1",
        "C": "q",
    }


def test_check_context_holds_the_reproducers_and_not_the_users_context(
    series, tmp_path
):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("pytest\n")
    ctx = write_check_context(series, tmp_path / "check", wheels)
    ids = reproducer_ids(series)
    assert (ctx / "ids.txt").read_text().split() == ids
    for file in {i.split("::")[0] for i in ids}:
        assert (ctx / file).read_bytes() == (ROOT / file).read_bytes()
    assert (ctx / "tests" / "conftest.py").is_file()
    assert (ctx / "tests" / "harness" / "engine.py").is_file()
    assert (ctx / "tests" / "upstream_env" / "fork_upstream_plugin.py").is_file()
    assert (ctx / "image_check.py").read_bytes() == image.CHECK_SCRIPT.read_bytes()
    assert any((ctx / "hf" / "hub").iterdir())
    assert (ctx / "wheels" / "requirements.txt").read_text() == "pytest\n"
    # Only the named reproducer files, none of the others.
    shipped = {p.name for p in (ctx / "tests" / "reproducers").iterdir()}
    assert shipped == {Path(i.split("::")[0]).name for i in ids}
    steps = instructions((ctx / "Dockerfile").read_text())
    assert steps[:2] == [("ARG", "IMAGE"), ("FROM", "${IMAGE}")]
    (run,) = [a for k, a in steps if k == "RUN"]
    assert f"target={image.CHECK_MOUNT}" in run and "image_check.py" in run
    assert not list(ctx.rglob("__pycache__"))


def test_missing_podman_says_what_to_install():
    as_root = missing_tools_message(["podman"], is_root=True, has_apt=True)
    assert "apt-get update && apt-get install -y podman" in as_root
    user = missing_tools_message(["podman", "mmdebstrap"], False, True)
    assert "sudo apt-get install -y podman mmdebstrap" in user
    other = missing_tools_message(["podman"], False, False)
    assert "install podman with your system's package manager" in other


def test_ensure_tools_does_not_install_when_told_not_to(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ForkError, match="needs podman, which is not on PATH"):
        ensure_tools(["podman"], install=False)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    ensure_tools(["podman"], install=False)  # present: nothing to do


def test_containers_conf(monkeypatch, tmp_path):
    monkeypatch.setattr(image, "PODMAN_CONF", tmp_path / "podman" / "c.conf")
    monkeypatch.delenv("CONTAINERS_CONF", raising=False)
    conf = containers_conf()
    assert conf == tmp_path / "podman" / "c.conf"
    assert conf.read_text() == PODMAN_CONF_TEXT
    assert "default_ulimits = []" in PODMAN_CONF_TEXT
    mine = tmp_path / "mine.conf"
    mine.write_text("[containers]\n")
    monkeypatch.setenv("CONTAINERS_CONF", str(mine))
    assert containers_conf() == mine  # the user's own is left alone
    monkeypatch.setenv("CONTAINERS_CONF", str(tmp_path / "none.conf"))
    with pytest.raises(ForkError, match="none.conf, which does not exist"):
        containers_conf()


def test_overlay_layers_and_summary():
    # newest first: two layers of the overlay on a two-layer stand-in
    assert overlay_layers([300, 200, 5000, 7000], [5000, 7000]) == 500
    with pytest.raises(ForkError):
        overlay_layers([1], [1, 2])
    out = (
        "STEP 2/2: RUN ...\n"
        "39 passed in 20.1s\n"
        f"{image_check.SUMMARY_PREFIX} 39 of 39 reproducer tests passed (10 files)\n"
        "COMMIT localhost/x\n"
    )
    assert check_summary(out) == "39 of 39 reproducer tests passed (10 files)"
    assert check_summary(f"    | {image_check.SUMMARY_PREFIX} ok\n") == "ok"
    with pytest.raises(ForkError, match="no summary"):
        check_summary("nothing\n")


def write_junit(path: Path) -> None:
    suite = ET.Element("testsuite")
    cases = [
        ("tests.reproducers.test_a", "test_one", None),
        ("tests.reproducers.test_a", "test_two[x-y]", "failure"),
        ("tests.reproducers.test_b.TestK", "test_three", "skipped"),
        ("tests.reproducers.test_b", "test_four", "error"),
    ]
    for classname, name, child in cases:
        case = ET.SubElement(suite, "testcase", classname=classname, name=name)
        case.set("file", classname.split(".TestK")[0].replace(".", "/") + ".py")
        if child:
            ET.SubElement(case, child, message="m")
    ET.ElementTree(suite).write(path)


def test_in_image_check_reads_junit_as_the_project_does(tmp_path):
    junit = tmp_path / "junit.xml"
    write_junit(junit)
    ours = image_check.read_junit(junit)
    assert ours == read_junit(junit)
    assert ours["tests/reproducers/test_a.py::test_one"] == "passed"
    assert ours["tests/reproducers/test_b.py::TestK::test_three"] == "skipped"
    ids = [
        "tests/reproducers/test_a.py::test_one",
        "tests/reproducers/test_a.py::test_two[x-y]",
        "tests/reproducers/test_c.py::test_missing",
    ]
    assert image_check.verdict(ids, ours) == [
        "tests/reproducers/test_a.py::test_two[x-y]: failed",
        "tests/reproducers/test_c.py::test_missing: not run",
    ]
    assert image_check.verdict(ids[:1], ours) == []


def test_cli_help():
    for script in ("image.py", "image_check.py"):
        proc = subprocess.run(
            [sys.executable, ROOT / "scripts" / script, "--help"],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
        assert "reproducer" in proc.stdout


def podman_available() -> bool:
    if shutil.which("podman"):
        return True
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


@pytest.mark.slow
@pytest.mark.skipif(
    not podman_available(),
    reason="podman is not installed and cannot be (not root, or no apt-get): "
    "apt-get install podman mmdebstrap",
)
def test_make_image(series):
    """The default release's image: stand-in (cached after the first run),
    the overlay built on it, the reproducers passing inside."""
    proc = subprocess.run(
        [sys.executable, ROOT / "scripts" / "image.py", "--series", series.dir],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    ids = reproducer_ids(series)
    assert f"{len(ids)} of {len(ids)} reproducer tests passed" in proc.stderr
    assert "patched modules are imported" in proc.stderr
    tag = proc.stdout.strip().splitlines()[-1]
    assert tag.endswith("-standin") and series.base().version in tag
