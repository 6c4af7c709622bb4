"""A harness worker process, driven a line at a time: one `--serve`
process of a module of tests/harness (harness.soak_worker for make soak,
harness.trace_worker for the differential oracle) on one vLLM tree.

Here rather than in soak.py so that differential.py, which soak.py runs,
can use it without the two importing each other.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

from lib.errors import ForkError
from lib.paths import ROOT, rel
from lib.testenv import tree_env

# Seconds a worker's first answer may take beyond a trace's timeout.
STARTUP_S = 300


def worker_env(tree: Path) -> dict[str, str]:
    env = tree_env(tree)
    env["PYTHONPATH"] += os.pathsep + str(ROOT / "tests")
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    return env


class Worker:
    """One `--serve` process of a harness module on one tree: it answers one
    JSON line per request line (harness.soak_worker: a run per call). Its
    stderr goes to `log_dir`/worker-<name>.log."""

    def __init__(
        self,
        python: Path,
        tree: Path,
        name: str,
        seed: int,
        module: str = "harness.soak_worker",
        *,
        log_dir: Path,
    ):
        self.name = name
        self.answered = False
        # Set iteration order depends on the hash seed, and vLLM iterates
        # sets of block hashes: without a fixed one a seed does not replay.
        env = {**os.environ, **worker_env(tree), "PYTHONHASHSEED": str(seed % 2**32)}
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"worker-{name}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [str(python), "-m", module, "--serve"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def send(self, line: str) -> None:
        """Ask without waiting (`receive` gets the answer): the workers of
        both trees then work at once."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass

    def receive(self, what: str, timeout: float) -> dict:
        assert self.proc.stdout is not None
        if not self.answered:
            # The first answer waits for the worker to import torch and
            # vLLM too: over two minutes with three workers starting at
            # once on a loaded 2-core machine (a make test that failed so).
            timeout += STARTUP_S
        killer = threading.Timer(timeout, self.proc.kill)
        killer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            killer.cancel()
        if not line:
            self.proc.wait()
            why = "timed out" if self.proc.returncode == -9 else "exited"
            raise ForkError(
                f"worker on {self.name} {why} in {what} (--timeout {timeout:g}); "
                f"see {rel(self.log_path)}"
            )
        self.answered = True
        return json.loads(line)

    def run(
        self, workload: str, seed: int, scale: int, timeout: float, timing: bool = False
    ) -> dict:
        flags = " timing" if timing else ""
        self.send(f"{workload} {seed} {scale}{flags}")
        return self.receive(f"{workload} seed {seed}", timeout)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()
        self.log.close()
