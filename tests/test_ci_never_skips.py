"""Under CI=true a skip is a failure (tests/conftest.py): a missing tool or environment cannot let CI pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SKIPPING = '''
import pytest

pytest.importorskip("a_module_nobody_has", reason="no such module: pip install it")


def test_never_reached():
    pass
'''
SKIPPING_AT_SETUP = '''
import pytest


def test_needs_a_tool():
    pytest.skip("no frobnicator: apt-get install frobnicator")


@pytest.mark.xfail(reason="an expected failure stays one")
def test_expected_to_fail():
    assert False
'''


def _pytest(tmp_path: Path, source: str, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_case.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT")}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(TESTS) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "-rs", str(tmp_path / "test_case.py")], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)


def test_a_skip_passes_outside_ci_and_fails_in_ci_with_its_install_command(tmp_path):
    outside = _pytest(tmp_path, SKIPPING_AT_SETUP, None)
    assert outside.returncode == 0, outside.stdout
    assert "1 skipped, 1 xfailed" in outside.stdout
    inside = _pytest(tmp_path, SKIPPING_AT_SETUP, "true")
    assert inside.returncode == 1, inside.stdout
    assert "1 failed, 1 xfailed" in inside.stdout
    assert "apt-get install frobnicator" in inside.stdout


def test_a_module_skipped_at_collection_fails_in_ci(tmp_path):
    outside = _pytest(tmp_path, SKIPPING, None)
    assert outside.returncode == 5 and "1 skipped" in outside.stdout, outside.stdout   # 5: nothing else to run
    inside = _pytest(tmp_path, SKIPPING, "true")
    assert inside.returncode == 2 and "1 error" in inside.stdout, inside.stdout        # 2: a collection error
    assert "pip install it" in inside.stdout
