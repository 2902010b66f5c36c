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

import dataclasses
from dataclasses import dataclass

import torch

from loadplan.layouts import hy_v3_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..parallel.tensor import TensorParallel
from ..weights import CheckpointNames
from .causal_lm import DecoderLayer
from .config import ConfigError, get_field as _get, moe_layout
from .deepseek_v3 import moe_or_dense_mlp
from .glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM

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

    @classmethod
    def from_hf(cls, d: dict) -> "HYV3Config":
        """transformers' HYV3Config defaults where a checkpoint may leave a field out."""
        partial = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise ConfigError(f"config.partial_rotary_factor: {partial!r} not supported; HY-V3 rotates whole heads")
        if d.get("mlp_bias"):
            raise ConfigError("config.mlp_bias: true is not supported; HY-V3's MLPs have no bias")
        rope = {} if d.get("rope_parameters") or d.get("rope_theta") is not None else {"rope_theta": 11_158_840.0}
        layout = moe_layout(hy_v3_layout, d)          # the registry's reader of the layer and expert fields
        # Glm4MoeConfig reads the other fields both share, under GLM's names, with HY-V3's defaults; its layers and
        # experts are the layout's; its router has one group, whatever the config says (transformers'
        # HYV3TopKRouter has none).
        glm = Glm4MoeConfig.from_layout(dict(
            d, **rope, n_group=1, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=float(_get(d, "router_scaling_factor", 2.826, (int, float))),
            partial_rotary_factor=1.0, use_qk_norm=True, vocab_size=d.get("vocab_size", 120832),
            hidden_size=d.get("hidden_size", 4096), intermediate_size=d.get("intermediate_size", 13312),
            num_attention_heads=d.get("num_attention_heads", 64), num_key_value_heads=d.get("num_key_value_heads", 8),
            head_dim=_get(d, "head_dim", 128, int), moe_intermediate_size=d.get("moe_intermediate_size", 1536),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5)), layout)
        return cls(**{f.name: getattr(glm, f.name) for f in dataclasses.fields(Glm4MoeConfig)},
                   moe_fp32_combine=bool(_get(d, "enable_moe_fp32_combine", True, bool)))


class HYV3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: HYV3Config, plan, layer_id: int, dtype: torch.dtype):
        tp = TensorParallel.of(plan)   # heads and dense features split over the TP ranks (the experts: RoutedExperts)
        attn = GQAttention(AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                         cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, qkv_bias=cfg.attention_bias,
                                         o_bias=cfg.attention_bias, qk_norm="head"), tp=tp, dtype=dtype)
        super().__init__(layer_id, attn, moe_or_dense_mlp(cfg, plan, layer_id, dtype, tp), cfg.hidden_size,
                         cfg.rms_norm_eps, dtype)


class HYV3ForCausalLM(Glm4MoeForCausalLM):
    ARCHITECTURE = ARCHITECTURE
    CONFIG = HYV3Config
    DECODER_LAYER = HYV3DecoderLayer
    CHECKPOINT_NAMES = HY_V3_NAMES
