#!/usr/bin/env python3
"""Build the patched vLLM wheel from upstream's released one, compiling nothing.

Takes upstream's wheel of the series' base release (`pip download --no-deps
--only-binary :all: vllm==<version>`, cached in .cache/wheels/), and:
  - replaces the files under vllm/ that the series changes, adds the
    overlay's files and drops files a patch deletes (each replaced file is
    first checked to be the release's own, so a wrong wheel is refused);
  - labels the version <version>+fork.<patches>.g<series fingerprint>;
  - rewrites RECORD (sha256 and size of every file).
Every other file, the compiled kernels included, is copied unchanged. The
result is checked against upstream's wheel file by file before it is kept.

Output: dist/vllm-<version>+fork...-<upstream's tags>.whl. Install it with
`pip install <wheel>` where upstream's vllm would go (same dependencies).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.tree_release import announce_choice
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import DIST, rel
from lib.series import Series, add_series_arguments, series_from_arguments
from ship.changes import (
    PackageChanges,
    add_ship_tree_argument,
    base_content,
    package_changes,
    patched_content,
    ship_tree,
)
from ship.install import upstream_wheel

LOCAL_LABEL_RE = re.compile(r"[a-z0-9]+(\.[a-z0-9]+)*")
CHUNK = 1 << 20


@dataclass
class WheelDiff:
    """How two wheels differ, with the dist-info directory names matched up."""

    changed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    same: int = 0


def record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def local_label(series: Series) -> str:
    return f"fork.{len(series.patches())}.g{series.fingerprint()[:8]}"


def dist_info_dir(zf: zipfile.ZipFile) -> str:
    """The wheel's `<name>-<version>.dist-info/` directory."""
    dirs = {
        n.split("/", 1)[0] + "/"
        for n in zf.namelist()
        if n.split("/", 1)[0].endswith(".dist-info")
    }
    if len(dirs) != 1:
        raise ForkError(f"{zf.filename}: expected one .dist-info directory, got {dirs}")
    return dirs.pop()


def wheel_version(path: Path) -> tuple[str, str, str]:
    """(name, version, tags) from a wheel's file name."""
    parts = path.name.removesuffix(".whl").split("-")
    if not path.name.endswith(".whl") or len(parts) < 5:
        raise ForkError(f"{rel(path)} is not a wheel file name (name-ver-tags.whl)")
    return parts[0], parts[1], "-".join(parts[2:])


def set_metadata_version(metadata: bytes, version: str) -> bytes:
    text = metadata.decode("utf-8")
    new, n = re.subn(r"^Version: .*$", f"Version: {version}", text, count=1, flags=re.M)
    if n != 1:
        raise ForkError("the wheel's METADATA has no Version: line")
    return new.encode("utf-8")


def _copy_info(info: zipfile.ZipInfo, name: str) -> zipfile.ZipInfo:
    """Entry header for `name` with `info`'s date and permissions."""
    out = zipfile.ZipInfo(name, date_time=info.date_time)
    out.compress_type = zipfile.ZIP_DEFLATED
    out.external_attr = info.external_attr
    out.create_system = info.create_system
    out.file_size = info.file_size
    return out


class WheelWriter:
    """Writes zip entries and keeps the RECORD rows for them."""

    def __init__(self, path: Path) -> None:
        self.zip = zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=6)
        self.rows: list[tuple[str, str, str]] = []

    def write_bytes(self, info: zipfile.ZipInfo, data: bytes) -> None:
        info.file_size = len(data)
        self.zip.writestr(info, data)
        self.rows.append((info.filename, record_hash(data), str(len(data))))

    def copy_stream(self, info: zipfile.ZipInfo, src: io.BufferedIOBase) -> None:
        h, size = hashlib.sha256(), 0
        with self.zip.open(info, "w") as dst:
            while chunk := src.read(CHUNK):
                h.update(chunk)
                dst.write(chunk)
                size += len(chunk)
        digest = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
        self.rows.append((info.filename, f"sha256={digest}", str(size)))

    def close_with_record(self, record: zipfile.ZipInfo) -> None:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerows(self.rows)
        writer.writerow((record.filename, "", ""))
        data = buf.getvalue().encode("utf-8")
        record.file_size = len(data)
        self.zip.writestr(record, data)
        self.zip.close()


def check_against_release(
    zin: zipfile.ZipFile, tree: Path, changes: PackageChanges
) -> None:
    """Refuse a wheel that is not the release the series is based on."""
    names = set(zin.namelist())
    for path in changes.replaced + changes.deleted:
        if path not in names:
            raise ForkError(
                f"{zin.filename} has no {path}, which vLLM {changes.version} ships "
                "and the series changes: is it upstream's wheel of that release?"
            )
        if zin.read(path) != base_content(tree, changes, path):
            raise ForkError(
                f"{path} in {zin.filename} differs from vLLM {changes.version}'s "
                "source: the wheel is not that release (or was already patched). "
                "Use upstream's wheel (delete it from .cache/wheels/ to download)."
            )
    for path in changes.added:
        if path in names:
            raise ForkError(
                f"{zin.filename} already has {path}, which the series adds: is it "
                f"upstream's wheel of vLLM {changes.version}?"
            )


