#!/usr/bin/env python3
"""Add a fix from upstream vLLM to the series as its next numbered patch.

From a local clone of vLLM and a commit or a commit range:
  scripts/keep/import_patch.py --repo ~/src/vllm 1a2b3c4d           (one commit)
  scripts/keep/import_patch.py --repo ~/src/vllm v0.21.0..1a2b3c4d  (squashed)
or from an mbox or .patch file (git format-patch output, or a pull
request's https://github.com/vllm-project/vllm/pull/<n>.patch saved):
  scripts/keep/import_patch.py fix.patch --reproducer tests/reproducers/...

Only the paths the series tracks are kept (series.TRACKED_PATHS:
vllm/v1/core, vllm/v1/simple_kv_offload and their tests). The change is
applied to a tree built from the series (in a temporary directory, your
vllm/ is not touched), squashed into one commit that keeps the upstream
author and message, and given the project's trailers:
  Upstream-Status: backport of upstream commit <sha> (or --status)
  Upstream-Commit: <sha>                  one per upstream commit
  Upstream-PR:     vllm-project/vllm#<n>  from a "(#<n>)" ending a subject
  Upstream-Issue:  --issue, or "Fixes #<n>" in the message
  Reproducer:      --reproducer (repeatable; `make test` needs one)
It is written with refresh's `git format-patch`, so `make apply && make
refresh` leaves it byte for byte. Refused, with nothing written: input that
is not a patch, a change that touches no tracked path, a change already in
the series (same upstream commit or same diff), one that does not apply.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.apply import make_hint, patch_ids, scratch_tree
from keep.refresh import format_patches, series_commits
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import DEFAULT_TREE, ROOT, WORK, rel
from lib.proc import git, git_ok, run, tool_identity_env
from lib.series import TRACKED_PATHS, Series, is_tracked

MAIL_START = re.compile(r"^From ([0-9a-f]{40}) ", re.M)
DIFF_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)
ZERO = "0" * 40
PR_RE = re.compile(r"\(#(\d+)\)\s*$")
ISSUE_RE = re.compile(
    r"\b(?:fix(?:es|ed)?|close[sd]?|resolve[sd]?)\b:?\s*"
    r"(?:https://github\.com/vllm-project/vllm/issues/|#)(\d+)",
    re.I,
)


@dataclass
class Mail:
    """One commit as an email: headers and message, then its diff blocks."""

    commit: str | None
    head: str
    blocks: list[str]

    @property
    def subject(self) -> str:
        m = re.search(r"^Subject: (.*(?:\n .*)*)", self.head, re.M)
        text = " ".join(m.group(1).split()) if m else ""
        return re.sub(r"^\[PATCH[^\]]*\]\s*", "", text)

    def paths(self) -> list[str]:
        out = []
        for block in self.blocks:
            m = DIFF_HEADER.match(block)
            if m:
                out += [m.group(1), m.group(2)]
        return sorted(set(out))

    def text(self) -> str:
        return self.head.rstrip("\n") + "\n---\n\n" + "".join(self.blocks)


def parse_mails(text: str, source: str) -> list[Mail]:
    """Split an mbox (or one .patch) into mails; refuse what is not a patch."""
    if not DIFF_HEADER.search(text):
        raise ForkError(
            f"{source} is not a patch: it has no `diff --git` section. Give a "
            "file made by git format-patch (or a pull request's .patch), or "
            "--repo with a commit range."
        )
    starts = [m.start() for m in MAIL_START.finditer(text)] or [0]
    mails = []
    for begin, end in zip(starts, [*starts[1:], len(text)], strict=True):
        chunk = text[begin:end]
        if not re.search(r"^Subject: ", chunk, re.M) or not re.search(
            r"^From: ", chunk, re.M
        ):
            raise ForkError(
                f"{source} has a diff without an author and message (no From: "
                "and Subject: headers): make it with `git format-patch`."
            )
        first = DIFF_HEADER.search(chunk)
        assert first is not None
        head = chunk[: first.start()]
        # The message ends at "---" (the diffstat follows, which filtering
        # would make wrong); git am does not need it.
        head = head.split("\n---\n", 1)[0]
        diff = chunk[first.start() :]
        starts_b = [m.start() for m in DIFF_HEADER.finditer(diff)]
        blocks = [
            diff[a:b] for a, b in zip(starts_b, [*starts_b[1:], len(diff)], strict=True)
        ]
        m = MAIL_START.match(chunk)
        commit = m.group(1) if m and m.group(1) != ZERO else None
        mails.append(Mail(commit, head + "\n", blocks))
    return mails


def keep_tracked(mails: list[Mail], source: str) -> list[Mail]:
    """Drop diff blocks outside the tracked paths, and mails left empty."""
    kept = []
    touched: set[str] = set()
    for mail in mails:
        touched.update(mail.paths())
        blocks = []
        for block in mail.blocks:
            m = DIFF_HEADER.match(block)
            if m and (is_tracked(m.group(1)) or is_tracked(m.group(2))):
                blocks.append(block)
        if blocks:
            kept.append(Mail(mail.commit, mail.head, blocks))
        else:
            say(f"    skipping {mail.subject}: it touches no tracked path")
    if not kept:
        shown = ", ".join(sorted(touched)[:8]) + (" ..." if len(touched) > 8 else "")
        raise ForkError(
            f"{source} touches none of the paths the series tracks "
            f"({', '.join(TRACKED_PATHS)}); it changes {shown}. Nothing to import."
        )
    return kept


def mails_from_repo(repo: Path, spec: str) -> list[Mail]:
    """format-patch the commits of `spec` (a commit, or A..B) in a clone."""
    if not git_ok(repo, "rev-parse", "--git-dir"):
        raise ForkError(f"--repo {repo}: not a git repository (a clone of vLLM)")
    rng = spec if ".." in spec else f"{spec}^!"
    proc = run(["git", "-C", repo, "rev-list", "--no-merges", rng], check=False)
    if proc.returncode != 0:
        raise ForkError(f"{spec!r} is not a commit or range in {repo}")
    if not proc.stdout.split():
        raise ForkError(f"{spec!r} has no commits (merges left out) in {repo}")
    text = git(
        repo,
        "format-patch",
        "--stdout",
        "--no-merges",
        "--full-index",
        "--no-signature",
        "-k",
        rng,
        "--",
        *TRACKED_PATHS,
    )
    if not text.strip():
        raise ForkError(
            f"{spec!r} in {repo} touches none of the paths the series tracks "
            f"({', '.join(TRACKED_PATHS)}). Nothing to import."
        )
    return parse_mails(text + "\n", f"{spec} in {repo}")


def known_commits(series: Series) -> dict[str, str]:
    """Upstream commit ids the series already carries -> patch name."""
    out = {}
    for p in series.patches():
        for value in p.trailers().get("Upstream-Commit", []):
            out[value.split()[0].lower()] = p.name
    return out


def check_not_imported(series: Series, mails: list[Mail]) -> None:
    known = known_commits(series)
    for mail in mails:
        if not mail.commit:
            continue
        for sha, name in known.items():
            if mail.commit.startswith(sha) or sha.startswith(mail.commit):
                raise ForkError(
                    f"upstream commit {mail.commit[:12]} ({mail.subject}) is already "
                    f"in the series: {rel(series.dir)}/{name}"
                )


def trailers(
    mails: list[Mail], status: str | None, issues: list[str], reproducers: list[str]
) -> list[str]:
    """The project's trailers for an imported change."""
    commits = [m.commit for m in mails if m.commit]
    short = ", ".join(c[:12] for c in commits)
    status = status or (
        f"backport of upstream commit{'s' if len(commits) > 1 else ''} {short}"
        if commits
        else "backport (from a patch file without commit ids)"
    )
    out = [f"Upstream-Status: {status}"]
    out += [f"Upstream-Commit: {c}" for c in commits]
    messages = "\n".join(m.head for m in mails)
    for mail in mails:
        if m := PR_RE.search(mail.subject):
            out.append(f"Upstream-PR: vllm-project/vllm#{m.group(1)}")
    found = issues or sorted(set(ISSUE_RE.findall(messages)), key=int)
    out += [
        f"Upstream-Issue: {i if '#' in i else f'vllm-project/vllm#{i}'}" for i in found
    ]
    out += [f"Reproducer: {r}" for r in reproducers]
    return out


