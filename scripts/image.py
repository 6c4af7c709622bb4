#!/usr/bin/env python3
"""Build `make overlay`'s context into a real image and run the reproducers in it.

`make overlay` writes a build context FROM upstream's image
(vllm/vllm-openai:v<version>), and checks it without an engine. This builds
it for real, with podman, on a local stand-in for upstream's image (which
cannot be pulled here), in three builds:

  1. the stand-in (built once, then cached as a podman image whose tag is
     keyed by the release and a hash of its recipe): a Debian root file
     system from Debian's packages (mmdebstrap), Python 3 and pip from
     Debian, and upstream's released vllm wheel of the same release
     installed as upstream's Dockerfile installs it (`uv pip install
     --system`), with the project's CPU torch and vLLM's
     requirements/common.txt from a wheelhouse downloaded here beforehand;
  2. the overlay: dist/container-v<version>/ exactly as `make overlay`
     writes it, with --build-arg BASE_IMAGE=<stand-in>; its own RUN checks
     the files and ends with `python3 -m vllm._fork`;
  3. the check, FROM the overlay's image: a build of its own, from
     .work/image/check-v<version>/ (not part of the user's context), that
     runs every test the patches name in a `Reproducer:` trailer against the
     vllm installed in the image (scripts/image_check.py); it fails the
     build unless they all pass, and its image is removed afterwards.

Then it prints the stand-in's size, the fork image's size and the overlay
layers' size. `podman run` is not needed (the checks are RUN steps of a
build). Podman and mmdebstrap are installed with apt-get when missing and
running as root; otherwise the command to install them is printed. The
podman settings this machine needs (default_ulimits = [], chroot isolation)
are written to .cache/podman/containers.conf unless CONTAINERS_CONF is set;
the images are kept in a podman storage of make image's own,
.cache/podman/<driver>/ (overlay where podman can use it, else vfs).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from changes import ship_tree
from common import (
    CACHE,
    DEFAULT_SERIES,
    DIST,
    ROOT,
    WORK,
    ForkError,
    fresh_output_dir,
    main_guard,
    parser,
    rel,
    run,
    say,
    step,
)
from container import (
    BASE_ARG,
    check_context,
    image_tag,
    upstream_image,
    write_context,
)
from image_check import SUMMARY_PREFIX
from install import upstream_wheel
from repack import local_label
from series import Series
from testenv import build_hf_cache
from venv import DEFAULT_TORCH, TEST_REQS, adapted_requirements, ensure_venv

# The stand-in's root file system: Debian's packages only.
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_PACKAGES = ("python3", "python3-pip", "ca-certificates")
# Debian bookworm's python3 is 3.11; the wheelhouse is resolved for it.
STANDIN_PYTHON = "3.11"
# The installer upstream's Dockerfile uses (`uv pip install --system`).
UV_SPEC = "uv==0.13.9"
# What the in-image check installs into a directory of its own.
CHECK_REQS = [r for r in TEST_REQS if not r.startswith("ruff")]
CHECK_SCRIPT = ROOT / "scripts" / "image_check.py"
CHECK_MOUNT = "/opt/vllm-fork-check"
IMAGE_CACHE = CACHE / "image"
IMAGE_WORK = WORK / "image"
LOGS = WORK / "logs"
PODMAN_CONF = CACHE / "podman" / "containers.conf"
# Without it, every RUN fails here: "setrlimit RLIMIT_NOFILE: Operation not
# permitted" (the container may not raise its open-files limit).
PODMAN_CONF_TEXT = "[containers]\ndefault_ulimits = []\n"
# make image keeps its images in a podman storage of its own (one per
# driver), so it never meets the settings of the user's podman storage.
PODMAN_STORAGE = CACHE / "podman"
# overlay where the kernel (or fuse-overlayfs) allows it; vfs works
# everywhere, but copies the whole file system for every layer.
STORAGE_DRIVERS = ("overlay", "vfs")


def short_hash(data: object) -> str:
    text = json.dumps(data, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class StandIn:
    """The recipe of the stand-in for upstream's image of one release.

    Everything that goes into the image is named here, so that its hash
    keys the cached image: the same recipe is never built twice, a changed
    one (another torch, a new common.txt, another package) is.
    """

    version: str
    requirements: str  # vLLM's requirements/common.txt, adapted as .venv's
    torch: str = DEFAULT_TORCH
    uv: str = UV_SPEC
    suite: str = DEBIAN_SUITE
    mirror: str = DEBIAN_MIRROR
    packages: tuple[str, ...] = DEBIAN_PACKAGES
    python: str = STANDIN_PYTHON

    def rootfs_key(self) -> str:
        return short_hash(["minbase", self.suite, self.mirror, list(self.packages)])

    def key(self) -> str:
        return short_hash(
            [
                self.rootfs_key(),
                self.version,
                self.requirements,
                self.torch,
                self.uv,
                self.python,
                self.dockerfile(),
            ]
        )

    @property
    def rootfs_tag(self) -> str:
        return f"localhost/vllm-fork-rootfs:{self.suite}-{self.rootfs_key()}"

    @property
    def tag(self) -> str:
        return f"localhost/vllm-fork-standin:{self.version}-{self.key()}"

    def mmdebstrap_cmd(self, out: Path) -> list[str]:
        return [
            "mmdebstrap",
            "--variant=minbase",
            f"--include={','.join(self.packages)}",
            self.suite,
            str(out),
            self.mirror,
        ]

    def wheelhouse_reqs(self) -> str:
        """requirements.txt of the wheelhouse (vllm itself goes --no-deps)."""
        return f"{self.torch}\n{self.requirements}"

    def dockerfile(self) -> str:
        uv = (
            "uv pip install --system --break-system-packages --no-cache "
            "--no-index --find-links /tmp/wheels"
        )
        return f"""\
