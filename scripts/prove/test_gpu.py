#!/usr/bin/env python3
"""`make test-gpu`: the copy-versus-compute races on a real GPU, each bare
release against its series.

On a machine with CUDA, runs scripts/prove/gpu_worker.py once per tree of
the bundle (the bare release and the series, of 0.20.2 and 0.23.0, where
the store race is live, and of 0.33.0, where upstream fixed it, as the
control), against the tree's own SimpleCPUOffloadWorker and copy backend:
seed 004's store launched while the forward's KV write is held back with
torch.cuda._sleep, the same store with no barrier (the control), a load
into a block a kernel in flight reads or zeroes, and a store's time with
and without the barrier. Prints a table (the verdict: gpu_judge.py) and
exits 1 when a series or a fixed release copies anything but what was
written, a bare release's race does not show, or a control shows no race.

Without CUDA (no torch in --python, or torch.cuda.is_available() False) it
says so in one line and exits 0: nothing is run and nothing is claimed.

--bundle writes the bundle (default .work/gpu-bundle/) and stops: only what
the GPU machine needs, under 64 MiB (each tree's offload package, the
scripts, manifest.json; see gpu_bundle.py). It needs no GPU, and fetches a
release's sdist when the cache lacks it. A run uses the bundle in --dir,
writing it first when there is none and this is a checkout of the fork
(not the bundle itself). --out gets results.json, table.txt and
workers.log (default .work/gpu/).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import OUTPUT_MARKER, ROOT, WORK, fresh_output_dir, rel
from prove import gpu_judge
from prove.gpu_worker import NUM_BLOCKS

# Run from inside a bundle, ROOT is the bundle (scripts/lib/paths.py's
# grandparent), which holds the manifest and the trees.
IN_BUNDLE = (ROOT / "manifest.json").is_file() and (ROOT / "trees").is_dir()
DEFAULT_DIR = ROOT if IN_BUNDLE else WORK / "gpu-bundle"
DEFAULT_OUT = WORK / "gpu"
# What the probe prints: torch's version (None without torch), CUDA, the GPU.
PROBE = """
import json
try:
    import torch
except Exception as e:
    print(json.dumps({"torch": None, "error": f"{type(e).__name__}: {e}"}))
    raise SystemExit
out = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
if out["cuda"]:
    out["device"] = torch.cuda.get_device_name(0)
    try:
        import cuda.bindings.driver  # noqa: F401
        out["bindings"] = True
    except Exception:
        out["bindings"] = False
