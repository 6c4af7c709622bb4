#!/usr/bin/env python3
"""Write a container build context that turns upstream's image into the fork's.

The context (default dist/container-v<version>/) holds a Dockerfile that
starts FROM upstream's image of the series' base release
(vllm/vllm-openai:v<version>) and lays the files the series changes in the
installed vllm package over it, compiling nothing:

  Dockerfile
  fork/manifest.json     each file: path, action, upstream's and the fork's sha256
  fork/install.py        runs in the image (stdlib only): checks every file it
                         touches is upstream's, copies, recompiles bytecode,
                         updates pip's RECORD
  fork/files/vllm/...    the patched files

The image build ends with `python3 -m vllm._fork`, which fails the build
unless every file the series changes matches the digests `make apply`
recorded (vllm/_fork_digests.json, shipped with the files) and the patched
modules are the ones Python imports. Build it with:

  docker build -t vllm-fork:<version>-<label> dist/container-v<version>

The base image is the build argument BASE_IMAGE, upstream's image by
default; `make image` (scripts/ship/image.py) builds the same context on a local
stand-in for it and runs the series' reproducers in the result.

The context is checked after it is written (see check_context): the
Dockerfile's instructions, its FROM line, and every file against the
manifest.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.tree_release import announce_choice
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import DIST, ROOT, fresh_output_dir, rel
from lib.series import Series, add_series_arguments, series_from_arguments
from ship.changes import (
    PackageChanges,
    add_ship_tree_argument,
    base_content,
    package_changes,
    patched_content,
    sha256_hex,
    ship_tree,
)
from ship.repack import local_label

UPSTREAM_IMAGE = "vllm/vllm-openai"
# The build argument naming the image to build on; its default is upstream's.
BASE_ARG = "BASE_IMAGE"
PAYLOAD = "fork"
IN_IMAGE = "/opt/vllm-fork"
INSTALLER = ROOT / "scripts" / "ship" / "image_install.py"
DOCKERFILE_KEYWORDS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM",
    "HEALTHCHECK", "LABEL", "MAINTAINER", "ONBUILD", "RUN", "SHELL",
    "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip
# A RUN that mentions one of these would build or download code.
BUILD_TOOLS = re.compile(r"\b(pip3?|uv|setup\.py|cmake|nvcc|ninja|make|curl|wget)\b")


def upstream_image(version: str) -> str:
    return f"{UPSTREAM_IMAGE}:v{version}"


def image_tag(version: str, label: str) -> str:
    # Docker tags allow no "+": 0.20.2+fork.1 becomes 0.20.2-fork.1.
    return f"vllm-fork:{version}-{label}"


def dockerfile(version: str, fork_version: str, label: str, fingerprint: str) -> str:
    tag = image_tag(version, label)
    return f"""\
# vllm-fork {fork_version}: upstream's vLLM {version} image with the patch
# series' Python files laid over it; nothing is compiled. Written by
# `make overlay`; build it from this directory with:
#   docker build -t {tag} .
# and check an image with:
#   docker run --rm --entrypoint python3 {tag} -m vllm._fork
# {BASE_ARG} is upstream's image; `make image` builds this same context on a
# local stand-in for it with --build-arg {BASE_ARG}=<stand-in>.
ARG {BASE_ARG}={upstream_image(version)}
FROM ${{{BASE_ARG}}}
# Declared again so that the label below names the image actually built on.
ARG {BASE_ARG}
COPY {PAYLOAD}/ {IN_IMAGE}/
# install.py refuses files that are not vLLM {version}'s own; vllm._fork
# then fails the build unless Python imports the patched modules (-B: its
# imports leave no bytecode of torch & co. in this layer).
RUN python3 {IN_IMAGE}/install.py {IN_IMAGE} && python3 -B -m vllm._fork
LABEL org.opencontainers.image.title="vllm-fork" \\
      org.opencontainers.image.version="{fork_version}" \\
      org.opencontainers.image.base.name="${{{BASE_ARG}}}" \\
      io.github.vllm-fork.series="{fingerprint}"
"""


def manifest(
    tree: Path, changes: PackageChanges, fork_version: str, fingerprint: str
) -> dict:
    files = []
    for path, action in sorted(
        [(p, "replace") for p in changes.replaced]
        + [(p, "add") for p in changes.added]
        + [(p, "delete") for p in changes.deleted]
    ):
        old = None if action == "add" else base_content(tree, changes, path)
        new = None if action == "delete" else patched_content(tree, path)
        files.append(
            {
                "path": path,
                "action": action,
                "upstream_sha256": sha256_hex(old) if old is not None else None,
                "sha256": sha256_hex(new) if new is not None else None,
            }
        )
    return {
        "fork": "vllm-fork",
        "version": changes.version,
        "fork_version": fork_version,
        "series": fingerprint,
        "image": upstream_image(changes.version),
        "files": files,
    }


def write_context(series: Series, tree: Path, out: Path) -> Path:
    """Write the build context for `series` (built in `tree`) into `out`."""
    changes = package_changes(tree, series)
    label, fingerprint = local_label(series), series.fingerprint()
    fork_version = f"{changes.version}+{label}"
    fresh_output_dir(out, "container build context")
    payload = out / PAYLOAD
    data = manifest(tree, changes, fork_version, fingerprint)
    for f in data["files"]:
        if f["action"] != "delete":
            dest = payload / "files" / f["path"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(patched_content(tree, f["path"]))
    (payload / "manifest.json").write_text(json.dumps(data, indent=2) + "\n")
    shutil.copyfile(INSTALLER, payload / "install.py")
    (out / "Dockerfile").write_text(
        dockerfile(changes.version, fork_version, label, fingerprint)
    )
    return out


def instructions(text: str) -> list[tuple[str, str]]:
    """A Dockerfile's instructions as (KEYWORD, arguments), continuations joined."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        keyword, _, args = current.partition(" ")
        out.append((keyword.upper(), args.strip()))
        current = ""
    if current:
        raise ValueError("the last instruction ends with a line continuation")
    return out


