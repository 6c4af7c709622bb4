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
     vllm installed in the image (scripts/ship/image_check.py); it fails the
     build unless they all pass, and its image is removed afterwards.

Then it prints the stand-in's size, the fork image's size and the overlay
layers' size. `podman run` is not needed (the checks are RUN steps of a
build). Podman and mmdebstrap are installed with apt-get when missing and
running as root; otherwise the command to install them is printed. The
podman settings this machine needs (default_ulimits = [], chroot isolation)
are written to .cache/podman/containers.conf unless CONTAINERS_CONF is set;
the images are kept in a podman storage of make image's own,
.cache/podman/<driver>/ (overlay where podman can use it, else vfs). All
of podman's side (the tools, their versions, the settings, the storage) is
scripts/ship/podman.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.fetch import sha256_file
from keep.tree_release import announce_choice
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import CACHE, DIST, ROOT, WORK, fresh_output_dir, rel
from lib.proc import run
from lib.series import Series, add_series_arguments, series_from_arguments
from lib.testenv import build_hf_cache
from lib.venv import DEFAULT_TORCH, TEST_REQS, adapted_requirements, ensure_venv
from ship.changes import add_ship_tree_argument, ship_tree
from ship.container import (
    BASE_ARG,
    IN_IMAGE,
    check_context,
    image_tag,
    upstream_image,
    write_context,
)
from ship.image_check import SUMMARY_PREFIX
from ship.install import upstream_wheel
from ship.podman import (
    STORAGE_DRIVERS,
    Podman,
    check_debian_keyring,
    check_podman,
    choose_podman,
    containers_conf,
    ensure_tools,
    stream,
)
from ship.repack import local_label

# The stand-in's root file system: Debian's packages only.
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_PACKAGES = ("python3", "python3-pip", "ca-certificates")
# Debian bookworm's python3 is 3.11 and its glibc 2.36: both wheelhouses are
# resolved for them (pip download --python-version/--platform), whatever
# Python runs `make image`.
STANDIN_PYTHON = "3.11"
STANDIN_GLIBC = "2.36"
# The installer upstream's Dockerfile uses (`uv pip install --system`).
UV_SPEC = "uv==0.13.9"
# What the in-image check installs into a directory of its own (it runs
# pytest on one process: no ruff, no xdist).
CHECK_REQS = [r for r in TEST_REQS if not r.startswith(("ruff", "pytest-xdist"))]
CHECK_SCRIPT = ROOT / "scripts" / "ship" / "image_check.py"
CHECK_MOUNT = "/opt/vllm-fork-check"
IMAGE_CACHE = CACHE / "image"
IMAGE_WORK = WORK / "image"
LOGS = WORK / "logs"
# Where a CPU torch wheel is looked for (pip's find-links here, and ours).
TORCH_DIRS = (CACHE / "wheels", Path("/opt/wheels"))


