"""A.X K1 (`AXK1ForCausalLM`: SK Telecom's), following transformers' modeling_axk1 numerically: DeepSeek-V3's model
(models/deepseek_v3.py: MLA with a q LoRA, the grouped sigmoid router with its routing bias, shared experts) whose
MoE layers normalise their output (routed and shared experts together) by an RMSNorm of their own before the
residual sum: the checkpoint's `post_mlp_layernorm`, at the layer's level. Layer i is MoE iff mlp_layer_types[i] is
"sparse" (by default as DeepSeek's first_k_dense_replace (1) and moe_layer_freq (1) say). Its shared experts the
registry never fuses (DeepSeek's gate: not the fused architecture).
"""

from __future__ import annotations

import dataclasses

import torch

from ..layers.norm import RMSNorm
from .config import ConfigError, get_field as _get, per_layer
from .deepseek_v3 import DeepseekV3Config, DeepseekV3DecoderLayer, DeepseekV3ForCausalLM

ARCHITECTURE = "AXK1ForCausalLM"

# transformers' AXK1Config defaults where they differ from DeepSeek-V3's, or where DeepSeek-V3's are required
AXK1_DEFAULTS = {"vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                 "num_hidden_layers": 61, "num_attention_heads": 64, "n_shared_experts": 1, "n_routed_experts": 192,
                 "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                 "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                 "max_position_embeddings": 32768}


def axk1_config(d: dict) -> DeepseekV3Config:
    """config.json read as transformers' AXK1Config reads it: DeepSeek-V3's fields, its defaults, mlp_layer_types."""
    d = dict(AXK1_DEFAULTS, **d)
    if d.get("num_local_experts") is not None and "n_routed_experts" not in d:
        d["n_routed_experts"] = d["num_local_experts"]
    if d.get("q_lora_rank") is None:
        raise ConfigError("config.q_lora_rank: null is not supported; A.X K1's queries always go through their LoRA")
    n = _get(d, "num_hidden_layers", kind=int)
    first, freq = _get(d, "first_k_dense_replace", 1, int), _get(d, "moe_layer_freq", 1, int)
    if freq < 1:
        raise ConfigError(f"config.moe_layer_freq: must be >= 1, got {freq}")
    types = per_layer(d, "mlp_layer_types", n, ("dense", "sparse"),
                      ["sparse" if i >= first and i % freq == 0 else "dense" for i in range(n)])
    v3 = DeepseekV3Config.from_hf(dict(d, first_k_dense_replace=0, moe_layer_freq=1))
    return dataclasses.replace(v3, moe_layers=tuple(i for i, t in enumerate(types) if t == "sparse"))


class AXK1DecoderLayer(DeepseekV3DecoderLayer):
    """DeepSeek-V3's layer; on MoE layers x + post_mlp_layernorm(mlp(post_attention_layernorm(x)))."""

    def __init__(self, cfg: DeepseekV3Config, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if layer_id in cfg.moe_layers \
            else None

    def forward(self, x, cos, sin, input_pos=None):
        """x [B, T, D] -> [B, T, D]"""
        x = x + self.mixer(self.input_layernorm(x), cos, sin, input_pos)
        B, T, D = x.shape
        y = self.mlp(self.post_attention_layernorm(x).reshape(B * T, D))
        if self.post_mlp_layernorm is not None:
            y = self.post_mlp_layernorm(y)
        return x + y.view(B, T, D)


class AXK1ForCausalLM(DeepseekV3ForCausalLM):
    ARCHITECTURE = ARCHITECTURE
    DECODER_LAYER = AXK1DecoderLayer

    @classmethod
    def parse_config(cls, hf_config: dict) -> DeepseekV3Config:
        return axk1_config(hf_config)
