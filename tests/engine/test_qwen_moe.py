"""Qwen3-MoE and Qwen2-MoE from save_pretrained checkpoints: logits against transformers, float32."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.loader import load_model
from loadplan.engine.models.qwen_moe import ConfigError, QwenMoeConfig

from engine_helpers import LocalRegistry, hf_logits_of_order_one, load_kwargs, make_checkpoint, prompt

QWEN2, QWEN3 = "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
ATOL = 1e-3


def _engine_logits(path, ids, **kw):
    model = load_model(path, registry=LocalRegistry(), **load_kwargs(**kw))
    with torch.no_grad():
        return model, model(ids)


def _check(path, arch, **kw):
    ids = prompt()
    want = hf_logits_of_order_one(path, arch, ids)
    model, got = _engine_logits(path, ids, **kw)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= ATOL
    return model, got


@pytest.mark.parametrize("legacy_rope", [False, True], ids=["rope_parameters", "rope_theta"])
def test_qwen3_moe_matches_transformers(tmp_path, legacy_rope):
    path = make_checkpoint(tmp_path, QWEN3, legacy_rope=legacy_rope, rope_parameters={
        "rope_type": "default", "rope_theta": 5000.0})
    model, _ = _check(path, QWEN3)
    assert model.plan.decisions["moe.shared_experts_fusion"].value is False
    assert model.plan.decisions["moe.shared_experts_fusion"].reason == "no shared experts"
    assert model.model.layers[0].self_attn.q_norm is not None


def test_qwen3_moe_sparse_step_mlp_only_layers_and_attention_bias(tmp_path):
    path = make_checkpoint(tmp_path, QWEN3, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3],
                           attention_bias=True)
    model, _ = _check(path, QWEN3)
    # layer i is sparse iff i not in mlp_only_layers and (i + 1) % 2 == 0: only layer 1
    assert model.moe_layer_ids == (1,)
    assert list(model.routed_experts_weights_of_layer) == [1]
    assert model.model.layers[0].self_attn.o_proj.bias is not None


def test_qwen3_moe_linear_rope_scaling_both_spellings(tmp_path):
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    a = make_checkpoint(tmp_path / "a", QWEN3, rope_parameters=rope)
    b = make_checkpoint(tmp_path / "b", QWEN3, rope_parameters=rope, legacy_rope=True)
    _, la = _check(a, QWEN3)
    _, lb = _check(b, QWEN3)
    torch.testing.assert_close(la, lb, atol=0, rtol=0)


@pytest.mark.parametrize("legacy_rope", [False, True], ids=["rope_parameters", "rope_theta"])
def test_qwen2_moe_fused_and_unfused_match_transformers_and_each_other(tmp_path, legacy_rope):
    path = make_checkpoint(tmp_path, QWEN2, legacy_rope=legacy_rope)
    fused, lf = _check(path, QWEN2)
    unfused, lu = _check(path, QWEN2, disable_shared_experts_fusion=True)
    assert fused.plan.decisions["moe.shared_experts_fusion"].value is True
    assert unfused.plan.decisions["moe.shared_experts_fusion"].value is False
    block_f, block_u = fused.model.layers[0].mlp, unfused.model.layers[0].mlp
    assert block_f.experts.gate_up_proj.shape[0] == 9 and block_f.shared_expert is None
    assert block_u.experts.gate_up_proj.shape[0] == 8 and block_u.shared_expert is not None
    assert (lf - lu).abs().max().item() <= 1e-4


def test_qwen2_moe_with_a_shared_expert_of_another_size_is_not_fused(tmp_path):
    path = make_checkpoint(tmp_path, QWEN2, shared_expert_intermediate_size=48)
    model, _ = _check(path, QWEN2)
    d = model.plan.decisions["moe.shared_experts_fusion"]
    assert d.value is False and "shared_expert_intermediate_size=48" in d.reason
    assert model.model.layers[0].mlp.experts.num_fused_shared_experts == 0


def test_qwen2_moe_sharded_checkpoint_with_index(tmp_path):
    path = make_checkpoint(tmp_path, QWEN2, max_shard_size="60KB", num_hidden_layers=4, mlp_only_layers=[2],
                           decoder_sparse_step=1)
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    model, _ = _check(path, QWEN2)
    assert model.moe_layer_ids == (0, 1, 3)


def test_tied_embeddings(tmp_path):
    path = make_checkpoint(tmp_path, QWEN3, tie_word_embeddings=True)
    model, _ = _check(path, QWEN3)
    assert model.lm_head is None


def test_config_refusals_name_the_field():
    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4}
    QwenMoeConfig.from_hf(base, QWEN3)
    with pytest.raises(ConfigError, match="use_sliding_window"):
        QwenMoeConfig.from_hf({**base, "use_sliding_window": True}, QWEN3)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        QwenMoeConfig.from_hf({**base, "num_experts_per_tok": 5}, QWEN3)
    with pytest.raises(ConfigError, match="config.moe_intermediate_size: missing"):
        QwenMoeConfig.from_hf({k: v for k, v in base.items() if k != "moe_intermediate_size"}, QWEN3)
    with pytest.raises(ValueError, match="hidden_act 'gelu' not supported; supported: silu"):
        QwenMoeConfig.from_hf({**base, "hidden_act": "gelu"}, QWEN3)
    # Qwen2-MoE's shared expert: transformers fills in a width of 5632 where the config leaves it out
    with pytest.raises(ConfigError, match="config.shared_expert_intermediate_size: missing"):
        QwenMoeConfig.from_hf(base, QWEN2)
    q2 = QwenMoeConfig.from_hf({**base, "shared_expert_intermediate_size": 4}, QWEN2)
    assert q2.qkv_bias and not q2.o_bias and not q2.qk_norm
    q3 = QwenMoeConfig.from_hf(base, QWEN3)
    assert not q3.qkv_bias and q3.qk_norm and q3.head_dim == 4


@pytest.mark.parametrize("folder, arch, low, high", [
    ("qwen3-30b-a3b", QWEN3, 30.4e9, 30.6e9),          # published: 30.5B
    ("qwen1.5-moe-a2.7b", QWEN2, 14.2e9, 14.4e9),       # published: 14.3B
])
def test_hub_configs_build_on_meta_at_their_published_size(folder, arch, low, high):
    import json
    import pathlib

    from loadplan.engine.loader import build_model

    from engine_helpers import make_plan

    cfg = json.loads((pathlib.Path(__file__).parents[1] / "data" / "configs" / folder / "config.json").read_text())
    model = build_model(cfg, make_plan(cfg), torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    assert low < n < high
    assert all(p.is_meta for p in model.parameters())
