"""`make test-gpu` without a GPU: the bundle (what it holds, its size limit,
that it runs on its own), the one line and exit 0 where there is no CUDA,
the judge of a run's results, and a whole run through the trees' real
worker and copy backend on sync_cuda.py, a CUDA that orders everything (so
no race can show, and the judge must refuse the run)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from keep.apply import scratch_tree
from lib.errors import ForkError
from lib.paths import ROOT
from lib.series import Series, series_for_version
from prove import gpu_bundle, gpu_judge, gpu_standin, gpu_worker
from prove.test_gpu import load_manifest, stale_scripts

HERE = Path(__file__).resolve().parent
TEST_GPU = ROOT / "scripts" / "prove" / "test_gpu.py"
TREES = ["v0.20.2-base", "v0.20.2-series", "v0.33.0-base", "v0.33.0-series"]


@pytest.fixture(scope="module")
def bundle(
    series: Series, tree: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The bundle of the default release (the shared scratch tree) and the
    newest one: the releases `make test` has in its cache."""
    newest = series_for_version("0.33.0")
    tmp = tmp_path_factory.mktemp("gpu")
    sources = [(series, tree), (newest, scratch_tree(newest, tmp / "v0.33.0"))]
    gpu_bundle.build(tmp / "bundle", sources)
    return tmp / "bundle"


def shim(tmp: Path, name: str, body: str) -> Path:
    """An executable standing in for a Python, for --python."""
    path = tmp / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def no_torch_python(tmp: Path) -> Path:
    # A None in sys.modules makes `import torch` raise ImportError.
    code = "import sys; sys.modules['torch'] = None; exec(sys.argv[1])"
    return shim(tmp, "python-no-torch", f'exec {sys.executable} -c "{code}" "$2"')


def run(*args: str | Path, script: Path = TEST_GPU) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )


# --- the bundle -----------------------------------------------------------------