def next_number(series: Series) -> int:
    return max((p.number for p in series.patches()), default=0) + 1


def apply_mails(tree: Path, mails: list[Mail], keep: Path, series: Series) -> None:
    """git am the filtered mails at the tree's HEAD, or explain the conflict
    (keeping the filtered patch as `keep`, to apply by hand on `series`)."""
    mbox = tree.parent / "filtered.patch"
    mbox.write_bytes(
        "".join(m.text() for m in mails).encode("utf-8", "surrogateescape")
    )
    am = run(
        ["git", "-C", tree, "am", "-q", "-3", "--keep-non-patch", mbox],
        env=tool_identity_env(),
        check=False,
    )
    if am.returncode == 0:
        return
    files = git(tree, "diff", "--name-only", "--diff-filter=U").split()
    out = (am.stdout + am.stderr).strip()
    run(["git", "-C", tree, "am", "--abort"], check=False)
    if "No changes" in out or "already applied" in out:
        raise ForkError(
            "the change is already in the series: applying it changes nothing"
        )
    keep.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(mbox, keep)
    raise ForkError(
        "the change does not apply to the series"
        + (f" (conflicts in {', '.join(files)})" if files else "")
        + f":\n{out[-1500:]}\nThe filtered patch is kept as {rel(keep)}. To "
        f"import it by hand: {make_hint('apply', DEFAULT_TREE, series)}; "
        f"git -C {rel(DEFAULT_TREE)} am -3 {rel(keep)}; resolve, add the trailers "
        "(see --help) with git commit --amend; "
        f"{make_hint('refresh', DEFAULT_TREE, series)}."
    )