# Stand-in for {upstream_image(self.version)}, written by `make image`
# (scripts/image.py): Debian {self.suite}'s Python with upstream's released
# vllm {self.version} wheel, installed as upstream's docker/Dockerfile does
# (uv pip install --system), with a CPU torch instead of the CUDA set.
ARG ROOTFS={self.rootfs_tag}
FROM ${{ROOTFS}}
ENV DEBIAN_FRONTEND=noninteractive UV_LINK_MODE=copy
WORKDIR /vllm-workspace
# One RUN, one layer; the wheels are mounted, not copied into the image.
# Bytecode is compiled for vllm so that the overlay must deal with stale
# .pyc files (uv leaves none by default: the harder case is tested).
RUN --mount=type=bind,source=wheels,target=/tmp/wheels \\
    python3 -m pip install -q --break-system-packages --no-cache-dir \\
        --no-index --find-links /tmp/wheels {self.uv} \\
    && {uv} -r /tmp/wheels/requirements.txt \\
    && {uv} --no-deps /tmp/wheels/vllm-{self.version}-*.whl \\
    && python3 -m compileall -q -j 0 \\
        "$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/vllm" \\
    && python3 -c 'import importlib.metadata as m; print("vllm", m.version("vllm"))'
ENV VLLM_USAGE_SOURCE=production-docker-image
ENTRYPOINT ["vllm", "serve"]
"""


def check_dockerfile() -> str:
    return f"""\
# The reproducer check of `make image` (scripts/image.py), FROM the image
# built from make overlay's context. Not part of that context: nothing of
# this build goes into the fork's image.
ARG IMAGE
FROM ${{IMAGE}}
RUN --mount=type=bind,source=.,target={CHECK_MOUNT} \\
    python3 {CHECK_MOUNT}/image_check.py {CHECK_MOUNT}
"""


def reproducer_ids(series: Series) -> list[str]:
    return [t for p in series.patches() for t in p.reproducers()]


def write_check_context(series: Series, out: Path, wheels: Path) -> Path:
    """The check build's context: the reproducers and what they import."""
    ids = reproducer_ids(series)
    if not ids:
        raise ForkError(
            f"no patch in {rel(series.dir)}/ names a Reproducer: nothing to check"
        )
    fresh_output_dir(out, "image check context")
    tests = ROOT / "tests"
    (out / "tests" / "reproducers").mkdir(parents=True)
    shutil.copyfile(tests / "conftest.py", out / "tests" / "conftest.py")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("harness", "upstream_env"):
        shutil.copytree(tests / name, out / "tests" / name, ignore=ignore)
    for file in sorted({i.split("::")[0] for i in ids}):
        if not (ROOT / file).is_file():
            raise ForkError(f"a Reproducer trailer names {file}, which is missing")
        shutil.copyfile(ROOT / file, out / file)
    shutil.copyfile(ROOT / "pyproject.toml", out / "pyproject.toml")
    shutil.copyfile(CHECK_SCRIPT, out / "image_check.py")
    (out / "ids.txt").write_text("\n".join(ids) + "\n")
    build_hf_cache(out / "hf")
    shutil.copytree(wheels, out / "wheels")
    (out / "Dockerfile").write_text(check_dockerfile())
    return out


