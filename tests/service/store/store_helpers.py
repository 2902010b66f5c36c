"""Helpers of the store tests (imported by their conftest and test modules)."""

from __future__ import annotations

import datetime as dt
import itertools

import sqlalchemy as sa

from loadplan.service.store.models import Base

QWEN3 = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4, "num_experts": 8,
         "num_experts_per_tok": 2}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4, "n_routed_experts": 256,
               "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1}
TABLES = tuple(Base.metadata.tables)


def count_rows(engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {t: conn.execute(sa.select(sa.func.count()).select_from(Base.metadata.tables[t])).scalar_one()
                for t in TABLES}


class Clock:
    """A registry clock that moves one second per call: distinct, known creation times."""

    def __init__(self, start: dt.datetime):
        self._ticks = itertools.count()
        self.start = start

    def __call__(self) -> dt.datetime:
        return self.start + dt.timedelta(seconds=next(self._ticks))