def squash(
    tree: Path, start: str, mails: list[Mail], lines: list[str], subject: str | None
) -> str:
    """One commit from `start` to HEAD, upstream message plus trailers."""
    commits = git(tree, "rev-list", "--reverse", f"{start}..HEAD").split()
    if not commits:
        raise ForkError(
            "the change is already in the series: applying it changes nothing"
        )
    first = commits[0]
    if len(commits) == 1:
        message = git(tree, "log", "-1", "--format=%B", first)
        if subject:
            message = subject + "\n" + message.partition("\n")[2]
    else:
        listed = "\n".join(f"- {(m.commit or '?')[:12]} {m.subject}" for m in mails)
        message = (
            f"{subject or git(tree, 'log', '-1', '--format=%s', first)}\n\n"
            f"Backport of {len(mails)} upstream commits, squashed:\n\n{listed}\n"
        )
    args = [a for line in lines for a in ("--trailer", line)]
    message = git(tree, "interpret-trailers", *args, input=message.rstrip() + "\n")
    author = git(tree, "log", "-1", "--format=%an%x00%ae%x00%ad", "--date=raw", first)
    name, email, date = author.split("\0")
    env = {
        **tool_identity_env(date),
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
    }
    git(tree, "reset", "-q", "--soft", start)
    git(tree, "commit", "-q", "--no-verify", "-F", "-", input=message, env=env)
    return git(tree, "rev-parse", "HEAD")


def import_change(
    series: Series,
    mails: list[Mail],
    source: str,
    status: str | None = None,
    issues: list[str] | None = None,
    reproducers: list[str] | None = None,
    subject: str | None = None,
) -> Path:
    """Add the mails' tracked changes to `series` as one patch; return it."""
    mails = keep_tracked(mails, source)
    check_not_imported(series, mails)
    for r in reproducers or []:
        if not (ROOT / r.split("::")[0]).is_file():
            say(f"warning: reproducer {r} does not exist yet")
    if not reproducers:
        say(
            "warning: no --reproducer: `make test` fails until the patch names "
            "one (add a Reproducer: trailer in vllm/ and "
            f"`{make_hint('refresh', DEFAULT_TREE, series)}`)"
        )
    number = next_number(series)
    with tempfile.TemporaryDirectory(prefix="vllm-fork-import-") as tmp:
        step(f"building the series in a scratch tree to apply {source} on")
        tree = scratch_tree(series, Path(tmp) / "tree")
        commits = series_commits(tree, series)
        start = commits[-1] if commits else series.base().tag
        git(tree, "checkout", "-q", "--detach", start)
        step(f"applying {len(mails)} commit(s), tracked paths only")
        apply_mails(
            tree, mails, WORK / "import" / f"{number:04d}-filtered.patch", series
        )
        lines = trailers(mails, status, issues or [], reproducers or [])
        commit = squash(tree, start, mails, lines, subject)
        diff = git(tree, "show", "--format=", commit) + "\n"
        new_ids = patch_ids(tree, diff)
        for p in series.patches():
            if new_ids and new_ids <= patch_ids(tree, p.path.read_text()):
                raise ForkError(
                    f"the change is already in the series: it is {rel(p.path)}"
                )
        made = format_patches(tree, [commit], Path(tmp) / "out", start=number)[0]
        dest = series.dir / made.name
        dest.write_bytes(made.read_bytes())
    return dest


def main() -> int:
    p = parser(__doc__, series="series to add the patch to")
    p.add_argument(
        "source",
        help="an mbox or .patch file; with --repo, a commit or a range A..B",
    )
    p.add_argument("--repo", type=Path, help="a local clone of vLLM")
    p.add_argument(
        "--reproducer",
        action="append",
        default=[],
        metavar="FILE::TEST",
        help="reproducer test of the fix (repeatable)",
    )
    p.add_argument(
        "--issue",
        action="append",
        default=[],
        metavar="N",
        help="upstream issue it fixes (default: from 'Fixes #N' in the message)",
    )
    p.add_argument(
        "--status",
        help="Upstream-Status value (default: backport of upstream commit <sha>); "
        "start it with 'backport' or 'upstream' if the fix is in an upstream "
        "release, so that `make export` skips it",
    )
    p.add_argument("--subject", help="subject of the squashed patch")
    args = p.parse_args()
    series = Series(args.series.resolve())
    if args.repo:
        repo = args.repo.expanduser().resolve()
        mails, source = mails_from_repo(repo, args.source), f"{args.source}"
    else:
        path = Path(args.source)
        if not path.is_file():
            raise ForkError(
                f"{args.source}: no such file (to import commits, pass --repo "
                "<clone of vLLM> with the commit or range)"
            )
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
        mails, source = parse_mails(text, rel(path)), rel(path)
    dest = import_change(
        series, mails, source, args.status, args.issue, args.reproducer, args.subject
    )
    say(f"added {rel(dest)}")
    say("next: make apply && make test (the reproducer must fail on the base)")
    return 0


if __name__ == "__main__":
    main_guard(main)
