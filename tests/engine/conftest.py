"""Fixtures of the engine tests; the helpers live in engine_helpers.py (importable by name)."""

from __future__ import annotations

import pytest

from engine_helpers import LocalRegistry


@pytest.fixture
def registry() -> LocalRegistry:
    return LocalRegistry()


@pytest.fixture
def registry_address(tmp_path):
    """The address of a real registry (the embedded server, on a SQLite file in tmp_path) for ranks that run in
    processes of their own (engine/worker.py's generate_distributed asks one registry, it starts none)."""
    from loadplan.service.embedded import EmbeddedRegistry

    with EmbeddedRegistry(f"sqlite:///{tmp_path / 'registry.db'}") as reg:
        yield reg.address