def test_the_bundle_holds_each_trees_offload_package_and_the_scripts(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [t["name"] for t in manifest["trees"]] == TREES
    # Only the bare 0.20.2 lacks the barrier (0.33.0 has upstream's).
    races = {t["name"]: t["store_race_expected"] for t in manifest["trees"]}
    assert races == dict.fromkeys(TREES, False) | {"v0.20.2-base": True}
    listed = set(manifest["files"])
    on_disk = {
        str(p.relative_to(bundle))
        for p in bundle.rglob("*")
        if p.is_file() and p.name not in ("manifest.json", ".vllm-fork-output")
    }
    assert listed == on_disk
    assert {p.name for p in bundle.iterdir()} == {
        ".vllm-fork-output",
        "README.txt",
        "manifest.json",
        "scripts",
        "trees",
    }
    for name in TREES:
        package = bundle / "trees" / name / gpu_bundle.OFFLOAD
        assert {"worker.py", "copy_backend.py", "cuda_mem_ops.py"} <= {
            p.name for p in package.iterdir()
        }
    # Nothing of the trees but their offload package travels.
    assert all(
        f.startswith(("scripts/", "README.txt"))
        or f.split("/", 2)[2].startswith(gpu_bundle.OFFLOAD + "/")
        for f in listed
    )
    for script in gpu_bundle.SCRIPTS:
        copy = bundle / "scripts" / script
        assert copy.read_bytes() == (ROOT / "scripts" / script).read_bytes()
    # Patch 0005 is in the series' worker, not in the bare release's.
    worker = bundle / "trees" / "{}" / gpu_bundle.OFFLOAD / "worker.py"
    base = str(worker).format("v0.20.2-base")
    patched = str(worker).format("v0.20.2-series")
    assert "compute" in Path(patched).read_text()
    assert Path(base).read_text() != Path(patched).read_text()


def test_the_bundle_is_far_under_the_limit_and_a_larger_one_is_refused(bundle):
    assert gpu_bundle.check_size(bundle) < gpu_bundle.LIMIT_BYTES / 16
    with pytest.raises(ForkError, match=r"MiB, over the 0 MiB a GPU machine takes"):
        gpu_bundle.check_size(bundle, limit=1024)


def test_a_changed_or_missing_file_of_the_bundle_is_refused(bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    assert load_manifest(copy)["trees"]
    worker = copy / "trees" / "v0.20.2-series" / gpu_bundle.OFFLOAD / "worker.py"
    worker.write_text(worker.read_text() + "# edited\n")
    (copy / "scripts" / "prove" / "gpu_judge.py").unlink()
    with pytest.raises(ForkError) as e:
        load_manifest(copy)
    assert "v0.20.2-series/vllm/v1/simple_kv_offload/worker.py: changed" in str(e.value)
    assert "scripts/prove/gpu_judge.py: missing" in str(e.value)
    with pytest.raises(ForkError, match="not a GPU bundle"):
        load_manifest(tmp_path)


def test_a_bundle_older_than_the_scripts_is_found(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert stale_scripts(manifest) == []
    manifest["files"]["scripts/prove/gpu_worker.py"] = "0" * 64
    manifest["files"]["scripts/prove/gone.py"] = "0" * 64
    assert stale_scripts(manifest) == [
        "scripts/prove/gone.py",
        "scripts/prove/gpu_worker.py",
    ]


def test_the_bundles_import_check_builds_a_worker_with_no_vllm(bundle):
    """What the GPU machine lacks (vLLM's dependencies) is never needed: the
    tree with the most imports (0.33.0: disk backend, sizing, envs) imports
    and builds its worker in a process with no vLLM but the stand-ins (the
    run below does so for every tree)."""
    worker = bundle / "scripts" / "prove" / "gpu_worker.py"
    tree = bundle / "trees" / "v0.33.0-base"
    proc = run("--check-imports", "--tree", tree, script=worker)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"ok": True, "wait_event": True}
    proc = run("--check-imports", "--tree", bundle, script=worker)
    assert proc.returncode == 1 and "not a vLLM tree's offload" in proc.stderr


def test_the_stand_ins_refuse_a_folder_that_is_no_tree(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a vLLM tree's offload"):
        gpu_standin.install(tmp_path)


# --- without CUDA ----------------------------------------------------------------


@pytest.mark.parametrize("where", ["fork", "bundle"])
def test_without_cuda_one_line_exit_0_and_nothing_written(bundle, tmp_path, where):
    script = TEST_GPU if where == "fork" else bundle / "scripts/prove/test_gpu.py"
    out = tmp_path / "out"
    for python, why in [
        (no_torch_python(tmp_path), "no torch in"),
        (Path(sys.executable), "torch.cuda.is_available() is False"),
    ]:
        proc = run("--python", python, "--out", out, script=script)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.count("\n") == 1 and why in proc.stdout
        assert proc.stdout.startswith("test-gpu: no CUDA here (")
        assert "nothing was run and nothing is claimed" in proc.stdout
        assert not out.exists()


def test_the_script_answers_help_and_refuses_bad_input(bundle, tmp_path):
    for script in (TEST_GPU, bundle / "scripts/prove/test_gpu.py"):
        proc = run("--help", script=script)
        assert proc.returncode == 0 and proc.stdout.startswith("usage:")
    for args, message in [
        (["--reps", "0"], "must be >= 1"),
        (["--sleep-ms", "0"], "--sleep-ms must be above 0"),
        (["--timing-blocks", "33"], "--timing-blocks must be between 1 and 32"),
        (["--bundle", "--releases", ","], "--releases names no release"),
        (["--bundle", "--releases", "9.9.9"], "no series for vLLM 9.9.9"),
    ]:
        proc = run(*args, "--dir", tmp_path / "b")
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr
        assert not (tmp_path / "b").exists()
    # A bundle does not write bundles.
    proc = run("--bundle", script=bundle / "scripts/prove/test_gpu.py")
    assert proc.returncode == 1 and "cannot write a bundle" in proc.stderr


def test_the_default_releases_are_the_ones_the_help_names():
    assert gpu_bundle.DEFAULT_RELEASES == ("0.20.2", "0.23.0", "0.33.0")
    assert "0.20.2,0.23.0,0.33.0" in run("--help").stdout


# --- a whole run on a CUDA that orders everything --------------------------------


def test_a_run_where_nothing_can_race_is_refused(bundle, tmp_path):
    """Through each tree's real worker, copy backend and ctypes driver call,
    on sync_cuda.py: every copy is exact, so the series and 0.33.0 are
    clean, and the bare 0.20.2's race and every control show nothing, which
    the judge must not pass."""
    python = shim(
        tmp_path,
        "python-sync-cuda",
        f'exec {sys.executable} {HERE / "sync_cuda.py"} "$@"',
    )
    out = tmp_path / "out"
    proc = run(
        "--dir", bundle, "--python", python, "--out", out,
        "--reps", "2", "--timing-rounds", "2",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "FAILED" in proc.stdout and "sync CPU stand-in" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        ".vllm-fork-output",
        "results.json",
        "table.txt",
        "workers.log",
    ]
    saved = json.loads((out / "results.json").read_text())
    assert saved["passed"] is False
    docs = saved["results"]
    assert sorted(docs) == TREES
    for name, doc in docs.items():
        assert doc["error"] is None, doc["error"]
        for check in gpu_judge.RACE_CHECKS:
            assert doc["checks"][check]["clean"] == 2, (name, check)
        assert doc["checks"]["timing"]["ratio"] > 0
        # The tree's own parameters, read back from its ctypes struct.
        bare = name == "v0.20.2-base"
        assert doc["shipped"] == {
            "store_order": "ANY" if bare else "STREAM",
            "wait_event": not bare,
        }, name
    rows = {r["check"]: r for r in saved["rows"]}
    assert not rows["0.20.2 base: store as shipped (seed 004)"]["ok"]
    for label in ("0.20.2 series", "0.33.0 base", "0.33.0 series"):
        assert rows[f"{label}: store as shipped (seed 004)"]["ok"]
    controls = [
        r
        for r in saved["rows"]
        if "(control)" in r["check"] or ": load into" in r["check"]
    ]
    assert len(controls) == 3 * len(TREES)
    assert all(not r["ok"] for r in controls)
    assert (
        "never raced"
        in rows["0.33.0 series: store without barrier (control)"]["detail"]
    )


# --- the judge -------------------------------------------------------------------


def counts(race=0, clean=0, torn=0, missing=0, reps=None):
    reps = reps if reps is not None else race + clean + torn + missing
    return {
        "reps": reps,
        "race": race,
        "clean": clean,
        "torn": torn,
        "missing": missing,
    }


TIMING = {
    "rounds": 5,
    "blocks": 16,
    "block_bytes": 1 << 20,
    "with_ms": 1.1,
    "without_ms": 1.0,
    "ratio": 1.1,
    "ratio_q1": 1.0,
    "ratio_q3": 1.2,
}


def doc(store, bare=None, load=None, zero=None):
    raced = counts(race=9, clean=1)
    return {
        "error": None,
        "shipped": {"store_order": "STREAM", "wait_event": True},
        "checks": {
            "store": store,
            "store-bare": bare or raced,
            "load": load or raced,
            "zero": zero or raced,
            "timing": TIMING,
        },
    }


BASE = gpu_judge.Tree("v0.20.2-base", "0.20.2", "base", True)
SERIES = gpu_judge.Tree("v0.20.2-series", "0.20.2", "series", False)


def verdicts(results, trees=(BASE, SERIES)):
    rows = gpu_judge.judge(list(trees), results)
    return gpu_judge.passed(rows), {r.check: r for r in rows}


def test_the_judge_passes_a_racing_base_and_a_clean_series():
    base, series = doc(counts(race=97, torn=3)), doc(counts(clean=10))
    ok, rows = verdicts({"v0.20.2-base": base, "v0.20.2-series": series})
    assert ok
    assert (
        "100 of 100 stores copied"
        in rows["0.20.2 base: store as shipped (seed 004)"].detail
    )
    assert (
        "clean: 10 of 10" in rows["0.20.2 series: store as shipped (seed 004)"].detail
    )
    assert "1.10 (1.00-1.20)" in rows["0.20.2 series: store time, barrier/none"].detail
    table = gpu_judge.table(list(gpu_judge.judge([BASE, SERIES], {})))
    assert table.splitlines()[0].startswith("check") and "FAIL" in table


RACED, CLEAN = counts(race=5), counts(clean=10)


@pytest.mark.parametrize(
    "base, series, failing, says",
    [
        (RACED, counts(clean=9, race=1), "series: store as", "not clean"),
        (RACED, counts(clean=9, torn=1), "series: store as", "not clean"),
        (RACED, counts(clean=9, missing=1), "series: store as", "wrote nothing"),
        (CLEAN, CLEAN, "base: store as", "did not show"),
        (counts(race=5, missing=5), CLEAN, "base: store as", "wrote nothing"),
    ],
)
def test_the_judge_fails_a_store_that_is_not_as_expected(base, series, failing, says):
    ok, rows = verdicts({"v0.20.2-base": doc(base), "v0.20.2-series": doc(series)})
    assert not ok
    bad = [r for r in rows.values() if not r.ok]
    assert len(bad) == 1 and failing in bad[0].check and says in bad[0].detail


def test_a_fixed_release_must_be_clean_too():
    fixed = gpu_judge.Tree("v0.33.0-base", "0.33.0", "base", False)
    ok, rows = verdicts({"v0.33.0-base": doc(counts(race=1, clean=9))}, [fixed])
    assert (
        not ok
        and "not clean" in rows["0.33.0 base: store as shipped (seed 004)"].detail
    )


@pytest.mark.parametrize("check", ["store-bare", "load", "zero"])
def test_a_control_that_never_races_fails_the_run(check):
    argument = {"store-bare": "bare", "load": "load", "zero": "zero"}[check]
    series = doc(counts(clean=10), **{argument: counts(clean=10)})
    ok, rows = verdicts({"v0.20.2-base": doc(counts(race=3)), "v0.20.2-series": series})
    assert not ok
    (bad,) = [r for r in rows.values() if not r.ok]
    assert bad.check.startswith("0.20.2 series: ") and bad.detail.startswith("0 of 10")


def test_a_missing_result_a_failed_worker_or_a_failed_check_fails():
    broken = doc(counts(clean=10))
    broken["checks"]["load"] = {"error": "Traceback ...\nRuntimeError: load 7 not done"}
    ok, rows = verdicts({"v0.20.2-series": broken})
    assert not ok
    assert rows["0.20.2 base"].detail == "no result: the worker did not finish"
    assert rows["0.20.2 series: load"].detail == "failed: RuntimeError: load 7 not done"
    ok, rows = verdicts({"v0.20.2-base": {"error": "x\nOSError: no GPU"}}, [BASE])
    assert not ok and rows["0.20.2 base"].detail == "worker failed: OSError: no GPU"
    assert gpu_judge.judge([], {})[0].ok is False


def test_the_judge_reads_the_trees_of_a_manifest():
    trees = gpu_judge.trees_of(
        {"trees": [{"name": "v1-base", "release": "1", "kind": "base",
                    "store_race_expected": True}]}
    )  # fmt: skip
    assert trees == [gpu_judge.Tree("v1-base", "1", "base", True)]
    with pytest.raises(ValueError, match="lacks"):
        gpu_judge.trees_of({"trees": [{"name": "v1-base"}]})


def test_the_worker_and_the_judge_name_the_same_checks():
    assert gpu_worker.RACE_CHECKS == gpu_judge.RACE_CHECKS


def test_a_block_is_judged_by_all_of_its_bytes():
    v = gpu_worker.verdict
    assert v({5}, clean=5, race=4) == "clean"
    assert v({4}, clean=5, race=4) == "race"
    assert v({4, 5}, clean=5, race=4) == "torn"
    assert v({gpu_worker.SENTINEL}, clean=5, race=4) == "missing"
    values = [gpu_worker.rep_values(i) for i in range(500)]
    assert all(old != new for old, new in values)
    assert not {0, gpu_worker.SENTINEL} & {x for pair in values for x in pair}
    assert all(values[i][1] != values[i + 1][1] for i in range(499))
