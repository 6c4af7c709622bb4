#!/usr/bin/env python3
"""`make e2e`: the real `vllm serve` on a CPU, base against series.

For each release the project has a series for, it starts vLLM's own
OpenAI API server and EngineCore from the bare release (base) and from the
release with its series, one after the other, each with a model-free
worker (tests/in_server/model_free_worker.py: the harness's fake model runner,
and the release's real SimpleCPUOffloadWorker on the fake CUDA), and drives
them with the `openai` client over loopback (scripts/prove/e2e_load.py):

  seed000  hybrid (full + sliding window), eager CPU offload, two long
           prompts back to back;
  seed002  requests that finish in the step their last block is computed,
           then prompts extending them: their CPU hits must be complete;
  seed003  a peer engine on the shared pool (tests/in_server/peer_scheduler.py)
           takes blocks between the scheduler's count and its grab, under
           a concurrent load;
  load     a mix: concurrency, streaming, streams closed mid-way, shared
           prefixes, preemptions, CPU hits.

What the base must do comes from the series (scripts/prove/e2e_judge.py): where
it names a scenario's reproducer, the base must break there as that
reproducer says (the engine dies of the bug's exception; or CPU hits are
lost); elsewhere it must behave as the series. The series must answer
every request, stay healthy and read no wrong KV block.
The load mix is not judged on the base (nothing there is a declared bug).
Anything else fails. Tables go to stdout and .work/e2e/e2e.md (the runs as
data: e2e.json, which `make export` quotes in its PR texts), server
logs to .work/e2e/.

--short (part of make test): seed000 and a small load mix on the default
release's base and series, the load mix on the newest release's series
(seed000 is a base-against-series pair: it runs where the base does).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import ROOT, WORK, rel
from lib.proc import run
from lib.series import Series, default_and_newest, find_series
from prove.e2e_judge import Row, Scenario, judge, named_reproducers, verdict
from prove.e2e_server import Server, read_json_lines
from prove.release_trees import prepare

OUT = WORK / "e2e"
LOAD_CLIENT = ROOT / "scripts" / "prove" / "e2e_load.py"
# KV bytes per token of the model-free worker's layers (K and V, one head
# of 16 fp16 values; the harness's PAGE_BYTES, which this process cannot
# import): CPU offload sizes are given in bytes.
TOKEN_BYTES = 2 * 1 * 16 * 2
BLOCK_SIZE = 16


def serve_args(
    gpu_blocks: int,
    cpu_blocks: int | None,
    hybrid: bool,
    max_model_len: int = 512,
    batched: int = 256,
    max_num_seqs: int = 32,
) -> list[str]:
    args = [
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks-override",
        str(gpu_blocks),
        "--max-model-len",
        str(max_model_len),
        "--max-num-batched-tokens",
        str(batched),
        "--max-num-seqs",
        str(max_num_seqs),
    ]
    if hybrid:
        args.append("--no-disable-hybrid-kv-cache-manager")
    if cpu_blocks is not None:
        config = {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": cpu_blocks * BLOCK_SIZE * TOKEN_BYTES,
                "lazy_offload": False,
            },
        }
        args += ["--kv-transfer-config", json.dumps(config)]
    return args


def hybrid_env(window: int) -> dict[str, str]:
    return {
        "VLLM_FORK_E2E_HYBRID": "1",
        "VLLM_FORK_E2E_SLIDING_WINDOW": str(window),
    }


def scenarios(short: bool) -> list[Scenario]:
    load_n, load_c = (40, 16) if short else (300, 32)
    seed000 = Scenario(
        "seed000",
        # seed 000's pool: the first long request nearly fills it, and its
        # window blocks are freed and reused while it prefills.
        serve_args(gpu_blocks=52, cpu_blocks=1024, hybrid=True, max_model_len=480),
        hybrid_env(48),
        ["--workload", "seed000"],
        reproducer="test_seed000_hybrid_offload.py::test_second_long_request_does_not_crash",
        breaks="dies",
        base_exception="AssertionError",
        base_raiser="popleft_n",
    )
    seed002 = Scenario(
        "seed002",
        # One block of prefill per step: a two-block prompt's last block is
        # computed in the step that samples its only token.
        serve_args(
            gpu_blocks=32,
            cpu_blocks=32,
            hybrid=False,
            max_model_len=256,
            batched=BLOCK_SIZE,
            max_num_seqs=BLOCK_SIZE,
        ),
        {"VLLM_SERVER_DEV_MODE": "1"},
        ["--workload", "seed002", "--requests", "3"],
        reproducer="test_offload_flush_on_finish.py::test_extended_prompt_hits_both_blocks",
        breaks="loses CPU hits",
    )
    seed003 = Scenario(
        "seed003",
        [
            *serve_args(gpu_blocks=96, cpu_blocks=None, hybrid=True),
            "--scheduler-cls",
            "in_server.peer_scheduler.PeerScheduler",
        ],
        hybrid_env(48),
        ["--workload", "load", "--requests", "60", "--concurrency", "16"],
        reproducer="test_seed003_shared_pool.py::test_peer_takes_blocks_from_running_requests",
        breaks="dies",
        base_exception="ValueError: Cannot get",
        base_raiser="get_new_blocks",
        peer=True,
    )
    load = Scenario(
        "load",
        serve_args(gpu_blocks=96, cpu_blocks=256, hybrid=True),
        # Stores finish two steps late: requests finish with stores in flight.
        {**hybrid_env(48), "VLLM_FORK_E2E_STORE_DELAY": "2"},
        ["--workload", "load", "--requests", str(load_n), "--concurrency", str(load_c)],
    )
    return [seed000, load] if short else [seed000, seed002, seed003, load]


@dataclass
class Target:
    series: Series
    kind: str  # "base" or "series"
    tree: Path
    python: Path

    @property
    def label(self) -> str:
        return f"v{self.series.base().version}-{self.kind}"


def run_scenario(t: Target, sc: Scenario) -> Row:
    row = Row(sc, t.kind)
    stem = f"{t.label}-{sc.name}"
    violations, peer_log = OUT / f"{stem}.violations", OUT / f"{stem}.peer"
    violations.unlink(missing_ok=True)
    peer_log.unlink(missing_ok=True)
    env = {
        **sc.env,
        "VLLM_FORK_E2E_VIOLATIONS": str(violations),
        "VLLM_FORK_E2E_PEER": str(peer_log),
    }
    with Server(
        t.python, t.tree, t.series.base().version, sc.serve, env, OUT / f"{stem}.log"
    ) as server:
        row.start_seconds = server.started_in
        proc = run(
            [str(t.python), str(LOAD_CLIENT), "--url", server.url, *sc.client],
            cwd=ROOT,
            check=False,
            capture=True,
        )
        try:
            result = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError) as e:
            raise ForkError(f"the e2e client failed: {proc.stderr[-2000:]}") from e
        row.alive = server.health() == 200
        row.exception = server.engine_exception()
    row.planned = result.get("planned", 0)
    row.outcomes = result["outcomes"]
    row.preemptions = result.get("preemptions")
    row.left = result.get("left", {})
    row.run_seconds = result["seconds"]
    row.metrics_missing = result.get("metrics_missing", False)
    if "cpu_hit_tokens" in result:
        row.cpu_hits = (result["cpu_hit_tokens"], result["cpu_hit_tokens_wanted"])
        row.gpu_hits = result["gpu_hit_tokens"]
    row.violations = [v["violation"] for v in read_json_lines(violations)]
    row.peer_strikes = read_json_lines(peer_log)
    return row


def fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}"
    return str(value)


def one_line(label: str, r: Row) -> str:
    return (
        f"{label} {r.scenario.name}: {len(r.outcomes)} sent, "
        f"{sum(r.errors.values())} failed, engine "
        f"{'alive' if r.alive else 'dead'}, {len(r.violations)} violations: "
        f"{verdict(r)}"
    )


def table(title: str, rows: list[Row]) -> list[str]:
    lines = [
        f"### {title}",
        "",
        "| scenario | sent | 200 | closed by client | errors | engine after "
        "| violations | preemptions | CPU hit tokens | peer strikes | start s "
        "| run s | verdict |",
        "| --- " + "| ---: " * 4 + "| --- " + "| ---: " * 6 + "| --- |",
    ]
    for r in rows:
        ok = sum(o == "ok" for o in r.outcomes)
        cancelled = sum(o == "cancelled" for o in r.outcomes)
        engine = "alive" if r.alive else "dead"
        hits = f"{r.cpu_hits[0]}/{r.cpu_hits[1]}" if r.cpu_hits else "-"
        peer = str(r.effective_strikes) if r.scenario.peer else "-"
        lines.append(
            f"| {r.scenario.name} | {len(r.outcomes)} | {ok} | {cancelled} | "
            f"{sum(r.errors.values())} | {engine} | {len(r.violations)} | "
            f"{fmt(r.preemptions)} | {hits} | {peer} | {r.start_seconds:.0f} | "
            f"{r.run_seconds:.0f} | {verdict(r)} |"
        )
    details = []
    for r in rows:
        for error, n in r.errors.most_common(3):
            details.append(f"- {r.scenario.name}: {n}x `{error}`")
        if r.exception:
            details.append(f"- {r.scenario.name}: EngineCore logged `{r.exception}`")
        for v in r.violations[:2]:
            details.append(f"- {r.scenario.name}: {v}")
    return lines + ([""] + details if details else []) + [""]


def record(t: Target, r: Row) -> dict:
    """One run as data (e2e.json), for what quotes it (export's PR text)."""
    return {
        "release": t.series.base().version,
        "kind": t.kind,
        "scenario": r.scenario.name,
        "reproducer": r.scenario.reproducer,
        "sent": len(r.outcomes),
        "ok": sum(o == "ok" for o in r.outcomes),
        "cancelled": sum(o == "cancelled" for o in r.outcomes),
        "errors": sum(r.errors.values()),
        "alive": r.alive,
        "exception": r.exception,
        "violations": len(r.violations),
        "preemptions": r.preemptions,
        "cpu_hits": list(r.cpu_hits) if r.cpu_hits else None,
        "peer_strikes": r.effective_strikes if r.scenario.peer else None,
        "verdict": verdict(r),
    }


def in_pool(one, runs: list, jobs: int, stop: threading.Event) -> list:
    """`one` on each run, `jobs` at a time, the results in order; after a
    failure or an interrupt no run not yet started starts."""
    pool = ThreadPoolExecutor(jobs)
    try:
        futures = [pool.submit(one, t, sc) for t, sc in runs]
        return [row for f in futures if (row := f.result()) is not None]
    except BaseException:
        # After an interrupt or a run that failed, start no other server;
        # the running ones stop as their Server contexts exit.
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def short_runs(targets: list[Target], short: bool) -> list[tuple[Target, Scenario]]:
    """The (target, scenario) runs: all of them, or make test's short set.
    Short: a scenario with a reproducer is a base-against-series pair, so it
    runs only where its base runs too (the newest release's series alone
    gets the load mix: a server start costs 1-2 minutes); the base runs only
    scenarios with a reproducer (nothing else is judged there)."""
    with_base = {t.series.base().version for t in targets if t.kind == "base"}
    runs = []
    for t in targets:
        for sc in scenarios(short):
            paired = sc.reproducer is not None
            if short and t.kind == "base" and not paired:
                continue
            if short and paired and t.series.base().version not in with_base:
                continue
            runs.append((t, sc))
    return runs


def run_targets(
    targets: list[Target], short: bool, only: list[str] | None = None, jobs: int = 1
) -> tuple[bool, list[str], list[str]]:
    """Every scenario (or those named in `only`) on every target; (all as
    expected, report tables, one line per run). `jobs` servers at a time:
    a server's start is a chain of single-threaded imports (API server,
    EngineCore, worker), so two of them on two cores take little longer
    than one; the runs themselves are judged on their outcomes, not timed."""
    OUT.mkdir(parents=True, exist_ok=True)
    runs = [
        (t, sc)
        for t, sc in short_runs(targets, short)
        if not (only and sc.name not in only)
    ]

    stop = threading.Event()

    def one(t: Target, sc: Scenario) -> Row | None:
        if stop.is_set():
            return None  # an earlier run failed or was interrupted
        step(f"e2e {t.label}: {sc.name}")
        start = time.monotonic()
        try:
            row = run_scenario(t, sc)
        except BaseException:
            stop.set()
            raise
        judge(row, named_reproducers(t.series))
        say(
            f"    {t.label} {sc.name}: {len(row.outcomes)} requests, engine "
            f"{'alive' if row.alive else 'dead'}, {time.monotonic() - start:.0f}s"
            + (f": {'; '.join(row.problems)}" if row.problems else "")
        )
        return row

    if jobs > 1 and any(sc.peer for _, sc in runs):
        # The peer's strikes are timed against the server's own steps.
        say("    one server at a time: the peer scenario is timed")
        jobs = 1
    if jobs <= 1:
        # In the calling thread: Ctrl-C stops a server's start at once (a
        # worker thread would finish the start before the pool saw it).
        rows = [one(t, sc) for t, sc in runs]
    else:
        rows = in_pool(one, runs, jobs, stop)
    report: list[str] = []
    summary = [one_line(t.label, row) for (t, _), row in zip(runs, rows, strict=True)]
    records = [record(t, row) for (t, _), row in zip(runs, rows, strict=True)]
    for t in targets:
        mine = [row for (rt, _), row in zip(runs, rows, strict=True) if rt is t]
        report += table(f"{t.label} ({rel(t.tree)})", mine)
    ok = not any(row.problems for row in rows)
    stem = "e2e-short" if short else "e2e"
    (OUT / f"{stem}.md").write_text("\n".join(report))
    (OUT / f"{stem}.json").write_text(json.dumps(records, indent=1) + "\n")
    return ok, report, summary


def default_targets(short: bool, releases: list[str] | None) -> Iterator[Target]:
    from lib.venv import series_venv

    # Every release named, else the default one and the newest.
    all_series = find_series() if releases else default_and_newest(find_series())[0]
    for i, s in enumerate(all_series):
        if releases and s.base().version not in releases:
            continue
        trees = prepare(s)
        common_txt = trees.base / "requirements" / "common.txt"
        python = series_venv(trees.version, common_txt, default=i == 0)
        if i == 0:
            yield Target(s, "base", trees.base, python)
            yield Target(s, "series", trees.patched, python)
        elif not short or i == len(all_series) - 1:
            if not short:
                yield Target(s, "base", trees.base, python)
            yield Target(s, "series", trees.patched, python)


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--short",
        action="store_true",
        help="seed000 and a small load mix; default base+series, newest series",
    )
    p.add_argument(
        "--release",
        action="append",
        help="only this release's series (repeatable; default: all)",
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=[sc.name for sc in scenarios(short=False)],
        help="only this scenario (repeatable; default: all)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="servers at a time (default 1; make test's short run takes 2; "
        "the timed peer scenario, seed003, always runs alone)",
    )
    args = p.parse_args()
    if args.jobs < 1:
        raise ForkError(f"--jobs {args.jobs}: at least one server at a time")
    start = time.monotonic()
    targets = list(default_targets(args.short, args.release))
    if not targets:
        raise ForkError(f"no series for release(s) {args.release}: see patches/")
    ok, report, _ = run_targets(targets, args.short, args.scenario, args.jobs)
    say("\n" + "\n".join(report))
    say(
        f"{'PASSED' if ok else 'FAILED'} in {time.monotonic() - start:.0f}s "
        f"(logs in {rel(OUT)}/)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    main_guard(main)
