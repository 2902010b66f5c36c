"""What the family tests share: the prompt their logits are compared on."""

from __future__ import annotations

import pytest

from engine_helpers import prompt


@pytest.fixture(scope="module")
def ids():
    """Two 11-token prompts (a module that needs others defines its own `ids`)."""
    return prompt(T=11)