print(json.dumps(out))
"""
PROBE_TIMEOUT_S = 300


def default_python() -> Path:
    """The fork's .venv where there is one (an operator's CUDA install),
    else this Python (a GPU machine's python3)."""
    venv = ROOT / ".venv" / "bin" / "python"
    return venv if venv.exists() else Path(sys.executable)


def probe(python: Path) -> dict[str, Any]:
    """What `python` has: torch, CUDA, a GPU, cuda-bindings."""
    try:
        proc = subprocess.run(
            [str(python), "-c", PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ForkError(f"cannot run {python}: {e}") from e
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise ForkError(
            f"{python} did not answer the CUDA probe (exit {proc.returncode}):\n"
            f"{(proc.stdout + proc.stderr).strip()[-2000:]}"
        ) from e


def no_cuda_line(python: Path, found: dict[str, Any]) -> str | None:
    """The one line said where there is no CUDA; None where there is."""
    if found.get("torch") is None:
        why = f"no torch in {python}: {found.get('error', 'not importable')}"
    elif not found.get("cuda"):
        why = f"torch {found['torch']} in {python}: torch.cuda.is_available() is False"
    else:
        return None
    return f"test-gpu: no CUDA here ({why}); nothing was run and nothing is claimed"


def load_manifest(bundle: Path) -> dict[str, Any]:
    """The bundle's manifest, once every file it lists is there unchanged."""
    path = bundle / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except FileNotFoundError as e:
        raise ForkError(f"{rel(bundle)}/ is not a GPU bundle: no manifest.json") from e
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ForkError(f"{rel(path)} is not a bundle manifest: {e}") from e
    bad = []
    for name, digest in sorted(files.items()):
        f = bundle / name
        if not f.is_file():
            bad.append(f"{name}: missing")
        elif hashlib.sha256(f.read_bytes()).hexdigest() != digest:
            bad.append(f"{name}: changed since the bundle was written")
    if bad:
        raise ForkError(
            f"{rel(bundle)}/ is not the bundle its manifest describes:\n  "
            + "\n  ".join(bad)
            + "\nWrite it again: make test-gpu ARGS=--bundle"
        )
    return manifest


def stale_scripts(manifest: dict[str, Any], scripts_root: Path = ROOT) -> list[str]:
    """The bundle's scripts that differ from this checkout's: a bundle
    written before the scripts changed runs an old worker."""
    return sorted(
        name
        for name, digest in manifest["files"].items()
        if name.startswith("scripts/")
        and (
            not (scripts_root / name).is_file()
            or hashlib.sha256((scripts_root / name).read_bytes()).hexdigest() != digest
        )
    )


def ensure_bundle(
    bundle: Path, releases: list[str] | None, python: Path | None = None
) -> None:
    """Write the bundle where there is none, from a checkout of the fork."""
    if (bundle / "manifest.json").is_file():
        return
    if IN_BUNDLE:
        raise ForkError(f"no bundle in {bundle}: pass --dir with the bundle folder")
    say(f"no GPU bundle in {rel(bundle)}/: writing it")
    write_bundle(bundle, releases, python)


def write_bundle(
    bundle: Path, releases: list[str] | None, python: Path | None = None
) -> None:
    if IN_BUNDLE:
        raise ForkError("a bundle cannot write a bundle: run --bundle in the fork")
    from prove import gpu_bundle

    step(f"GPU bundle: {', '.join(releases or gpu_bundle.DEFAULT_RELEASES)}")
    with gpu_bundle.built_trees(list(releases or gpu_bundle.DEFAULT_RELEASES)) as src:
        manifest = gpu_bundle.build(bundle, src)
    check_imports(bundle, manifest, python or default_python())
    size = gpu_bundle.size_of(bundle)
    names = ", ".join(t["name"] for t in manifest["trees"])
    say(
        f"wrote {rel(bundle)}/: {names}; {len(manifest['files'])} files, "
        f"{size / 2**10:.0f} KiB (limit {gpu_bundle.LIMIT_BYTES / 2**20:.0f} MiB)\n"
        f"On the GPU machine: python3 {rel(bundle)}/scripts/prove/test_gpu.py "
        f"--out <dir> (or make test-gpu in a checkout that carries it)"
    )


def check_imports(bundle: Path, manifest: dict[str, Any], python: Path) -> None:
    """Import each bundled tree's offload code over the stand-ins and build
    its worker, here, with a local torch: a tree that imports something the
    stand-ins lack fails now rather than on the GPU machine."""
    if probe(python).get("torch") is None:
        say(f"not checked: no torch in {python} to import the trees with")
        return
    worker = bundle / "scripts" / "prove" / "gpu_worker.py"
    failed = []
    for tree in manifest["trees"]:
        proc = subprocess.run(
            [str(python), str(worker), "--check-imports"]
            + ["--tree", str(bundle / tree["path"])],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            failed.append(f"{tree['name']}: {(proc.stdout + proc.stderr).strip()}")
    if failed:
        raise ForkError(
            "the bundle's trees do not import over gpu_standin.py:\n"
            + "\n".join(failed)
        )
    say(f"checked: every tree's offload code imports over the stand-ins ({python})")


def run_tree(
    python: Path, bundle: Path, tree: dict[str, Any], args: Any, tmp: Path
) -> tuple[dict[str, Any], str]:
    """One tree's worker: its document (an error, when it wrote none) and
    its log."""
    out = tmp / f"{tree['name']}.json"
    cmd = [
        str(python),
        str(bundle / "scripts" / "prove" / "gpu_worker.py"),
        "--tree",
        str(bundle / tree["path"]),
        "--out",
        str(out),
        "--reps",
        str(args.reps),
        "--sleep-ms",
        str(args.sleep_ms),
        "--timing-rounds",
        str(args.timing_rounds),
        "--timing-blocks",
        str(args.timing_blocks),
    ]
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log = proc.stdout + proc.stderr + f"(exit {proc.returncode})\n"
    except subprocess.TimeoutExpired as e:
        # What it printed so far: bytes, whatever text= says.
        parts = [
            x.decode(errors="replace") if isinstance(x, bytes) else x or ""
            for x in (e.stdout, e.stderr)
        ]
        log = "".join(parts) + f"(killed after {args.timeout} s)\n"
    for line in log.splitlines():
        if line.startswith("    "):  # the worker's per-check summary
            say(line)
    if not out.is_file():  # the judge shows the worker's last words
        return {"error": log.strip()[-4000:] or "no output"}, log
    return json.loads(out.read_text()), log


def prepare_out(out: Path) -> Path:
    """An output folder: an empty one is used as it is (a folder another tool
    collects), else one a run of ours wrote is replaced."""
    if out.is_dir() and not any(out.iterdir()):
        (out / OUTPUT_MARKER).write_text("make test-gpu's results\n")
        return out
    return fresh_output_dir(out, "make test-gpu's results")


def run(args: Any) -> int:
    python = args.python or default_python()
    found = probe(python)
    line = no_cuda_line(python, found)
    if line:
        print(line)
        return 0
    if not found.get("bindings"):
        raise ForkError(
            f"{python} has CUDA but no cuda-bindings, which the copy backend "
            "calls the driver through: pip install cuda-bindings"
        )
    bundle = (args.dir or DEFAULT_DIR).resolve()
    ensure_bundle(bundle, args.releases, python)
    manifest = load_manifest(bundle)
    stale = [] if IN_BUNDLE else stale_scripts(manifest)
    if stale:
        raise ForkError(
            f"{rel(bundle)}/ was written before these scripts changed: "
            f"{', '.join(stale)}. Write it again: make test-gpu ARGS=--bundle"
        )
    try:
        trees = gpu_judge.trees_of(manifest)
    except ValueError as e:
        raise ForkError(str(e)) from e
    entries = {t["name"]: t for t in manifest["trees"]}
    if args.only:
        unknown = sorted(set(args.only) - set(entries))
        if unknown:
            raise ForkError(
                f"--only {', '.join(unknown)}: not in the bundle, which has "
                + ", ".join(entries)
            )
        trees = [t for t in trees if t.name in args.only]
    out = prepare_out(args.out.resolve())
    say(f"GPU: {found.get('device')} (torch {found['torch']}, {python})")
    results: dict[str, dict[str, Any] | None] = {}
    logs = []
    with tempfile.TemporaryDirectory(prefix="test-gpu-") as tmp:
        for t in trees:
            step(f"{t.name}")
            results[t.name], log = run_tree(
                python, bundle, entries[t.name], args, Path(tmp)
            )
            logs.append(f"==> {t.name}\n{log}")
    rows = gpu_judge.judge(trees, results)
    ok = gpu_judge.passed(rows)
    text = "\n".join(
        [
            gpu_judge.device_line(results),
            "",
            gpu_judge.table(rows),
            "",
            f"{'PASSED' if ok else 'FAILED'}: {sum(r.ok for r in rows)} of "
            f"{len(rows)} checks pass",
        ]
    )
    print(text)
    (out / "table.txt").write_text(text + "\n")
    (out / "workers.log").write_text("\n".join(logs) + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {
                "manifest": {k: v for k, v in manifest.items() if k != "files"},
                "results": results,
                "rows": [r.__dict__ for r in rows],
                "passed": ok,
            },
            indent=1,
        )
        + "\n"
    )
    say(f"results in {rel(out)}/")
    return 0 if ok else 1


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--bundle", action="store_true", help="only write the bundle, into --dir"
    )
    p.add_argument(
        "--dir",
        type=Path,
        help="the bundle folder (default: .work/gpu-bundle/, or the bundle "
        "this script is in)",
    )
    p.add_argument(
        "--releases",
        type=lambda s: [r.strip() for r in s.split(",") if r.strip()],
        help="releases to bundle, comma-separated (default: 0.20.2,0.23.0,0.33.0)",
    )
    p.add_argument(
        "--python",
        type=Path,
        help="the Python with torch that runs the trees (default: .venv's, "
        "else this one)",
    )
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="results folder (.work/gpu/)"
    )
    p.add_argument(
        "--only", action="append", help="run only this tree, e.g. v0.20.2-base"
    )
    p.add_argument("--reps", type=int, default=100, help="repetitions per race check")
    p.add_argument(
        "--sleep-ms",
        type=float,
        default=20.0,
        help="GPU time the forward's write is held back (default 20)",
    )
    p.add_argument("--timing-rounds", type=int, default=41, help="timed stores")
    p.add_argument(
        "--timing-blocks", type=int, default=16, help="1 MiB blocks per timed store"
    )
    p.add_argument(
        "--timeout", type=int, default=180, help="seconds per tree (default 180)"
    )
    args = p.parse_args()
    if args.releases is not None and not args.releases:
        raise ForkError("--releases names no release")
    if args.reps < 1 or args.timing_rounds < 1 or args.timeout < 1:
        raise ForkError("--reps, --timing-rounds and --timeout must be >= 1")
    if args.sleep_ms <= 0:
        raise ForkError("--sleep-ms must be above 0")
    if not 1 <= args.timing_blocks <= NUM_BLOCKS:
        raise ForkError(f"--timing-blocks must be between 1 and {NUM_BLOCKS}")
    if args.bundle:
        write_bundle((args.dir or DEFAULT_DIR).resolve(), args.releases, args.python)
        return 0
    return run(args)


if __name__ == "__main__":
    main_guard(main)
