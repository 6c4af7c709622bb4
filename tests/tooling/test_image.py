"""make image: make overlay's context built for real, the reproducers run in it.

The fast tests cover the logic without podman: the stand-in's recipe and its
cache key, the wheelhouses' target platform and stamps, the build arguments,
the check build's context, the messages when podman is missing or unusable,
and the in-image check's verdict (pytest's results, the vllm it imported,
the files' modes, the test tools it keeps).
test_make_image (slow, make test-slow) builds the default release's image.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from lib.errors import ForkError
from lib.paths import ROOT
from lib.testenv import read_junit
from ship import image, image_check, podman
from ship.container import (
    BASE_ARG,
    arg_defaults,
    expand_args,
    instructions,
    write_context,
)
from ship.image import (
    StandIn,
    check_summary,
    cpu_torch,
    download_args,
    human,
    overlay_layers,
    wheelhouse,
    write_check_context,
)
from ship.podman import (
    PODMAN_CONF_TEXT,
    Podman,
    containers_conf,
    ensure_tools,
    missing_tools_message,
    podman_version_problem,
    rlimit_hint,
    subuid_problem,
)
from shipenv import reproducer_ids

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
        StandIn("0.20.2", REQS, vllm_sha256="ab" * 32),  # another vllm wheel
        StandIn("0.20.2", REQS, torch_wheel="torch-2.13.0+cpu-cp311-x.whl"),
        StandIn("0.20.2", REQS, glibc="2.35"),
    ]
    assert len({recipe.key(), *(o.key() for o in others)}) == len(others) + 1
    # The root file system depends on Debian's side alone: mmdebstrap's command.
    assert StandIn("0.33.0", "x\n", torch="t").rootfs_key() == recipe.rootfs_key()
    debian = [
        StandIn("0.20.2", REQS, mirror="http://mirror.example/debian"),
        StandIn("0.20.2", REQS, suite="trixie"),
        StandIn("0.20.2", REQS, packages=("python3",)),
    ]
    assert len({recipe.rootfs_key(), *(d.rootfs_key() for d in debian)}) == 4
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
    # Bytecode Python uses without looking at the source: the overlay must
    # remove it, or the old code runs (the reproducers then fail).
    assert "compileall" in run and "--invalidation-mode unchecked-hash" in run
    assert ("ENTRYPOINT", '["vllm", "serve"]') in steps
    assert recipe.wheelhouse_reqs() == f"torch==2.13.0+cpu\n{REQS}"
    cmd = recipe.mmdebstrap_cmd(Path("/tmp/rootfs.tar"))
    assert cmd[:2] == ["mmdebstrap", "--variant=minbase"]
    assert "--include=python3,python3-pip,ca-certificates" in cmd
    assert cmd[-3:] == ["bookworm", "/tmp/rootfs.tar", "http://deb.debian.org/debian"]


def test_wheelhouses_are_for_the_standins_python_whatever_runs_pip(
    monkeypatch, tmp_path
):
    args = StandIn("0.20.2", REQS).download_args()
    assert args == download_args("3.11", "2.36")
    for flag in ("--python-version 3.11", "--implementation cp", "--abi cp311"):
        assert flag in " ".join(args)
    platforms = {args[i + 1] for i, a in enumerate(args) if a == "--platform"}
    # pip does not widen --platform: each older manylinux tag is named.
    assert {"manylinux_2_36_x86_64", "manylinux_2_28_x86_64"} <= platforms
    assert (
        "manylinux2014_x86_64" in platforms and "manylinux_2_37_x86_64" not in platforms
    )
    assert "--only-binary=:all:" in args
    calls = []
    monkeypatch.setattr(image, "pip_download", lambda py, d, a: calls.append(a))
    dest = tmp_path / "wheels"
    wheelhouse(Path("python"), dest, "pytest\n", args)
    wheelhouse(Path("python"), dest, "pytest\n", args)  # stamped: not again
    assert len(calls) == 1 and calls[0][2:] == args
    wheelhouse(Path("python"), dest, "pytest\n", download_args("3.12", "2.36"))
    assert len(calls) == 2  # another target Python: downloaded again


def test_torch_is_the_cpu_wheel_from_disk_never_pypis(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    wheel = tmp_path / "b" / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.touch()
    (tmp_path / "b" / "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    dirs = [tmp_path / "a", tmp_path / "b"]
    assert cpu_torch("torch==2.13.0", "3.11", dirs) == wheel
    assert cpu_torch("torch == 2.13.0+cpu", "3.11", dirs) == wheel
    with pytest.raises(ForkError, match="CPU wheel for Python 3.12.*CUDA build"):
        cpu_torch("torch==2.13.0", "3.12", dirs)
    with pytest.raises(ForkError, match="pinned as torch==X.Y.Z"):
        cpu_torch("torch>=2", "3.11", dirs)
    assert StandIn("0.20.2", REQS, torch="torch==2.13.0").torch_requirement() == (
        "torch==2.13.0+cpu"
    )


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
    # The label names the image built on, upstream's or the stand-in.
    after_from = steps[2:]
    assert after_from[0] == ("ARG", BASE_ARG)
    (label,) = [a for k, a in after_from if k == "LABEL"]
    assert f'org.opencontainers.image.base.name="${{{BASE_ARG}}}"' in label
    # The command to list make image's images, from any directory.
    line = podman.shell_cmd("images")
    assert line.startswith(f"CONTAINERS_CONF={(tmp_path / 'c.conf').resolve()} podman ")
    assert f"--root={(tmp_path / 'podman').resolve() / 'vfs' / 'storage'}" in line
    assert "--storage-driver=vfs" in line and line.endswith(" images")


def test_storage_driver_falls_back_to_vfs(monkeypatch, tmp_path):
    tried = []

    def works(self):
        tried.append(self.storage_driver)
        return self.storage_driver == "vfs"

    monkeypatch.setattr(Podman, "works", works)
    assert podman.choose_podman("auto", tmp_path / "c.conf").storage_driver == "vfs"
    assert tried == ["overlay", "vfs"]
    with pytest.raises(ForkError, match="storage driver overlay: `podman --root="):
        podman.choose_podman("overlay", tmp_path / "c.conf")


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
    assert "--manifest /opt/vllm-fork/manifest.json" in run
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


def test_unusable_podman_says_what_to_do(tmp_path):
    assert podman_version_problem("podman version 4.3.1\n") is None
    assert podman_version_problem("podman version 5.0.0") is None
    assert "needs podman >= 4.0" in podman_version_problem("podman version 3.4.4")
    assert "cannot read" in podman_version_problem("what")
    subuid, subgid = tmp_path / "subuid", tmp_path / "subgid"
    subuid.write_text("alice:100000:65536\n")
    subgid.write_text("1000:100000:65536\n")
    assert subuid_problem("alice", 1000, subuid, subgid) is None
    problem = subuid_problem("bob", 1001, subuid, subgid)
    assert f"{subuid} and {subgid}" in problem
    assert "usermod --add-subuids 100000-165535 --add-subgids 100000-165535 bob" in (
        problem
    )
    assert "subgid" in subuid_problem("alice", 1000, subuid, tmp_path / "none")
    with pytest.raises(ForkError, match="apt-get install -y debian-archive-keyring"):
        podman.check_debian_keyring(tmp_path / "keyring.gpg")
    # The containers.conf podman was given, not the caller's environment.
    hint = rlimit_hint("setrlimit RLIMIT_NOFILE", {"CONTAINERS_CONF": "/x.conf"})
    assert "(/x.conf) must hold" in hint and "default_ulimits = []" in hint
    assert rlimit_hint("other", {"CONTAINERS_CONF": "/x.conf"}) == ""


def test_containers_conf(monkeypatch, tmp_path):
    monkeypatch.setattr(podman, "PODMAN_CONF", tmp_path / "podman" / "c.conf")
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
    assert human(999) == "999 B" and human(1_600_000) == "1.6 MB"
    assert human(3_236_197_740) == "3.2 GB" and human(5_000_000_000_000) == "5000.0 GB"


def write_junit(path: Path) -> None:
    suite = ET.Element("testsuite")
    cases = [
        ("tests.reproducers.test_a", "test_one", None),
        ("tests.reproducers.test_a", "test_two[x-y]", "failure"),
        ("tests.reproducers.test_b.TestK", "test_three", "skipped"),
        ("tests.reproducers.test_b", "test_four", "error"),
        # passed, then an error in teardown: reported twice
        ("tests.reproducers.test_b", "test_five", None),
        ("tests.reproducers.test_b", "test_five", "error"),
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
    assert ours["tests/reproducers/test_b.py::test_five"] == "error"  # the worst
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


def fake_vllm(where: Path) -> Path:
    pkg = where / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    return pkg


def write_probe(path: Path, vllm: Path | None) -> Path:
    file = str(vllm / "__init__.py") if vllm else None
    path.write_text(json.dumps({"vllm": file}))
    return path


def test_in_image_check_verdict_end_to_end(tmp_path):
    """image_check.judge on what pytest and the probe plugin leave behind."""
    site_dir = tmp_path / "site-packages"
    image_vllm = fake_vllm(site_dir)
    sites = [site_dir]
    junit = tmp_path / "junit.xml"
    write_junit(junit)
    probe = write_probe(tmp_path / "probe.json", image_vllm)
    passed = ["tests/reproducers/test_a.py::test_one"]
    assert image_check.judge(passed, junit, 0, probe, image_vllm, sites) == []
    # A failing test.
    failing = [*passed, "tests/reproducers/test_a.py::test_two[x-y]"]
    assert image_check.judge(failing, junit, 1, probe, image_vllm, sites) == [
        "tests/reproducers/test_a.py::test_two[x-y]: failed"
    ]
    # No test at all (pytest exit 5), its JUnit file empty.
    empty = tmp_path / "empty.xml"
    ET.ElementTree(ET.Element("testsuite")).write(empty)
    problems = image_check.judge(passed, empty, 5, probe, image_vllm, sites)
    assert problems == [
        "pytest collected no test (exit 5)",
        "tests/reproducers/test_a.py::test_one: not run",
    ]
    # pytest failed although every named test passed (e.g. a session error).
    assert (
        "pytest failed (exit 3)"
        in image_check.judge(passed, junit, 3, probe, image_vllm, sites)[0]
    )
    # A vllm on a path of its own shadowed the image's.
    shadow = fake_vllm(tmp_path / "shadow")
    shadowed = write_probe(tmp_path / "shadowed.json", shadow)
    problems = image_check.judge(passed, junit, 0, shadowed, image_vllm, sites)
    assert problems == [
        f"the tests imported vllm from {shadow}, not the image's {image_vllm}",
        f"the tests' vllm ({shadow}) is in none of the image's site-packages "
        f"({site_dir})",
    ]
    # vllm never imported, or the probe never ran.
    none = write_probe(tmp_path / "none.json", None)
    assert image_check.judge(passed, junit, 0, none, image_vllm, sites) == [
        "the tests never imported vllm"
    ]
    missing = tmp_path / "missing.json"
    assert (
        "probe plugin did not run"
        in image_check.judge(passed, junit, 0, missing, image_vllm, sites)[0]
    )


def test_probe_plugin_records_the_vllm_pytest_imported(tmp_path):
    """The probe, run in a real pytest process with a shadowing vllm first
    on the path: it records the shadow, which judge then refuses."""
    shadow = fake_vllm(tmp_path / "shadow")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / f"{image_check.PROBE_PLUGIN}.py").write_text(image_check.PROBE_SOURCE)
    (tmp_path / "test_x.py").write_text("import vllm\n\ndef test_x():\n    pass\n")
    probe = tmp_path / "probe.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), str(plugins)]),
        image_check.PROBE_ENV: str(probe),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", image_check.PROBE_PLUGIN,
         "-p", "no:cacheprovider", "-c", os.devnull, "test_x.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(probe.read_text())["vllm"] == str(shadow / "__init__.py")
    image_vllm = tmp_path / "site" / "vllm"
    problems = image_check.judge(
        [], tmp_path / "j.xml", 0, probe, image_vllm, [tmp_path / "site"]
    )
    assert len(problems) == 2 and str(shadow) in problems[0]


def test_in_image_check_wants_the_overlay_world_readable(tmp_path):
    site_dir = tmp_path / "site"
    (site_dir / "vllm" / "sub").mkdir(parents=True)
    for name in ("vllm/a.py", "vllm/sub/b.py"):
        (site_dir / name).write_text("")
        (site_dir / name).chmod(0o644)
    manifest = {
        "files": [
            {"path": "vllm/a.py", "action": "replace"},
            {"path": "vllm/sub/b.py", "action": "add"},
            {"path": "vllm/gone.py", "action": "delete"},
        ]
    }
    (site_dir / "vllm").chmod(0o755)
    (site_dir / "vllm" / "sub").chmod(0o755)
    assert image_check.unreadable(site_dir, manifest) == []
    (site_dir / "vllm" / "a.py").chmod(0o600)
    (site_dir / "vllm" / "sub").chmod(0o750)
    assert image_check.unreadable(site_dir, manifest) == [
        f"{site_dir / 'vllm' / 'a.py'}: not world-readable",
        f"{site_dir / 'vllm' / 'sub'}/: not world-readable and traversable",
    ]
    (site_dir / "vllm" / "sub").chmod(0o755)
    (site_dir / "vllm" / "sub" / "b.py").unlink()
    assert f"{site_dir / 'vllm' / 'sub' / 'b.py'}: missing" in image_check.unreadable(
        site_dir, manifest
    )


def test_in_image_check_keeps_the_images_own_packages(tmp_path):
    """pip install --target puts packaging & co. into the tools directory
    even where the image has them; they are removed, the others stay."""
    tools = tmp_path / "tools"
    for name, version in (("packaging", "1.0"), ("zz-fork-only-tool", "1.0")):
        mod = name.replace("-", "_")
        info = tools / f"{mod}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Name: {name}\nVersion: {version}\n")
        (tools / mod).mkdir()
        (tools / mod / "__init__.py").write_text("")
        record = [
            f"{mod}/__init__.py,,",
            f"{info.name}/METADATA,,",
            f"{info.name}/RECORD,,",
        ]
        (info / "RECORD").write_text("\n".join(record) + "\n")
    assert image_check.drop_installed(tools) == ["packaging"]
    assert sorted(p.name for p in tools.iterdir()) == [
        "zz_fork_only_tool",
        "zz_fork_only_tool-1.0.dist-info",
    ]
    assert site.getsitepackages()  # the check compares against these


def test_cli_help():
    for script in ("image.py", "image_check.py"):
        proc = subprocess.run(
            [sys.executable, ROOT / "scripts" / "ship" / script, "--help"],
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
        [
            sys.executable,
            ROOT / "scripts" / "ship" / "image.py",
            "--series",
            series.dir,
        ],
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
