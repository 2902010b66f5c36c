"""Fixtures of the engine tests; the helpers live in engine_helpers.py (importable by name)."""

from __future__ import annotations

import pytest

from engine_helpers import LocalRegistry


@pytest.fixture
def registry() -> LocalRegistry:
    return LocalRegistry()
