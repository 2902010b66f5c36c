"""HY-V3 (`HYV3ForCausalLM`: Tencent's Hunyuan V3), following transformers' modeling_hy_v3 numerically: Qwen3's
attention over DeepSeek-V3's MoE block.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads.

- Attention: grouped-query with per-head RMSNorm on q and k (before the rotation), whole heads rotated (rope theta
  11158840 unless the config says otherwise), biases on q/k/v/o with `attention_bias`.
- Layer i is MoE iff mlp_layer_types[i] is "sparse" (by default every layer but the first). MoE: DeepSeek-V3's block
  (deepseek_v3.DeepseekV3MoE) with one group: the sigmoid router whose top-k is chosen with the routing bias (the
  checkpoint's `mlp.expert_bias`), renormalised and scaled by router_scaling_factor; num_experts routed experts and
  num_shared_experts shared ones (one MLP of that many times the width, the checkpoint's `mlp.shared_mlp`), which the
  registry never fuses (our choice: no fused layout exists). With enable_moe_fp32_combine (the default) the routed
  and shared outputs are summed in float32.
"""

from __future__ import annotations

from dataclasses import dataclass


from loadplan.layouts import hy_v3_layout
from ..layers.attention import AttentionSpec
from ..weights import CheckpointNames
from .config import ConfigError, Family
from .glm4_moe import (GLM_FIELDS, Glm4MoeConfig, Glm4MoeDecoderLayer, Glm4MoeForCausalLM, refuse_partial_rotary,
                       rotary_dim, theta_unless_given)

ARCHITECTURE = "HYV3ForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}.
HY_V3_NAMES = CheckpointNames((
    ("mlp.router.gate.weight", "mlp.gate.weight"),
    ("mlp.expert_bias", "mlp.gate.e_score_correction_bias"),
    *((f"mlp.shared_mlp.{p}.weight", f"mlp.shared_experts.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")),
))


@dataclass(frozen=True)
class HYV3Config(Glm4MoeConfig):
    moe_fp32_combine: bool = True        # the routed and shared outputs summed in float32 (DeepseekV3MoE)


def _no_mlp_bias(d: dict, fields: dict) -> None:
    if d.get("mlp_bias"):
        raise ConfigError("config.mlp_bias: true is not supported; HY-V3's MLPs have no bias")


# transformers' HYV3Config defaults where a checkpoint may leave a field out (rope theta 11158840); its router has one
# group, whatever the config says (transformers' HYV3TopKRouter has none), scaled by router_scaling_factor.
HY_V3 = Family(ARCHITECTURE, hy_v3_layout, dict(
    GLM_FIELDS, vocab_size=120832, hidden_size=4096, intermediate_size=13312, num_attention_heads=64,
    num_key_value_heads=8, head_dim=128, moe_intermediate_size=1536, routed_scaling_factor=2.826,
    moe_fp32_combine=True),
    names=dict(routed_scaling_factor="router_scaling_factor", moe_fp32_combine="enable_moe_fp32_combine"),
    rope=theta_unless_given(11_158_840.0), fixed=dict(n_group=1, topk_group=1, norm_topk_prob=True, use_qk_norm=True),
    own=(refuse_partial_rotary("HY-V3 rotates whole heads"), _no_mlp_bias, rotary_dim))


class HYV3DecoderLayer(Glm4MoeDecoderLayer):
    @classmethod
    def attention_spec(cls, cfg: HYV3Config, layer_id: int) -> AttentionSpec:
        return AttentionSpec.of(cfg, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm="head")


class HYV3ForCausalLM(Glm4MoeForCausalLM):
    ARCHITECTURE = ARCHITECTURE
    FAMILY = HY_V3
    CONFIG = HYV3Config
    DECODER_LAYER = HYV3DecoderLayer
    CHECKPOINT_NAMES = HY_V3_NAMES