def short_hash(data: object) -> str:
    text = json.dumps(data, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def download_args(python: str, glibc: str) -> list[str]:
    """pip download's flags for wheels that install on CPython `python` with
    glibc `glibc` on x86_64, whatever interpreter runs pip. pip does not
    widen a --platform to older manylinux tags, so each is named."""
    major, minor = (int(x) for x in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 16, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    abi = "cp" + python.replace(".", "")
    args = ["--python-version", python, "--implementation", "cp", "--abi", abi]
    for tag in tags:
        args += ["--platform", tag]
    return [*args, "--only-binary=:all:"]


def find_links_dirs() -> list[Path]:
    """Ours, then the directories PIP_FIND_LINKS names."""
    env = os.environ.get("PIP_FIND_LINKS", "").split()
    dirs = [Path(d.removeprefix("file://")) for d in env if "://" not in d]
    dirs += [Path(d[len("file://") :]) for d in env if d.startswith("file://")]
    return [*TORCH_DIRS, *(d for d in dirs if d not in TORCH_DIRS)]


def cpu_torch(spec: str, python: str, dirs: list[Path]) -> Path:
    """The CPU build of the torch `spec` pins, for CPython `python`, from a
    local directory. Never PyPI's: there `torch==X` is the CUDA build."""
    m = re.fullmatch(r"torch==([0-9][0-9a-z.]*?)(\+cpu)?", spec.replace(" ", ""))
    if m is None:
        raise ForkError(
            f"the stand-in needs torch pinned as torch==X.Y.Z, not {spec!r}"
        )
    cp = "cp" + python.replace(".", "")
    name = f"torch-{m[1]}+cpu-{cp}-{cp}-manylinux*_x86_64.whl"
    for d in dirs:
        found = sorted(d.glob(name))
        if found:
            return found[-1]
    raise ForkError(
        f"the stand-in needs torch {m[1]}'s CPU wheel for Python {python} "
        f"({name}), found in none of {', '.join(map(str, dirs))}; PyPI's "
        f"torch=={m[1]} is the CUDA build, which is not used. Download it from "
        f"https://download.pytorch.org/whl/cpu/torch/ into {rel(TORCH_DIRS[0])}/"
    )


@dataclass(frozen=True)
class StandIn:
    """The recipe of the stand-in for upstream's image of one release.

    Everything that goes into the image is named here, so that its hash
    keys the cached image: the same recipe is never built twice, a changed
    one (another torch, a new common.txt, another package, another vllm
    wheel) is.
    """

    version: str
    requirements: str  # vLLM's requirements/common.txt, adapted as .venv's
    torch: str = DEFAULT_TORCH
    uv: str = UV_SPEC
    suite: str = DEBIAN_SUITE
    mirror: str = DEBIAN_MIRROR
    packages: tuple[str, ...] = DEBIAN_PACKAGES
    python: str = STANDIN_PYTHON
    glibc: str = STANDIN_GLIBC
    vllm_sha256: str = ""  # upstream's wheel that is installed
    torch_wheel: str = ""  # the CPU torch wheel's file name

    def rootfs_key(self) -> str:
        return short_hash(self.mmdebstrap_cmd(Path("rootfs.tar")))

    def download_args(self) -> list[str]:
        return download_args(self.python, self.glibc)

    def key(self) -> str:
        return short_hash(
            [
                self.rootfs_key(),
                self.version,
                self.requirements,
                self.torch,
                self.uv,
                self.python,
                self.download_args(),
                self.vllm_sha256,
                self.torch_wheel,
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

    def torch_requirement(self) -> str:
        """torch pinned to its CPU build (the wheelhouse has only that)."""
        return self.torch.split("+")[0] + "+cpu"

    def wheelhouse_reqs(self) -> str:
        """requirements.txt of the wheelhouse (vllm itself goes --no-deps)."""
        return f"{self.torch_requirement()}\n{self.requirements}"

    def dockerfile(self) -> str:
        uv = (
            "uv pip install --system --break-system-packages --no-cache "
            "--no-index --find-links /tmp/wheels"
        )
        return f"""\
# Stand-in for {upstream_image(self.version)}, written by `make image`
# (scripts/ship/image.py): Debian {self.suite}'s Python with upstream's released
# vllm {self.version} wheel, installed as upstream's docker/Dockerfile does
# (uv pip install --system), with a CPU torch instead of the CUDA set.
ARG ROOTFS={self.rootfs_tag}
FROM ${{ROOTFS}}
ENV DEBIAN_FRONTEND=noninteractive UV_LINK_MODE=copy
WORKDIR /vllm-workspace
# One RUN, one layer; the wheels are mounted, not copied into the image.
# vllm's bytecode is compiled unchecked-hash: Python then uses each .pyc
# without looking at its source, so the overlay must remove the stale ones
# (uv leaves none by default: the worst case is tested).
RUN --mount=type=bind,source=wheels,target=/tmp/wheels \\
    python3 -m pip install -q --break-system-packages --no-cache-dir \\
        --no-index --find-links /tmp/wheels {self.uv} \\
    && {uv} -r /tmp/wheels/requirements.txt \\
    && {uv} --no-deps /tmp/wheels/vllm-{self.version}-*.whl \\
    && python3 -m compileall -q -j 0 --invalidation-mode unchecked-hash \\
        "$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/vllm" \\
    && python3 -c 'import importlib.metadata as m; print("vllm", m.version("vllm"))'
ENV VLLM_USAGE_SOURCE=production-docker-image
ENTRYPOINT ["vllm", "serve"]
"""


def check_dockerfile() -> str:
    return f"""\
# The reproducer check of `make image` (scripts/ship/image.py), FROM the image
# built from make overlay's context. Not part of that context: nothing of
# this build goes into the fork's image.
ARG IMAGE
FROM ${{IMAGE}}
RUN --mount=type=bind,source=.,target={CHECK_MOUNT} \\
    python3 {CHECK_MOUNT}/image_check.py {CHECK_MOUNT} \\
        --manifest {IN_IMAGE}/manifest.json
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
            "-d",
            dest,
            *args,
        ],
        capture=False,
    )


def wheelhouse(python: Path, dest: Path, requirements: str, extra: list[str]) -> Path:
    """Download the wheels `requirements` need into `dest` (once: a stamp
    records the requirements and pip's flags, the target Python and
    platform among them) and write dest/requirements.txt."""
    stamp = dest / ".fork-wheels.stamp"
    digest = short_hash([requirements, extra])
    if stamp.is_file() and stamp.read_text() == digest:
        return dest
    step(f"downloading wheels into {rel(dest)}/")
    dest.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
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


def standin_recipe(python: Path, version: str, requirements: str) -> StandIn:
    """The recipe, with the two wheels it installs found (and hashed)."""
    vllm = upstream_wheel(python, version)
    torch = cpu_torch(DEFAULT_TORCH, STANDIN_PYTHON, find_links_dirs())
    return StandIn(
        version,
        requirements,
        vllm_sha256=sha256_file(vllm),
        torch_wheel=torch.name,
    )


def build_standin(
    podman: Podman, recipe: StandIn, python: Path, install: bool, rebuild: bool
) -> tuple[str, bool]:
    """The stand-in's tag, built unless cached; and whether it was built."""
    if podman.exists(recipe.tag) and not rebuild:
        say(f"    cached: {recipe.tag}")
        return recipe.tag, False
    if not podman.exists(recipe.rootfs_tag) or rebuild:
        ensure_tools(["mmdebstrap"], install)
        check_debian_keyring()
        WORK.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=WORK) as tmp:
            tar = Path(tmp) / "rootfs.tar"
            step(f"Debian {recipe.suite} root file system (mmdebstrap)")
            stream(
                recipe.mmdebstrap_cmd(tar), {}, LOGS / "image-rootfs.log", "mmdebstrap"
            )
            podman.output("import", tar, recipe.rootfs_tag)
    context = IMAGE_CACHE / f"standin-v{recipe.version}"
    torch = cpu_torch(recipe.torch, recipe.python, find_links_dirs())
    wheels = wheelhouse(
        python,
        context / "wheels",
        recipe.wheelhouse_reqs(),
        [*recipe.download_args(), "--find-links", str(torch.parent), UV_SPEC],
    )
    vllm = upstream_wheel(python, recipe.version)
    if sha256_file(vllm) != recipe.vllm_sha256:
        raise ForkError(f"{rel(vllm)} changed while `make image` ran")
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
    for unit in ("B", "kB", "MB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


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
    add_series_arguments(p)
    add_ship_tree_argument(p)
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
    series = series_from_arguments(args)
    announce_choice(series, "imaging")
    version = series.base().version
    ensure_tools(["podman"], not args.no_install)
    check_podman()
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
    recipe = standin_recipe(
        python, version, adapted_requirements(tree / "requirements" / "common.txt")
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
        python,
        IMAGE_CACHE / "check-wheels",
        "\n".join(CHECK_REQS) + "\n",
        recipe.download_args(),
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
    say(f"image        {tag}")
    say(f"stand-in     {standin} ({human(standin_size)})")
    say(f"image size   {human(image_size)} ({image_size} bytes)")
    say(f"overlay      {human(layers)} ({layers} bytes: the layers on the stand-in)")
    say(f"reproducers  {summary}")
    for name, seconds in timings:
        say(f"time         {name}: {seconds:.0f}s")
    total = time.monotonic() - start
    say(f"total        {total:.0f}s (logs in {rel(LOGS)}/image-*.log)")
    say(f"the images:  {podman.shell_cmd('images')}")
    say(
        f"with Docker: docker build -t {image_tag(version, local_label(series))} "
        f"{rel(context)}  (FROM {upstream_image(version)})"
    )
    print(tag)
    return 0


if __name__ == "__main__":
    main_guard(main)
