"""Tiny random Qwen-MoE checkpoints made with transformers, and a local registry.

`LocalRegistry` runs the registry's real use case (`service.registry.Registry`,
the real rules) over an in-memory store: the engine gets real plans without a
server. One test in test_loader.py goes through the embedded gRPC registry.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from loadplan.service.registry import NewPlan, Registry


def _transformers():
    """transformers is a test-only dependency: the tests that need it skip without it."""
    return pytest.importorskip("transformers")


class _MemoryStore:
    def __init__(self):
        self.plans = {}

    def save_plan(self, new: NewPlan):
        self.plans[new.plan.plan_id] = new.plan
        return new.plan


class LocalRegistry:
    """An object with resolve_load_plan(request): what load_model accepts as `registry`."""

    def __init__(self):
        self.registry = Registry(_MemoryStore())
        self.requests = []

    def resolve_load_plan(self, request):
        self.requests.append(request)
        return self.registry.resolve(request)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations and logits: fan-in scaled matrices, unit embeddings, norms near 1, small biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                # then it is the head too: keep logits O(1) (a multimodal model's: its text model's say)
                tied = model.config.get_text_config().tie_word_embeddings
                p.copy_(torch.randn(p.shape, generator=g) / (math.sqrt(p.shape[-1]) if tied else 1))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
              max_position_embeddings=256, rms_norm_eps=1e-6)


def make_checkpoint(path: Path, arch: str, *, seed: int = 0, legacy_rope: bool = False,
                    max_shard_size: str | None = None, **overrides) -> Path:
    """Save a random tiny model of `arch`; returns the folder. legacy_rope rewrites config.json to the
    Hub's older rope_theta/rope_scaling spelling."""
    transformers = _transformers()
    if arch == "Qwen2MoeForCausalLM":
        cfg_cls, model_cls = transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM
        kw = dict(COMMON, shared_expert_intermediate_size=32)
    else:
        cfg_cls, model_cls = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
        kw = dict(COMMON, head_dim=24, norm_topk_prob=True)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw))
    randomize(model, seed)
    save_kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kw)
    f = path / "config.json"
    cfg = json.loads(f.read_text())
    if legacy_rope:
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params["rope_theta"]
        cfg["rope_scaling"] = None if params.get("rope_type", "default") == "default" else params
    f.write_text(json.dumps(cfg, indent=2))
    return path


# DeepSeek-V3 with 256 routed experts, so that the registry's fusion gate passes (DESIGN 5.2); everything else
# tiny. No rope settings: the caller adds them.
DEEPSEEK_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=256,
                     n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=1,
                     q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                     max_position_embeddings=256, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6)


def make_deepseek_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random DeepSeek-V3 of `config` (transformers' DeepseekV3Config kwargs), routing bias included."""
    return _save_random_model(path, "DeepseekV3", seed, config)


def _save_random_model(path: Path, family: str, seed: int, config: dict, adjust=None) -> Path:
    """transformers' `{family}ForCausalLM` of `{family}Config(**config)`, randomized, with a random
    e_score_correction_bias where the family's router has one (a buffer there, which randomize() skips),
    then `adjust(model, seed)` where given, saved to `path`."""
    transformers = _transformers()
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(**config))
    _randomize_with_routing_bias(model, seed)
    if adjust is not None:
        adjust(model, seed)
    model.save_pretrained(path)
    return path


def _randomize_with_routing_bias(model: torch.nn.Module, seed: int) -> None:
    """randomize(), and a random routing bias where the router keeps it as a buffer (skipped there):
    e_score_correction_bias, LFM2-MoE's expert_bias."""
    randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):   # DeepSeek's and others'; LFM2-MoE's
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


# dots.llm1: DeepSeek-V3's MoE (16 routed experts in 4 groups, top-4, 2 shared experts) under Qwen3's attention
# (qk norm, 16-wide heads); layer 0 dense.
DOTS1_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=16, n_shared_experts=2,
                  num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                  max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=None)


def make_dots1_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random dots.llm1 of DOTS1_TINY updated with `config` (transformers' Dots1Config kwargs), routing bias
    included."""
    return _save_random_model(path, "Dots1", seed, dict(DOTS1_TINY, **config))


# ERNIE-4.5 MoE: 8 routed experts (top-2, softmax router with a routing bias) and 2 shared ones, layer 0 dense;
# untied embeddings (transformers' default ties them: a variant).
ERNIE4_5_MOE_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, moe_num_experts=8, moe_k=2,
                         moe_num_shared_experts=2, moe_layer_start_index=1, max_position_embeddings=256,
                         tie_word_embeddings=False)


def make_ernie4_5_moe_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random ERNIE-4.5 MoE of ERNIE4_5_MOE_TINY updated with `config` (transformers' Ernie4_5_MoeConfig
    kwargs); its routing bias (`mlp.moe_statics.e_score_correction_bias`, [1, E]) random as every bias."""
    return _save_random_model(path, "Ernie4_5_Moe", seed, dict(ERNIE4_5_MOE_TINY, **config))


# Hunyuan (A13B's layout, tiny): 8 experts of 16 (top-2) and a shared MLP as wide on every layer; GQA with 8-wide heads
# and q/k norms after the rotation; Hunyuan-A13B's NTK-alpha rope (alpha 1000 barely turns 8-wide heads: tests of the
# rope itself use a small alpha).
HUNYUAN_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, num_experts=8, moe_topk=2, max_position_embeddings=256,
                    rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0})


def make_hunyuan_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Hunyuan MoE of HUNYUAN_TINY updated with `config` (transformers' HunYuanMoEV1Config kwargs)."""
    return _save_random_model(path, "HunYuanMoEV1", seed, dict(HUNYUAN_TINY, **config))


# Phi-3.5-MoE (its layout, tiny): 8 experts of 16, two a token (sparsemixer), LayerNorms, q/k/v/o and head biases,
# LongRoPE with 4 short factors (8-wide heads) and its mscales, the original context 64.
PHIMOE_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
                   attention_bias=True, lm_head_bias=True, router_jitter_noise=0.01,
                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                    "short_factor": [1.0, 1.25, 1.5, 3.0], "long_factor": [1.0, 2.0, 4.0, 8.0],
                                    "short_mscale": 1.2, "long_mscale": 1.4, "original_max_position_embeddings": 64})


def make_phimoe_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Phi-3.5-MoE of PHIMOE_TINY updated with `config` (transformers' PhimoeConfig kwargs)."""
    return _save_random_model(path, "Phimoe", seed, dict(PHIMOE_TINY, **config))


# EXAONE-MoE (K-EXAONE's layout, tiny): layer 0 dense; 8 routed experts of 16 in 2 groups (top-2 of the best group)
# with a routing bias, 1 shared; windowed layers (4 positions, rotated) alternating with global NoPE ones.
EXAONE_MOE_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                       num_experts_per_tok=2, num_shared_experts=1, n_group=2, topk_group=1,
                       routed_scaling_factor=2.5, sliding_window=4, sliding_window_pattern=2,
                       max_position_embeddings=256)


def make_exaone_moe_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random EXAONE-MoE of EXAONE_MOE_TINY updated with `config` (transformers' ExaoneMoeConfig kwargs),
    routing bias included."""
    return _save_random_model(path, "ExaoneMoe", seed, dict(EXAONE_MOE_TINY, **config))


# Cohere2-MoE (tiny): layer 0 dense (48 wide, rotated though global: its prefix pattern is 1); 8 routed experts of 16
# (top-2: softmax over the top-2 logits) and 1 shared, averaged with them; windowed layers (4 positions, rotated)
# alternating with global NoPE ones; LayerNorm without bias; a tied head, logits scaled by 0.5.
COHERE2_MOE_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=16, prefix_dense_intermediate_size=48,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                        num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1, sliding_window=4,
                        sliding_window_pattern=2, logit_scale=0.5, max_position_embeddings=256, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)


def make_cohere2_moe_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Cohere2-MoE of COHERE2_MOE_TINY updated with `config` (transformers' Cohere2MoeConfig kwargs)."""
    return _save_random_model(path, "Cohere2Moe", seed, dict(COHERE2_MOE_TINY, **config))


# HY-V3 (tiny): layer 0 dense; 8 routed experts of 16 (top-2, biased sigmoid router scaled by 2.826) and 1 shared;
# Qwen3's attention (q/k norms) with whole heads rotated.
HY_V3_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=256)


