"""A test engine row for loadplan's vendor-kernel runner rules.

loadplan's gates keep their conditions for a vendor fused-MoE kernel (DESIGN 5.2 rules 6-7: device thresholds,
fused slots under EP); no shipped engine row asks them since the sglang and vllm profiles decide for those engines
(service/rules/sglang.py, vllm.py). The tests of those conditions ask them through this row.
"""

from __future__ import annotations

import pytest

from loadplan.service.rules import engines

VENDOR_KERNEL = "vendor-kernel"


@pytest.fixture(autouse=True)
def vendor_kernel_engine(monkeypatch):
    monkeypatch.setitem(engines.ENGINES, VENDOR_KERNEL,
                        engines.Engine(VENDOR_KERNEL, "0", "loadplan's rules for a vendor fused-MoE kernel",
                                       runner="kernel", default_for=()))