def arg_defaults(steps: list[tuple[str, str]]) -> dict[str, str]:
    """The default values of ARG instructions (NAME=value; NAME alone has none)."""
    defaults = {}
    for keyword, args in steps:
        if keyword == "ARG":
            name, eq, value = args.partition("=")
            if eq:
                defaults[name.strip()] = value.strip().strip('"')
    return defaults


def expand_args(text: str, defaults: dict[str, str]) -> str:
    """`text` with $NAME and ${NAME} replaced by the ARG defaults, as the
    build does when no --build-arg is given; an unknown name stays as it is."""
    return re.sub(
        r"\$\{(\w+)\}|\$(\w+)",
        lambda m: defaults.get(m.group(1) or m.group(2), m.group(0)),
        text,
    )


def check_context(context: Path, version: str) -> list[str]:
    """A dry check of a build context: what docker build would trip over.

    No Docker engine is needed: the Dockerfile is parsed, its single stage
    must start FROM upstream's image of `version` (the default of the ARG
    that names the base image, which `make image` sets), copy only files that
    exist in the context, build nothing, and end by checking the import;
    every file in the manifest must be in the context with its sha256.
    """
    dockerfile_path = context / "Dockerfile"
    if not dockerfile_path.is_file():
        return [f"{rel(dockerfile_path)} is missing"]
    try:
        steps = instructions(dockerfile_path.read_text())
    except ValueError as e:
        return [f"{rel(dockerfile_path)}: {e}"]
    problems = []
    for keyword, args in steps:
        if keyword not in DOCKERFILE_KEYWORDS:
            problems.append(f"unknown instruction {keyword} {args}")
    first = next((i for i, (k, _) in enumerate(steps) if k != "ARG"), len(steps))
    if first == len(steps) or steps[first][0] != "FROM":
        problems.append("the Dockerfile must start with FROM (ARGs for it before)")
    defaults = arg_defaults(steps[:first])
    froms = [
        expand_args(args, defaults) for keyword, args in steps if keyword == "FROM"
    ]
    if froms != [upstream_image(version)]:
        problems.append(
            f"FROM {froms}: want one stage, FROM {upstream_image(version)} "
            f"(the default of ARG {BASE_ARG})"
        )
    for keyword, args in steps:
        if keyword in ("COPY", "ADD"):
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            for src in words[:-1]:
                path = (context / src).resolve()
                if not path.is_relative_to(context.resolve()) or not path.exists():
                    problems.append(f"{keyword} {src}: not in the context")
        if keyword == "RUN" and (m := BUILD_TOOLS.search(args)):
            problems.append(f"RUN uses {m.group(1)}: the overlay must not build")
    runs = " && ".join(args for keyword, args in steps if keyword == "RUN")
    if f"{IN_IMAGE}/install.py" not in runs or "-m vllm._fork" not in runs:
        problems.append("no RUN installs the files and checks them with vllm._fork")
    manifest_path = context / PAYLOAD / "manifest.json"
    if not manifest_path.is_file():
        return problems + [f"{rel(manifest_path)} is missing"]
    data = json.loads(manifest_path.read_text())
    if data.get("version") != version:
        problems.append(f"manifest is for vLLM {data.get('version')}, not {version}")
    for f in data.get("files", []):
        path = context / PAYLOAD / "files" / f["path"]
        have = sha256_hex(path.read_bytes()) if path.is_file() else None
        if have != f["sha256"]:
            problems.append(f"{rel(path)}: content does not match the manifest")
    if not (context / PAYLOAD / "install.py").is_file():
        problems.append(f"{PAYLOAD}/install.py is missing")
    return problems


def main() -> int:
    p = parser(__doc__)
    add_series_arguments(p)
    add_ship_tree_argument(p)
    p.add_argument(
        "--out",
        type=Path,
        help="context directory to (re)write (default: dist/container-v<version>)",
    )
    args = p.parse_args()
    series = series_from_arguments(args)
    announce_choice(series, "writing the context of")
    version = series.base().version
    tree = ship_tree(series, args.tree.resolve() if args.tree else None)
    out = (args.out or DIST / f"container-v{version}").resolve()
    step(f"writing the build context {rel(out)}/")
    write_context(series, tree, out)
    data = json.loads((out / PAYLOAD / "manifest.json").read_text())
    for f in data["files"]:
        say(f"    {f['action']:8s} {f['path']}")
    problems = check_context(out, version)
    if problems:
        raise ForkError(
            f"the context in {rel(out)}/ fails its dry check:\n  "
            + "\n  ".join(problems)
        )
    say(f"    dry check passed (FROM {upstream_image(version)}, nothing compiled)")
    say(f"build: docker build -t {image_tag(version, local_label(series))} {rel(out)}")
    print(out)
    return 0


if __name__ == "__main__":
    main_guard(main)