def make_hy_v3_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random HY-V3 of HY_V3_TINY updated with `config` (transformers' HYV3Config kwargs), routing bias
    included."""
    return _save_random_model(path, "HYV3", seed, dict(HY_V3_TINY, **config))


# Laguna (tiny): layer 0 dense; global layers (4 heads, half of each rotated, theta 5e5) around windowed ones (8 heads,
# 4 positions, whole heads rotated); per-head softplus gates; 8 routed experts of 16 (top-2, biased sigmoid router,
# logits soft-capped at 2, scaled by 1.5) and a shared expert of 24.
LAGUNA_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
                   num_attention_heads=4, num_attention_heads_per_layer=[4, 8, 8, 4], num_key_value_heads=2,
                   head_dim=8, num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=24,
                   sliding_window=4, layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                  "full_attention"],
                   moe_router_logit_softcapping=2.0, moe_routed_scaling_factor=1.5, max_position_embeddings=256)


def make_laguna_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Laguna of LAGUNA_TINY updated with `config` (transformers' LagunaConfig kwargs), routing bias
    included."""
    return _save_random_model(path, "Laguna", seed, dict(LAGUNA_TINY, **config))


# A.X K1 (tiny): DeepSeek-V3's MLA and grouped router (8 experts in 2 groups, top-2 of the best group) with its routing
# bias, 1 shared expert, layers 0 and 2 dense; the MoE layers' output norm.
AXK1_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                 kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, n_group=2,
                 topk_group=1, mlp_layer_types=["dense", "sparse", "dense", "sparse"], max_position_embeddings=256,
                 bos_token_id=0, eos_token_id=1)


def make_axk1_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random A.X K1 of AXK1_TINY updated with `config` (transformers' AXK1Config kwargs), routing bias
    included."""
    return _save_random_model(path, "AXK1", seed, dict(AXK1_TINY, **config))


# Mellum (tiny): windowed layers (4 positions, theta 1e4) around global ones (theta 5e5), q/k norms; 8 experts of 16
# (softmax top-2, renormalised), layer 3 dense.
MELLUM_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                   sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                  "full_attention"],
                   mlp_layer_types=["sparse", "sparse", "sparse", "dense"], max_position_embeddings=256)


def make_mellum_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Mellum of MELLUM_TINY updated with `config` (transformers' MellumConfig kwargs)."""
    return _save_random_model(path, "Mellum", seed, dict(MELLUM_TINY, **config))


# Flint (tiny): layer 0 dense (mlp_only_layers); sink logits on every layer, windowed (4 positions, rotated) and global
# (NoPE) layers; 8 experts of 16 (sigmoid top-2, renormalised) and an ungated shared expert of 24.
FLINT_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                  shared_expert_intermediate_size=24, sliding_window=4, mlp_only_layers=[0],
                  layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
                  max_position_embeddings=256)


def make_flint_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Flint of FLINT_TINY updated with `config` (transformers' FlintConfig kwargs)."""
    return _save_random_model(path, "Flint", seed, dict(FLINT_TINY, **config))


# Kolibri-1 (tiny): windowed layers (4 positions, rotated) and a global NoPE one, sandwich norms; 8 experts of 16
# (top-2 of the logits plus the routing bias, sigmoid weights renormalised) and an ungated shared expert of 24.
KOLIBRI1_TINY = dict(vocab_size=128, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                     shared_expert_intermediate_size=24, sliding_window=4, norm_topk_prob=True,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                     max_position_embeddings=256)


def make_kolibri1_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Kolibri-1 of KOLIBRI1_TINY updated with `config` (transformers' Kolibri1Config kwargs), routing
    bias included."""
    return _save_random_model(path, "Kolibri1", seed, dict(KOLIBRI1_TINY, **config))


# Mistral 4 (tiny): DeepSeek-V3's MLA (q LoRA, interleaved rotary) and MoE with the softmax router in 2 groups (top-2
# of the best group), layer 0 dense, 1 shared expert, experts 12 wide (stacked by transformers' save: 2 x 12 != 32
# tells their orientation); YaRN over 4 original positions, so that the queries past them are scaled by
# llama_4_scaling_beta (0.3).
MISTRAL4_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=12,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                     num_experts_per_tok=2,
                     kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                     max_position_embeddings=256, first_k_dense_replace=1, n_group=2, topk_group=1,
                     routed_scaling_factor=1.5, pad_token_id=0,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.3,
                                      "partial_rotary_factor": 0.5})


def make_mistral4_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Mistral 4 of MISTRAL4_TINY updated with `config` (transformers' Mistral4Config kwargs)."""
    return _save_random_model(path, "Mistral4", seed, dict(MISTRAL4_TINY, **config))


# Sarvam's (tiny), in transformers' config kwargs: sarvam-105b's shape (DeepSeek-V3's MLA and MoE, layer 0 dense, one
# group) and sarvam-30b's (GLM-4-MoE's: q/k norms, q/k/v biases, whole heads rotated), 8 experts each, 1 shared.
SARVAM_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                   num_attention_heads=4, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256)
SARVAM_MLA_TINY = dict(SARVAM_TINY, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12)
SARVAM_MOE_TINY = dict(SARVAM_TINY, num_key_value_heads=2, head_dim=8, pad_token_id=0, eos_token_id=1,
                       use_qkv_bias=True)
# The config.json fields transformers' save writes under DeepSeek's / GLM's names, and Sarvam's own names for them
SARVAM_NAMES = {"n_routed_experts": "num_experts", "n_shared_experts": "num_shared_experts",
                "attention_bias": "use_qkv_bias", "num_nextn_predict_layers": "num_mtp_layers"}


def make_sarvam_checkpoint(path: Path, family: str, *, seed: int = 0, hub: dict | None = None, **config) -> Path:
    """Save a random `Sarvam{family}` ("MLA" or "MoE": transformers builds DeepSeek-V3 or GLM-4-MoE from its config)
    of SARVAM_{family}_TINY updated with `config`, routing bias included, with config.json as Sarvam's own checkpoints
    write it: their entry class, their names for the fields (SARVAM_NAMES), and `hub`'s fields over it (DROP: left
    out). transformers' AutoModelForCausalLM reads that file back as it reads theirs (its reference for the
    engine's)."""
    transformers = _transformers()
    torch.manual_seed(seed)
    tiny = SARVAM_MLA_TINY if family == "MLA" else SARVAM_MOE_TINY
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, f"Sarvam{family}Config")(
        **dict(tiny, **config)))
    _randomize_with_routing_bias(model, seed)
    model.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    written = {SARVAM_NAMES.get(k, k): v for k, v in saved.items() if not (k in SARVAM_NAMES and v is None)}
    written.update(architectures=[f"Sarvam{family}ForCausalLM"], **(hub or {}))
    (path / "config.json").write_text(json.dumps({k: v for k, v in written.items() if v is not DROP}))
    return path


# Step-3.5 (Step-3.7-Flash's text model, tiny): layer 0 dense; global layers (4 heads, half of each rotated, theta 1e4)
# around windowed ones (8 heads, 4 positions, whole heads rotated, theta 500), per-head output gates, a softmax scale
# of 12 ** -0.5; 8 routed experts of 16 (top-2, biased sigmoid router, scaled by 2) and a shared expert of 24; SwiGLU
# clamps tight enough to bite on layer 2's experts and shared expert and on the dense layer.
STEP3P5_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, n_routed_experts=8,
                    num_experts_per_tok=2, share_expert_dim=24, sliding_window=4, num_sliding_attention_heads=8,
                    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], moe_router_scaling_factor=2.0,
                    query_pre_attn_scalar=12, swiglu_limits=[0, 0, 0.02, 0], swiglu_limits_shared=[0.05, 0, 0.02, 0],
                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
                    pad_token_id=0, max_position_embeddings=256)
STEP3P7_VISION_TINY = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
STEP3P7_TOWERS = ("vision_model.", "vit_large_projector.")


def make_step3p7_checkpoint(path: Path, *, seed: int = 0, **text) -> Path:
    """Save a random Step-3.7 (`Step3p7ForConditionalGeneration`) whose text model is STEP3P5_TINY updated with `text`
    (transformers' Step3p7TextConfig kwargs) beside a one-layer vision tower, routing bias included."""
    transformers = _transformers()
    torch.manual_seed(seed)
    model = transformers.Step3p7ForConditionalGeneration(transformers.Step3p7Config(
        text_config=dict(STEP3P5_TINY, **text), vision_config=STEP3P7_VISION_TINY))
    _randomize_with_routing_bias(model, seed)
    model.save_pretrained(path)
    return path


def make_step3p5_checkpoint(path: Path, *, seed: int = 0, **text) -> tuple[Path, Path]:
    """(a Step-3.5 checkpoint `Step3p5ForCausalLM`, the Step-3.7 one it is cut from): the text model's tensors, as
    Step-3.5's own checkpoints spell them, under its text_config. transformers has no Step-3.5 class of its own: the
    Step-3.7 checkpoint, run text-only, is its reference."""
    full = make_step3p7_checkpoint(path / "step3p7", seed=seed, **text)
    text_only = with_tensors(full, path / "step3p5",
                             lambda t: [t.pop(k) for k in list(t) if k.startswith(STEP3P7_TOWERS)])
    config = json.loads((full / "config.json").read_text())["text_config"]
    (text_only / "config.json").write_text(json.dumps(dict(config, architectures=["Step3p5ForCausalLM"])))
    return text_only, full


