#!/usr/bin/env python3
"""The bug ledger (docs/ledger.md): every known bug in vLLM's KV block
allocator (vllm/v1/core) and CPU offload (vllm/v1/simple_kv_offload) on the
releases the fork serves, and whether the fork carries its fix, will not,
or cannot yet.

The rows are scripts/data/ledger.toml. A carried row names its patch by
subject; its number (0001, R1, ...) and the releases that carry it come
from the committed series, as README.md's release table computes them
(scripts/keep/release_table.py), so a rebase that renumbers or drops a
patch changes the ledger without an edit.

  python3 scripts/keep/ledger.py             write docs/ledger.md (make ledger)
  python3 scripts/keep/ledger.py --check     exit 1 while docs/ledger.md differs
                                             or a row disagrees with the series
  python3 scripts/keep/ledger.py --releases 0.20.2,0.33.0
                                             also print, per release and bug:
                                             fixed upstream / fixed by the fork
                                             (patch N) / open
  python3 scripts/keep/ledger.py --readme    print README.md's last row of the
                                             series table ("and N more ...")
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.release_table import release_patches
from lib.cli import main_guard, parser, say
from lib.errors import ForkError
from lib.paths import ROOT, rel
from lib.series import Series, find_series, version_key

DATA = ROOT / "scripts" / "data" / "ledger.toml"
LEDGER = ROOT / "docs" / "ledger.md"
VERDICTS = {"carried": "carried", "will-not": "will not", "cannot-yet": "cannot yet"}
FOUND_BY = ("reproducer", "probe", "read")
# The cells of the per-release view (`--releases`, `make matrix`).
FIXED_UPSTREAM = "fixed upstream"
OPEN = "open"
NOT_AFFECTED = "-"
UNKNOWN = "unknown"
REF = re.compile(r"^([\w.-]+/[\w.-]+)#(\d+)$")
# A pytest id in a row's probe text: tests/<path>.py::<test>[<params>].
TEST_ID = re.compile(r"tests/[\w/]+\.py::\w+(?:\[[\w.-]+\])?")


@dataclass(frozen=True)
class Bug:
    """One row of scripts/data/ledger.toml (its header says what each field
    holds)."""

    id: str
    title: str
    issues: tuple[str, ...]
    prs: tuple[str, ...]
    fixed_in: str
    found_by: str
    affected: tuple[str, str]
    verdict: str
    scope: str
    patch: str = ""
    reason: str = ""
    reproducers: tuple[str, ...] = ()
    spared: tuple[str, ...] = ()
    probe: str = ""
    fix_note: str = ""
    seed: str = ""


REQUIRED = ("id", "title", "issues", "prs", "fixed_in", "found_by", "affected")
REQUIRED += ("verdict", "scope")


def releases(all_series: list[Series]) -> list[str]:
    """The releases the ledger speaks of: those with a series, oldest first."""
    return sorted((s.base().version for s in all_series), key=version_key)


def check_row(i: int, row: dict, known: list[str]) -> list[str]:
    """What is wrong with one [[bug]] table; empty when nothing is."""
    where = f"bug {i + 1} ({row.get('id', 'no id')})"
    names = {f.name for f in fields(Bug)}
    errors = [f"{where}: lacks {k}" for k in REQUIRED if k not in row]
    errors += [f"{where}: unknown field {k}" for k in sorted(set(row) - names)]
    if errors:
        return errors
    text = ("id", "title", "fixed_in", "found_by", "verdict", "scope", "patch")
    text += ("reason", "probe", "fix_note", "seed")
    errors += [
        f"{where}: {k} must be a string"
        for k in text
        if not isinstance(row.get(k, ""), str)
    ]
    lists = ("issues", "prs", "reproducers", "spared")
    errors += [
        f"{where}: {k} must be a list of strings"
        for k in lists
        if not isinstance(row.get(k, []), list)
        or not all(isinstance(x, str) for x in row.get(k, []))
    ]
    if errors:
        return errors
    if row["verdict"] not in VERDICTS:
        errors.append(
            f"{where}: verdict {row['verdict']!r} is none of {list(VERDICTS)}"
        )
    if row["found_by"] not in FOUND_BY:
        errors.append(f"{where}: found_by {row['found_by']!r} is none of {FOUND_BY}")
    span = row["affected"]
    if not (isinstance(span, list) and len(span) == 2):
        return [*errors, f"{where}: affected must be [first, last]"]
    for name in [*span, *([row["fixed_in"]] if row["fixed_in"] else [])]:
        if name not in known:
            errors.append(f"{where}: {name!r} is no release with a series")
    if errors:
        return errors
    if version_key(span[0]) > version_key(span[1]):
        errors.append(f"{where}: affected {span[0]} comes after {span[1]}")
    for name in row.get("spared", []):
        if name not in known or not (
            version_key(span[0]) < version_key(name) < version_key(span[1])
        ):
            errors.append(
                f"{where}: spared {name!r} is no release strictly inside "
                f"affected {span[0]}-{span[1]}"
            )
    if row["fixed_in"] and version_key(row["fixed_in"]) <= version_key(span[1]):
        errors.append(f"{where}: fixed in {row['fixed_in']}, yet affected to {span[1]}")
    for ref in row["prs"]:
        if not REF.match(ref):
            errors.append(f"{where}: PR {ref!r} is not owner/repo#N")
    if row["verdict"] == "carried":
        if not row.get("patch"):
            errors.append(f"{where}: a carried row names its patch's subject")
        if not row.get("reproducers"):
            errors.append(f"{where}: a carried row names its reproducers")
        if row.get("reason"):
            errors.append(f"{where}: a carried row has no reason")
    else:
        if not row.get("reason"):
            errors.append(f"{where}: a {row['verdict']} row says why (reason)")
        if not row.get("probe"):
            errors.append(f"{where}: a {row['verdict']} row says how it was measured")
        if row.get("patch") or row.get("reproducers"):
            errors.append(f"{where}: only a carried row has a patch or reproducers")
    return errors


def load(path: Path = DATA, known: list[str] | None = None) -> list[Bug]:
    """The ledger's rows, in the file's order; a ForkError listing every
    problem when the data is not what the header of ledger.toml describes."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ForkError(f"{rel(path)}: {e}") from e
    known = known if known is not None else releases(find_series())
    rows = data.get("bug", [])
    errors = [] if set(data) <= {"bug"} else [f"unknown tables: {sorted(set(data))}"]
    errors += [e for i, row in enumerate(rows) for e in check_row(i, row, known)]
    ids = [row.get("id") for row in rows]
    errors += [f"id {i!r} is used twice" for i in sorted(set(ids)) if ids.count(i) > 1]
    if not rows:
        errors.append("no [[bug]] rows")
    if errors:
        raise ForkError(f"{rel(path)}:\n  " + "\n  ".join(errors))
    return [
        Bug(**{k: tuple(v) if isinstance(v, list) else v for k, v in row.items()})
        for row in rows
    ]


