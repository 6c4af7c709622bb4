"""One real `vllm serve` for `make e2e`: start it, watch it, stop it.

The server is vLLM's own (OpenAI API server + EngineCore + a worker
process) from a source tree on PYTHONPATH, on 127.0.0.1 and a free port,
with the model-free worker of tests/in_server (no weights, no tokenizer). It is
always stopped on leaving the `with` block, whatever happened: its whole
process group gets SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from lib.errors import ForkError
from lib.paths import ROOT, rel
from lib.proc import free_port
from lib.testenv import tree_env

MODEL_DIR = ROOT / "tests" / "harness" / "model"
E2E_PATH = ROOT / "tests"
STARTUP_SECONDS = 180
# The exception line of a traceback the EngineCore logged, e.g.
# "(EngineCore pid=1) ERROR 11-23 05:41:16 [core.py:1138] AssertionError".
ENGINE_EXCEPTION = re.compile(
    r"^\(EngineCore[^)]*\) ERROR [^\]]*\] ([A-Za-z_][\w.]*(?:Error|Exception)\b.*)$",
    re.M,
)


# A traceback frame the EngineCore logged: `File "...", line 1, in popleft_n`.
RAISING_FRAME = re.compile(
    r'^\(EngineCore[^)]*\) ERROR [^\]]*\]\s+File "[^"]+", line \d+, in (\w+)$', re.M
)
SERVED_MODEL = "e2e"


def version_metadata(version: str, root: Path) -> Path:
    """A directory under `root` holding only a vllm dist-info of `version`."""
    where = root / "metadata" / version
    dist = where / f"vllm-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    )
    return where


class Server:
    """`with Server(...) as server:` a running server, or ForkError."""

    def __init__(
        self,
        python: Path,
        tree: Path,
        version: str,
        args: list[str],
        env: dict[str, str],
        log: Path,
    ):
        self.python, self.args, self.log = python, args, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            **tree_env(tree),
            # The model-free worker keeps request state as Model Runner V1
            # does; vLLM picks V2 by itself where Triton works.
            "VLLM_USE_V2_MODEL_RUNNER": "0",
            # The fake runner's sampled tokens hash the request id: the same
            # run samples the same tokens.
            "PYTHONHASHSEED": "0",
            **env,
        }
        # `vllm serve` reads its version from the package's metadata, which a
        # tree on PYTHONPATH lacks; the model-free worker and the peer
        # scheduler import from tests/.
        self.env["PYTHONPATH"] = os.pathsep.join(
            [
                str(version_metadata(version, log.parent)),
                self.env["PYTHONPATH"],
                str(E2E_PATH),
            ]
        )
        self.proc: subprocess.Popen | None = None
        self.started_in = 0.0

    def command(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            str(MODEL_DIR),
            "--served-model-name",
            SERVED_MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--skip-tokenizer-init",
            "--worker-cls",
            "in_server.model_free_worker.ModelFreeWorker",
            "--enforce-eager",
            "--no-async-scheduling",
            *self.args,
        ]

    def __enter__(self) -> Server:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self._wait_ready(start)
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - start
        return self

    def _wait_ready(self, start: float) -> None:
        # Ready when it serves our model: a 200 from /health alone could come
        # from another process that took the port after free_port() let go.
        while time.monotonic() - start < STARTUP_SECONDS:
            if self.health() == 200 and self.serves_model():
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise ForkError(
                    f"vllm serve exited ({self.proc.returncode}) before it was "
                    f"ready: {self.engine_exception() or 'see ' + rel(self.log)}"
                )
            time.sleep(0.5)
        raise ForkError(
            f"vllm serve not ready in {STARTUP_SECONDS}s: see {rel(self.log)}"
        )

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        # EngineCore and the worker may outlive the API server (it exits by
        # itself once its engine died): end the whole session in every case.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def health(self) -> int:
        """/health's HTTP status; 0 when nothing answers."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def cpu_seconds(self) -> float:
        """CPU time (user and system) the server's processes have used:
        every live process of its session (API server, EngineCore, worker)
        and the children they have reaped. Read from /proc rather than
        psutil: the bench's driver runs on the system Python, which need not
        have it, and vLLM serves on Linux."""
        if self.proc is None:
            return 0.0
        ticks = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                # The fields after the command's closing parenthesis (the
                # command may hold any character): state is the 3rd field of
                # stat, session the 6th, utime, stime, cutime and cstime the
                # 14th to 17th.
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # it exited while we read
            if int(fields[3]) == self.proc.pid:
                ticks += sum(int(x) for x in fields[11:15])
        return ticks / os.sysconf("SC_CLK_TCK")

    def serves_model(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as r:
                models = json.loads(r.read())
        except (OSError, ValueError):
            return False
        return any(m.get("id") == SERVED_MODEL for m in models.get("data", []))

    def engine_exception(self) -> str:
        """The first exception the EngineCore logged, with the function that
        raised it ("AssertionError (in popleft_n)"); '' if none."""
        if not self.log.exists():
            return ""
        return first_engine_exception(self.log.read_text(errors="replace"))


def first_engine_exception(log: str) -> str:
    m = ENGINE_EXCEPTION.search(log)
    if not m:
        return ""
    frames = RAISING_FRAME.findall(log, 0, m.start())
    return m.group(1).strip() + (f" (in {frames[-1]})" if frames else "")


def read_json_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]