# AFMoE (Trinity's layout, tiny): layer 0 dense; 8 routed experts of 16 (top-2, sigmoid with a routing bias, scaled
# by 2.5) and 2 shared; gated attention, windowed layers (4 positions, rotated) alternating with global NoPE ones.
AFMOE_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                  num_shared_experts=2, num_dense_layers=1, route_scale=2.5, global_attn_every_n_layers=2,
                  sliding_window=4, max_position_embeddings=256)


def make_afmoe_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random AFMoE of AFMOE_TINY updated with `config` (transformers' AfmoeConfig kwargs)."""
    return _save_random_model(path, "Afmoe", seed, dict(AFMOE_TINY, **config))


# FlexOlmo: 8 experts of 16 (top-2) on every layer, OLMoE's projection norms in OLMo 2's post-norm layer.
FLEX_OLMO_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
                      pad_token_id=0, eos_token_id=1)


def make_flex_olmo_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random FlexOlmo of FLEX_OLMO_TINY updated with `config` (transformers' FlexOlmoConfig kwargs)."""
    return _save_random_model(path, "FlexOlmo", seed, dict(FLEX_OLMO_TINY, **config))


# LFM2-MoE (LFM2-8B-A1B's layout, tiny): conv and attention layers alternating, layer 0 dense, then 8 experts of 16
# (top-2, sigmoid with a routing bias, scaled by 1.5).
LFM2_MOE_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                     num_experts_per_tok=2, num_dense_layers=1, conv_L_cache=3, routed_scaling_factor=1.5,
                     max_position_embeddings=256, layer_types=["conv", "full_attention", "conv", "full_attention"])


def make_lfm2_moe_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random LFM2-MoE of LFM2_MOE_TINY updated with `config` (transformers' Lfm2MoeConfig kwargs), its
    routing bias random."""
    return _save_random_model(path, "Lfm2Moe", seed, dict(LFM2_MOE_TINY, **config))


# DBRX (its layout, tiny): 8 experts of 16 (top-2, weights divided by their 1-norm) on every layer, GQA with a fused
# q/k/v clamped to +-0.5 (which random weights reach: the clamp bites).
DBRX_TINY = dict(d_model=32, n_heads=4, n_layers=3, max_seq_len=256, vocab_size=128,
                 attn_config={"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 10000.0},
                 ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 8, "moe_top_k": 2,
                             "moe_normalize_expert_weights": 1.0})


def make_dbrx_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random DBRX of DBRX_TINY updated with `config` (transformers' DbrxConfig kwargs)."""
    return _save_random_model(path, "Dbrx", seed, dict(DBRX_TINY, **config))


# MiMo-V2-Flash (its layout, tiny): a global layer then windowed ones (4 positions, twice the key/value heads, sinks);
# 12-wide queries and keys, 8-wide values scaled; each kind its own rope (theta, rotated fraction); layer 0 dense,
# then 8 routed experts of 16 in 2 groups (top-2 of the best group), no shared one.
MIMO_V2_FLASH_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=12, v_head_dim=8,
                          n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, sliding_window=4,
                          layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                          max_position_embeddings=256,
                          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                              "partial_rotary_factor": 0.5},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 500.0,
                                                                 "partial_rotary_factor": 0.334}})