def probe_tests(bugs: list[Bug]) -> list[str]:
    """The tests the rows' probes name, each once: they pin what the bare
    releases do, and make test-releases runs them on every series. An id
    whose parameters the pattern cannot read is an error, not the whole
    test silently."""
    ids = {t for bug in bugs for t in TEST_ID.findall(bug.probe)}
    cut = sorted(
        f"{bug.id}: {m.group(0)}..."
        for bug in bugs
        for m in TEST_ID.finditer(bug.probe)
        if bug.probe[m.end() : m.end() + 1] == "["
    )
    if cut:
        raise ForkError(
            f"{rel(DATA)}: a probe's test id with parameters the ledger cannot "
            "read (letters, digits, '.', '-' and '_' only):\n  " + "\n  ".join(cut)
        )
    return sorted(ids)


def in_range(version: str, first: str, last: str) -> bool:
    return version_key(first) <= version_key(version) <= version_key(last)


def affects(bug: Bug, version: str) -> bool:
    """The release's own code has the bug: inside `affected`, not spared."""
    return in_range(version, *bug.affected) and version not in bug.spared


def fixed_upstream(bug: Bug, version: str) -> bool:
    """The release's own code has the fix."""
    return bool(bug.fixed_in) and version_key(version) >= version_key(bug.fixed_in)


