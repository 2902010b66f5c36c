"""Mixtral (Mixtral-8x7B, Mixtral-8x22B), numerically following transformers' modeling_mixtral.

Shapes: as qwen_moe.py (T tokens, D hidden, E experts, K top-k).

A Mixtral layer is Qwen3-MoE's without the q/k norm, so it is built by qwen_moe.py's
layer from a `QwenMoeConfig` read off Mixtral's config: GQA attention without biases,
full rotary (theta 1e6 unless the config says otherwise), an optional sliding window;
every layer sparse, num_local_experts experts of width intermediate_size, the router
softmax -> top-k -> renormalised (always, `norm_topk_prob`); no shared expert, so no
fusion. What differs is the checkpoint's spelling: `block_sparse_moe.gate` is the
router and `block_sparse_moe.experts.{e}.w1/w3/w2` the gate/up/down projections
(`MIXTRAL_NAMES`, engine/weights.py's `CheckpointNames`).
"""

from __future__ import annotations

import torch

from ..layers.mlp import activation
from ..layers.rope import rope_config_from_hf
from ..weights import CheckpointNames
from .causal_lm import CausalLM
from .config import ConfigError, get_field as _get
from .qwen_moe import QwenDecoderLayer, QwenMoeConfig

ARCHITECTURE = "MixtralForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}.
MIXTRAL_NAMES = CheckpointNames((
    ("block_sparse_moe.gate.weight", "mlp.gate.weight"),
    ("block_sparse_moe.experts.{e}.w1.weight", "mlp.experts.{e}.gate_proj.weight"),
    ("block_sparse_moe.experts.{e}.w3.weight", "mlp.experts.{e}.up_proj.weight"),
    ("block_sparse_moe.experts.{e}.w2.weight", "mlp.experts.{e}.down_proj.weight"),
))


def mixtral_config(d: dict) -> QwenMoeConfig:
    """Mixtral's config.json as the layer's config; transformers' MixtralConfig defaults where it has
    them and a real checkpoint may leave them out (rms_norm_eps, rope theta, hidden_act, head_dim)."""
    hidden = _get(d, "hidden_size", kind=int)
    heads = _get(d, "num_attention_heads", kind=int)
    n_layers = _get(d, "num_hidden_layers", kind=int)
    width = _get(d, "intermediate_size", kind=int)
    n_experts = _get(d, "num_local_experts", kind=int)
    top_k = _get(d, "num_experts_per_tok", kind=int)
    if not 0 < top_k <= n_experts:
        raise ConfigError(f"config.num_experts_per_tok: {top_k} must be in [1, num_local_experts={n_experts}]")
    window = _get(d, "sliding_window", None, int)
    if window is not None and window < 1:
        raise ConfigError(f"config.sliding_window: must be >= 1 or null, got {window}")
    act = _get(d, "hidden_act", "silu", str)
    activation(act)   # refuses unknown activations by name
    return QwenMoeConfig(
        architecture=ARCHITECTURE,
        vocab_size=_get(d, "vocab_size", kind=int),
        hidden_size=hidden,
        intermediate_size=width,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        # transformers' default is 8, which fits no particular head count: a config must say it.
        num_key_value_heads=_get(d, "num_key_value_heads", kind=int),
        head_dim=_get(d, "head_dim", hidden // heads, int),
        rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-5)),
        hidden_act=act,
        max_position_embeddings=_get(d, "max_position_embeddings", 4096 * 32, int),
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False, bool)),
        rope=rope_config_from_hf(d, default_theta=1e6),
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
        qkv_bias=False,
        o_bias=False,
        qk_norm=False,
        moe_layers=tuple(range(n_layers)),
        sliding_window=window,
    )


class MixtralForCausalLM(CausalLM):
    TENSOR_PARALLEL = True
    CHECKPOINT_NAMES = MIXTRAL_NAMES

    @classmethod
    def parse_config(cls, hf_config: dict) -> QwenMoeConfig:
        return mixtral_config(hf_config)

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        cfg = self.parse_config(hf_config)
        super().__init__(cfg, plan, QwenDecoderLayer, n_routed=cfg.num_experts, rope_head_dim=cfg.head_dim,
                         dtype=dtype)
