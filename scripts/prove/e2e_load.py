#!/usr/bin/env python3
"""The client side of `make e2e`: one workload against a running server.

Runs in the tree's environment (it needs the `openai` client, a vLLM
dependency) and sends prompts as token ids to /v1/completions (the server
has no tokenizer). Prints one JSON object: the outcome of every request
("ok", "cancelled" for a stream the client closed on purpose, or the
error: HTTP status and message) and the workload's own figures.

Workloads:
  seed000  two long distinct prompts, one after the other (seed 000);
  seed002  two-block prompts that finish in the step their last block is
           computed, then, after the GPU prefix cache is reset, prompts
           that extend them: every full block must come back from the CPU;
  load     a mix: bounded concurrency, streaming and not, streams the
           client closes mid-way, shared prefixes, deterministic (seeded);
  bench    make bench's: a fixed concurrency of plain requests sharing
           prefixes, each one's latency in "latencies" (seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
import urllib.request
from dataclasses import dataclass

import openai

REQUEST_TIMEOUT = 120.0
MODEL_ALIAS = "e2e"


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    stream: bool = False
    # A stream the client closes after this many chunks (None: read it all).
    cancel_after: int | None = None


def error_text(e: Exception) -> str:
    """`<status> <message>` for an HTTP error, else the client's own."""
    if isinstance(e, openai.APIStatusError):
        body = e.body if isinstance(e.body, dict) else {}
        message = body.get("message") or body.get("error", {}).get("message") or ""
        return f"{e.status_code} {message or e.message}".splitlines()[0][:160]
    if isinstance(e, openai.APITimeoutError):
        return "client timeout"
    if isinstance(e, openai.APIConnectionError):
        return "connection error"
    return f"{type(e).__name__}: {e}".splitlines()[0][:160]


async def run_job(client: openai.AsyncOpenAI, job: Job, out: dict) -> str:
    """Send one request; its outcome goes into out["outcomes"]."""
    out["sent"] += 1
    outcome = await send(client, job)
    out["outcomes"].append(outcome)
    return outcome


async def send(client: openai.AsyncOpenAI, job: Job) -> str:
    try:
        if not job.stream:
            r = await client.completions.create(
                model=MODEL_ALIAS, prompt=job.prompt, max_tokens=job.max_tokens
            )
            choice = r.choices[0]
            got = r.usage.completion_tokens if r.usage else None
            if choice.finish_reason != "length" or got != job.max_tokens:
                return f"bad answer: {choice.finish_reason}, {got} tokens"
            return "ok"
        stream = await client.completions.create(
            model=MODEL_ALIAS, prompt=job.prompt, max_tokens=job.max_tokens, stream=True
        )
        chunks, finish = 0, None
        async for chunk in stream:
            chunks += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if job.cancel_after is not None and chunks >= job.cancel_after:
                await stream.close()
                break
        if finish is None and job.cancel_after is not None:
            return "cancelled"
        return "ok" if finish == "length" else f"bad stream: finish {finish}"
    except Exception as e:  # every failure is an outcome to report
        return error_text(e)