class SeriesView:
    """The committed series as the ledger reads them: each release's
    patches by subject, and each subject's label in README.md's release
    table (0001 ... by their number in patches/, R1 ... for the patches only
    other releases carry)."""

    def __init__(self, all_series: list[Series] | None = None) -> None:
        all_series = all_series or find_series()
        default = all_series[0]
        self.labels = {p.subject(): p.name[:4] for p in default.patches()}
        self.labels.update(release_patches(default, all_series))
        self.releases = releases(all_series)
        self.subjects = {
            s.base().version: {p.subject(): p for p in s.patches()} for s in all_series
        }

    def carriers(self, subject: str) -> list[str]:
        """The releases whose series carries the patch, oldest first."""
        return [v for v in self.releases if subject in self.subjects[v]]

    def reproducers(self, subject: str) -> set[str]:
        """Every Reproducer: trailer the patch has in any series."""
        return {
            t
            for v in self.releases
            if subject in self.subjects[v]
            for t in self.subjects[v][subject].reproducers()
        }

    def spans(self, versions: list[str]) -> str:
        """Releases as runs of consecutive ones: "0.19.0-0.25.1, 0.30.0"."""
        runs: list[list[str]] = []
        for v in self.releases:
            if v not in versions:
                continue
            i = self.releases.index(v)
            if runs and self.releases.index(runs[-1][-1]) == i - 1:
                runs[-1].append(v)
            else:
                runs.append([v])
        return ", ".join(r[0] if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def status(bug: Bug, version: str, series: SeriesView) -> str:
    """Where the bug stands on one release: fixed upstream, fixed by the
    fork (patch N), open, or not affected ("-")."""
    if version not in series.releases:
        return UNKNOWN
    if fixed_upstream(bug, version):
        return FIXED_UPSTREAM
    if not affects(bug, version):
        return NOT_AFFECTED
    if bug.verdict == "carried" and bug.patch in series.subjects[version]:
        return f"fixed by the fork (patch {series.labels[bug.patch]})"
    return OPEN


def disagreements(bugs: list[Bug], series: SeriesView) -> list[str]:
    """Where a carried row and the committed series disagree: a release it
    affects whose series lacks the patch (and whose code lacks the fix), a
    release from the first fixed one on that still carries it, or a
    reproducer the patch's trailers do not name. A release past one row's
    upstream fix may keep the patch for another row it still affects."""
    out = []
    # Per patch, the releases some carried row still needs it on.
    kept_for: dict[str, set[str]] = {}
    for bug in bugs:
        if bug.verdict == "carried":
            kept_for.setdefault(bug.patch, set()).update(
                v
                for v in series.releases
                if affects(bug, v) and not fixed_upstream(bug, v)
            )
    for bug in bugs:
        if bug.verdict != "carried":
            continue
        if bug.patch not in series.labels:
            out.append(f"{bug.id}: no series carries a patch {bug.patch!r}")
            continue
        have = series.carriers(bug.patch)
        for v in series.releases:
            upstream = fixed_upstream(bug, v)
            if affects(bug, v) and not upstream and v not in have:
                out.append(f"{bug.id}: the {v} series lacks {bug.patch!r}")
            if upstream and v in have and v not in kept_for[bug.patch]:
                out.append(
                    f"{bug.id}: fixed upstream in {v}, yet its series carries it"
                )
        named = series.reproducers(bug.patch)
        for t in bug.reproducers:
            if t not in named:
                out.append(f"{bug.id}: {t} is no Reproducer: trailer of {bug.patch!r}")
    return out


def link(ref: str, kind: str) -> str:
    """owner/repo#N as a link (vllm-project/vllm#N shown as vllm#N)."""
    m = REF.match(ref)
    if not m:
        return ref
    short = m.group(1).removeprefix("vllm-project/")
    return (
        f"[{short}#{m.group(2)}](https://github.com/{m.group(1)}/{kind}/{m.group(2)})"
    )


def fix_cell(bug: Bug, newest: str) -> str:
    what = ", ".join(link(p, "pull") for p in bug.prs) or bug.fix_note
    if not bug.fixed_in:
        return f"{what}; none up to {newest}" if what else f"none up to {newest}"
    read = " (read)" if bug.found_by == "read" else ""
    return f"{what or 'PR not identified'}; first in {bug.fixed_in}{read}"


def verdict_cell(bug: Bug, series: SeriesView) -> str:
    if bug.verdict == "carried":
        return f"carried: {series.labels.get(bug.patch, '?')}"
    return f"{VERDICTS[bug.verdict]}: {bug.reason}"


def counts(bugs: list[Bug]) -> str:
    n = {v: sum(b.verdict == v for b in bugs) for v in VERDICTS}
    return (
        f"{n['carried']} carried, {n['will-not']} the fork will not carry, "
        f"{n['cannot-yet']} it cannot yet"
    )


def render(bugs: list[Bug], series: SeriesView | None = None) -> str:
    """docs/ledger.md."""
    series = series or SeriesView()
    first, newest = series.releases[0], series.releases[-1]
    lines = [
        "# The bug ledger",
        "",
        "<!-- scripts/keep/ledger.py writes this page from scripts/data/ledger.toml "
        "and the series: edit those, then `make ledger` -->",
        "",
        "Every known bug in vLLM's KV block allocator (`vllm/v1/core`) and CPU "
        "offload connector (`vllm/v1/simple_kv_offload`) on the releases this "
        f"fork serves ({first}-{newest}), and whether the fork carries its fix "
        "(the patch's number as in the README's release table: 0001 ... in "
        "`patches/`, R1 ... only in other releases' series), will not, or cannot "
        f"yet, with why. {len(bugs)} bugs: {counts(bugs)}.",
        "",
        "*First in* is the first release whose code has the fix and *affected* "
        "the bare releases that have the bug, found by running the row's "
        "reproducers or probe on the bare releases, or, where it says *read*, "
        "by reading their sources (*not* names a release inside the span "
        "whose code lacks it: a fix a later release took back). A carried fix "
        "is in the series of every "
        "affected release, and `make rebase` drops it from the first release "
        "whose bare tree passes its reproducers, unless another row it "
        "carries still affects that release "
        "(`tests/tooling/test_ledger.py` checks both against the committed "
        "series). `make ledger` prints where each bug stands on each release "
        "(fixed upstream, fixed by the fork, open); `make matrix` adds the same "
        "for the releases it measures.",
        "",
        "How upstream's record is searched for these bugs, and the reports "
        "examined and left out, with the date of the last scan: "
        "[ledger-scan.md](ledger-scan.md).",
        "",
        "| bug | upstream issue | upstream fix | affected | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    for bug in bugs:
        issues = ", ".join(link(i, "issues") for i in bug.issues) or "-"
        span = "-".join(dict.fromkeys(bug.affected))
        span += f" (not {', '.join(bug.spared)})" if bug.spared else ""
        read = " (read)" if bug.found_by == "read" else ""
        lines.append(
            f"| [{bug.title}](#{bug.id}) | {issues} | {fix_cell(bug, newest)} "
            f"| {span}{read} | {verdict_cell(bug, series)} |"
        )
    lines += ["", "## The rows, and how each was measured"]
    for bug in bugs:
        lines += ["", f'<a id="{bug.id}"></a>', "", f"### {bug.id}: {bug.title}", ""]
        if bug.verdict == "carried":
            label = series.labels.get(bug.patch, "?")
            have = series.spans(series.carriers(bug.patch)) or "no release"
            lines.append(
                f"- **Carried** by {label}, *{bug.patch}*, in the series of {have}."
            )
            tests = ", ".join(f"`{t}`" for t in bug.reproducers)
            lines.append(
                f"- **Measured** by its reproducers, which fail on the affected "
                f"bare releases and pass with their series: {tests}."
            )
        else:
            lines.append(f"- **{VERDICTS[bug.verdict].capitalize()}**: {bug.reason}.")
        if bug.probe:
            lines.append(f"- **Probe**: {bug.probe}")
        lines.append(f"- **Scope**: {bug.scope}")
    return "\n".join(lines) + "\n"


def readme_row(bugs: list[Bug]) -> str:
    """The last row of README.md's series table, which lists only the rows
    of the seeds' bugs."""
    rest = [b for b in bugs if not b.seed]
    return (
        f"| … | and {len(rest)} more from the ledger: [docs/ledger.md](docs/ledger.md) "
        f"({counts(rest)}) | |"
    )


def status_table(bugs: list[Bug], versions: list[str], series: SeriesView) -> str:
    """Per release (columns) and bug (rows): where it stands."""
    lines = [
        "| bug | " + " | ".join(versions) + " |",
        "| --- |" + " --- |" * len(versions),
    ]
    for bug in bugs:
        cells = [status(bug, v, series) for v in versions]
        lines.append(f"| {bug.id} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if docs/ledger.md differs or a row "
        "disagrees with the series",
    )
    p.add_argument(
        "--releases",
        metavar="LIST",
        help="comma-separated releases (or 'all') to print the per-release view for",
    )
    p.add_argument(
        "--readme", action="store_true", help="print README.md's series-table row"
    )
    args = p.parse_args()
    series = SeriesView()
    bugs = load(known=series.releases)
    if args.readme:
        sys.stdout.write(readme_row(bugs) + "\n")
        return 0
    problems = disagreements(bugs, series)
    text = render(bugs, series)
    if args.check:
        if LEDGER.is_file() and LEDGER.read_text() == text and not problems:
            return 0
        for problem in problems:
            say(f"  {problem}")
        if not LEDGER.is_file() or LEDGER.read_text() != text:
            say(f"{rel(LEDGER)} differs from the data: run `make ledger`")
        return 1
    if problems:
        raise ForkError(
            "the ledger disagrees with the series:\n  " + "\n  ".join(problems)
        )
    LEDGER.write_text(text)
    say(f"written {rel(LEDGER)}: {len(bugs)} bugs, {counts(bugs)}")
    if args.releases:
        chosen = series.releases if args.releases == "all" else args.releases.split(",")
        sys.stdout.write(status_table(bugs, [v.strip() for v in chosen], series) + "\n")
    return 0


if __name__ == "__main__":
    main_guard(main)
