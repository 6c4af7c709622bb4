"""A patch series: its pinned upstream base, its patches and their trailers."""

from __future__ import annotations

import argparse
import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES, OVERLAY, rel

BASE_FILE = "base.toml"
BASE_KEYS = ("version", "sdist_url", "sdist_sha256", "git_url", "git_ref", "git_commit")
# Written only when set: a base comes from a release's sdist (sdist_url and
# sdist_sha256 pin it) or from a git ref (git_commit pins it).
OPTIONAL_KEYS = ("sdist_url", "sdist_sha256", "git_commit")
TRAILER_RE = re.compile(r"^([A-Za-z][A-Za-z0-9-]*): (.+)$")
# The upstream paths the series is about: what `import` keeps of an upstream
# fix, and where upstream's own tests of that code live.
TRACKED_PATHS = (
    "vllm/v1/core",
    "vllm/v1/simple_kv_offload",
    "tests/v1/core",
    "tests/v1/simple_kv_offload",
)
# An Upstream-Status value starting with one of these (any case) says the fix
# exists upstream (e.g. "backport of vllm-project/vllm#12345, in 0.24.0"):
# `export` skips such a patch.
UPSTREAM_STATUS_PREFIXES = ("upstream", "backport")
# Trailers the fork adds to a patch's message; an upstream commit drops them.
FORK_TRAILERS = (
    "Upstream-Status",
    "Upstream-Issue",
    "Upstream-PR",
    "Upstream-Commit",
    "Reproducer",
)


def is_tracked(path: str) -> bool:
    """Whether a repository path lies under one of TRACKED_PATHS."""
    return any(path == t or path.startswith(t + "/") for t in TRACKED_PATHS)


@dataclass(frozen=True)
class Base:
    """Where the upstream release of a series comes from, and its checksum."""

    version: str
    sdist_url: str = ""
    sdist_sha256: str = ""
    git_url: str = "https://github.com/vllm-project/vllm.git"
    git_ref: str = ""
    git_commit: str = ""

    @property
    def source(self) -> str:
        """Where the release comes from: "sdist" (PyPI) or "git" (a ref)."""
        return "sdist" if self.sdist_url else "git"

    @property
    def pin(self) -> str:
        """What identifies the exact source: the sdist's sha256 or the commit."""
        return self.sdist_sha256 or self.git_commit

    @property
    def tag(self) -> str:
        """Name of the imported upstream commit: a tag in the cache repository;
        in a tree, refs/remotes/<tag>, so `git describe` (setuptools-scm) does
        not take it for the package version."""
        return f"upstream/v{self.version}"

    @property
    def tree_ref(self) -> str:
        return f"refs/remotes/{self.tag}"

    @property
    def branch(self) -> str:
        """Branch that holds this base plus the series."""
        return f"fork/v{self.version}"

    def to_toml(self) -> str:
        lines = ["# Pinned upstream base of this patch series (see README.md)."]
        for key in BASE_KEYS:
            value = getattr(self, key) or (
                f"v{self.version}" if key == "git_ref" else ""
            )
            if value or key not in OPTIONAL_KEYS:
                lines.append(f'{key} = "{value}"')
        return "\n".join(lines) + "\n"


def read_base(path: Path) -> Base:
    if not path.is_file():
        raise ForkError(f"{rel(path)} not found: a series needs its pinned base")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ForkError(f"{rel(path)} is not valid TOML: {e}") from e
    pins = ("git_commit",) if "git_commit" in data else ("sdist_url", "sdist_sha256")
    missing = [k for k in ("version", *pins) if k not in data]
    if missing:
        raise ForkError(f"{rel(path)} lacks {', '.join(missing)}")
    unknown = sorted(set(data) - set(BASE_KEYS))
    if unknown:
        raise ForkError(f"{rel(path)} has unknown keys: {', '.join(unknown)}")
    if "sdist_sha256" in data and not re.fullmatch(
        r"[0-9a-f]{64}", data["sdist_sha256"]
    ):
        raise ForkError(f"{rel(path)}: sdist_sha256 must be 64 lowercase hex digits")
    if "git_commit" in data and not re.fullmatch(r"[0-9a-f]{40}", data["git_commit"]):
        raise ForkError(f"{rel(path)}: git_commit must be 40 lowercase hex digits")
    data.setdefault("sdist_url", "")
    data.setdefault("sdist_sha256", "")
    data.setdefault("git_ref", f"v{data['version']}")
    return Base(**data)