def make_mimo_v2_flash_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random MiMo-V2-Flash of MIMO_V2_FLASH_TINY updated with `config` (transformers' MiMoV2FlashConfig
    kwargs), routing bias included."""
    return _save_random_model(path, "MiMoV2Flash", seed, dict(MIMO_V2_FLASH_TINY, **config))


# Granite MoE: 8 experts of 16 (top-2) on every layer, with granite-3.0-1b-a400m's multipliers.
GRANITEMOE_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
                       embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22,
                       logits_scaling=6.0)


# Granite MoE SWA: GRANITEMOE_TINY's layer with sinks, windowed layers 1 and 2 (4 positions), per-layer thetas (layer
# 2 NoPE) and a shared MLP; attention scaled by 1 (granite-3.0's 1/64 leaves the scores too flat for the rope to show).
GRANITEMOE_SWA_TINY = dict(GRANITEMOE_TINY, sliding_window=4, shared_intermediate_size=24, attention_multiplier=1.0,
                           layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                           layer_rope_theta=[10000.0, 500.0, 0])


def make_granitemoe_checkpoint(path: Path, *, seed: int = 0, family: str = "GraniteMoe", **config) -> Path:
    """Save a random Granite MoE of GRANITEMOE_TINY updated with `config` (transformers' GraniteMoeConfig kwargs);
    `family="GraniteMoeShared"` for GraniteMoeSharedForCausalLM (with shared_intermediate_size)."""
    return _save_random_model(path, family, seed, dict(GRANITEMOE_TINY, **config))


# Granite 4.0-H: GRANITEMOE_TINY's MoE layer and a shared MLP under Mamba2 (4 heads of 16 in 2 groups of 8 state
# features; transformers runs chunks of 4) and NoPE attention token mixers.
GRANITEMOE_HYBRID_TINY = dict(GRANITEMOE_TINY, shared_intermediate_size=24, layer_types=["mamba", "attention", "mamba"],
                              mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                              mamba_chunk_size=4)


def make_granitemoe_hybrid_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Granite 4.0-H of GRANITEMOE_HYBRID_TINY updated with `config` (transformers'
    GraniteMoeHybridConfig kwargs)."""
    return _save_random_model(path, "GraniteMoeHybrid", seed, dict(GRANITEMOE_HYBRID_TINY, **config))


# Nemotron-H: every kind of block (Mamba2 with 4 heads of 16 in 2 groups of 8 state features; NoPE attention; a
# dense relu^2 MLP; two MoE blocks of 8 ungated experts of 16 in 2 groups, top-2, a shared MLP of 24); transformers
# runs chunks of 4.
NEMOTRON_H_TINY = dict(vocab_size=128, hidden_size=32, layers_block_type=["linear_attention", "moe", "full_attention",
                                                                          "mlp", "moe"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                       mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=4,
                       n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                       max_position_embeddings=256)


def make_nemotron_h_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Nemotron-H of NEMOTRON_H_TINY updated with `config` (transformers' NemotronHConfig kwargs),
    routing bias included."""
    return _save_random_model(path, "NemotronH", seed, dict(NEMOTRON_H_TINY, **config))


# Jamba: 4 layers, attention on layer 2 (period 4, offset 2), Mamba on the others (64 inner channels, 8 state
# features, dt rank 2); 8 experts of 48 (top-2) on layers 1 and 3, a dense MLP on 0 and 2.
JAMBA_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, expert_layer_period=2,
                  expert_layer_offset=1, attn_layer_period=4, attn_layer_offset=2, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=2, max_position_embeddings=256)


def make_jamba_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Jamba of JAMBA_TINY updated with `config` (transformers' JambaConfig kwargs)."""
    return _save_random_model(path, "Jamba", seed, dict(JAMBA_TINY, **config))


# Kimi-Linear: Kimi delta attention on layers 0, 2 and 3 (4 heads of 8), NoPE MLA on layer 1 (no query latent);
# layer 0 dense, the others DeepSeek-V3's MoE (8 experts in 2 groups, top-2, one shared expert).
KIMI_LINEAR_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, num_local_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                        linear_head_dim=8, linear_num_heads=4,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)


def make_kimi_linear_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Kimi-Linear of KIMI_LINEAR_TINY updated with `config` (transformers' KimiLinearConfig kwargs),
    decays of every size and a routing bias."""
    return _save_random_model(path, "KimiLinear", seed, dict(KIMI_LINEAR_TINY, **config), _decays_of_every_size)


# LongCat-Flash: 2 layers of two MLA sublayers (4 heads, both latents) and two dense MLPs, and one MoE block of 8 routed
# experts and 4 zero-computation ones, top-3 among the 12.
LONGCAT_FLASH_TINY = dict(vocab_size=128, hidden_size=32, ffn_hidden_size=48, expert_ffn_hidden_size=16, num_layers=2,
                          num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                          qk_nope_head_dim=8, head_dim=8, v_head_dim=12, n_routed_experts=8, zero_expert_num=4,
                          moe_topk=3, routed_scaling_factor=6.0, max_position_embeddings=256, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2)


def make_longcat_flash_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random LongCat-Flash of LONGCAT_FLASH_TINY updated with `config` (transformers' LongcatFlashConfig
    kwargs), with a routing bias of the size of its softmax scores (so that it shifts the choice without making it),
    and each zero-computation expert's router row near a routed expert's, so that tokens pick both kinds (with rows
    drawn alike, whether they do depended on the draw: transformers 5.25 saves fewer expert rows, and none did)."""
    def comparable_zero_experts(model, seed):
        g = torch.Generator().manual_seed(seed + 2)
        n, zero = model.config.n_routed_experts, model.config.zero_expert_num or 0
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.mul_(0.1)
            for name, w in model.named_parameters():
                if name.endswith("router.classifier.weight") and zero:
                    w[n:] = w[:zero] + 0.3 * w[:zero].std() * torch.randn(w[n:].shape, generator=g)
    return _save_random_model(path, "LongcatFlash", seed, dict(LONGCAT_FLASH_TINY, **config),
                              comparable_zero_experts)


# Solar Open: 3 layers, 4 heads of 8 (2 key/value heads), every layer 8 experts (top-2, in 2 groups of which 1 is
# picked) and one shared expert.
SOLAR_OPEN_TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, n_routed_experts=8,
                       num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                       max_position_embeddings=256)


def make_solar_open_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Solar Open of SOLAR_OPEN_TINY updated with `config` (transformers' SolarOpenConfig kwargs),
    routing bias included."""
    return _save_random_model(path, "SolarOpen", seed, dict(SOLAR_OPEN_TINY, **config))


# Ling 3 hybrid: KDA on layers 0 and 1 (4 heads of 8, the bounded decay), gated MLA (no query latent) on layer 2;
# layer 0 dense, the others DeepSeek-V3's MoE (8 experts in 2 groups, top-2, one shared expert); no MTP layer.
BAILING_HYBRID_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                           q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, head_dim=8,
                           num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                           layer_group_size=3, first_k_dense_replace=1, num_mtp_layers=0, pad_token_id=0,
                           eos_token_id=2)


def make_bailing_hybrid_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Ling 3 hybrid of BAILING_HYBRID_TINY updated with `config` (transformers' BailingHybridConfig
    kwargs), decays of every size and a routing bias."""
    return _save_random_model(path, "BailingHybrid", seed, dict(BAILING_HYBRID_TINY, **config), _decays_of_every_size)


# MiniMax-Text-01 / M1: 4 layers, full attention on 0 and 2 and lightning attention on 1 and 3 (transformers' default),
# 4 heads of 8 (transformers runs blocks of 4); 8 experts of 16 (top-2); residual factors other than 1.
MINIMAX_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2, block_size=4,
                    max_position_embeddings=256, full_attn_alpha_factor=1.5, full_attn_beta_factor=0.8,
                    linear_attn_alpha_factor=0.7, linear_attn_beta_factor=1.3, mlp_alpha_factor=1.2,
                    mlp_beta_factor=0.9)


def make_minimax_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random MiniMax of MINIMAX_TINY updated with `config` (transformers' MiniMaxConfig kwargs)."""
    return _save_random_model(path, "MiniMax", seed, dict(MINIMAX_TINY, **config))


# DeepSeek-V3.2: DEEPSEEK_TINY with its sparse attention indexer (8 index heads of 16, 8 of them rotated) keeping 4
# keys a query, and the default rope; 16 routed experts (in 8 groups of 2): it is never fused, whatever the count.
DEEPSEEK_V32_TINY = dict(DEEPSEEK_TINY, n_routed_experts=16, index_n_heads=8, index_head_dim=16, index_topk=4,
                         rope_theta=10000.0)


def make_deepseek_v32_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random DeepSeek-V3.2 of DEEPSEEK_V32_TINY updated with `config` (transformers' DeepseekV32Config
    kwargs), routing bias included."""
    return _save_random_model(path, "DeepseekV32", seed, dict(DEEPSEEK_V32_TINY, **config))


# GLM-5 (GLM-MoE-DSA): DEEPSEEK_TINY's sizes (256 experts: its fusion gate passes) with V3.2's indexer sizes.
GLM_MOE_DSA_TINY = dict(DEEPSEEK_TINY, index_n_heads=8, index_head_dim=16, index_topk=4, rope_theta=10000.0,
                        n_group=1, topk_group=1)


def make_glm_moe_dsa_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random GLM-5 of GLM_MOE_DSA_TINY updated with `config` (transformers' GlmMoeDsaConfig kwargs),
    routing bias included."""
    return _save_random_model(path, "GlmMoeDsa", seed, dict(GLM_MOE_DSA_TINY, **config))


def make_deepseek_mtp_checkpoint(path: Path, *, seed: int = 0, **config) -> tuple[Path, Path]:
    return make_mtp_checkpoint(path, "DeepseekV3", seed=seed, **config)


def make_mtp_checkpoint(path: Path, family: str, *, seed: int = 0, draft_arch: str | None = None,
                        **config) -> tuple[Path, Path]:
    """A `family` (DeepseekV3, DeepseekV32, Glm4Moe) checkpoint in DeepSeek's MTP layout, with one
    Multi-Token-Prediction layer, and its NextN draft folder: (target folder, draft folder). transformers' model of
    num_hidden_layers + 1 layers gives the MTP layer's decoder part (layer L = num_hidden_layers, MoE); its MTP
    tensors (enorm, hnorm, eh_proj, shared_head, its own embed_tokens) are added at random; config.json then says
    L layers and num_nextn_predict_layers 1. The draft folder holds the same tensors (a link) and the config with
    architectures [draft_arch] (default f"{family}ForCausalLMNextN"). `path / "hf_with_mtp_layer"` is the same as
    transformers' model of L + 1 layers (for a reference of the MTP layer's decoder part)."""
    from safetensors.torch import load_file, save_file

    L = config["num_hidden_layers"]
    target = path / "target"
    _save_random_model(target, family, seed, dict(config, num_hidden_layers=L + 1))
    weights = target / "model.safetensors"
    tensors = load_file(weights)
    D, V = config["hidden_size"], config["vocab_size"]
    g = torch.Generator().manual_seed(seed + 2)
    mtp = f"model.layers.{L}."
    tensors.update({
        mtp + "embed_tokens.weight": torch.randn(V, D, generator=g),
        mtp + "enorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        mtp + "hnorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        mtp + "eh_proj.weight": torch.randn(D, 2 * D, generator=g) / math.sqrt(2 * D),
        mtp + "shared_head.norm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        mtp + "shared_head.head.weight": torch.randn(V, D, generator=g) / math.sqrt(D),
    })
    save_file(tensors, weights, metadata={"format": "pt"})
    cfg = json.loads((target / "config.json").read_text())
    for folder, arch, layers in ((path / "hf_with_mtp_layer", f"{family}ForCausalLM", L + 1),
                                 (path / "draft", draft_arch or f"{family}ForCausalLMNextN", L),
                                 (target, f"{family}ForCausalLM", L)):
        folder.mkdir(exist_ok=True)
        if folder != target:
            (folder / "model.safetensors").symlink_to(weights)
        per_layer = {k: cfg[k][:layers] for k in ("layer_types", "mlp_layer_types") if k in cfg}   # V3.2's lists
        (folder / "config.json").write_text(json.dumps(dict(cfg, architectures=[arch], num_hidden_layers=layers,
                                                            num_nextn_predict_layers=1, **per_layer), indent=2))
    return target, path / "draft"


FP8_MAX = 448.0           # float8_e4m3fn


def _quantized(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek's FP8 checkpoint quantizes: the linear layers' matrices, not the router, embedding or head
    (Mixtral's experts are spelled w1/w2/w3, Qwen3-Next's linear attention's inputs in_proj_qkvz and in_proj_ba);
    and a stack of experts' matrices (Step-3.5's `moe.*_proj.weight` [E, N, K]), each in its own blocks."""
    if t.dim() == 3:
        return name.endswith("proj.weight")
    return t.dim() == 2 and (name.endswith("proj.weight") or ".linear_attn.in_proj_" in name
                             or name.endswith((".w1.weight", ".w2.weight", ".w3.weight")))


def _quantize(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)]) with each block's amax at FP8_MAX; a stack
    [E, N, K] matrix by matrix (scales [E, ...])."""
    if w.dim() == 3:
        q, s = zip(*(_quantize(m, block) for m in w))
        return torch.stack(q), torch.stack(s)
    N, K = w.shape
    bn, bk = block
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(N / bn), math.ceil(K / bk))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s[i, j] = blk.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def _dequantized_block_by_block(q: torch.Tensor, s: torch.Tensor, block: list[int]) -> torch.Tensor:
    if q.dim() == 3:
        return torch.stack([_dequantized_block_by_block(m, ms, block) for m, ms in zip(q, s)])
    out = q.to(torch.float32)
    bn, bk = block
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= s[i, j]
    return out


def make_fp8_copies(plain: Path, root: Path, block: list[int]) -> tuple[Path, Path, int]:
    """`plain` (one model.safetensors) quantized as DeepSeek ships FP8 (root/"fp8", its config saying so) and the
    same weights dequantized block by block here (root/"dequantized", a plain checkpoint): (fp8, dequantized,
    how many matrices were quantized)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(plain / "model.safetensors")
    fp8, reference = {}, {}
    for name, t in tensors.items():
        if _quantized(name, t):
            q, s = _quantize(t, block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            reference[name] = _dequantized_block_by_block(q, s, block)
        else:
            fp8[name] = reference[name] = t
    cfg = json.loads((plain / "config.json").read_text())
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block}
    for folder, weights, config in ((root / "fp8", fp8, dict(cfg, quantization_config=quantization)),
                                    (root / "dequantized", reference, cfg)):
        folder.mkdir()
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config))
    return root / "fp8", root / "dequantized", sum(_quantized(n, t) for n, t in tensors.items())


# compressed-tensors `pack-quantized`, Kimi-K2.5-style: the routed experts int4 in groups (group_0); here also the
# dense MLPs int8 per output row (group_1), so that two schemes and two strategies are read; attention, shared
# experts, router and head stay plain (`ignore`, or not a target).
COMPRESSED_GROUPS = {
    "group_0": {"targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"], "input_activations": None,
                "output_activations": None,
                "weights": {"type": "int", "num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 8,
                            "dynamic": False, "actorder": None, "observer": "minmax"}},
    "group_1": {"targets": [r"re:.*mlp\.(gate|up|down)_proj$"], "input_activations": None, "output_activations": None,
                "weights": {"type": "int", "num_bits": 8, "symmetric": True, "strategy": "channel",
                            "dynamic": False, "actorder": None, "observer": "minmax"}},
}


def compressed_quantization(groups: dict = COMPRESSED_GROUPS) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": groups, "kv_cache_scheme": None,
            "ignore": ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*"]}


def make_compressed_copies(plain: Path, root: Path, quantization: dict | None = None, prefix: str = "",
                           config: dict | None = None) -> tuple[Path, Path, int]:
    """`plain` (one model.safetensors) packed by compressed-tensors' own compressor as `quantization` (default:
    `compressed_quantization()`) says: each linear layer's matrix not in `ignore` by the first config group whose
    targets match it (root/"packed", its config saying so), and the same weights as that library decompresses
    them (root/"dequantized", a plain checkpoint): (packed, dequantized, how many matrices were packed).
    `prefix` and `config`: a wrapper's name prefix and config.json (default: plain's)."""
    import re

    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    quantization = quantization or compressed_quantization()

    def matches(target: str, module: str) -> bool:
        return bool(re.match(target[3:], module)) if target.startswith("re:") else target in ("Linear", module)

    schemes = [(g["targets"], QuantizationScheme(targets=g["targets"], weights=QuantizationArgs(**{
        k: v for k, v in g["weights"].items() if k not in ("observer", "observer_kwargs")})))
        for g in quantization["config_groups"].values()]
    packed, reference, n = {}, {}, 0
    for name, t in load_file(plain / "model.safetensors").items():
        name = prefix + name
        module = name.removesuffix(".weight")
        linear = _quantized(name, t) or name.endswith("lm_head.weight")
        ignored = any(matches(i, module) for i in quantization.get("ignore", ()))
        scheme = next((sc for targets, sc in schemes if any(matches(tg, module) for tg in targets)), None)
        if not linear or ignored or scheme is None:
            packed[name] = reference[name] = t
            continue
        args, qmax = scheme.weights, 2 ** (scheme.weights.num_bits - 1) - 1
        rows = t.float()
        if args.strategy == "group":
            scale = rows.reshape(rows.shape[0], -1, args.group_size).abs().amax(dim=2) / qmax
        else:
            scale = rows.abs().amax(dim=1, keepdim=True) / qmax
        parts = PackedQuantizationCompressor.compress({"weight": t, "weight_scale": scale.clamp(min=1e-8)}, scheme)
        for part, tensor in parts.items():
            packed[f"{module}.{part}"] = tensor
        reference[name] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"].to(t.dtype)
        n += 1
    cfg = config if config is not None else json.loads((plain / "config.json").read_text())
    return (*_save_packed_and_dequantized(root, packed, reference, cfg, quantization), n)


def _save_packed_and_dequantized(root: Path, packed: dict, reference: dict, cfg: dict,
                                 quantization: dict) -> tuple[Path, Path]:
    """root/"packed" (its config.json saying `quantization`) and root/"dequantized" (a plain checkpoint)."""
    from safetensors.torch import save_file

    for folder, weights, cfg_of in ((root / "packed", packed, dict(cfg, quantization_config=quantization)),
                                    (root / "dequantized", reference, cfg)):
        folder.mkdir()
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(cfg_of))
    return root / "packed", root / "dequantized"


def quantize_groups(w: torch.Tensor, bits: int, groups: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Asymmetric min-max quantization of w [N, K] with input k in group groups[k]: (q [K, N], zero points
    [G, N], fp16 scales [G, N], the dequantized weight [N, K] = scale * (q - zero))."""
    n_groups, top = int(groups.max()) + 1, (1 << bits) - 1
    wt = w.float().T                                                           # [K, N]
    lo = torch.stack([wt[groups == g].amin(0) for g in range(n_groups)]).clamp(max=0)
    hi = torch.stack([wt[groups == g].amax(0) for g in range(n_groups)]).clamp(min=0)
    scales = ((hi - lo) / top).clamp(min=1e-6).half()
    zeros = (-lo / scales.float()).round().clamp(0, top).long()
    q = (wt / scales.float()[groups] + zeros[groups]).round().clamp(0, top).long()
    return q, zeros, scales, (scales.float()[groups] * (q - zeros[groups])).T.contiguous()


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 tensor with those bits."""
    return (words - (words >= 2 ** 31).long() * 2 ** 32).to(torch.int32)


def make_packed_linear_copies(plain: Path, root: Path, pack, quantization: dict) -> tuple[Path, Path, int]:
    """`plain` (one model.safetensors) with every linear layer's matrix (`_quantized`: not the routers, embedding
    or head) packed by `pack(w) -> (parts by name, dequantized w)` as a GPTQ / AWQ quantizer stores it, with a
    zero bias beside each layer that had none (as AutoGPTQ writes one): root/"packed" (its config saying
    `quantization`), and root/"dequantized" (the dequantized weights, a plain checkpoint): (packed, dequantized,
    how many matrices were packed)."""
    from safetensors.torch import load_file

    tensors = load_file(plain / "model.safetensors")
    packed, reference, n = {}, {}, 0
    for name, t in tensors.items():
        if not _quantized(name, t):
            packed[name] = reference[name] = t
            continue
        module = name.removesuffix(".weight")
        parts, reference[name] = pack(t)
        packed.update({f"{module}.{part}": v for part, v in parts.items()})
        if f"{module}.bias" not in tensors:
            packed[f"{module}.bias"] = torch.zeros(t.shape[0], dtype=t.dtype)
        n += 1
    cfg = json.loads((plain / "config.json").read_text())
    return (*_save_packed_and_dequantized(root, packed, reference, cfg, quantization), n)


# GLM-4-MoE: 16 routed experts in 4 groups, one shared expert, q/k/v bias, qk norm, half-rotary heads (the
# default partial_rotary_factor). The GLM gate has no expert-count condition, so fusion passes at this size.
GLM4_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=16,
                 n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                 max_position_embeddings=256, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
                 attention_bias=True, rms_norm_eps=1e-6)


def make_glm4_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random GLM-4-MoE of `config` (transformers' Glm4MoeConfig kwargs), routing bias included."""
    return _save_random_model(path, "Glm4Moe", seed, config)


