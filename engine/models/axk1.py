"""A.X K1 (`AXK1ForCausalLM`: SK Telecom's), following transformers' modeling_axk1 numerically: DeepSeek-V3's model
(models/deepseek_v3.py: MLA with a q LoRA, the grouped sigmoid router with its routing bias, shared experts) whose
MoE layers normalise their output (routed and shared experts together) by an RMSNorm of their own before the
residual sum: the checkpoint's `post_mlp_layernorm`, at the layer's level. Layer i is MoE iff mlp_layer_types[i] is
"sparse" (by default as DeepSeek's first_k_dense_replace (1) and moe_layer_freq (1) say). Its shared experts the
registry never fuses (DeepSeek's gate: not the fused architecture).
"""

from __future__ import annotations

import torch

from loadplan.layouts import axk1_layout
from ..layers.norm import RMSNorm
from .config import ConfigError, moe_layout
from .deepseek_v3 import DeepseekV3Config, DeepseekV3DecoderLayer, DeepseekV3ForCausalLM

ARCHITECTURE = "AXK1ForCausalLM"

# transformers' AXK1Config defaults where they differ from DeepSeek-V3's, or where DeepSeek-V3's are required (those
# of the layers and experts: the registry's reader's, axk1_layout)
AXK1_DEFAULTS = {"vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                 "num_attention_heads": 64, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
                 "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
                 "max_position_embeddings": 32768}


def axk1_config(d: dict) -> DeepseekV3Config:
    """config.json read as transformers' AXK1Config reads it: DeepSeek-V3's fields, its defaults, its layers and
    experts as the registry's reader says (mlp_layer_types, else DeepSeek's first_k_dense_replace and
    moe_layer_freq)."""
    layout = moe_layout(axk1_layout, d)
    d = dict(AXK1_DEFAULTS, **d)
    if d.get("q_lora_rank") is None:
        raise ConfigError("config.q_lora_rank: null is not supported; A.X K1's queries always go through their LoRA")
    return DeepseekV3Config.from_layout(d, layout)


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
