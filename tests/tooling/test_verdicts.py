"""What a reproducer says about a release: only an honest failure is "the
bug is there"; a test that could not exercise the code is "broken"."""

from __future__ import annotations

import sys
from pathlib import Path

from lib.testenv import reproducer_verdicts

RELEASE = {
    "vllm/__init__.py": "",
    "vllm/pool.py": (
        "def take(n):\n"
        "    assert n > 0\n"  # the bug: an assert where an error belongs
        "    return n\n\n\n"
        "def record():\n"
        "    import torch\n\n"
        "    torch.cuda.current_stream()\n"  # a CUDA-only call on this CPU
    ),
}
TESTS = {
    "test_pool.py": (
        "import pytest\n"
        "from vllm import pool\n\n\n"
        "def test_fixed():\n"
        "    assert pool.take(2) == 2\n\n\n"
        "def test_bug():\n"
        "    with pytest.raises(ValueError):\n"
        "        pool.take(0)\n\n\n"
        "def test_name_gone():\n"
        "    pool.take_many(2)\n\n\n"
        "def test_needs_cuda():\n"
        "    pool.record()\n"
    ),
    "test_gone.py": "from vllm.pool import removed\n\n\ndef test_x():\n    pass\n",
}


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_verdicts(tmp_path):
    tree, project = tmp_path / "tree", tmp_path / "project"
    write(tree, RELEASE)
    write(project, {f"tests/reproducers/{k}": v for k, v in TESTS.items()})
    ids = [
        f"tests/reproducers/test_pool.py::{name}"
        for name in ("test_fixed", "test_bug", "test_name_gone", "test_needs_cuda")
    ] + [
        "tests/reproducers/test_gone.py::test_x",
        "tests/reproducers/test_missing.py::test_y",
    ]
    v = reproducer_verdicts(
        Path(sys.executable),
        tree,
        ids,
        project,
        tmp_path / "junit.xml",
        tmp_path / "log.txt",
    )
    got = {t.split("::")[-1]: (x.state, x.message) for t, x in v.items()}
    assert got["test_fixed"] == ("passes", "")
    assert got["test_bug"][0] == "fails"
    assert got["test_name_gone"][0] == "broken"
    assert "AttributeError" in got["test_name_gone"][1]
    assert got["test_needs_cuda"][0] == "broken"
    assert got["test_needs_cuda"][1].endswith("(raised in torch)")
    assert got["test_x"][0] == "broken" and "removed" in got["test_x"][1]
    assert got["test_y"] == (
        "not run",
        "tests/reproducers/test_missing.py does not exist",
    )


def test_a_run_killed_before_its_report_is_not_run(tmp_path):
    """A pytest stopped before it wrote its report (an interrupt, the OOM
    killer): every test is "not run", pointing at the log, no traceback."""
    write(tmp_path, {f"tests/reproducers/{k}": v for k, v in TESTS.items()})
    test_id = "tests/reproducers/test_pool.py::test_bug"
    v = reproducer_verdicts(
        Path(sys.executable),
        tmp_path / "tree",
        [test_id],
        tmp_path,
        tmp_path / "junit.xml",
        tmp_path / "log.txt",
        pytest=lambda *args: -9,
    )
    assert v[test_id].state == "not run"
    assert "log.txt" in v[test_id].message
