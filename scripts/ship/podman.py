"""podman as `make image` (scripts/ship/image.py) runs it: the tools it needs,
checked (or installed with apt-get), this machine's settings, a storage of
its own, and its output streamed to the terminal and a log.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from lib.cli import say, step
from lib.errors import ForkError
from lib.paths import CACHE, rel
from lib.proc import run

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
# RUN --mount=type=bind (the stand-in's wheels, the check's files) came
# with podman 4.0 (buildah 1.24).
PODMAN_MIN = (4, 0)
# mmdebstrap checks Debian's Release files with this keyring; Debian has it,
# Ubuntu & co. need the package debian-archive-keyring.
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")


def apt_line(names: str, is_root: bool, has_apt: bool) -> str:
    if has_apt and is_root:
        return f"apt-get update && apt-get install -y {names}"
    if has_apt:
        return f"sudo apt-get update && sudo apt-get install -y {names}"
    return f"install {names} with your system's package manager"


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def missing_tools_message(tools: list[str], is_root: bool, has_apt: bool) -> str:
    """What to do when podman (or mmdebstrap) is not installed."""
    names = " ".join(tools)
    return (
        f"`make image` needs {names}, which is not on PATH. Install it with:\n"
        f"  {apt_line(names, is_root, has_apt)}\n"
        "(Debian bookworm's podman 4.3 is enough; `make image` installs it itself "
        "when it runs as root on a system with apt-get.)"
    )


def ensure_tools(tools: list[str], install: bool) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if not missing:
        return
    root = is_root()
    has_apt = shutil.which("apt-get") is not None
    if not (install and root and has_apt):
        raise ForkError(missing_tools_message(missing, root, has_apt))
    step(f"installing {' '.join(missing)} (apt-get)")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", *missing], env=env)
    still = [t for t in missing if shutil.which(t) is None]
    if still:
        raise ForkError(f"apt-get installed no {' '.join(still)}")


def podman_version_problem(version_output: str) -> str | None:
    """Why this podman (`podman --version`'s output) will not do, or None."""
    m = re.search(r"(\d+)\.(\d+)", version_output)
    if m is None:
        return f"cannot read podman's version from {version_output.strip()!r}"
    have = (int(m[1]), int(m[2]))
    if have >= PODMAN_MIN:
        return None
    want = ".".join(map(str, PODMAN_MIN))
    return (
        f"podman {m[1]}.{m[2]} is too old: `make image` builds with "
        f"RUN --mount, which needs podman >= {want} (Debian 12's and Ubuntu "
        "24.04's podman have it): upgrade podman"
    )


def subuid_problem(user: str, uid: int, subuid: Path, subgid: Path) -> str | None:
    """Why rootless podman (as `user`) cannot build images here, or None:
    it needs ranges of subordinate user and group ids."""
    missing = []
    for path in (subuid, subgid):
        text = path.read_text() if path.is_file() else ""
        owners = {line.split(":")[0] for line in text.splitlines() if ":" in line}
        if user not in owners and str(uid) not in owners:
            missing.append(str(path))
    if not missing:
        return None
    return (
        f"rootless podman needs subordinate ids for {user} in "
        f"{' and '.join(missing)}, which have none: add them with\n"
        f"  sudo usermod --add-subuids 100000-165535 "
        f"--add-subgids 100000-165535 {user}\n"
        "then run `podman system migrate` (or run `make image` as root)"
    )


def check_podman() -> None:
    """Stop early, saying what to do, where podman cannot build here."""
    out = run(["podman", "--version"]).stdout
    problem = podman_version_problem(out)
    if problem is None and not is_root():
        import pwd

        uid = os.getuid()
        problem = subuid_problem(
            pwd.getpwuid(uid).pw_name,
            uid,
            Path("/etc/subuid"),
            Path("/etc/subgid"),
        )
    if problem:
        raise ForkError(problem)


def check_debian_keyring(keyring: Path = DEBIAN_KEYRING) -> None:
    if keyring.is_file():
        return
    line = apt_line(
        "debian-archive-keyring", is_root(), shutil.which("apt-get") is not None
    )
    raise ForkError(
        f"mmdebstrap needs Debian's archive keyring ({keyring}) to check "
        "Debian's packages, and it is missing (Ubuntu does not install it by "
        f"default). Install it with:\n  {line}"
    )


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

    def shell_cmd(self, *args: str) -> str:
        """The command line to type, from any directory, to run podman on
        make image's storage (e.g. shell_cmd("images"))."""
        conf = f"CONTAINERS_CONF={self.conf.resolve()}"
        where = self.storage.resolve() / self.storage_driver
        return " ".join(
            [
                conf,
                "podman",
                f"--root={where / 'storage'}",
                f"--runroot={where / 'run'}",
                f"--storage-driver={self.storage_driver}",
                *args,
            ]
        )

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


def rlimit_hint(output: str, env: dict[str, str]) -> str:
    """What to set when podman could not set RLIMIT_NOFILE ("" otherwise)."""
    if "RLIMIT_NOFILE" not in output:
        return ""
    conf = env.get("CONTAINERS_CONF") or os.environ.get("CONTAINERS_CONF")
    where = f"The containers.conf in use ({conf})" if conf else "containers.conf"
    return f"\n{where} must hold:\n{PODMAN_CONF_TEXT}"


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
        hint = rlimit_hint(text, env)
        raise ForkError(f"{what} failed (exit {code}); full log: {rel(log)}{hint}")
    return text
