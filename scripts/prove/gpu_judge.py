"""What `make test-gpu` expects of a GPU run, and the verdict on one.

Per tree of the bundle (a release's bare base or its series), from the
counts gpu_worker.py wrote:

- the store as the tree ships it (seed 004): where the bundle says the
  release lacks the barrier (its series carries "Order SimpleCPUOffload
  GPU->CPU stores after compute"), the bare release must copy stale or torn
  KV in at least one repetition; everywhere else (every series, a base where
  upstream has the fix) every store must copy exactly what was written;
- the store with no barrier (the control): it must race at least once,
  or the run did not exercise the race window and proves nothing;
- a load into a block a kernel in flight reads, and into a block compute
  zeroes: each must overtake the kernel at least once. The fixes of these
  races are in the scheduler, which these checks do not run; they show that
  the worker never orders a load after compute on a real GPU, which is what
  the harness's fake CUDA assumes and why its findings are races;
- the barrier's cost: the ratio of a store's time with and without it,
  reported, never judged.

A tree with no result, a worker that failed, or a store that wrote nothing
fails. Pure logic: no imports from the project, so it travels in the bundle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The four race checks gpu_worker.py runs, in its order.
RACE_CHECKS = ("store", "store-bare", "load", "zero")


@dataclass(frozen=True)
class Tree:
    """One tree of the bundle and what its shipped store must show."""

    name: str  # the bundle's folder name, e.g. v0.20.2-base
    release: str
    kind: str  # "base" or "series"
    store_race_expected: bool

    @property
    def label(self) -> str:
        return f"{self.release} {self.kind}"


@dataclass(frozen=True)
class Row:
    check: str
    ok: bool
    detail: str


def trees_of(manifest: dict[str, Any]) -> list[Tree]:
    """The trees a bundle's manifest.json lists, in its order."""
    try:
        return [
            Tree(t["name"], t["release"], t["kind"], bool(t["store_race_expected"]))
            for t in manifest["trees"]
        ]
    except (KeyError, TypeError) as e:
        raise ValueError(f"manifest.json: a tree entry lacks {e}") from e


def last_line(text: str) -> str:
    lines = [x for x in str(text).strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else "no message"


def raced(c: dict[str, Any]) -> int:
    return int(c.get("race", 0)) + int(c.get("torn", 0))


def counts(c: dict[str, Any]) -> str:
    return (
        f"{c.get('race', 0)} race, {c.get('torn', 0)} torn, "
        f"{c.get('missing', 0)} missing, {c.get('clean', 0)} clean of {c['reps']}"
    )


def judge_store(tree: Tree, c: dict[str, Any], shipped: dict[str, Any]) -> Row:
    name = f"{tree.label}: store as shipped (seed 004)"
    how = (
        f"store order {shipped.get('store_order', '?')}, "
        f"{'waits for compute' if shipped.get('wait_event') else 'no wait'}"
    )
    if c.get("missing"):
        return Row(name, False, f"a store wrote nothing: {counts(c)}")
    if tree.store_race_expected:
        if raced(c):
            return Row(
                name,
                True,
                f"the bare release races: {raced(c)} of {c['reps']} stores copied "
                f"KV the held-back write had not written ({counts(c)}; {how})",
            )
        return Row(
            name,
            False,
            f"the bare release's race did not show: {counts(c)} ({how})",
        )
    if c.get("clean") == c["reps"]:
        return Row(
            name, True, f"clean: {c['reps']} of {c['reps']} stores exact ({how})"
        )
    return Row(name, False, f"not clean: {counts(c)} ({how})")


def judge_control(tree: Tree, check: str, c: dict[str, Any]) -> Row:
    what = {
        "store-bare": (
            "store without barrier (control)",
            "a store with no wait, ANY order, read the block before the write",
            "never raced: the race window was not exercised (raise --sleep-ms)",
        ),
        "load": (
            "load into a block compute reads",
            "the load overwrote a block a kernel in flight read: loads are "
            "unordered with compute, as the harness models them",
            "no load overtook the held-back read: loads look ordered after "
            "compute here, unlike the harness's model (or the window was missed)",
        ),
        "zero": (
            "load into a block compute zeroes",
            "the zeroing wiped the loaded KV: unordered, as the harness models",
            "the loaded KV always survived the held-back zeroing: unlike the "
            "harness's model (or the window was missed)",
        ),
    }[check]
    name = f"{tree.label}: {what[0]}"
    if c.get("missing"):
        return Row(name, False, f"a copy wrote nothing: {counts(c)}")
    if raced(c):
        return Row(name, True, f"{raced(c)} of {c['reps']}: {what[1]}")
    return Row(name, False, f"0 of {c['reps']}: {what[2]}")


def judge_timing(tree: Tree, t: dict[str, Any]) -> Row:
    name = f"{tree.label}: store time, barrier/none"
    mib = t["block_bytes"] * t["blocks"] / 2**20
    return Row(
        name,
        True,
        f"{t['ratio']:.2f} ({t['ratio_q1']:.2f}-{t['ratio_q3']:.2f}): "
        f"{t['with_ms']:.3f} ms with, {t['without_ms']:.3f} ms without, per "
        f"{mib:g} MiB store, median of {t['rounds']} rounds (reported, not judged)",
    )


def judge_tree(tree: Tree, doc: dict[str, Any] | None) -> list[Row]:
    if doc is None:
        return [Row(tree.label, False, "no result: the worker did not finish")]
    if doc.get("error"):
        return [Row(tree.label, False, f"worker failed: {last_line(doc['error'])}")]
    checks = doc.get("checks", {})
    rows = []
    for check in (*RACE_CHECKS, "timing"):
        c = checks.get(check)
        if c is None or c.get("error"):
            why = last_line(c["error"]) if c else "not run"
            rows.append(Row(f"{tree.label}: {check}", False, f"failed: {why}"))
        elif check == "store":
            rows.append(judge_store(tree, c, doc.get("shipped", {})))
        elif check == "timing":
            rows.append(judge_timing(tree, c))
        else:
            rows.append(judge_control(tree, check, c))
    return rows


def judge(trees: list[Tree], results: dict[str, dict[str, Any] | None]) -> list[Row]:
    """Every tree's rows; a tree missing from `results` fails."""
    if not trees:
        return [Row("bundle", False, "the bundle lists no tree")]
    return [row for t in trees for row in judge_tree(t, results.get(t.name))]


def passed(rows: list[Row]) -> bool:
    return bool(rows) and all(r.ok for r in rows)


def device_line(results: dict[str, dict[str, Any] | None]) -> str:
    """The GPU, driver and software the results were measured on."""
    seen = {
        (
            d.get("name"),
            d.get("driver"),
            d.get("driver_api"),
            d.get("torch"),
            d.get("cuda_bindings"),
        )
        for doc in results.values()
        if doc and (d := doc.get("device"))
    }
    if not seen:
        return "device: unknown (no worker reported one)"
    return "; ".join(
        f"device: {n}, driver {drv} (CUDA {api}), torch {t}, cuda-bindings {b}"
        for n, drv, api, t, b in sorted(seen, key=str)
    )


def table(rows: list[Row]) -> str:
    """The rows as `make test` prints its summary: name, result, detail."""
    width = max([len("check"), *(len(r.check) for r in rows)])
    lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    for r in rows:
        lines.append(f"{r.check:<{width}}  {'pass' if r.ok else 'FAIL':6}  {r.detail}")
    return "\n".join(lines)
