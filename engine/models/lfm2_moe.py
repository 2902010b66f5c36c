"""LFM2-MoE (`Lfm2MoeForCausalLM`: Liquid AI's LFM2-8B-A1B), following transformers' modeling_lfm2_moe numerically.

Shapes: B batch, T tokens, D hidden, E experts, K top-k, V vocab, H/H_kv heads.

A hybrid: each layer's token mixer is, by `layer_types`, either a gated short convolution (layers/short_conv.py,
"conv") or grouped-query attention with per-head q/k RMSNorms before the rotation ("full_attention"); then
layer i < num_dense_layers has a dense SwiGLU MLP, the others an MoE block:
- router: sigmoid of the logits; top-k of sigmoid + `expert_bias` (use_expert_bias, else of the sigmoid alone);
  weights the chosen sigmoids, renormalised (+ 1e-6) with norm_topk_prob, times routed_scaling_factor;
- no shared expert, so no fusion.
The checkpoints spell the parts otherwise than the engine (`LFM2_MOE_NAMES`): `feed_forward` for the MLP (w1, w3,
w2: gate, up, down), `operator_norm` / `ffn_norm` for the two norms, the final norm `model.embedding_norm`, the
attention's `out_proj` and `q_layernorm` / `k_layernorm`. Tensor parallelism is not built for it (the loader refuses
tp_size > 1): in_proj's rows hold B, C and x one after the other, which a split by rows would mix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loadplan.layouts import lfm2_moe_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.mlp import GatedMLP
from ..layers.short_conv import ShortConv
from ..moe import RoutedExperts
from ..weights import CheckpointNames
from .causal_lm import DeclaredCausalLM, DecoderLayer
from .config import ConfigError, DecoderConfig, get_field as _get, moe_layout, per_layer, read_fields, read_rope

ARCHITECTURE = "Lfm2MoeForCausalLM"
LAYER_TYPES = ("conv", "full_attention")

# (checkpoint, engine) suffixes (under model.layers.{i}, and the final norm's).
LFM2_MOE_NAMES = CheckpointNames((
    ("operator_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("model.embedding_norm.weight", "model.norm.weight"),
    ("self_attn.out_proj.weight", "self_attn.o_proj.weight"),
    ("self_attn.q_layernorm.weight", "self_attn.q_norm.weight"),
    ("self_attn.k_layernorm.weight", "self_attn.k_norm.weight"),
    ("feed_forward.gate.weight", "mlp.gate.weight"),
    ("feed_forward.expert_bias", "mlp.expert_bias"),
    ("feed_forward.experts.{e}.w1.weight", "mlp.experts.{e}.gate_proj.weight"),
    ("feed_forward.experts.{e}.w3.weight", "mlp.experts.{e}.up_proj.weight"),
    ("feed_forward.experts.{e}.w2.weight", "mlp.experts.{e}.down_proj.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
))


@dataclass(frozen=True)
class Lfm2MoeConfig(DecoderConfig):
    intermediate_size: int            # dense layers
    moe_intermediate_size: int        # each expert
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # rms_norm_eps: the config's norm_eps
    layer_types: tuple[str, ...]
    conv_kernel: int                  # conv_L_cache
    conv_bias: bool
    num_experts: int
    num_experts_per_tok: int
    use_expert_bias: bool
    norm_topk_prob: bool
    routed_scaling_factor: float
    moe_layers: tuple[int, ...]

    @classmethod
    def from_hf(cls, d: dict) -> "Lfm2MoeConfig":
        """transformers' Lfm2MoeConfig defaults where a checkpoint may leave a field out (layer_types it needs)."""
        layout = moe_layout(lfm2_moe_layout, d)          # the registry's reader of the layer and expert fields
        n = len(layout.layer_ids)
        hidden = _get(d, "hidden_size", 2048, int)
        heads = _get(d, "num_attention_heads", 32, int)
        kernel = _get(d, "conv_L_cache", 3, int)
        if kernel < 1:
            raise ConfigError(f"config.conv_L_cache: must be >= 1, got {kernel}")
        if d.get("layer_types") is None:
            raise ConfigError("config.layer_types: missing (transformers reads each layer's kind from it)")
        rope = read_rope(d, default_theta=1e6)
        tie = d.get("tie_word_embeddings", d.get("tie_embedding", True))   # tie_embedding: its older name
        return cls(
            **read_fields(d, cls, dict(vocab_size=65536, intermediate_size=7168, moe_intermediate_size=1792,
                                       num_key_value_heads=8, head_dim=hidden // heads, rms_norm_eps=1e-5,
                                       max_position_embeddings=128_000, conv_bias=False, use_expert_bias=True,
                                       norm_topk_prob=True, routed_scaling_factor=1.0),
                          names=dict(rms_norm_eps="norm_eps")),
            hidden_size=hidden, num_hidden_layers=n, num_attention_heads=heads, tie_word_embeddings=bool(tie),
            rope=rope, layer_types=tuple(per_layer(d, "layer_types", n, LAYER_TYPES, [])), conv_kernel=kernel,
            num_experts=layout.n_routed, num_experts_per_tok=layout.top_k, moe_layers=layout.moe_layers)


class Lfm2MoeBlock(nn.Module):
    """The sigmoid router (with its expert bias) and the routed experts."""

    def __init__(self, cfg: Lfm2MoeConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.scale = cfg.num_experts_per_tok, cfg.norm_topk_prob, \
            cfg.routed_scaling_factor
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False, dtype=dtype)          # router
        self.expert_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32), requires_grad=False) \
            if cfg.use_expert_bias else None
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, plan,
                                     layer_id=layer_id, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        logits = self.gate(x)                                              # [T, E]
        scores = logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        ids = torch.topk(choice, self.top_k, dim=-1).indices               # [T, K]
        weights = scores.gather(-1, ids).type_as(logits)                   # [T, K]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return self.experts(x, ids, (weights * self.scale).to(x.dtype))    # reduced if the plan says


class Lfm2MoeDecoderLayer(DecoderLayer):
    def __init__(self, cfg: Lfm2MoeConfig, plan, layer_id: int, dtype: torch.dtype):
        conv = cfg.layer_types[layer_id] == "conv"
        attn = None if conv else GQAttention(AttentionSpec.of(cfg, qk_norm="head"), dtype=dtype)
        mlp = Lfm2MoeBlock(cfg, plan, layer_id, dtype) if layer_id in cfg.moe_layers else \
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, "silu", dtype)
        super().__init__(layer_id, attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.conv = ShortConv(cfg.hidden_size, cfg.conv_kernel, cfg.conv_bias, dtype) if conv else None

    @property
    def mixer(self) -> nn.Module:
        return self.conv if self.conv is not None else self.self_attn


class Lfm2MoeForCausalLM(DeclaredCausalLM):
    ARCHITECTURE = ARCHITECTURE
    CHECKPOINT_NAMES = LFM2_MOE_NAMES
    CONFIG = Lfm2MoeConfig
    DECODER_LAYER = Lfm2MoeDecoderLayer
