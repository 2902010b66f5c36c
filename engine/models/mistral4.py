"""Mistral 4 (`Mistral4ForCausalLM`), following transformers' modeling_mistral4 numerically: DeepSeek-V3's model
(models/deepseek_v3.py) with two differences.

- Router: softmax scores over the routed experts, group-limited (each group scored by its two best), no
  load-balancing bias; the top-k weights renormalised and scaled by routed_scaling_factor (layers/deepseek_router.py
  with scoring "softmax" and no bias).
- Attention: DeepSeek's MLA, each query scaled by 1 + llama_4_scaling_beta * log(1 + floor(p / original)) at position
  p, `original` the rope's original_max_position_embeddings (Llama 4's long-context scaling; layers/mla.py's
  `query_position_scale`). transformers' default rope is YaRN (factor 128 over 8192 positions, beta 0.1); a rope
  without llama_4_scaling_beta is refused (transformers cannot run one either).
Layers from first_k_dense_replace (0) on are MoE, with n_shared_experts (1) shared experts beside the routed ones,
which the registry never fuses (DeepSeek's gate: not the fused architecture). transformers saves each layer's experts
stacked, `mlp.experts.gate_up_proj` [E, 2I, D] (gate then up) and `down_proj` [E, D, I], as its model holds them:
shown one expert at a time (engine/stacked_experts.py; per-expert checkpoints are read as they are).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from loadplan.layouts import mistral4_layout
from ..stacked_experts import StackedExperts
from .config import ConfigError, moe_layout
from .deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

ARCHITECTURE = "Mistral4ForCausalLM"

# transformers' Mistral4Config defaults where they differ from DeepSeek-V3's, or where DeepSeek-V3's are required (its
# layer and expert fields: the registry's reader, mistral4_layout)
MISTRAL4_DEFAULTS = {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 12288,
                     "moe_intermediate_size": 2048, "num_attention_heads": 32, "routed_scaling_factor": 1.0,
                     "kv_lora_rank": 256, "q_lora_rank": 1024, "qk_rope_head_dim": 64, "v_head_dim": 128,
                     "qk_nope_head_dim": 64, "n_group": 1, "topk_group": 1, "max_position_embeddings": 1048576}
# transformers' default rope (its partial_rotary_factor is qk_rope_head_dim's share of a head, which MLA rotates)
DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}


@dataclass(frozen=True)
class Mistral4Config(DeepseekV3Config):
    routing_bias: bool = False                         # DeepseekV3MoE's router: no load-balancing bias
    query_position_scale: tuple[float, int] = (0.0, 1)  # (llama_4_scaling_beta, original_max_position_embeddings)


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    ARCHITECTURE = ARCHITECTURE

    @classmethod
    def parse_config(cls, hf_config: dict) -> Mistral4Config:
        d = dict(MISTRAL4_DEFAULTS, **hf_config)      # a field given as null is kept: q_lora_rank null means none
        if d.get("rope_scaling"):
            raise ConfigError("config.rope_scaling: not read by Mistral 4 (transformers reads rope_parameters, its "
                              "YaRN by default); say the rope there")
        rope = dict(d.pop("rope_parameters", None) or DEFAULT_ROPE)
        rope.pop("max_position_embeddings", None)                             # transformers' copy of the model's
        # MLA rotates qk_rope_head_dim features; transformers says so as their share of a head (qk_nope + qk_rope)
        partial, rotated, head = rope.pop("partial_rotary_factor", None), d["qk_rope_head_dim"], \
            d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
        if partial is not None and int(head * partial) != rotated:
            raise ConfigError(f"config.rope_parameters.partial_rotary_factor: {partial!r} of a {head}-wide head "
                              f"rotates {int(head * partial)} features, not qk_rope_head_dim={rotated}")
        beta, original = rope.pop("llama_4_scaling_beta", None), rope.get("original_max_position_embeddings")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)):
            raise ConfigError(f"config.rope_parameters.llama_4_scaling_beta: expected a number, got {beta!r} "
                              f"(Mistral 4 scales its queries by it)")
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ConfigError(f"config.rope_parameters.original_max_position_embeddings: expected a positive integer, "
                              f"got {original!r} (Mistral 4's query scaling counts positions in it)")
        layout = moe_layout(mistral4_layout, hf_config)   # the registry's reader of the layer and expert fields
        # DeepSeek-V3's reading of the rest, its layers and experts the layout's: its router read as V3's, then made
        # Mistral 4's (softmax, no bias)
        v3 = DeepseekV3Config.from_layout(dict(d, rope_parameters=rope, scoring_func="sigmoid", topk_method="noaux_tc"),
                                          layout)
        return Mistral4Config(**dict({f.name: getattr(v3, f.name) for f in dataclasses.fields(DeepseekV3Config)},
                                     scoring_func="softmax"),
                              query_position_scale=(float(beta), original))

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        super().__init__(hf_config, plan, dtype=dtype)
        lo, hi = self.layer_range
        for layer in self.model.layers[lo:hi]:
            layer.self_attn.query_position_scale = self.config.query_position_scale

    def checkpoint_view(self, ckpt):
        cfg = self.config
        return StackedExperts(ckpt, cfg.n_routed_experts, gate_up="concatenated", hidden_size=cfg.hidden_size,
                              expert_width=cfg.moe_intermediate_size)