def make_glm4v_moe_checkpoint(path: Path, *, seed: int = 0, **text_config) -> Path:
    """Save a random GLM-4.5V (`Glm4vMoeForConditionalGeneration`): GLM4_TINY's text model (without q/k norm, which
    GLM-4.5V's attention does not have) updated with `text_config`, its MRoPE sections [2, 1, 1] over the 8
    rotated features, and a one-block vision tower; routing bias included."""
    transformers = _transformers()
    text = {k: v for k, v in GLM4_TINY.items() if k != "use_qk_norm"}
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                 "partial_rotary_factor": 0.5}, **text_config)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=2, spatial_merge_size=1, temporal_patch_size=1)
    torch.manual_seed(seed)
    model = transformers.Glm4vMoeForConditionalGeneration(transformers.Glm4vMoeConfig(text_config=text,
                                                                                      vision_config=vision))
    _randomize_with_routing_bias(model, seed)
    model.save_pretrained(path)
    return path


# GLM-4-MoE-Lite (GLM-4.7-Flash): MLA attention, 16 routed experts and one shared, layers 1 and 2 sparse (its
# mlp_layer_types default: the first dense); transformers' defaults for the routing (1.8 scaling, one group).
GLM4_LITE_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                      num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=16,
                      num_experts_per_tok=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=12, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
                      pad_token_id=None)