def missing_tools_message(tools: list[str], is_root: bool, has_apt: bool) -> str:
    """What to do when podman (or mmdebstrap) is not installed."""
    names = " ".join(tools)
    if has_apt and is_root:
        how = f"apt-get update && apt-get install -y {names}"
    elif has_apt:
        how = f"sudo apt-get update && sudo apt-get install -y {names}"
    else:
        how = f"install {names} with your system's package manager"
    return (
        f"`make image` needs {names}, which is not on PATH. Install it with:\n"
        f"  {how}\n"
        "(Debian bookworm's podman 4.3 is enough; `make image` installs it itself "
        "when it runs as root on a system with apt-get.)"
    )


def ensure_tools(tools: list[str], install: bool) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if not missing:
        return
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    has_apt = shutil.which("apt-get") is not None
    if not (install and is_root and has_apt):
        raise ForkError(missing_tools_message(missing, is_root, has_apt))
    step(f"installing {' '.join(missing)} (apt-get)")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", *missing], env=env)
    still = [t for t in missing if shutil.which(t) is None]
    if still:
        raise ForkError(f"apt-get installed no {' '.join(still)}")


def containers_conf() -> Path:
    """The containers.conf podman uses: CONTAINERS_CONF's, or ours."""
    given = os.environ.get("CONTAINERS_CONF")
    if given:
        if not Path(given).is_file():
            raise ForkError(
                f"CONTAINERS_CONF names {given}, which does not exist: unset it "
                f"to use {rel(PODMAN_CONF)}, or create it with:\n{PODMAN_CONF_TEXT}"
            )
        return Path(given)
    PODMAN_CONF.parent.mkdir(parents=True, exist_ok=True)
    if not PODMAN_CONF.is_file() or PODMAN_CONF.read_text() != PODMAN_CONF_TEXT:
        PODMAN_CONF.write_text(PODMAN_CONF_TEXT)
    return PODMAN_CONF


@dataclass
class Podman:
    """podman with this machine's settings, its output logged."""

    storage_driver: str = "overlay"
    conf: Path = field(default_factory=lambda: PODMAN_CONF)
    storage: Path = PODMAN_STORAGE

    def env(self) -> dict[str, str]:
        return {"CONTAINERS_CONF": str(self.conf)}

    def global_args(self) -> list[str]:
        where = self.storage / self.storage_driver
        return [
            f"--root={where / 'storage'}",
            f"--runroot={where / 'run'}",
            f"--storage-driver={self.storage_driver}",
        ]

    def cmd(self, *args: str | Path) -> list[str]:
        return ["podman", *self.global_args(), *map(str, args)]

    def works(self) -> bool:
        """Whether podman can open its storage with this driver."""
        proc = run(self.cmd("info"), env=self.env(), check=False)
        return proc.returncode == 0

    def output(self, *args: str | Path) -> str:
        return run(self.cmd(*args), env=self.env()).stdout

    def exists(self, tag: str) -> bool:
        proc = run(self.cmd("image", "exists", tag), env=self.env(), check=False)
        return proc.returncode == 0

    def size(self, tag: str) -> int:
        return int(self.output("image", "inspect", "--format", "{{.Size}}", tag))

    def layer_sizes(self, tag: str) -> list[int]:
        """Sizes of the image's layers, newest first (`podman history`)."""
        history = json.loads(self.output("history", "--format", "json", tag))
        return [int(h.get("size", 0)) for h in history]

    def build_cmd(
        self, context: Path, tag: str, build_args: dict[str, str], layers: bool = True
    ) -> list[str]:
        args = ["build", "--isolation=chroot", f"--layers={str(layers).lower()}"]
        for name, value in build_args.items():
            args += ["--build-arg", f"{name}={value}"]
        return self.cmd(*args, "-t", tag, context)

    def build(
        self,
        context: Path,
        tag: str,
        build_args: dict[str, str],
        log: Path,
        layers: bool = True,
    ) -> str:
        """Build, echoing podman's output and logging it; return the output."""
        cmd = self.build_cmd(context, tag, build_args, layers)
        return stream(cmd, self.env(), log, f"podman build of {tag}")


