"""The pytest plugin every upstream test run loads (tests/upstream_env):
it skips only the tests that cannot run here, and only while they cannot."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from lib.paths import ROOT

PLUGIN_DIR = ROOT / "tests" / "upstream_env"

TESTS = {
    "tests/v1/core/test_scheduler.py": (
        "def test_schedule_multimodal_requests():\n    assert False\n\n"
        "def test_schedule_multimodal_requests_not():\n    pass\n\n"
        "def test_schedule():\n    pass\n"
    ),
    "tests/v1/core/test_other.py": "def test_schedule_multimodal_requests():\n"
    "    pass\n",
}


def outcomes(tmp_path: Path, lacking: bool) -> dict[str, str]:
    for rel, text in TESTS.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    # The conditions are the plugin's own; the test decides what they say.
    (tmp_path / "conftest.py").write_text(
        "import fork_upstream_plugin as p\n"
        "for k, (why, _) in list(p.CANNOT_RUN_HERE.items()):\n"
        f"    p.CANNOT_RUN_HERE[k] = (why, lambda: {lacking})\n"
    )
    junit = tmp_path / "out.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "fork_upstream_plugin", "-q"]
        + ["-p", "no:cacheprovider", f"--junitxml={junit}", "tests"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(PLUGIN_DIR), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        check=False,
    )
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("failure", "skipped")]
        found[f"{case.get('classname')}::{case.get('name')}"] = (
            kinds[0] if kinds else "passed"
        )
    return found


def test_only_the_named_test_is_skipped_while_it_cannot_run(tmp_path):
    assert outcomes(tmp_path, lacking=True) == {
        "tests.v1.core.test_scheduler::test_schedule_multimodal_requests": "skipped",
        # A longer name with the same start is another test: node ids are
        # matched up to "::" or the end, as pytest's --deselect does not.
        "tests.v1.core.test_scheduler::test_schedule_multimodal_requests_not": (
            "passed"
        ),
        "tests.v1.core.test_scheduler::test_schedule": "passed",
        "tests.v1.core.test_other::test_schedule_multimodal_requests": "passed",
    }


def test_nothing_is_skipped_where_it_can_run(tmp_path):
    found = outcomes(tmp_path, lacking=False)
    assert found["tests.v1.core.test_scheduler::test_schedule_multimodal_requests"] == (
        "failure"
    )
    assert "skipped" not in found.values()