def make_glm4_lite_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random GLM-4-MoE-Lite of GLM4_LITE_TINY updated with `config` (transformers' Glm4MoeLiteConfig
    kwargs), routing bias included."""
    return _save_random_model(path, "Glm4MoeLite", seed, dict(GLM4_LITE_TINY, **config))


# DeepSeek-V2: 16 routed experts in 4 groups, two shared experts (one MLP twice as wide), softmax routing.
DEEPSEEK_V2_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=16,
                        n_shared_experts=2, num_experts_per_tok=4, n_group=4, topk_group=2,
                        topk_method="group_limited_greedy", first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256,
                        routed_scaling_factor=2.5, rms_norm_eps=1e-6)


def make_deepseek_v2_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random DeepSeek-V2 of `config` (transformers' DeepseekV2Config kwargs)."""
    return _save_random_model(path, "DeepseekV2", seed, config)


# Mixtral: 8 experts, top-2, every layer sparse; 3 layers so that two pipeline stages have uneven shares.
MIXTRAL_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
                    rms_norm_eps=1e-5)


# OLMoE: 8 experts, top-2, every layer sparse, q/k normalised over the whole projection; norm_topk_prob off
# (as OLMoE ships). The token ids transformers' OlmoeConfig defaults to (50279...) are outside this vocabulary.
OLMOE_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, norm_topk_prob=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)


def make_olmoe_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random OLMoE of OLMOE_TINY updated with `config` (transformers' OlmoeConfig kwargs)."""
    return _save_random_model(path, "Olmoe", seed, dict(OLMOE_TINY, **config))


# gpt-oss: 8 experts, top-2, every layer sparse; a window of 4 on layers 0 and 2 (transformers' default
# layer_types: sliding on even layers), so prompts of more than 4 tokens meet it; the default YaRN rope.
GPT_OSS_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                    max_position_embeddings=256, sliding_window=4, eos_token_id=None, pad_token_id=None,
                    bos_token_id=None)


def make_gpt_oss_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random gpt-oss of GPT_OSS_TINY updated with `config` (transformers' GptOssConfig kwargs): experts
    stacked and gate/up interleaved, as transformers saves them; random sinks and router and expert biases."""
    return _save_random_model(path, "GptOss", seed, dict(GPT_OSS_TINY, **config))


# MiniMax-M2: 8 experts, top-2, every layer sparse; half of each head rotated (rotary_dim 8 of 16).
MINIMAX_M2_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=8,
                       num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=None, pad_token_id=None,
                       bos_token_id=None)


def make_minimax_m2_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random MiniMax-M2 of MINIMAX_M2_TINY updated with `config` (transformers' MiniMaxM2Config kwargs):
    the Hub's spelling (block_sparse_moe.*), a random routing correction bias."""
    return _save_random_model(path, "MiniMaxM2", seed, dict(MINIMAX_M2_TINY, **config))


# Llama 4: 4 layers (dense, MoE, dense, MoE: interleave step 2), 4 experts, top-1; layers 0-2 rotate (Llama 3
# rope scaling) and attend within chunks of 4 positions, layer 3 is NoPE with the temperature of floor_scale 2.
LLAMA4_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=32, intermediate_size_mlp=48,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                   num_experts_per_tok=1, interleave_moe_layer_step=2, max_position_embeddings=256,
                   attention_chunk_size=4, floor_scale=2, eos_token_id=None, pad_token_id=None, bos_token_id=None,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64})


def make_llama4_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Llama 4 text model of LLAMA4_TINY updated with `config` (transformers' Llama4TextConfig
    kwargs): `feed_forward.*`, experts stacked with gate and up concatenated."""
    transformers = _transformers()
    torch.manual_seed(seed)
    model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**dict(LLAMA4_TINY, **config)))
    randomize(model, seed)
    model.save_pretrained(path)
    return path


def make_llama4_wrapper_checkpoint(path: Path, *, seed: int = 0) -> Path:
    """Llama 4 as the Hub ships it: Llama4ForConditionalGeneration, LLAMA4_TINY as its text_config and a tiny vision
    model, saved with the text model under `language_model.` and the towers under `vision_model.` and
    `multi_modal_projector.`."""
    transformers = _transformers()
    torch.manual_seed(seed)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    model = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=LLAMA4_TINY,
                                                                                  vision_config=vision))
    randomize(model, seed)
    model.save_pretrained(path)
    return path


# Qwen3-VL-MoE: a Qwen3-MoE text model (8 experts, top-2; MRoPE sections 2/3/3 of head_dim 16) and a tiny vision
# tower. D=64 and I=16: its stacked experts' two orientations have different shapes.
QWEN3_VL_TEXT_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                          num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                           "mrope_interleaved": True})


def make_qwen3_vl_moe_checkpoint(path: Path, *, seed: int = 0) -> Path:
    """Qwen3VLMoeForConditionalGeneration as transformers saves it: `model.language_model.*`, `lm_head.weight`,
    `model.visual.*`; experts stacked as the model holds them ([E, 2I, D], [E, D, I])."""
    transformers = _transformers()
    torch.manual_seed(seed)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0], num_position_embeddings=16)
    model = transformers.Qwen3VLMoeForConditionalGeneration(transformers.Qwen3VLMoeConfig(
        text_config=QWEN3_VL_TEXT_TINY, vision_config=vision, tie_word_embeddings=False))
    randomize(model, seed)
    model.save_pretrained(path)
    return path


# Qwen3-Next: 4 layers (linear, linear, linear, full attention), 8 experts of width 32, top-2, and a shared
# expert of the same width (so the registry's fusion gate passes); 2 key heads serving 4 value heads.
QWEN3_NEXT_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256,
                       eos_token_id=None, pad_token_id=None, bos_token_id=None)


def make_qwen3_next_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Qwen3-Next of QWEN3_NEXT_TINY updated with `config` (transformers' Qwen3NextConfig kwargs):
    experts one by one as the Hub keeps them; random A_log and dt_bias (decays of every size)."""
    transformers = _transformers()
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**dict(QWEN3_NEXT_TINY, **config)))
    _randomize_linear_attention(model, seed)
    model.save_pretrained(path)
    return path


def make_qwen3_next_mtp_checkpoint(path: Path, *, seed: int = 0) -> tuple[Path, Path]:
    """A Qwen3-Next checkpoint of QWEN3_NEXT_TINY with its Multi-Token-Prediction module as Qwen ships it (`mtp.*`),
    and its draft folder: (target folder, draft folder). transformers' model of one more layer (full attention,
    MoE) gives the module's decoder layer, `mtp.layers.0`; its fc and norms are added at random. The draft folder
    holds the same tensors (a link) and the config with architectures ["Qwen3NextForCausalLMMTP"];
    `path / "hf_with_mtp_layer"` is transformers' model of the extra layer (its decoder layer's reference)."""
    return _make_qwen_mtp_checkpoint(path, make_qwen3_next_checkpoint, ("Qwen3NextForCausalLM",
                                                                         "Qwen3NextForCausalLMMTP"), seed)


def make_qwen3_5_mtp_checkpoint(path: Path, *, seed: int = 0, **config) -> tuple[Path, Path]:
    """`make_qwen3_next_mtp_checkpoint` for Qwen3.5-MoE's text model (`Qwen3_5MoeForCausalLM`, its draft
    `Qwen3_5ForCausalLMMTP`) of QWEN3_5_MOE_TINY updated with `config`, experts one by one."""
    return _make_qwen_mtp_checkpoint(path, make_qwen3_5_moe_checkpoint, ("Qwen3_5MoeForCausalLM",
                                                                          "Qwen3_5ForCausalLMMTP"), seed, config)


def _make_qwen_mtp_checkpoint(path: Path, make, archs: tuple[str, str], seed: int,
                              config: dict | None = None) -> tuple[Path, Path]:
    from safetensors.torch import load_file, save_file

    L = QWEN3_NEXT_TINY["num_hidden_layers"]
    types = ["linear_attention"] * (L - 1) + ["full_attention"]
    full = make(path / "hf_with_mtp_layer", seed=seed, num_hidden_layers=L + 1, layer_types=types + ["full_attention"],
                **(config or {}))
    tensors = {name.replace(f"model.layers.{L}.", "mtp.layers.0.", 1): t
               for name, t in load_file(full / "model.safetensors").items()}
    D = QWEN3_NEXT_TINY["hidden_size"]
    g = torch.Generator().manual_seed(seed + 2)
    tensors.update({"mtp.fc.weight": torch.randn(D, 2 * D, generator=g) / math.sqrt(2 * D),
                    **{f"mtp.{n}.weight": 0.1 * torch.randn(D, generator=g)       # offsets from 1
                       for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}})
    target, draft = path / "target", path / "draft"
    target.mkdir()
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    cfg = dict(json.loads((full / "config.json").read_text()), num_hidden_layers=L, layer_types=types)
    draft.mkdir()
    (draft / "model.safetensors").symlink_to(target / "model.safetensors")
    for folder, arch in zip((target, draft), archs):
        (folder / "config.json").write_text(json.dumps(dict(cfg, architectures=[arch]), indent=2))
    return target, draft