def repack(
    upstream: Path,
    tree: Path,
    changes: PackageChanges,
    label: str,
    out_dir: Path,
) -> Path:
    """Write the patched wheel into out_dir and return its path."""
    name, version, tags = wheel_version(upstream)
    if name != "vllm" or version != changes.version:
        raise ForkError(
            f"{rel(upstream)} is {name} {version}, the series is based on "
            f"vllm {changes.version}"
        )
    if not LOCAL_LABEL_RE.fullmatch(label):
        raise ForkError(
            f"--label {label!r} is not a version label: use lowercase letters, "
            "digits and dots (e.g. fork.3)"
        )
    new_version = f"{version}+{label}"
    out = out_dir / f"{name}-{new_version}-{tags}.whl"
    out_dir.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    skip = set(changes.replaced) | set(changes.deleted)
    with zipfile.ZipFile(upstream) as zin:
        check_against_release(zin, tree, changes)
        old_info = dist_info_dir(zin)
        new_info = f"{name}-{new_version}.dist-info/"
        # A wheel's <name>-<version>.data/ directory is named by version too.
        old_data, new_data = f"{name}-{version}.data/", f"{name}-{new_version}.data/"
        writer = WheelWriter(part)
        try:
            infos = zin.infolist()
            package = [i for i in infos if not i.filename.startswith(old_info)]
            meta = [i for i in infos if i.filename.startswith(old_info)]
            total = len(package)
            for n, info in enumerate(package, 1):
                if info.filename in skip:
                    if info.filename in changes.replaced:
                        data = patched_content(tree, info.filename)
                        writer.write_bytes(_copy_info(info, info.filename), data)
                    continue
                if info.file_size > 20 << 20:
                    say(f"    {info.filename} ({info.file_size / 1e6:.0f} MB)")
                elif n % 1000 == 0:
                    say(f"    {n}/{total} files")
                target = info.filename
                if target.startswith(old_data):
                    target = new_data + target[len(old_data) :]
                with zin.open(info) as src:
                    writer.copy_stream(_copy_info(info, target), src)
            # New files get the date of the release's own METADATA: a fixed
            # input, so the same series always gives the same wheel bytes.
            stamp = zin.getinfo(old_info + "METADATA")
            for path in changes.added:
                info = _copy_info(stamp, path)
                info.external_attr = 0o100644 << 16
                writer.write_bytes(info, patched_content(tree, path))
            record = None
            for info in meta:
                rel_name = info.filename[len(old_info) :]
                target = _copy_info(info, new_info + rel_name)
                if rel_name == "RECORD":
                    record = target
                elif rel_name == "METADATA":
                    data = set_metadata_version(zin.read(info), new_version)
                    writer.write_bytes(target, data)
                else:
                    writer.write_bytes(target, zin.read(info))
            if record is None:
                raise ForkError(f"{rel(upstream)} has no {old_info}RECORD")
            writer.close_with_record(record)
        except BaseException:
            writer.zip.close()
            part.unlink(missing_ok=True)
            raise
    part.replace(out)
    return out


def read_record(zf: zipfile.ZipFile) -> dict[str, tuple[str, str]]:
    """RECORD rows as path -> (hash, size)."""
    text = zf.read(dist_info_dir(zf) + "RECORD").decode("utf-8")
    return {row[0]: (row[1], row[2]) for row in csv.reader(io.StringIO(text)) if row}


def verify_record(path: Path) -> list[str]:
    """Problems with a wheel's RECORD (empty when every file checks out)."""
    problems = []
    with zipfile.ZipFile(path) as zf:
        record_name = dist_info_dir(zf) + "RECORD"
        rows = read_record(zf)
        names = [i.filename for i in zf.infolist() if not i.is_dir()]
        for name in names:
            if name not in rows:
                problems.append(f"{name}: not in RECORD")
            elif name == record_name:
                if rows[name] != ("", ""):
                    problems.append(f"{name}: RECORD must not hash itself")
            else:
                h, size = hashlib.sha256(), 0
                with zf.open(name) as f:
                    while chunk := f.read(CHUNK):
                        h.update(chunk)
                        size += len(chunk)
                digest = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
                if rows[name] != (f"sha256={digest}", str(size)):
                    problems.append(f"{name}: hash or size differs from RECORD")
        problems += [
            f"{n}: in RECORD, not in the wheel" for n in set(rows) - set(names)
        ]
    return sorted(problems)


