"""The draft pull request description of an exported patch
(dist/export/<patch>.md), in vLLM's template.

`pr_description` fills it from the patch's message: the purpose, the issues
it fixes (`issue_line`), the PRs it is stacked on, its reproducer tests with
their source (`test_source`) and how to run them, and the results: the
checks the branch passed and the last end-to-end runs of its scenarios
(`e2e_figures`, from make e2e's records). Separate from export.py, which
makes the branches and runs the checks: this is text only.
"""

from __future__ import annotations

import ast
import json
import re

from lib.paths import ROOT, WORK, rel
from lib.series import TRAILER_RE, Patch

# make e2e's runs as data (make test's short run: e2e-short.json).
E2E_RECORDS = (WORK / "e2e" / "e2e.json", WORK / "e2e" / "e2e-short.json")
ISSUE_RE = re.compile(r"^(?:([\w.-]+/[\w.-]+))?#(\d+)$")
UPSTREAM_REPO = "vllm-project/vllm"


def test_source(test_id: str) -> str | None:
    """Source of a reproducer test named `file::name` (or file::Class::name)."""
    file, _, name = test_id.partition("::")
    path = ROOT / file
    if not path.is_file():
        return None
    text = path.read_text()
    want = name.split("::")[-1].split("[")[0]
    for node in ast.walk(ast.parse(text)):
        is_def = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        if is_def and node.name == want:
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            return "\n".join(text.splitlines()[first - 1 : node.end_lineno])
    return None


def issue_line(issue: str) -> str:
    m = ISSUE_RE.match(issue.strip())
    if not m:
        return f"Fixes {issue}"
    repo, number = m.group(1) or UPSTREAM_REPO, m.group(2)
    if repo == UPSTREAM_REPO:
        return f"FIX #{number}"
    return f"Fixes https://github.com/{repo}/issues/{number}"


def and_list(items: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return " and ".join(filter(None, [", ".join(items[:-1]), items[-1]]))


def pr_description(
    patch: Patch,
    message: str,
    base_version: str,
    onto: str,
    lint_ok: bool,
    checks: list[str] | None = None,
    figures: list[str] | None = None,
    depends_on: list[str] | None = None,
) -> str:
    """A draft PR description in vLLM's template, from the patch's message;
    `figures`: Markdown of measured results (before/after tables);
    `depends_on`: the PRs (named by patch file and branch) it is stacked on."""
    subject, _, body = message.partition("\n\n")
    body_paras = [
        p
        for p in body.rstrip().split("\n\n")
        if not all(TRAILER_RE.match(line.strip()) for line in p.splitlines())
    ]
    issues = patch.trailers().get("Upstream-Issue", [])
    lines = [f"# {subject.strip()}", "", "## Purpose", ""]
    if depends_on:
        if len(depends_on) == 1:
            pr, it, them, shows = "PR", "it", "that one", "that PR's commit"
        else:
            pr, it, them, shows = "PRs", "them", "those", "their commits"
        lines += [
            f"**Depends on** the {pr} of {and_list(depends_on)}: this change "
            f"is stacked on {it} (it needs {it}). Please review and merge this "
            f"PR after {them}; until then its diff also shows {shows}.",
            "",
        ]
    lines += ["\n\n".join(body_paras), ""]
    lines += [issue_line(i) for i in issues] + ([""] if issues else [])
    lines += ["## Test Plan", ""]
    tests = patch.reproducers()
    if tests:
        lines += [
            "The reproducer from the vllm-fork patch series (its own test "
            "harness, driving vLLM's real scheduler; the deeper proof beside "
            "the tests this change adds under tests/, if any):",
            "",
        ]
        lines += [f"- `{t}`" for t in tests]
        lines += [
            "",
            "```bash",
            "# in a vllm-fork checkout, against a vLLM tree with this change:",
            f"pytest {' '.join(tests)}",
            "```",
            "",
        ]
        for t in tests:
            source = test_source(t)
            if source:
                lines += [
                    "<details>",
                    f"<summary><code>{t}</code></summary>",
                    "",
                    "```python",
                    source.rstrip(),
                    "```",
                    "</details>",
                    "",
                ]
    else:
        lines += ["(The patch names no reproducer test.)", ""]
    lines += [
        "## Test Result",
        "",
        (
            ""
            if figures
            else f"On vLLM {base_version}, the fork's base, the reproducer fails "
            "without this change and passes with it (checked by vllm-fork's "
            "`make test`, together with tests/v1/core and "
            "tests/v1/simple_kv_offload). "
        )
        + f"Rebased onto {onto[:12]}"
        + (f", on top of {and_list(depends_on)}" if depends_on else "")
        + ("; the changed files pass vLLM's ruff settings there." if lint_ok else "."),
        "",
        *(
            ["Checked on the exported branch, as vLLM's pre-commit and CI would:", ""]
            + [f"- {c}" for c in checks]
            + [""]
            if checks
            else []
        ),
        *((figures + [""]) if figures else []),
        "---",
        "<details>",
        "<summary> Essential Elements of an Effective PR Description Checklist "
        "</summary>",
        "",
        '- [x] The purpose of the PR, such as "Fix some issue (link existing '
        'issues this PR will resolve)".',
        "- [x] The test plan, such as providing test command.",
        f"- [{'x' if figures else ' '}] The test results, such as pasting the "
        "results comparison before and after, or e2e results",
        "- [ ] (Optional) The necessary documentation update.",
        "</details>",
        "",
    ]
    return "\n".join(lines)


def e2e_figures(patch: Patch, release: str) -> list[str]:
    """The last end-to-end runs (make e2e, else make test's short one) of the
    scenarios this patch's reproducers stand for, on `release`: the bare
    release against the fork's whole series, this patch among it."""
    path = next((p for p in E2E_RECORDS if p.exists()), None)
    if path is None:
        return []
    named = {t.removeprefix("tests/reproducers/") for t in patch.reproducers()}
    rows = [
        r
        for r in json.loads(path.read_text())
        if r["release"] == release and r["reproducer"] in named
    ]
    if not rows:
        return []
    lines = [
        f"End to end: vLLM {release}'s real `vllm serve` on a CPU, with "
        "vllm-fork's model-free worker, driven by the `openai` client "
        f"(vllm-fork's `make e2e`, {rel(path)}). The bare release, and the "
        "release with the fork's whole series (this change among it):",
        "",
        "| scenario | vLLM | requests | answered | closed by client | errors "
        "| engine after | preemptions | peer strikes | CPU hit tokens |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (r["scenario"], r["kind"])):
        engine = "alive" if r["alive"] else f"dead: `{r['exception']}`"
        hits = "/".join(map(str, r["cpu_hits"])) if r["cpu_hits"] else "-"
        strikes = "-" if r["peer_strikes"] is None else str(r["peer_strikes"])
        preempted = "-" if r["preemptions"] is None else f"{r['preemptions']:.0f}"
        who = "bare release" if r["kind"] == "base" else "with the series"
        lines.append(
            f"| {r['scenario']} | {who} | {r['sent']} | {r['ok']} "
            f"| {r.get('cancelled', '-')} | {r['errors']} | {engine} | {preempted} "
            f"| {strikes} | {hits} |"
        )
    return lines