def metric(url: str, name: str) -> float | None:
    """A counter's value from /metrics (None if the server is gone)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    m = re.search(rf"^vllm:{name}{{[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def reset_prefix_cache(url: str, tries: int = 20) -> bool:
    """POST /reset_prefix_cache until the engine did it: it refuses while
    blocks are in use (stores in flight), answering 200 all the same."""
    for _ in range(tries):
        req = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                body = r.read().decode()
        except OSError:
            return False
        if '"success": false' not in body.replace("\n", " "):
            return True
        time.sleep(0.5)
    return False


def settle(url: str, seconds: float = 15.0) -> dict[str, float | None]:
    """Running and waiting requests once the engine is done (a request the
    engine lost track of stays there)."""
    deadline = time.monotonic() + seconds
    while True:
        counts = {
            name: metric(url, f"num_requests_{name}") for name in ("running", "waiting")
        }
        if not any(counts.values()) or time.monotonic() > deadline:
            return counts
        time.sleep(0.5)


async def seed000(client: openai.AsyncOpenAI, url: str, args, out: dict) -> None:
    out["planned"] = 2
    # Two 445-token prompts that share no block (token ids within the
    # model's 1024-token vocabulary).
    for stride, offset in ((7, 0), (11, 500)):
        prompt = [3 + (i * stride + offset) % 997 for i in range(445)]
        await run_job(client, Job(prompt, 8), out)


def hit_counts(url: str) -> tuple[float | None, float | None]:
    """Prefix-cache hit tokens so far: (from the CPU, on the GPU)."""
    return (
        metric(url, "external_prefix_cache_hits_total"),
        metric(url, "prefix_cache_hits_total"),
    )


async def seed002(client: openai.AsyncOpenAI, url: str, args, out: dict) -> None:
    bs = args.block_size
    out["planned"] = 2 * args.requests
    cpu_hits, gpu_hits, full_blocks = 0.0, 0.0, 0
    for i in range(args.requests):
        prompt = [100 + 50 * i + t for t in range(2 * bs)]
        extended = prompt + [900 + t for t in range(bs + 1)]
        await run_job(client, Job(prompt, 1), out)
        # Only the CPU may hold the prompt now (a reset that never happened
        # shows as GPU hits below).
        await asyncio.to_thread(reset_prefix_cache, url)
        before = await asyncio.to_thread(hit_counts, url)
        await run_job(client, Job(extended, 1), out)
        after = await asyncio.to_thread(hit_counts, url)
        if None in before + after:
            out["metrics_missing"] = True
            return
        cpu_hits += after[0] - before[0]
        gpu_hits += after[1] - before[1]
        full_blocks += 2
        out["cpu_hit_tokens"] = int(cpu_hits)
        out["gpu_hit_tokens"] = int(gpu_hits)
        out["cpu_hit_tokens_wanted"] = full_blocks * bs


def load_jobs(n: int, max_model_len: int, seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(3, 1000) for _ in range(rng.randrange(32, 161))]
        for _ in range(6)
    ]
    jobs = []
    for _ in range(n):
        prefix = rng.choice(prefixes) if rng.random() < 0.7 else []
        suffix = [rng.randrange(3, 1000) for _ in range(rng.randrange(8, 201))]
        max_tokens = rng.randrange(1, 33)
        prompt = (prefix + suffix)[: max_model_len - max_tokens]
        stream = rng.random() < 0.5
        cancel = rng.randrange(1, 6) if stream and rng.random() < 0.25 else None
        jobs.append(Job(prompt, max_tokens, stream, cancel))
    return jobs


async def load(client: openai.AsyncOpenAI, url: str, args, out: dict) -> None:
    gate = asyncio.Semaphore(args.concurrency)
    jobs = load_jobs(args.requests, args.max_model_len)
    out["planned"] = len(jobs)

    async def gated(job: Job) -> None:
        async with gate:
            await run_job(client, job, out)

    await asyncio.gather(*(gated(j) for j in jobs))


async def bench(client: openai.AsyncOpenAI, url: str, args, out: dict) -> None:
    rng = random.Random(0)
    # More prefixes than a small pool keeps: with CPU offload some come back
    # from the CPU.
    prefixes = [[rng.randrange(3, 1000) for _ in range(64)] for _ in range(32)]
    jobs = [
        Job(
            rng.choice(prefixes)
            + [rng.randrange(3, 1000) for _ in range(rng.randrange(16, 97))],
            16,
        )
        for _ in range(args.requests)
    ]
    out["planned"] = len(jobs)
    out["latencies"] = []
    gate = asyncio.Semaphore(args.concurrency)

    async def timed(job: Job) -> None:
        async with gate:
            start = time.monotonic()
            if await run_job(client, job, out) == "ok":
                out["latencies"].append(time.monotonic() - start)

    await asyncio.gather(*(timed(j) for j in jobs))


WORKLOADS = {"seed000": seed000, "seed002": seed002, "load": load, "bench": bench}


async def main_async(args) -> dict:
    client = openai.AsyncOpenAI(
        base_url=f"{args.url}/v1",
        api_key="e2e",
        max_retries=0,
        timeout=REQUEST_TIMEOUT,
    )
    out: dict = {"sent": 0, "outcomes": []}
    start = time.monotonic()
    try:
        await asyncio.wait_for(
            WORKLOADS[args.workload](client, args.url, args, out), args.deadline
        )
    except TimeoutError:
        # Requests in flight at the deadline, or never sent, fail.
        missing = out.get("planned", out["sent"]) - len(out["outcomes"])
        out["outcomes"] += [f"not answered in {args.deadline:.0f}s"] * missing
    out["seconds"] = round(time.monotonic() - start, 1)
    out["preemptions"] = metric(args.url, "num_preemptions_total")
    if args.workload != "bench":
        # The bench reads the server's CPU time around this client: it waits
        # for every answer and reads nothing of what is left.
        out["left"] = await asyncio.to_thread(settle, args.url)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    # The server's --max-model-len: no prompt + output is longer.
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--deadline", type=float, default=300.0, help="seconds in all")
    p.add_argument(
        "--runs-from-stdin",
        action="store_true",
        help="one run per server URL read from stdin (--url is then ignored), "
        "a JSON line each, until EOF: make bench's runs without a client "
        "start (1-3 s of imports) between them",
    )
    args = p.parse_args()
    if not args.runs_from_stdin and not args.url:
        p.error("--url is required (or --runs-from-stdin)")
    if not args.runs_from_stdin:
        print(json.dumps(asyncio.run(main_async(args))))
        return
    for line in sys.stdin:
        if line.strip():
            args.url = line.strip()
            print(json.dumps(asyncio.run(main_async(args))), flush=True)


if __name__ == "__main__":
    main()
