"""make mutate's report (.work/mutate/mutate.md): per series and kind, what
was killed, what survived with its diff, and each equivalent's reason."""

from __future__ import annotations

from dataclasses import dataclass

from prove.mutate_operators import OperatorMutant
from prove.mutate_semantic import SemanticMutant


@dataclass
class Hunk:
    patch: str  # the patch's subject
    file: str
    header: str  # the hunk's @@ line
    text: str  # a patch holding just this hunk

    @property
    def name(self) -> str:
        return f"{self.file} {self.header.split('@@')[1].strip()}"


@dataclass
class Outcome:
    hunk: Hunk
    state: str  # killed, survived, equivalent, not separable
    detail: str = ""


def report(
    version: str,
    outcomes: list[Outcome],
    operators: list[OperatorMutant],
    semantic: list[SemanticMutant],
) -> list[str]:
    def killed(states: list[str]) -> str:
        n, m = states.count("killed"), states.count("killed") + states.count("survived")
        return f"{n} of {m} killed ({100 * n / m:.0f}%)" if m else "none run"

    return [
        f"## vLLM {version}",
        "",
        f"Hunk reverts: {killed([o.state for o in outcomes])}. "
        f"Operator mutants: {killed([m.state for m in operators])}. "
        f"Semantic mutants: {killed([m.state for m in semantic])}.",
        "",
        *hunk_report(outcomes),
        "",
        *operator_report(operators),
        "",
        *semantic_report(semantic),
    ]


def semantic_report(semantic: list[SemanticMutant]) -> list[str]:
    states = ("killed", "survived", "equivalent")
    lines = [
        "### Semantic mutants (scripts/data/semantic_mutants.toml)",
        "",
        "| patch | mutants | " + " | ".join(states) + " |",
        "| --- | --- | --- | --- | --- |",
    ]
    for patch in dict.fromkeys(m.patch for m in semantic):
        mine = [m for m in semantic if m.patch == patch]
        counts = " | ".join(str(sum(m.state == s for m in mine)) for s in states)
        lines.append(f"| {patch} | {len(mine)} | {counts} |")
    lines += ["", "| mutant | result | by | the bug |", "| --- | --- | --- | --- |"]
    for m in semantic:
        by = m.detail.replace("|", "\\|")
        lines.append(f"| {m.id} | {m.state} | {by} | {m.why} |")
    for m in semantic:
        if m.state == "survived":
            lines += ["", f"Survived: {m.id} ({m.file})", "```diff"]
            for edit in m.edits:
                lines += [f"-{x}" for x in edit.find.splitlines()]
                lines += [f"+{x}" for x in edit.replace.splitlines()]
            lines.append("```")
    return lines


def operator_report(operators: list[OperatorMutant]) -> list[str]:
    states = ("killed", "survived", "equivalent", "incompetent")
    lines = [
        "### Operator mutants (Cosmic Ray)",
        "",
        "| patch | mutants | " + " | ".join(states) + " |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for patch in dict.fromkeys(m.patch for m in operators):
        mine = [m for m in operators if m.patch == patch]
        counts = " | ".join(str(sum(m.state == s for m in mine)) for s in states)
        lines.append(f"| {patch} | {len(mine)} | {counts} |")
    for m in operators:
        if m.state == "survived":
            lines += ["", f"Survived: {m.patch}, {m.name}", "```diff"]
            body = m.diff.splitlines()
            lines += [d for d in body if not d.startswith(("---", "+++"))]
            lines.append("```")
    for state in ("equivalent", "incompetent"):
        listed = [m for m in operators if m.state == state]
        if listed:
            lines += ["", f"{state.capitalize()}:"]
            lines += [f"- {m.patch}, {m.name}: {m.detail}" for m in listed]
    return lines


def hunk_report(outcomes: list[Outcome]) -> list[str]:
    lines = [
        "### Hunks reverted alone",
        "",
        "| patch | hunks | killed | survived | equivalent | not separable |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    patches = list(dict.fromkeys(o.hunk.patch for o in outcomes))
    for patch in patches:
        mine = [o for o in outcomes if o.hunk.patch == patch]
        count = {
            s: sum(o.state == s for o in mine)
            for s in ("killed", "survived", "equivalent", "not separable")
        }
        lines.append(
            f"| {patch} | {len(mine)} | "
            + " | ".join(str(v) for v in count.values())
            + " |"
        )
    for o in outcomes:
        if o.state == "survived":
            lines += [
                "",
                f"Survived: {o.hunk.patch}, {o.hunk.name}",
                "```diff",
                o.hunk.text.split("\n@@", 1)[-1].join(["@@", ""]).rstrip(),
                "```",
            ]
    equivalent = [o for o in outcomes if o.state == "equivalent"]
    if equivalent:
        lines += ["", "Equivalent:"]
        lines += [f"- {o.hunk.patch}, {o.hunk.name}: {o.detail}" for o in equivalent]
    return lines