def choose_podman(driver: str, conf: Path) -> Podman:
    """podman with `driver`, or with the first that works for "auto"."""
    for name in STORAGE_DRIVERS if driver == "auto" else (driver,):
        podman = Podman(name, conf)
        if podman.works():
            return podman
        say(f"    podman cannot use the {name} storage driver here")
    tried = ", ".join(STORAGE_DRIVERS) if driver == "auto" else driver
    last = Podman(STORAGE_DRIVERS[-1] if driver == "auto" else driver, conf)
    raise ForkError(
        f"podman cannot open its storage in {rel(PODMAN_STORAGE)}/ with the "
        f"storage driver {tried}: `{' '.join(last.cmd('info'))}` says why"
    )


def stream(cmd: list[str], env: dict[str, str], log: Path, what: str) -> str:
    """Run `cmd`, its output to the terminal (indented) and to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    say(f"    $ {' '.join(cmd)}")
    lines = []
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            lines.append(line)
            say("    | " + line.rstrip("\n"))
        code = proc.wait()
    text = "".join(lines)
    if code != 0:
        hint = ""
        if "RLIMIT_NOFILE" in text:
            hint = (
                f"\nThe containers.conf in use ({os.environ.get('CONTAINERS_CONF')}"
                f") must hold:\n{PODMAN_CONF_TEXT}"
            )
        raise ForkError(f"{what} failed (exit {code}); full log: {rel(log)}{hint}")
    return text


def pip_download(python: Path, dest: Path, args: list[str]) -> None:
    run(
        [
            python,
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "--only-binary",
            ":all:",
            "-d",
            dest,
            *args,
        ],
        capture=False,
    )


def wheelhouse(python: Path, dest: Path, requirements: str, extra: list[str]) -> Path:
    """Download the wheels `requirements` need into `dest` (once: a stamp
    records what was downloaded) and write dest/requirements.txt."""
    stamp = dest / ".fork-wheels.stamp"
    digest = short_hash([requirements, extra])
    if stamp.is_file() and stamp.read_text() == digest:
        return dest
    step(f"downloading wheels into {rel(dest)}/")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "requirements.txt").write_text(requirements)
    pip_download(python, dest, ["-r", str(dest / "requirements.txt"), *extra])
    stamp.write_text(digest)
    return dest


def link_or_copy(src: Path, dest: Path) -> None:
    dest.unlink(missing_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def python_minor(python: Path) -> str:
    code = "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"
    return run([python, "-c", code]).stdout.strip()


def build_standin(
    podman: Podman, recipe: StandIn, python: Path, install: bool, rebuild: bool
) -> tuple[str, bool]:
    """The stand-in's tag, built unless cached; and whether it was built."""
    if podman.exists(recipe.tag) and not rebuild:
        say(f"    cached: {recipe.tag}")
        return recipe.tag, False
    have = python_minor(python)
    if have != recipe.python:
        raise ForkError(
            f"the stand-in's wheels are downloaded with {python} (Python {have}), "
            f"but the stand-in runs Debian {recipe.suite}'s Python {recipe.python}: "
            f"set VLLM_FORK_VENV to a Python {recipe.python} environment"
        )
    if not podman.exists(recipe.rootfs_tag) or rebuild:
        ensure_tools(["mmdebstrap"], install)
        WORK.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=WORK) as tmp:
            tar = Path(tmp) / "rootfs.tar"
            step(f"Debian {recipe.suite} root file system (mmdebstrap)")
            stream(
                recipe.mmdebstrap_cmd(tar), {}, LOGS / "image-rootfs.log", "mmdebstrap"
            )
            podman.output("import", tar, recipe.rootfs_tag)
    context = IMAGE_CACHE / f"standin-v{recipe.version}"
    wheels = wheelhouse(python, context / "wheels", recipe.wheelhouse_reqs(), [UV_SPEC])
    vllm = upstream_wheel(python, recipe.version)
    for old in wheels.glob("vllm-*.whl"):
        old.unlink()
    link_or_copy(vllm, wheels / vllm.name)
    (context / "Dockerfile").write_text(recipe.dockerfile())
    step(f"building the stand-in {recipe.tag}")
    podman.build(
        context,
        recipe.tag,
        {"ROOTFS": recipe.rootfs_tag},
        LOGS / "image-standin.log",
        layers=False,
    )
    return recipe.tag, True


