"""Fixtures `store`, `server`, `client`: a real in-process registry server over the fake store
(tests/service/registry_fixtures.py)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "service"))

from registry_fixtures import client, server, store  # noqa: E402,F401
