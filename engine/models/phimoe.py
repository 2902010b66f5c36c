"""Phi-3.5-MoE (`PhiMoEForCausalLM` on the Hub, `PhimoeForCausalLM` as transformers 5 saves it), following
transformers' modeling_phimoe numerically.

Shapes: B batch, T tokens, D hidden, E experts, V vocab.

Mixtral's layer (qwen_moe.py's, every layer sparse, no shared expert, so no fusion; the checkpoint spells the
experts as Mixtral does, `block_sparse_moe.experts.{e}.w1/w3/w2` and the router `block_sparse_moe.gate`) with:
- LayerNorm (weight and bias) for every norm, the final one too, at `rms_norm_eps`;
- q/k/v/o biases (`attention_bias`) and a bias on the head (`lm_head_bias`);
- the sparsemixer router, which picks exactly two experts: the best logit, then the best of the others, each
  weighted by a softmax over the logits within a relative margin of 2 * router_jitter_noise of it (the others
  masked out), as transformers evaluates it (no jitter, no sampling);
- LongRoPE: the frequencies divided by the config's short factors, cos/sin times short_mscale, what transformers
  computes while a sequence stays within original_max_position_embeddings (positions beyond are refused by the
  rotary embedding: layers/rope.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from loadplan.layouts import mixtral_layout
from ..layers.norm import LayerNorm
from .causal_lm import DeclaredCausalLM
from .config import ConfigError, Family, at_least, heads_wide
from .mixtral import MIXTRAL_NAMES
from .qwen_moe import EXPERTS_AS_WIDE, MOE_FIELDS, QwenDecoderLayer, QwenMoeConfig, QwenSparseMoeBlock

HUB_ARCHITECTURE = "PhiMoEForCausalLM"       # microsoft/Phi-3.5-MoE-instruct's config.json
ARCHITECTURE = "PhimoeForCausalLM"           # transformers' class, what its save_pretrained writes


@dataclass(frozen=True)
class PhimoeConfig(QwenMoeConfig):
    router_jitter_noise: float = 0.01        # the sparsemixer's margin: logits within 2x this (relative) compete
    lm_head_bias: bool = False


def _sparsemixer_fields(d: dict, fields: dict) -> None:
    """Two experts a token, a margin >= 0, no head bias on a tied head, one LongRoPE short factor per rotated pair."""
    if fields.num_experts_per_tok != 2:
        raise ConfigError(f"config.num_experts_per_tok: {fields.num_experts_per_tok} is not supported; "
                          f"Phi-3.5-MoE's sparsemixer routes every token to exactly 2 experts")
    if fields.router_jitter_noise < 0:
        raise ConfigError(f"config.router_jitter_noise: must be >= 0, got {fields.router_jitter_noise}")
    if fields.lm_head_bias and fields.tie_word_embeddings:
        raise ConfigError("config.lm_head_bias: a head bias with tie_word_embeddings is not supported")
    rope, rotated = fields.rope, int(fields.head_dim * fields.rope.partial_rotary_factor)
    if rope.rope_type == "longrope" and len(rope.short_factor) != rotated // 2:
        field = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
        raise ConfigError(f"config.{field}: {len(rope.short_factor)} short factors; the rotary dimension "
                          f"{rotated} needs one per pair of features")


# transformers' PhimoeConfig defaults where a checkpoint may leave a field out.
PHIMOE = Family(ARCHITECTURE, mixtral_layout, dict(
    MOE_FIELDS, rms_norm_eps=1e-5, max_position_embeddings=4096 * 32, router_jitter_noise=0.01, sliding_window=None,
    lm_head_bias=False, num_key_value_heads=8, head_dim=heads_wide, qkv_bias=False),
    names={"qkv_bias": "attention_bias"}, rope={"default_theta": 1e6, "longrope": True},
    fixed=dict(EXPERTS_AS_WIDE, norm_topk_prob=False, o_bias=lambda f: f.qkv_bias, qk_norm=False),
    own=(at_least("sliding_window", 1), _sparsemixer_fields))


def sparsemixer(scores: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, E] -> (ids [T, 2], weights [T, 2]) in scores' dtype: transformers' sparsemixer in eval mode."""
    ids, weights = [], []
    remaining = scores
    for _ in range(2):
        best, index = remaining.max(dim=-1, keepdim=True)                  # [T, 1] each
        margin = (best - scores) / scores.abs().clamp(min=best)            # [T, E]
        gates = torch.softmax(remaining.masked_fill(margin > 2 * eps, float("-inf")), dim=-1)
        ids.append(index)
        weights.append(gates.gather(-1, index))
        remaining = remaining.scatter(-1, index, float("-inf"))           # the next pick is among the others
    return torch.cat(ids, dim=-1), torch.cat(weights, dim=-1)


class PhimoeMoeBlock(QwenSparseMoeBlock):
    """The sparsemixer router and the routed experts."""

    def __init__(self, cfg: PhimoeConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        self.router_jitter_noise = cfg.router_jitter_noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        ids, weights = sparsemixer(self.router_logits(x), self.router_jitter_noise)   # [T, 2] each
        return self.experts(x, ids, weights.to(x.dtype))                               # reduced if the plan says


class PhimoeDecoderLayer(QwenDecoderLayer):
    NORM = LayerNorm
    MOE_BLOCK = PhimoeMoeBlock


class PhimoeForCausalLM(DeclaredCausalLM):
    ARCHITECTURE = ARCHITECTURE
    TENSOR_PARALLEL = True
    CHECKPOINT_NAMES = MIXTRAL_NAMES
    FAMILY = PHIMOE
    CONFIG = PhimoeConfig
    DECODER_LAYER = PhimoeDecoderLayer

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        super().__init__(hf_config, plan, dtype=dtype)
        cfg = self.config
        if cfg.lm_head_bias and self.lm_head is not None:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=True, dtype=dtype)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None and self.lm_head.bias is not None:
            return F.linear(h, self.lm_head.weight, self.lm_head.bias)
        return super()._head(h)


class PhiMoEForCausalLM(PhimoeForCausalLM):
    """The Hub's spelling of the entry class (microsoft/Phi-3.5-MoE-instruct's config.json)."""

    ARCHITECTURE = HUB_ARCHITECTURE
    FAMILY = replace(PHIMOE, architecture=HUB_ARCHITECTURE)
