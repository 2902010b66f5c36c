"""Helpers of the deploy tests (importable by name; fixtures live in conftest.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent
DEMO_MAX_NEW_TOKENS = 12


def clean_env() -> dict[str, str]:
    """This environment without LOADPLAN_* (a developer's settings must not leak into the commands)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("LOADPLAN_")}
