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

from loadplan.layouts import mixtral_layout
from ..weights import CheckpointNames
from .config import REQUIRED, Family, at_least, heads_wide
from .qwen_moe import EXPERTS_AS_WIDE, MOE_FIELDS, QwenLayerCausalLM, QwenMoeConfig

ARCHITECTURE = "MixtralForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}.
MIXTRAL_NAMES = CheckpointNames((
    ("block_sparse_moe.gate.weight", "mlp.gate.weight"),
    *((f"block_sparse_moe.experts.{{e}}.{w}.weight", f"mlp.experts.{{e}}.{proj}_proj.weight")
      for w, proj in (("w1", "gate"), ("w3", "up"), ("w2", "down"))),
))


# transformers' MixtralConfig defaults where a real checkpoint may leave a field out (rms_norm_eps, rope theta,
# hidden_act, head_dim); its num_key_value_heads default, 8, fits no particular head count: a config must say it.
MIXTRAL = Family(ARCHITECTURE, mixtral_layout, dict(
    MOE_FIELDS, rms_norm_eps=1e-5, max_position_embeddings=4096 * 32, num_key_value_heads=REQUIRED,
    head_dim=heads_wide, sliding_window=None), rope={"default_theta": 1e6}, own=(at_least("sliding_window", 1),),
    fixed=dict(EXPERTS_AS_WIDE, norm_topk_prob=True, qkv_bias=False, o_bias=False, qk_norm=False))


def mixtral_config(d: dict) -> QwenMoeConfig:
    """Mixtral's config.json as the layer's config."""
    return MIXTRAL.read(d, QwenMoeConfig)


class MixtralForCausalLM(QwenLayerCausalLM):
    ARCHITECTURE = ARCHITECTURE
    FAMILY = MIXTRAL
    CHECKPOINT_NAMES = MIXTRAL_NAMES
