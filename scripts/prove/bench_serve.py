"""The real server's speed for `make bench`: base against series.

For each configuration (no connector; SimpleCPUOffload with a GPU pool
smaller than what the prompts share, so prefixes come back from the CPU)
it starts `vllm serve` from both trees at once, with make e2e's model-free
worker (prove.e2e_server.Server, prove.e2e.serve_args), and drives them in
turn with the openai client (scripts/prove/e2e_load.py, workload "bench":
--serve-requests plain requests at --concurrency; one client process for
all of a configuration's runs), the order alternating round by round. A
run's requests/s are its answered requests over its wall time; its
latencies are each answered request's, send to answer. Wall time: the
server's processes, the client and the rest of the machine share its
cores, so keep the machine otherwise quiet. Each run also
records the CPU time of the server's processes (Server.cpu_seconds), per
answered request: on a machine with fewer cores than the server and its
client use, wall time moves by a quarter from run to run, and the CPU time
is where the series' cost shows. It is read just before the client is
given the run and just after its answer.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from lib.cli import say, step
from lib.errors import ForkError
from lib.paths import ROOT, WORK, rel
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


class Client:
    """One e2e_load.py process for a configuration's runs: a run is a
    server URL on its stdin, its answer a JSON line. Without a client start
    (1-3 s of imports) before each run, the server's CPU is read right
    around the requests, and 20 starts a release are saved."""

    def __init__(self, python: Path, args, log: Path) -> None:
        self.log_path = log
        self.log = open(log, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [
                str(python),
                str(LOAD_CLIENT),
                "--runs-from-stdin",
                "--workload",
                "bench",
                "--requests",
                str(args.serve_requests),
                "--concurrency",
                str(args.concurrency),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def run(self, url: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(url + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            return json.loads(line)
        except (OSError, json.JSONDecodeError) as e:
            raise ForkError(f"the bench client failed: see {rel(self.log_path)}") from e

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def one_run(client: Client, server: Server) -> ServeRun:
    cpu_before = server.cpu_seconds()
    result = client.run(server.url)
    cpu_seconds = server.cpu_seconds() - cpu_before
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
            client = stack.enter_context(
                Client(python, args, OUT / f"{stem}-client.log")
            )
            runs: dict[str, list[ServeRun]] = {kind: [] for kind in trees}
            for r in range(rounds):
                order = list(trees) if r % 2 == 0 else list(trees)[::-1]
                for kind in order:
                    runs[kind].append(one_run(client, servers[kind]))
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