@dataclass(frozen=True)
class Patch:
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def message(self) -> str:
        """The commit message part of the patch (before the diffstat)."""
        text = self.path.read_text()
        head, _, _ = text.partition("\n---\n")
        return head

    def subject(self) -> str:
        # A long subject is folded onto indented continuation lines.
        m = re.search(
            r"^Subject: (?:\[PATCH[^\]]*\] )?(.*(?:\n .*)*)$", self.message(), re.M
        )
        return " ".join(m.group(1).split()) if m else self.name

    def trailers(self) -> dict[str, list[str]]:
        """`Key: value` lines of the message's last paragraph."""
        body = self.message().rstrip().split("\n\n")[-1]
        out: dict[str, list[str]] = {}
        for line in body.splitlines():
            m = TRAILER_RE.match(line.strip())
            if m:
                out.setdefault(m.group(1), []).append(m.group(2).strip())
        return out

    def reproducers(self) -> list[str]:
        return self.trailers().get("Reproducer", [])

    @property
    def number(self) -> int:
        return int(self.name[:4])

    def upstream_status(self) -> str:
        return " ".join(self.trailers().get("Upstream-Status", []))

    def is_upstream(self) -> bool:
        """The fix exists upstream (see UPSTREAM_STATUS_PREFIXES)."""
        return self.upstream_status().lower().startswith(UPSTREAM_STATUS_PREFIXES)


@dataclass(frozen=True)
class Series:
    """A directory holding base.toml and NNNN-*.patch files."""

    dir: Path
    overlay: Path = OVERLAY

    @property
    def base_file(self) -> Path:
        return self.dir / BASE_FILE

    def base(self) -> Base:
        return read_base(self.base_file)

    def patches(self) -> list[Patch]:
        return [Patch(p) for p in sorted(self.dir.glob("[0-9][0-9][0-9][0-9]-*.patch"))]

    def overlay_files(self) -> list[Path]:
        """Overlay files, relative to the overlay root, in a stable order."""
        if not self.overlay.is_dir():
            return []
        return sorted(
            p.relative_to(self.overlay)
            for p in self.overlay.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        )

    def fingerprint(self) -> str:
        """Digest of everything `apply` builds from: base, patches, overlay."""
        h = hashlib.sha256()
        h.update(self.base().pin.encode())
        for p in self.patches():
            h.update(b"\0patch\0" + p.name.encode() + b"\0" + p.path.read_bytes())
        for f in self.overlay_files():
            data = (self.overlay / f).read_bytes()
            h.update(b"\0overlay\0" + str(f).encode() + b"\0" + data)
        return h.hexdigest()[:16]


def find_series(dirs: list[Path] | None = None) -> list[Series]:
    """The series in `dirs`; by default the default series (patches/) and
    every other release's series (patches/v*/ with a base.toml), in that
    order."""
    if dirs:
        return [Series(d.resolve()) for d in dirs]
    found = [Series(DEFAULT_SERIES)]
    others = [
        Series(d) for d in DEFAULT_SERIES.glob("v*") if (d / "base.toml").is_file()
    ]
    # By version, not by name: v0.100.0 comes after v0.33.0.
    found += sorted(others, key=lambda s: version_key(s.base().version))
    return found


def version_key(version: str) -> tuple:
    """Order releases: 0.9.0 < 0.33.0 < 0.100.0, and a final release above
    its pre-releases (0.34.0rc1, 0.34.0.dev0) and below its post-releases."""
    m = re.match(r"v?(\d+(?:\.\d+)*)(.*)", version)
    if not m:
        return ((), 0, ())
    release = tuple(int(x) for x in m.group(1).split("."))
    rest = m.group(2)
    tag = 1 if not rest else 2 if rest.lstrip(".").startswith("post") else 0
    return (release, tag, tuple(int(x) for x in re.findall(r"\d+", rest)))


def series_for_version(version: str) -> Series:
    """The series that serves a release: patches/ for the default one's
    version, else patches/v<version>/ (made by `make rebase`)."""
    version = version.removeprefix("v")
    default = Series(DEFAULT_SERIES)
    if version == default.base().version:
        return default
    candidate = DEFAULT_SERIES / f"v{version}"
    if (candidate / "base.toml").is_file():
        return Series(candidate)
    have = ", ".join(s.base().version for s in find_series())
    raise ForkError(
        f"no series for vLLM {version}: {rel(candidate)}/base.toml not found.\n"
        f"Releases with a series: {have}.\n"
        f"Make one with `make rebase BASE={version}` (from the nearest series), "
        "prove it with `make test-releases RELEASES=" + version + "`, and commit "
        f"{rel(candidate)}/ and {rel(DEFAULT_SERIES / 'resolutions')}/."
    )


def add_series_arguments(p: argparse.ArgumentParser) -> None:
    """--series DIR or --version RELEASE (make ... VERSION=<release>)."""
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--series",
        type=Path,
        help="series directory (default: patches/, or the --version's)",
    )
    which.add_argument(
        "--version",
        metavar="RELEASE",
        help="the series for this vLLM release (patches/ or patches/v<release>/)",
    )


def series_from_arguments(args: argparse.Namespace) -> Series:
    if args.version:
        return series_for_version(args.version)
    return Series((args.series or DEFAULT_SERIES).resolve())


def default_and_newest(found: list[Series]) -> tuple[list[Series], list[Series]]:
    """The default series (found first) and the newest release's; the rest."""
    default, others = found[0], found[1:]
    if not others:
        return [default], []
    newest = max(others, key=lambda s: version_key(s.base().version))
    return [default, newest], [s for s in others if s is not newest]
