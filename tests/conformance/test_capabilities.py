"""CheckCapabilities against SGLang's own answers: for groups of the recorded grid that differ only in the a2a
backend (the main sub-grid: config, device, shape and flags fixed), the report's verdict on each backend is SGLang's:
a backend SGLang refuses is refused with SGLang's own words for its first failing check, and one SGLang starts
starts (or is refused for a hazard the grid's verdict shows in SGLang's answer)."""

from __future__ import annotations

import random
import time

from loadplan.service.rules.capabilities import starts_with
from loadplan.service.rules.resolve import resolve_decisions

from .sglang_agreement import (HAZARD_PREFIX, RECORDING, carries, load_recording, point_name, requests_for,
                               sglang_refuses)

GROUPS = 12


def _groups(records):
    groups: dict[tuple, dict[str, dict]] = {}
    for r in records:
        p = r["point"]
        if p["grid"] != "main":
            continue
        key = tuple(sorted((k, v) for k, v in p.items() if k != "a2a_backend"))
        groups.setdefault(key, {})[p["a2a_backend"]] = r
    return groups


def test_each_backend_is_reported_as_sglang_answers_it():
    _, records = load_recording(RECORDING)
    groups = _groups(records)
    seed = time.time_ns() % 1_000_000
    rng = random.Random(seed)
    wrong = []
    for key in rng.sample(sorted(groups), GROUPS):
        by_backend = groups[key]
        first = next(iter(by_backend.values()))
        [request] = requests_for(first["point"], first["answer"])
        report = starts_with(request, resolve_decisions)
        assert {c.name for c in report.backends} == set(by_backend), point_name(first["point"])
        for c in report.backends:
            rec = by_backend[c.name]
            words = sglang_refuses(rec["answer"])
            if words is not None:
                ok = not c.starts and carries(c.reason, words)
            else:
                ok = c.starts or c.reason.startswith(HAZARD_PREFIX)
            if not ok:
                wrong.append(f"{point_name(rec['point'])}: report {c.starts} {c.reason[:200]!r}; SGLang "
                             f"{words[:200] if words else 'starts'!r}")
    assert not wrong, f"seed {seed}:\n" + "\n".join(wrong)
