"""The backend capability table (DESIGN 5.1) and what each row makes of the
forward path, the post-experts reduction and the fused slot's scale (DESIGN 5.4)."""

from __future__ import annotations

import pytest

from loadplan.plan import Keys
from loadplan.errors import NotFound
from loadplan.service.rules.backends import BACKENDS, backend
from loadplan.service.rules.resolve import resolve_decisions

from ._fixtures import deepseek, qwen3, request, resolve

# DESIGN 5.1, transcribed by hand: path, combine already reduces, DeepEP-class,
# per-rank fused slots, fusion force-disabled.
DESIGN_TABLE = {
    "none":          ("normal", False, False, False, False),
    "deepep":        ("a2a", True, True, True, False),
    "mooncake":      ("a2a", True, True, True, False),
    "mori":          ("a2a", True, True, True, False),
    "nixl":          ("a2a", True, False, False, False),
    "ascend_fuseep": ("a2a", True, False, False, False),
    "flashinfer":    ("a2a", True, False, False, True),
    "megamoe":       ("a2a", True, False, True, False),
}
A2A = sorted(n for n, row in DESIGN_TABLE.items() if row[0] == "a2a")


def test_table_has_exactly_the_design_rows():
    assert sorted(BACKENDS) == sorted(DESIGN_TABLE)


@pytest.mark.parametrize("name", sorted(DESIGN_TABLE))
def test_row_capabilities(name):
    row = backend(name)
    assert row.name == name
    assert (row.forward_path, row.combine_reduces, row.deepep_class, row.per_rank_fused_slots,
            row.fusion_force_disabled) == DESIGN_TABLE[name]


@pytest.mark.parametrize("name", ["", "DeepEP ", "pplx", "normal", "deepep2"])
def test_unknown_backend_is_not_found_listing_the_known_ones(name):
    with pytest.raises(NotFound) as e:
        backend(name)
    assert e.value.field == "runtime.a2a_backend"
    assert e.value.known == sorted(DESIGN_TABLE)
    for known in DESIGN_TABLE:
        assert known in e.value.message


def test_unknown_backend_in_a_request_is_not_found_never_a_normal_fallback():
    with pytest.raises(NotFound) as e:
        resolve_decisions(request(qwen3(), a2a_backend="uccl"))
    assert "'uccl'" in str(e.value) and "deepep" in str(e.value)


@pytest.mark.parametrize("name", sorted(DESIGN_TABLE))
@pytest.mark.parametrize("ep_size", [1, 2])
def test_forward_path_and_reduction_per_backend(name, ep_size):
    path, combine_reduces = DESIGN_TABLE[name][:2]
    d = resolve(qwen3(), a2a_backend=name, ep_size=ep_size).decisions
    assert d[Keys.FORWARD_PATH].value == path
    assert d[Keys.FORWARD_PATH].rule == f"backend.{name}.path"
    reduce = d[Keys.POST_EXPERTS_ALL_REDUCE]
    # normal path: partial sums on each rank need one all-reduce once experts are split;
    # a combine that already reduces must never be reduced again (double reduction)
    assert reduce.value == (not combine_reduces and ep_size > 1)
    assert reduce.rule == f"backend.{name}.reduction"
    assert reduce.reason


@pytest.mark.parametrize("name", A2A)
@pytest.mark.parametrize("ep_size,tp_size", [(1, 1), (2, 1), (1, 2), (4, 2), (8, 1)])
def test_no_a2a_backend_is_ever_reduced_again(name, ep_size, tp_size):
    """The mori bug class: an a2a combine already sums; a post-experts all-reduce would double it."""
    for cfg, kw in ((qwen3(), {}), (deepseek(), {"enforce_shared_experts_fusion": True})):
        d = resolve(cfg, a2a_backend=name, ep_size=ep_size, tp_size=tp_size, **kw).decisions
        assert d[Keys.POST_EXPERTS_ALL_REDUCE].value is False
        assert name in d[Keys.POST_EXPERTS_ALL_REDUCE].reason


@pytest.mark.parametrize("ep_size,tp_size,expected", [(1, 1, False), (2, 1, True), (1, 2, True), (2, 2, True)])
def test_normal_path_reduces_exactly_when_experts_are_split(ep_size, tp_size, expected):
    d = resolve(qwen3(), ep_size=ep_size, tp_size=tp_size).decisions
    assert d[Keys.POST_EXPERTS_ALL_REDUCE].value is expected


def _expect_fused(name: str, ep_size: int, enforced: bool) -> bool:
    """DeepSeek on the torch runner (device and EP conditions pass), from the DESIGN columns."""
    path, _, deepep_class, per_rank, forced_off = DESIGN_TABLE[name]
    if forced_off:
        return False
    if path == "a2a" and ep_size > 1 and not per_rank:
        return False
    return enforced or not deepep_class


@pytest.mark.parametrize("name", sorted(DESIGN_TABLE))
@pytest.mark.parametrize("ep_size", [1, 2])
@pytest.mark.parametrize("enforced", [False, True])
def test_fusion_and_fused_scale_per_backend(name, ep_size, enforced):
    d = resolve(deepseek(), a2a_backend=name, ep_size=ep_size, enforce_shared_experts_fusion=enforced).decisions
    fused = _expect_fused(name, ep_size, enforced)
    assert d[Keys.SHARED_EXPERTS_FUSION].value is fused
    assert d[Keys.NUM_FUSED_SHARED_EXPERTS].value == (1 if fused else 0)
    scale = d[Keys.FUSED_SHARED_EXPERT_SCALE]
    # a global slot on every rank of the normal path is summed ep_size times by the all-reduce
    normal = DESIGN_TABLE[name][0] == "normal"
    assert scale.value == pytest.approx(1.0 / ep_size if fused and normal else 1.0)
    assert scale.rule == "reduction.fused_scale" and scale.reason
    if not fused:
        assert d[Keys.SHARED_EXPERTS_FUSION].reason


def test_flashinfer_forces_fusion_off_even_when_enforced():
    d = resolve(deepseek(), a2a_backend="flashinfer", enforce_shared_experts_fusion=True).decisions
    assert d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "backend.flashinfer.fusion_force_disabled"


@pytest.mark.parametrize("name", ["nixl", "ascend_fuseep"])
def test_backend_without_per_rank_slots_refuses_fusion_under_ep(name):
    d = resolve(deepseek(), a2a_backend=name, ep_size=2, enforce_shared_experts_fusion=True).decisions
    assert d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == f"backend.{name}.no_per_rank_fused_slots"
    assert "ep_size=2" in d[Keys.SHARED_EXPERTS_FUSION].reason


@pytest.mark.parametrize("tp_size", [1, 2])
def test_fused_slot_scale_under_tp_only_is_one(tp_size):
    d = resolve(deepseek(), tp_size=tp_size).decisions
    assert d[Keys.SHARED_EXPERTS_FUSION].value is True
    assert d[Keys.FUSED_SHARED_EXPERT_SCALE].value == 1.0


@pytest.mark.parametrize("ep_size", [2, 4, 8])
def test_fused_scale_is_one_over_ep_size_on_the_normal_path(ep_size):
    d = resolve(deepseek(), ep_size=ep_size).decisions
    assert d[Keys.FUSED_SHARED_EXPERT_SCALE].value == pytest.approx(1.0 / ep_size)
    assert f"ep_size={ep_size}" in d[Keys.FUSED_SHARED_EXPERT_SCALE].reason
