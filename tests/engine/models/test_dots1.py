"""dots.llm1 (`Dots1ForCausalLM`: Qwen3's attention over DeepSeek-V3's MoE) from save_pretrained checkpoints: logits
and greedy tokens against transformers, float32, with and without sliding-window layers, and with renormalised
top-k weights; the registry plans it in the DeepSeek family and never fuses its two shared experts; what it
cannot run refused by field. EP 2 with every backend: tests/engine/parallel/test_expert_parallel.py."""

from __future__ import annotations

import pytest

from loadplan.engine.layers.attention import GQAttention
from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (check_matches_transformers, check_refused_before_any_plan, make_dots1_checkpoint, prompt,
                            with_config)

ARCH = "Dots1ForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_dots1_checkpoint(tmp_path_factory.mktemp("dots1"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=11)


def test_logits_and_greedy_tokens_match_transformers_and_its_shared_experts_are_never_fused(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "deepseek" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == "deepseek.structural.architecture"
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, GQAttention) and attn.q_norm is not None and attn.sliding_window is None
    assert model.moe_layer_ids == (1, 2) and model.model.layers[1].mlp.shared_experts.gate_proj.out_features == 32


@pytest.mark.parametrize("config", [
    dict(sliding_window=4, max_window_layers=1),        # layers 1 and 2 slide over 4 positions of the 11 and more
    dict(norm_topk_prob=True, attention_bias=True),     # renormalised top-k; q/k/v and o biased (Qwen3's)
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    model = check_matches_transformers(make_dots1_checkpoint(tmp_path / "v", **config), ARCH, ids)
    if "sliding_window" in config:
        assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, 4, 4]


@pytest.mark.parametrize("overrides, match", [
    ({"sliding_window": 4, "max_window_layers": 1, "use_sliding_window": False, "layer_types": None},
     r"config\.use_sliding_window: false, but sliding_window=4 and max_window_layers=1 make layers 1\.\.2 slide"),
    ({"n_shared_experts": None}, r"config\.n_shared_experts: missing"),
    ({"moe_layer_freq": 2}, r"config\.moe_layer_freq: 2 makes layers \[2\] MoE for SGLang"),
    ({"partial_rotary_factor": 0.5}, r"config\.partial_rotary_factor: 0\.5 not supported"),
])
def test_a_config_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