def human(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def overlay_layers(image: list[int], base: list[int]) -> int:
    """Bytes of the layers an image has on top of its base (newest first)."""
    if len(image) < len(base):
        raise ForkError("the fork's image has fewer layers than its base")
    return sum(image[: len(image) - len(base)])


def check_summary(output: str) -> str:
    """The in-image check's summary line, read back from the build's output."""
    for line in reversed(output.splitlines()):
        line = re.sub(r"^\s*\|?\s*", "", line)
        if line.startswith(SUMMARY_PREFIX):
            return line[len(SUMMARY_PREFIX) :].strip()
    raise ForkError("the check build printed no summary: see its log")


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--series",
        type=Path,
        default=DEFAULT_SERIES,
        help="series directory (default: patches/)",
    )
    p.add_argument(
        "--tree",
        type=Path,
        help="patched tree to take the files from (default: build "
        ".work/v<version>/series, as make overlay does)",
    )
    p.add_argument(
        "--storage-driver",
        choices=("auto", *STORAGE_DRIVERS),
        default=os.environ.get("VLLM_FORK_PODMAN_STORAGE", "auto"),
        help="podman's storage driver: overlay (fast), vfs (works everywhere, "
        "slow), or auto: overlay where podman can use it (default; env "
        "VLLM_FORK_PODMAN_STORAGE). Images are kept in .cache/podman/<driver>/",
    )
    p.add_argument(
        "--rebuild-standin",
        action="store_true",
        help="build the stand-in (and its root file system) again even if cached",
    )
    p.add_argument(
        "--no-install",
        action="store_true",
        help="never apt-get install podman or mmdebstrap; say what to install",
    )
    args = p.parse_args()
    start = time.monotonic()
    timings: list[tuple[str, float]] = []
    series = Series(args.series.resolve())
    version = series.base().version
    ensure_tools(["podman"], not args.no_install)
    podman = choose_podman(args.storage_driver, containers_conf())

    t = time.monotonic()
    step(f"writing the overlay's build context (make overlay) for {version}")
    tree = ship_tree(series, args.tree.resolve() if args.tree else None)
    context = DIST / f"container-v{version}"
    write_context(series, tree, context)
    problems = check_context(context, version)
    if problems:
        raise ForkError(
            "the overlay's context fails its dry check:\n  " + "\n  ".join(problems)
        )

    python = ensure_venv("build")
    recipe = StandIn(
        version, adapted_requirements(tree / "requirements" / "common.txt")
    )
    step(f"the stand-in for {upstream_image(version)}")
    standin, built = build_standin(
        podman, recipe, python, not args.no_install, args.rebuild_standin
    )
    timings.append(
        ("stand-in" + (" (built)" if built else " (cached)"), time.monotonic() - t)
    )

    t = time.monotonic()
    tag = f"localhost/{image_tag(version, local_label(series))}-standin"
    step(f"building {rel(context)}/ on the stand-in: {tag}")
    podman.build(context, tag, {BASE_ARG: standin}, LOGS / "image-overlay.log")
    timings.append(("overlay build", time.monotonic() - t))

    t = time.monotonic()
    step("running the reproducers in the image")
    check_wheels = wheelhouse(
        python, IMAGE_CACHE / "check-wheels", "\n".join(CHECK_REQS) + "\n", []
    )
    check_ctx = write_check_context(
        series, IMAGE_WORK / f"check-v{version}", check_wheels
    )
    check_tag = f"{tag}-check"
    try:
        output = podman.build(
            check_ctx, check_tag, {"IMAGE": tag}, LOGS / "image-check.log", layers=False
        )
    finally:
        if podman.exists(check_tag):
            run(podman.cmd("rmi", check_tag), env=podman.env(), check=False)
    summary = check_summary(output)
    timings.append(("reproducers in the image", time.monotonic() - t))

    standin_size = podman.size(standin)
    image_size = podman.size(tag)
    layers = overlay_layers(podman.layer_sizes(tag), podman.layer_sizes(standin))
    say("")
    say(f"image        {tag} (podman {' '.join(podman.global_args())})")
    say(f"stand-in     {standin} ({human(standin_size)})")
    say(f"image size   {human(image_size)} ({image_size} bytes)")
    say(f"overlay      {human(layers)} ({layers} bytes: the layers on the stand-in)")
    say(f"reproducers  {summary}")
    for name, seconds in timings:
        say(f"time         {name}: {seconds:.0f}s")
    total = time.monotonic() - start
    say(f"total        {total:.0f}s (logs in {rel(LOGS)}/image-*.log)")
    say(
        f"with Docker: docker build -t {image_tag(version, local_label(series))} "
        f"{rel(context)}  (FROM {upstream_image(version)})"
    )
    print(tag)
    return 0


if __name__ == "__main__":
    main_guard(main)