# Qwen3.5-MoE's text model: QWEN3_NEXT_TINY's sizes (every layer MoE: no dense width).
QWEN3_5_MOE_TINY = {k: v for k, v in QWEN3_NEXT_TINY.items() if k != "intermediate_size"}


def make_qwen3_5_moe_checkpoint(path: Path, *, seed: int = 0, wrapper: bool = False, **config) -> Path:
    """Save a random Qwen3.5-MoE of QWEN3_5_MOE_TINY updated with `config` (transformers' Qwen3_5MoeTextConfig
    kwargs): its text model (Qwen3_5MoeForCausalLM), or with `wrapper` the Hub's Qwen3_5MoeForConditionalGeneration
    (a one-block vision tower beside it); random A_log, dt_bias and conv weights as make_qwen3_next_checkpoint's."""
    transformers = _transformers()
    torch.manual_seed(seed)
    text = transformers.Qwen3_5MoeTextConfig(**dict(QWEN3_5_MOE_TINY, **config))
    if wrapper:
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2)
        model = transformers.Qwen3_5MoeForConditionalGeneration(
            transformers.Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision))
    else:
        model = transformers.Qwen3_5MoeForCausalLM(text)
    _randomize_linear_attention(model, seed)
    model.save_pretrained(path)
    return path


def _randomize_linear_attention(model: torch.nn.Module, seed: int) -> None:
    """`randomize`, then decays of every size (A_log, dt_bias) and conv weights of order one."""
    randomize(model, seed)
    _decays_of_every_size(model, seed)


def _decays_of_every_size(model: torch.nn.Module, seed: int) -> None:
    """A linear attention's A_log and dt_bias drawn to give decays of every size, its conv weights of order one."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 4, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=g) / 2)


def make_mixtral_checkpoint(path: Path, *, seed: int = 0, **config) -> Path:
    """Save a random Mixtral of MIXTRAL_TINY updated with `config` (transformers' MixtralConfig kwargs): the
    Hub's spelling, block_sparse_moe.experts.{e}.w1/w2/w3."""
    return _save_random_model(path, "Mixtral", seed, dict(MIXTRAL_TINY, **config))


def hf_reference(path: Path, arch: str):
    """transformers' model from the checkpoint, with its eager (default loop) experts and attention."""
    cls = getattr(_transformers(), arch)
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                experts_implementation="eager")
    return model.eval()


def hf_logits(path: Path, arch: str, ids: torch.Tensor) -> torch.Tensor:
    """The prompt's logits in one forward. The reference keeps no cache (here and in `hf_greedy`): none is needed,
    and transformers 5.25's cache of a Nemotron-H whose first layer is MoE has no length to ask (it raises)."""
    with torch.no_grad():
        return hf_reference(path, arch)(ids, use_cache=False).logits


def hf_logits_of_order_one(path: Path, arch: str, ids: torch.Tensor) -> torch.Tensor:
    """`hf_logits`, checked to be O(1), so that an absolute tolerance of 1e-3 means something."""
    want = hf_logits(path, arch, ids)
    assert 0.5 < want.abs().max() < 50, want.abs().max()
    return want


@torch.no_grad()
def hf_mtp(root: Path, target: Path, ids: torch.Tensor, arch: str, w: dict | None = None):
    """transformers' pieces of `arch` (its decoder layer, RMSNorm and rotary embedding) composed as the MTP module
    (engine/models/nextn.py) over every position of `ids` but the last, for a `make_mtp_checkpoint` folder:
    (target's last_hidden_state [1, T, D], MTP logits [1, T-1, V], MTP output [1, T-1, D]). `w`: the
    checkpoint's tensors (default: the target folder's), where the MTP layer's own ones are read."""
    import torch.nn.functional as F
    from safetensors.torch import load_file

    h = hf_reference(target, arch).model(ids).last_hidden_state             # after the target's final norm
    full = hf_reference(root / "hf_with_mtp_layer", arch)                   # layer L = the MTP decoder layer
    L = full.config.num_hidden_layers - 1
    w = load_file(target / "model.safetensors") if w is None else w
    p = f"model.layers.{L}."

    def norm(weight):
        n = type(full.model.norm)(weight.shape[0], eps=full.config.rms_norm_eps)
        n.weight.data.copy_(weight)
        return n

    tokens = ids[:, 1:]                                                     # t_{i+1} at position i
    T = tokens.shape[1]
    e = norm(w[p + "enorm.weight"])(F.embedding(tokens, w[p + "embed_tokens.weight"]))
    x = F.linear(torch.cat((e, norm(w[p + "hnorm.weight"])(h[:, :-1])), dim=-1), w[p + "eh_proj.weight"])
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    x = full.model.layers[L](x, attention_mask=mask, position_ids=pos,
                             position_embeddings=full.model.rotary_emb(x, pos))
    if isinstance(x, tuple):          # GLM-MoE-DSA's layer also returns its top-k selection
        x = x[0]
    out = norm(w[p + "shared_head.norm.weight"])(x)
    return h, F.linear(out, w[p + "shared_head.head.weight"]), out


class DictCheckpoint:
    """A fake engine.checkpoint.Checkpoint over a dict of tensors (names / shape / get)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


DROP = object()    # with_config(..., field=DROP): the field left out


def with_config(src: Path, dst: Path, **overrides) -> Path:
    """A checkpoint folder `dst`: `src`'s weights (a link) under `src`'s config.json with `overrides` (a field
    given DROP is left out)."""
    dst.mkdir()
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    config = dict(json.loads((src / "config.json").read_text()), **overrides)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not DROP}))
    return dst


def with_tensors(src: Path, dst: Path, edit) -> Path:
    """A checkpoint folder `dst`: `src`'s config.json over `src`'s tensors as `edit(tensors)` leaves them."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def check_refused_before_any_plan(path: Path, error: type[Exception], match: str, **load_kw) -> None:
    """Loading `path` (with `load_kw`) raises `error` (matching `match`) before the registry is asked for a plan."""
    import pytest

    from loadplan.engine.loader import load_model

    registry = LocalRegistry()
    with pytest.raises(error, match=match):
        load_model(path, registry=registry, **load_kwargs(**load_kw))
    assert registry.requests == []


@torch.no_grad()
def hf_qwen_mtp(root: Path, target: Path, ids: torch.Tensor, arch: str):
    """transformers' pieces of `arch` (Qwen3-Next's or Qwen3.5-MoE's text model) composed as the Qwen MTP module,
    for a `make_qwen3_next_mtp_checkpoint` folder (Qwen's `mtp.*` names), over every position of `ids` but the
    last: (the target's hidden states after its final norm [1, T, D], logits [1, T-1, V], output [1, T-1, D])."""
    import torch.nn.functional as F
    from safetensors.torch import load_file

    h = hf_reference(target, arch).model(ids).last_hidden_state
    full = hf_reference(root / "hf_with_mtp_layer", arch)                  # layer L: the module's decoder layer
    w = load_file(target / "model.safetensors")

    def norm(name):
        n = type(full.model.norm)(w[name].shape[0], eps=full.config.rms_norm_eps)
        n.weight.data.copy_(w[name])
        return n

    tokens = ids[:, 1:]
    T = tokens.shape[1]
    e = norm("mtp.pre_fc_norm_embedding.weight")(F.embedding(tokens, w["model.embed_tokens.weight"]))
    x = F.linear(torch.cat((e, norm("mtp.pre_fc_norm_hidden.weight")(h[:, :-1])), dim=-1), w["mtp.fc.weight"])
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    L = full.config.num_hidden_layers - 1
    x = full.model.layers[L](x, attention_mask=mask, position_ids=pos,
                             position_embeddings=full.model.rotary_emb(x, pos))
    out = norm("mtp.norm.weight")(x)
    return h, F.linear(out, w["lm_head.weight"]), out


def target_hidden_states(target_dir: Path, ids: torch.Tensor, arch: str, h_ref: torch.Tensor,
                         atol: float) -> torch.Tensor:
    """The engine target's final hidden states of `ids` [1, T, D] (what its MTP draft drafts from), checked
    against transformers' (`h_ref`), as are its logits."""
    target = load_local(target_dir)           # the same folder as the draft's: the MTP layer's tensors are skipped
    with torch.no_grad():
        t_logits, h = target.logits_and_hidden(ids)
    assert (h - h_ref).abs().max().item() <= atol
    assert (t_logits - hf_reference(target_dir, arch)(ids).logits).abs().max().item() <= atol
    return h


