"""Nemotron-H (`NemotronHForCausalLM`: Nemotron 3 Nano) from save_pretrained checkpoints: logits and greedy tokens
(decoded through the Mamba2 layers' state cache and the attention layers' KV cache) against transformers, float32:
Mamba2, NoPE attention, dense relu^2 MLP and MoE blocks (DeepSeek-V3's grouped sigmoid router over ungated relu^2
experts, a shared MLP beside them); biases, one Mamba2 group, unnormalised routing weights, a latent MoE (Nemotron 3
Super's); the Hub's older spellings of its config; a prompt longer than a chunk; token-by-token decoding; a batch
decodes each row as alone; speculative decoding rolls its Mamba2 layers back; the registry plans it unfused; what it
cannot run is refused by field before any plan; an expert's gate projection (which it has none of) is refused by
name. EP 2 with every backend, TP 2 (with a latent MoE) and PP 2: tests/engine/parallel/."""

from __future__ import annotations

import json

import pytest
import torch

from loadplan.engine.layers.attention import GQAttention
from loadplan.engine.layers.mamba2 import Mamba2Mixer
from loadplan.engine.models.config import ConfigError
from loadplan.engine.weights import MissingTensor, UnexpectedTensor
from loadplan.plan import Keys

from engine_helpers import (check_batch_rows_decode_alone, check_decoding_token_by_token, check_matches_transformers,
                            check_refused_before_any_plan, check_speculative_target_rolls_back, load_local, logits_of,
                            make_nemotron_h_checkpoint, prompt, with_config, with_tensors)

ARCH = "NemotronHForCausalLM"
# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config.json, its fields as published (auto_map and generation fields
# left out): the Hub's older spellings (hybrid_override_pattern with num_hidden_layers, rope_theta, norm_eps).
NANO = {"architectures": [ARCH], "model_type": "nemotron_h", "attention_bias": False, "chunk_size": 128,
        "conv_kernel": 4, "expand": 2, "head_dim": 128, "hidden_size": 2688,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "intermediate_size": 1856,
        "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64, "mamba_hidden_act": "silu", "mamba_num_heads": 64,
        "mamba_proj_bias": False, "mamba_ssm_cache_dtype": "float32", "max_position_embeddings": 262144,
        "mlp_bias": False, "mlp_hidden_act": "relu2", "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "n_groups": 8, "n_routed_experts": 128,
        "n_shared_experts": 1, "norm_eps": 1e-05, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts_per_tok": 6, "num_hidden_layers": 52, "num_key_value_heads": 2, "partial_rotary_factor": 1.0,
        "rescale_prenorm_residual": True, "residual_in_fp32": False, "rope_theta": 10000,
        "routed_scaling_factor": 2.5, "sliding_window": None, "ssm_state_size": 128, "tie_word_embeddings": False,
        "time_step_floor": 0.0001, "time_step_max": 0.1, "time_step_min": 0.001, "topk_group": 1,
        "torch_dtype": "bfloat16", "use_bias": False, "use_conv_bias": True, "vocab_size": 131072}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_nemotron_h_checkpoint(tmp_path_factory.mktemp("nemotron_h"))





