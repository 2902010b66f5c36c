"""The Qwen2-MoE block SGLang 0.5.23 builds for Qwen3-Next and Qwen3.5-MoE (DESIGN 8.1): it decides its own
shared-expert fusion while it is built (models/qwen2_moe.py: Qwen2MoeSparseMoeBlock.__init__, flags from
qwen3_next.py / qwen3_5.py), and its forward takes its own dispatch branch. tests/conformance checks the whole
grid against SGLang's code; these pin each condition."""

from __future__ import annotations

import pytest

from loadplan.plan import Keys
from loadplan.errors import FailedPrecondition

from ._fixtures import resolve


def qwen3_next(**over):
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 4,
           "num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 64,
           "shared_expert_intermediate_size": 64}
    cfg.update(over)
    return cfg


def qwen3_5_moe(**over):
    text = {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 4, "num_experts": 64, "num_experts_per_tok": 4,
            "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}
    text.update(over)
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text}


def sglang(cfg, **kw):
    kw.setdefault("device", "cuda:9.0")
    kw.setdefault("tp_size", 8)
    return resolve(cfg, engine="sglang", **kw).decisions


def test_qwen3_next_fuses_its_shared_expert_on_cuda_with_or_without_ep():
    for kw in ({}, {"tp_size": 2, "ep_size": 4}):
        d = sglang(qwen3_next(), **kw)
        assert d[Keys.SHARED_EXPERTS_FUSION].value is True, d[Keys.SHARED_EXPERTS_FUSION]
        assert d[Keys.SHARED_EXPERTS_FUSION].rule == "sglang.block.qwen2_moe.fused"
        assert d[Keys.NUM_FUSED_SHARED_EXPERTS].value == 1
        assert (d[Keys.FORWARD_PATH].value, d[Keys.POST_EXPERTS_ALL_REDUCE].value) == ("normal", True)
    # loadplan's own engine reads the same config through loadplan's gate, not SGLang's block
    assert resolve(qwen3_next(), tp_size=8).decisions[Keys.SHARED_EXPERTS_FUSION].rule != \
        "sglang.block.qwen2_moe.fused"


@pytest.mark.parametrize("over, kw, rule", [
    ({}, {"device": "hip:9.4"}, "sglang.block.qwen2_moe.device"),
    ({"n_shared_experts": 0}, {}, "sglang.block.qwen2_moe.no_shared_experts"),      # read before the width
    ({"shared_expert_intermediate_size": 128}, {}, "sglang.block.qwen2_moe.intermediate_size"),
    ({}, {"tp_size": 2, "ep_size": 4, "a2a_backend": "mori"}, "sglang.block.qwen2_moe.a2a"),
    ({}, {"tp_size": 2, "ep_size": 4, "a2a_backend": "megamoe"}, "sglang.block.qwen2_moe.per_rank_slots"),
    ({}, {"disable_shared_experts_fusion": True}, "sglang.disable_shared_experts_fusion"),
    ({}, {"device": "cuda:10.0"}, "sglang.disable_shared_experts_fusion"),   # SM100's flashinfer_trtllm runner
])
def test_qwen3_next_does_not_fuse_where_its_block_says_no(over, kw, rule):
    d = sglang(qwen3_next(**over), **kw)
    assert d[Keys.SHARED_EXPERTS_FUSION].value is False and d[Keys.SHARED_EXPERTS_FUSION].rule == rule


def test_sm100_gives_qwen3_next_the_trtllm_runner_as_qwen3_moe():
    d = sglang(qwen3_next(), device="cuda:10.0")
    assert d["sglang.moe_runner_backend"].value == "flashinfer_trtllm"


def test_qwen3_next_with_two_fused_shared_experts_is_refused_as_sglang_refuses_it():
    with pytest.raises(FailedPrecondition, match=r"^config\.n_shared_experts: SGLang 0\.5\.23 refuses to start: "
                                                 r"qwen3_next\.py fuses exactly one shared expert"):
        sglang(qwen3_next(n_shared_experts=2))
    # unfused (DeepEP), SGLang builds its one shared MLP and runs
    d = sglang(qwen3_next(n_shared_experts=2), tp_size=2, ep_size=4, a2a_backend="deepep")
    assert d[Keys.SHARED_EXPERTS_FUSION].value is False


def test_qwen3_5_moe_never_fuses_on_cuda_and_its_block_dispatches_itself_under_deepep():
    d = sglang(qwen3_5_moe())
    assert d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "sglang.block.qwen2_moe.device"
    # the Qwen2-MoE block's dispatch branch, not a normal branch that would all-reduce after the combine
    d = sglang(qwen3_5_moe(), tp_size=2, ep_size=4, a2a_backend="deepep")
    assert (d[Keys.FORWARD_PATH].value, d[Keys.POST_EXPERTS_ALL_REDUCE].value) == ("a2a", False)
    assert d[Keys.FORWARD_PATH].rule == "sglang.forward.qwen2_moe.dispatch"