def compare_wheels(original: Path, patched: Path) -> WheelDiff:
    """File-by-file comparison, by content (CRC and size, then bytes)."""
    diff = WheelDiff()
    with zipfile.ZipFile(original) as a, zipfile.ZipFile(patched) as b:
        a_info, b_info = dist_info_dir(a), dist_info_dir(b)

        def key(name: str, info_dir: str) -> str:
            """The name with the version-named directories made neutral."""
            data_dir = info_dir.removesuffix(".dist-info/") + ".data/"
            for prefix, neutral in ((info_dir, "<dist-info>/"), (data_dir, "<data>/")):
                if name.startswith(prefix):
                    return neutral + name[len(prefix) :]
            return name

        left = {key(i.filename, a_info): i for i in a.infolist()}
        right = {key(i.filename, b_info): i for i in b.infolist()}
        for name in sorted(set(left) | set(right)):
            if name not in right:
                diff.removed.append(name)
            elif name not in left:
                diff.added.append(name)
            elif (left[name].CRC, left[name].file_size) != (
                right[name].CRC,
                right[name].file_size,
            ) or a.read(left[name]) != b.read(right[name]):
                diff.changed.append(name)
            else:
                diff.same += 1
    return diff


def expected_diff(changes: PackageChanges) -> WheelDiff:
    """What repack may change: the series' files and the version's metadata."""
    return WheelDiff(
        changed=sorted(
            changes.replaced + ["<dist-info>/METADATA", "<dist-info>/RECORD"]
        ),
        added=sorted(changes.added),
        removed=sorted(changes.deleted),
    )


def check_wheel(upstream: Path, patched: Path, changes: PackageChanges) -> WheelDiff:
    """Raise unless `patched` is upstream's wheel with exactly the series' changes."""
    problems = verify_record(patched)
    if problems:
        raise ForkError(
            f"{rel(patched)}: RECORD does not verify:\n  " + "\n  ".join(problems)
        )
    got, want = compare_wheels(upstream, patched), expected_diff(changes)
    for kind in ("changed", "added", "removed"):
        if getattr(got, kind) != getattr(want, kind):
            raise ForkError(
                f"{rel(patched)}: files {kind} are {getattr(got, kind)}, "
                f"expected {getattr(want, kind)}"
            )
    return got


def build_wheel(
    series: Series,
    tree: Path | None = None,
    upstream: Path | None = None,
    out_dir: Path = DIST,
    label: str | None = None,
) -> tuple[Path, Path, PackageChanges]:
    """Build and check the patched wheel: (patched, upstream, changes)."""
    if upstream is not None and not upstream.is_file():
        raise ForkError(f"--upstream-wheel {upstream}: no such file")
    tree = ship_tree(series, tree)
    changes = package_changes(tree, series)
    if upstream is None:
        step(f"upstream's vllm {changes.version} wheel")
        upstream = upstream_wheel(Path(sys.executable), changes.version)
    say(f"    {rel(upstream)} ({upstream.stat().st_size / 1e6:.1f} MB)")
    step(f"repacking with the series' files ({changes.summary()})")
    out = repack(upstream, tree, changes, label or local_label(series), out_dir)
    step("checking RECORD and comparing with upstream's wheel file by file")
    try:
        diff = check_wheel(upstream, out, changes)
    except ForkError:
        out.unlink()
        raise
    say(f"    {diff.same} files identical to upstream's")
    return out, upstream, changes


def main() -> int:
    p = parser(__doc__)
    add_series_arguments(p)
    add_ship_tree_argument(p)
    p.add_argument(
        "--upstream-wheel",
        type=Path,
        help="upstream's wheel to start from (default: pip download into "
        ".cache/wheels/)",
    )
    p.add_argument(
        "--out", type=Path, default=DIST, help="output directory (default: dist/)"
    )
    p.add_argument(
        "--label",
        help="local version label (default: fork.<patches>.g<fingerprint>)",
    )
    args = p.parse_args()
    series = series_from_arguments(args)
    announce_choice(series, "making the wheel of")
    out, upstream, changes = build_wheel(
        series,
        args.tree.resolve() if args.tree else None,
        args.upstream_wheel.resolve() if args.upstream_wheel else None,
        args.out.resolve(),
        args.label,
    )
    for kind in ("replaced", "added", "deleted"):
        for path in getattr(changes, kind):
            say(f"    {kind:8s} {path}")
    for path in changes.not_shipped:
        say(f"    not in the wheel (outside vllm/): {path}")
    say(
        f"{rel(out)}: {out.stat().st_size / 1e6:.1f} MB "
        f"(upstream's {upstream.stat().st_size / 1e6:.1f} MB)"
    )
    print(out)
    return 0


if __name__ == "__main__":
    main_guard(main)
