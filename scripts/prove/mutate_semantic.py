"""The hand-written semantic mutants (scripts/data/semantic_mutants.toml):
loaded and checked, matched to the patches of a series, and applied to a
patched file's text. make mutate (prove/mutate.py) runs them."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from lib.errors import ForkError
from lib.paths import rel
from prove.mutate_operators import DATA

SEMANTIC = DATA / "semantic_mutants.toml"


@dataclass
class Edit:
    find: str  # exact text of the patched file, found there exactly once
    replace: str


@dataclass
class SemanticMutant:
    """A bug written by hand (scripts/data/semantic_mutants.toml)."""

    id: str
    release: str  # the series it applies to, by its base release
    patch: str  # a fragment of the subject of the patch it breaks
    file: str
    edits: list[Edit]  # find/replace, then each `also`, in one file
    why: str  # the plausible bug it stands for
    equivalent: str = ""  # why it cannot change behaviour, if it cannot
    state: str = ""  # killed, survived, equivalent
    detail: str = ""


SEMANTIC_FIELDS = {"id", "release", "patch", "file", "find", "replace", "why"}
SEMANTIC_OPTIONAL = {"also", "equivalent"}


def load_semantic(path: Path = SEMANTIC) -> list[SemanticMutant]:
    """The mutants of `path`, in its order; a malformed one is an error
    naming it (a typo must not drop a mutant from the count unseen)."""
    out: list[SemanticMutant] = []
    for n, m in enumerate(tomllib.loads(path.read_text()).get("mutant", []), 1):
        name = f"{rel(path)}: mutant {n} ({m.get('id', 'no id')})"
        keys = set(m)
        if not SEMANTIC_FIELDS <= keys <= SEMANTIC_FIELDS | SEMANTIC_OPTIONAL:
            raise ForkError(
                f"{name}: has {', '.join(sorted(keys))}; needs "
                f"{', '.join(sorted(SEMANTIC_FIELDS))} (and may have also, "
                "equivalent)"
            )
        also = m.get("also", [])
        if not all(sorted(a) == ["find", "replace"] for a in also):
            raise ForkError(f"{name}: each [[mutant.also]] has find and replace")
        edits = [Edit(e["find"], e["replace"]) for e in [m, *also]]
        if any(not e.find or e.find == e.replace for e in edits):
            raise ForkError(f"{name}: an edit with no text or no change")
        if any((m2.id, m2.release) == (m["id"], m["release"]) for m2 in out):
            raise ForkError(f"{name}: an earlier mutant of its release has the id")
        out.append(
            SemanticMutant(
                m["id"],
                m["release"],
                m["patch"],
                m["file"],
                edits,
                m["why"],
                m.get("equivalent", ""),
            )
        )
    return out


def mutated_text(mutant: SemanticMutant, text: str) -> str:
    """`text` (the patched file) with the mutant's edits made. Each text to
    find must be there exactly once, or the mutant is stale: an error that
    names it."""
    for edit in mutant.edits:
        count = text.count(edit.find)
        if count != 1:
            where = "not found" if count == 0 else f"found {count} times"
            raise ForkError(
                f"semantic mutant {mutant.id}: its text is {where} in "
                f"{mutant.file} of the {mutant.release} series "
                f"(scripts/data/semantic_mutants.toml):\n{edit.find}"
            )
        text = text.replace(edit.find, edit.replace)
    return text


def semantic_of(
    version: str, subjects: list[str], only: list[str] | None
) -> list[SemanticMutant]:
    """The mutants of the series on `version` whose patch is among
    `subjects` (and `only`). A mutant naming no patch of its series, or
    more than one, is an error."""
    mine = []
    for m in load_semantic():
        if m.release != version:
            continue
        matches = [s for s in subjects if m.patch in s]
        if len(matches) != 1:
            raise ForkError(
                f"semantic mutant {m.id}: patch {m.patch!r} matches "
                f"{len(matches)} patches of the {version} series, not one"
            )
        if only and not any(f in matches[0] for f in only):
            continue
        m.patch = matches[0]
        mine.append(m)
    return mine
