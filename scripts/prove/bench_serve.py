"""The real server's speed for `make bench`: base against series.

For each configuration (no connector; SimpleCPUOffload with a GPU pool
smaller than what the prompts share, so prefixes come back from the CPU)
it starts `vllm serve` from both trees at once, with make e2e's model-free
worker (prove.e2e_server.Server, prove.e2e.serve_args), and drives them in
turn with the openai client (scripts/prove/e2e_load.py, workload "bench":
--serve-requests plain requests at --concurrency), the order alternating
round by round. A run's requests/s are its answered requests over its
wall time; its latencies are each answered request's, send to answer.
Wall time: the server's processes, the client and the rest of the machine
share its cores, so keep the machine otherwise quiet. Each run also
records the CPU time of the server's processes (Server.cpu_seconds), per
answered request: on a machine with fewer cores than the server and its
client use, wall time moves by a quarter from run to run, and the CPU time
is where the series' cost shows. It is read before the client starts and
after it exits, so it also holds the server's idle time while the client
starts (both trees alike).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from lib.cli import say, step
from lib.errors import ForkError
from lib.paths import ROOT, WORK, rel
from lib.proc import run
from prove.bench_report import ServeRun
from prove.e2e import serve_args
from prove.e2e_server import Server

LOAD_CLIENT = ROOT / "scripts" / "prove" / "e2e_load.py"
OUT = WORK / "bench"
MAX_NUM_SEQS = 32
CONFIGS = {
    "no connector": serve_args(
        gpu_blocks=2048, cpu_blocks=None, hybrid=False, max_num_seqs=MAX_NUM_SEQS
    ),
    # 32 running requests want about 300 blocks and the prompts share 32
    # prefixes of 4 blocks: the pool keeps only some of them.
    "CPU offload": serve_args(
        gpu_blocks=320, cpu_blocks=4096, hybrid=False, max_num_seqs=MAX_NUM_SEQS
    ),
}


def started(
    stack: ExitStack,
    python: Path,
    tree: Path,
    version: str,
    serve: list[str],
    log: Path,
) -> Server:
    return stack.enter_context(Server(python, tree, version, serve, {}, log))


def one_run(python: Path, server: Server, args) -> ServeRun:
    cpu_before = server.cpu_seconds()
    proc = run(
        [
            str(python),
            str(LOAD_CLIENT),
            "--url",
            server.url,
            "--workload",
            "bench",
            "--requests",
            str(args.serve_requests),
            "--concurrency",
            str(args.concurrency),
        ],
        cwd=ROOT,
        check=False,
        capture=True,
    )
    cpu_seconds = server.cpu_seconds() - cpu_before
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise ForkError(f"the bench client failed: {proc.stderr[-2000:]}") from e
    latencies = result["latencies"]
    return ServeRun(
        requests=len(latencies),
        seconds=result["seconds"],
        latencies=latencies,
        errors=len(result["outcomes"]) - len(latencies),
        cpu_seconds=cpu_seconds,
    )


def serve_part(
    python: Path, trees: dict[str, Path], version: str, args
) -> dict[str, dict[str, list[ServeRun]]]:
    """Each configuration's runs, per tree."""
    # Five pairs of runs: a run of wall time on shared cores moves by a
    # quarter from one to the next, and the ratio is the median pair's.
    rounds = args.rounds or 5
    results: dict[str, dict[str, list[ServeRun]]] = {}
    for name, serve in CONFIGS.items():
        if args.only and not any(o in name for o in args.only):
            continue
        step(f"v{version}: vllm serve, {name}, base and series")
        stem = f"serve-v{version}-{name.replace(' ', '-').lower()}"
        with ExitStack() as stack, ThreadPoolExecutor(len(trees)) as pool:
            # Both started at once: a start takes half a minute of the budget.
            # Each is stopped on leaving, whichever of them failed to start.
            starting = {
                kind: pool.submit(
                    started,
                    stack,
                    python,
                    tree,
                    version,
                    serve,
                    OUT / f"{stem}-{kind}.log",
                )
                for kind, tree in trees.items()
            }
            servers = {kind: f.result() for kind, f in starting.items()}
            runs: dict[str, list[ServeRun]] = {kind: [] for kind in trees}
            for r in range(rounds):
                order = list(trees) if r % 2 == 0 else list(trees)[::-1]
                for kind in order:
                    runs[kind].append(one_run(python, servers[kind], args))
                    got = runs[kind][-1]
                    say(
                        f"    {kind}: {got.requests} answered in {got.seconds:.1f}s "
                        f"({got.rate:.1f}/s, server CPU "
                        f"{1e3 * got.cpu_per_request:.1f} ms each), "
                        f"{got.errors} not"
                    )
            for kind, server in servers.items():
                if server.health() != 200:
                    raise ForkError(
                        f"the {kind} server died under the bench load: "
                        f"{server.engine_exception() or 'see ' + rel(server.log)}"
                    )
        results[name] = runs
    return results