def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    model = check_matches_transformers(ckpt, ARCH, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == "nemotron_h" and d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert [type(layer.mixer) for layer in model.model.layers] == [Mamba2Mixer, type(None), GQAttention,
                                                                     type(None), type(None)]
    assert model.moe_layer_ids == (1, 4) and not model.model.layers[2].self_attn.use_rope
    experts = model.model.layers[1].mlp.experts
    assert not experts.gated and experts.gate_up_proj.shape == (8, 16, 32)           # up rows only, no gate
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0


@pytest.mark.parametrize("config", [
    dict(mlp_bias=True, use_bias=True, use_conv_bias=False, n_groups=1, norm_topk_prob=False),
    # a latent MoE (Nemotron 3 Super's): experts 16 wide in and out, between projections with biases
    dict(moe_latent_size=16, mlp_bias=True),
    # transformers ties nothing, whatever tie_word_embeddings says
    dict(tie_word_embeddings=True, layers_block_type=["moe", "linear_attention", "linear_attention",
                                                      "full_attention"], n_group=1, conv_kernel=2),
])
def test_its_variants_match_transformers(tmp_path, ids, config):
    check_matches_transformers(make_nemotron_h_checkpoint(tmp_path / "v", **config), ARCH, ids)


def test_the_hubs_older_spellings_of_its_config_are_read_alike(ckpt, tmp_path, ids):
    """Nemotron 3 Nano's config.json says hybrid_override_pattern with num_hidden_layers, and some of the Mamba2
    fields by their older names (mamba_n_groups, mamba_d_conv), which transformers reads first."""
    cfg = json.loads((ckpt / "config.json").read_text())
    hub = with_config(ckpt, tmp_path / "hub", layers_block_type=None, hybrid_override_pattern="ME*-E",
                      num_hidden_layers=5, n_groups=8, mamba_n_groups=cfg["n_groups"], conv_kernel=None,
                      mamba_d_conv=cfg["conv_kernel"])
    torch.testing.assert_close(logits_of(load_local(hub), ids), logits_of(load_local(ckpt), ids))


def test_the_published_nano_config_is_read_as_transformers_reads_it_and_planned():
    """Its 52 blocks (23 Mamba2, 23 MoE, 6 attention) and sizes; the registry plans its 23 MoE layers for EPLB, 16 of
    the 128 experts on each of 8 EP ranks, the shared MLP unfused."""
    from loadplan.engine.registry import model_class

    from engine_helpers import make_plan

    cfg = model_class(ARCH).parse_config(NANO)
    assert [cfg.layer_kinds.count(k) for k in ("mamba", "moe", "attention", "mlp")] == [23, 23, 6, 0]
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group) == (52, 128, 6, 1)
    assert (cfg.mamba_num_heads * cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size) == (4096, 8, 128)
    assert (cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size, cfg.time_step_min) == \
        (1856, 3712, 0.001)
    d = make_plan(NANO, ep_size=8, ep_rank=5, enable_eplb=True).decisions
    assert d[Keys.EPLB_ENABLED].value and [int(i) for i in d[Keys.EPLB_LAYERS].value] == list(cfg.moe_layers)
    assert d[Keys.NUM_LOCAL_EXPERTS].value == 16 and d[Keys.SHARED_EXPERTS_FUSION].value is False


def test_a_prompt_longer_than_a_chunk_matches_transformers(ckpt):
    """150 tokens: the engine's scan runs three chunks of 64, transformers' 38 chunks of 4."""
    check_matches_transformers(ckpt, ARCH, prompt(B=1, T=150, seed=3), n_new=3)


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt, ARCH, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt, ids)


def test_speculative_decoding_with_a_nemotron_h_target_gives_its_greedy_tokens(tmp_path):
    check_speculative_target_rolls_back(make_nemotron_h_checkpoint(tmp_path / "target"), tmp_path / "draft", 0.1)


def test_an_experts_gate_projection_is_refused_by_name_and_a_missing_up_projection_named(ckpt, tmp_path):
    def add_gate(tensors):
        tensors["backbone.layers.1.mixer.experts.3.gate_proj.weight"] = torch.zeros(16, 32)
    with pytest.raises(UnexpectedTensor, match=r"experts have no gate projection .* \[checkpoint tensor "
                                               r"'backbone\.layers\.1\.mixer\.experts\.3\.gate_proj\.weight'\]"):
        load_local(with_tensors(ckpt, tmp_path / "gated", add_gate))

    def drop_up(tensors):
        del tensors["backbone.layers.4.mixer.experts.5.up_proj.weight"]
    with pytest.raises(MissingTensor, match=r"model\.layers\.4\.mlp\.experts\.5\.up_proj\.weight"):
        load_local(with_tensors(ckpt, tmp_path / "no_up", drop_up))


@pytest.mark.parametrize("overrides,match", [
    (dict(moe_latent_size=0), r"config\.moe_latent_size: expected an integer >= 1 or null, got 0"),
    (dict(layers_block_type=["mamba", "moe", "sliding_attention"]), r"config\.layers_block_type: expected a list"),
    (dict(layers_block_type=None, hybrid_override_pattern="ME*X"), r"config\.hybrid_override_pattern: expected"),
    (dict(layers_block_type=None, hybrid_override_pattern="ME*", num_hidden_layers=4),
     r"config\.hybrid_override_pattern: 3 layers, but num_hidden_layers=4"),
    (dict(n_groups=3), r"config\.n_groups: 3 must be >= 1 and divide mamba_num_heads=4"),
    (dict(mlp_hidden_act="gelu"), r"config\.mlp_hidden_act: 'gelu' not supported"),
    (dict(n_group=3), r"config\.n_group: 3 must be >= 1 and divide n_routed_experts=8"),
    (dict(topk_group=3), r"config\.topk_group: 3 must be in \[1, n_group=2\]"),
    (dict(num_experts_per_tok=9), r"config\.num_experts_per_tok: 9 exceeds the number of routed experts \(8\)"),
])
def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
