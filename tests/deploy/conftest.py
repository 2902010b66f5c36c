"""A scratch directory laid out like a fresh clone after `make demo`, shared by the deploy tests.

The README's commands run from the repository root after `make demo` (they use
`.venv/bin/...`, `tests/data/...` and the checkpoints in `demo-out/`), so the demo
runs once per session here, in `repo_like`, and the README test runs its commands
there too.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from deploy_helpers import DEMO_MAX_NEW_TOKENS, ROOT, VENV, clean_env


@pytest.fixture(scope="session")
def repo_like(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("repo")
    (d / ".venv").symlink_to(VENV)
    for name in ("tests", "bench"):
        (d / name).symlink_to(ROOT / name)
    return d


@pytest.fixture(scope="session")
def demo_run(repo_like):
    """`loadplan demo` as `make demo` runs it (default directory demo-out/), once: (its dir, the process)."""
    proc = subprocess.run([str(VENV / "bin" / "loadplan"), "demo", "--max-new-tokens", str(DEMO_MAX_NEW_TOKENS)],
                          capture_output=True, text=True, cwd=repo_like, timeout=200, env=clean_env())
    assert proc.returncode == 0, f"loadplan demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return repo_like / "demo-out", proc