def check_nextn_draft(draft_dir: Path, ids: torch.Tensor, h: torch.Tensor, reference: tuple, atol: float,
                      **load_kw):
    """The NextN draft at `draft_dir` (loaded with `load_kw`) drafting from the engine target's hidden states `h`
    gives `reference`'s logits and output (transformers' pieces composed as the module, e.g. `hf_mtp`):
    returns (the draft, its logits)."""
    _, logits_ref, out_ref = reference
    draft = load_local(draft_dir, role="speculative", **load_kw)
    with torch.no_grad():
        logits, out = draft.logits_and_hidden(ids[:, 1:], hidden_states=h[:, :-1])
    assert (logits - logits_ref).abs().max().item() <= atol
    assert (out - out_ref).abs().max().item() <= atol
    return draft, logits


def check_speculative_gives_the_targets_greedy_tokens(target_dir: Path, draft_dir: Path, ids: torch.Tensor,
                                                      k: int) -> None:
    from loadplan.engine.generate import generate
    from loadplan.engine.speculative import speculative_generate

    target, draft = load_local(target_dir), load_local(draft_dir, role="speculative")
    want = generate(target, ids[0], 12)[0].tolist()
    tokens, stats = speculative_generate(target, draft, ids[0], 12, k)
    assert tokens == want
    assert stats["proposed"] > 0 and stats["draft_forwards"] > 0


def load_kwargs(**flat) -> dict:
    """load_model's keywords from one flat set (`ep_size=2, a2a_backend="mori", role=...`): the Parallel and Runtime
    fields become its `parallel` and `runtime`, the rest stay keywords."""
    import dataclasses

    from loadplan.plan import Parallel, Runtime

    out = {}
    for name, kind in (("parallel", Parallel), ("runtime", Runtime)):
        fields = {f.name for f in dataclasses.fields(kind)}
        given = {k: flat.pop(k) for k in list(flat) if k in fields}
        if given:
            out[name] = kind(**given)
    return {**out, **flat}


def load_local(path: Path, **kw):
    """The engine's model of the checkpoint at `path`, planned by a LocalRegistry (`kw`: as `load_kwargs` takes)."""
    from loadplan.engine.loader import load_model

    return load_model(path, registry=LocalRegistry(), **load_kwargs(**kw))


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


def check_matches_transformers(path: Path, arch: str, ids: torch.Tensor, n_new: int = 6, tol: float = 1e-4):
    """The engine's model of `path` (planned locally) gives transformers' `arch` logits of `ids` within `tol` (they
    are O(1)) and its `n_new` greedy tokens after ids[0]; returns the model."""
    from loadplan.engine.generate import generate

    model = load_local(path)
    assert (logits_of(model, ids) - hf_logits_of_order_one(path, arch, ids)).abs().max().item() <= tol
    assert generate(model, ids[0], n_new)[0].tolist() == hf_greedy(path, arch, ids[0].tolist(), n_new)
    return model


def generated_tokens(model, ids: torch.Tensor, n: int) -> list[int]:
    """The engine's n greedy tokens after ids[0] (through its caches)."""
    from loadplan.engine.generate import generate

    return generate(model, ids[0], n)[0].tolist()


@torch.no_grad()
def check_decoding_token_by_token(path: Path, arch: str, ids: torch.Tensor, prefill: int = 4, tol: float = 1e-4):
    """A cached prefill of `prefill` tokens, then one token a forward: every position's logits are transformers' of
    the whole of `ids` (a layer's step-by-step path and its cache, not only its whole-sequence one)."""
    model = load_local(path)
    model.setup_caches(ids.shape[0], 32)
    got = [model(ids[:, :prefill], input_pos=torch.arange(prefill))]
    got += [model(ids[:, t:t + 1], input_pos=torch.tensor([t])) for t in range(prefill, ids.shape[1])]
    assert (torch.cat(got, dim=1) - hf_logits_of_order_one(path, arch, ids)).abs().max() <= tol


def check_batch_rows_decode_alone(path: Path, ids: torch.Tensor) -> None:
    """A batch decodes its first row as that row alone, and the second row's logits are its own."""
    model = load_local(path)
    together = generated_tokens(model, ids, 5)
    model = load_local(path)
    assert together == generated_tokens(model, ids[:1], 5)
    assert torch.allclose(logits_of(model, ids)[1], logits_of(model, ids[1:])[0], atol=1e-5)


def check_speculative_target_rolls_back(path: Path, draft_dir: Path, noise: float) -> None:
    """Speculative decoding with the checkpoint at `path` as the target gives its greedy tokens, some drafts rejected:
    it verifies several drafted tokens in one forward and rolls back the rejected ones (its recurrent layers continue
    from the last accepted position). The draft (written to `draft_dir`) is the target with `noise` on its head."""
    from loadplan.engine.speculative import speculative_generate

    def noisy_head(tensors):
        head = tensors["lm_head.weight"]
        tensors["lm_head.weight"] = head + noise * torch.randn(head.shape, generator=torch.Generator().manual_seed(4))
    draft_path = with_tensors(path, draft_dir, noisy_head)
    ids = prompt(B=1, T=6, seed=2)
    want = generated_tokens(load_local(path), ids, 12)
    tokens, stats = speculative_generate(load_local(path), load_local(draft_path, role="speculative"), ids[0], 12, 3)
    assert tokens == want
    assert 0 < stats["accepted"] < stats["proposed"]                   # some rejected: rolled back


def _rank_logits(rank, world_size, path, ids, tp_size):
    from loadplan.engine.worker import WorkerSpec, init_rank, load_runner

    spec = WorkerSpec(model=str(path), prompt_ids=(), max_new_tokens=0, tp_size=tp_size, ep_size=world_size // tp_size)
    return logits_of(load_runner(spec, init_rank(spec), registry=LocalRegistry()), ids)


def check_ranks_give_one_process_logits(path: Path, ids: torch.Tensor, *, world: int = 2, atol: float = 1e-4):
    """The checkpoint at `path` on `world` TP ranks, then on `world` EP ranks: every rank's logits are one process's
    (each rank reads the whole tensors it shares, dequantized, and then takes its part: heads, features, experts)."""
    from loadplan.engine.parallel.launch import launch

    want = logits_of(load_local(path), ids)
    for tp_size in (world, 1):
        for rank, got in enumerate(launch(world, _rank_logits, path, ids, tp_size, timeout_s=240)):
            assert (got - want).abs().max().item() <= atol, f"tp {tp_size} ep {world // tp_size} rank {rank}"


def hf_greedy(path: Path, arch: str, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' n greedy tokens after `prompt_ids` (no end-of-sequence stop), each step over the whole
    sequence (no cache: see `hf_logits`)."""
    with torch.no_grad():
        out = hf_reference(path, arch).generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                                                eos_token_id=None, pad_token_id=0, use_cache=False)
    return out[0, len(prompt_ids):].tolist()


def prompt(B: int = 2, T: int = 7, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def qwen2_config(**overrides) -> dict:
    """A Qwen2-MoE config.json dict (no checkpoint) for layer-level tests."""
    cfg = dict(COMMON, architectures=["Qwen2MoeForCausalLM"], shared_expert_intermediate_size=32,
               rope_theta=10000.0, hidden_act="silu")
    cfg.update(overrides)
    return cfg


def make_plan(config: dict, *, ep_size=1, ep_rank=0, pp_size=1, pp_rank=0, tp_size=1, tp_rank=0, **runtime):
    """A real plan from the registry's rules, guarded as the loader hands it to constructors."""
    import uuid

    from loadplan.engine.plan_guard import GuardedPlan
    from loadplan.plan import Parallel, ResolveRequest, Runtime

    req = ResolveRequest(request_id=uuid.uuid4().hex, deployment_id=uuid.uuid4().hex, config=config,
                         parallel=Parallel(ep_size=ep_size, ep_rank=ep_rank, pp_size=pp_size, pp_rank=pp_rank,
                                           tp_size=tp_size, tp_rank=tp_rank),
                         runtime=Runtime(**runtime))
    return GuardedPlan(LocalRegistry().resolve_load_plan(req))


def delta_rule_inputs(T: int, B: int = 2, H: int = 3, dk: int = 8, dv: int = 5, seed: int = 0,
                      per_channel: bool = False):
    """(q, k, v, g, beta, state) of a delta rule over T positions (layers/gated_delta_net.py): unit keys, scaled unit
    queries, log decays in (-2, 0] one per head and position (`per_channel`: one per key channel too, Kimi delta
    attention's), write strengths in [0, 1), a random initial state. Seeded."""
    from loadplan.engine.layers.gated_delta_net import l2norm

    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, H, T, dk, generator=g)) * dk ** -0.5
    k = l2norm(torch.randn(B, H, T, dk, generator=g))
    v = torch.randn(B, H, T, dv, generator=g)
    decay = -torch.rand(B, H, T, *((dk,) if per_channel else ()), generator=g) * 2
    beta = torch.rand(B, H, T, generator=g)
    state = torch.randn(B, H, dk, dv, generator=g)
    return q, k, v, decay, beta, state
