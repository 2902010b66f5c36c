"""dots.llm1 (`Dots1ForCausalLM`, rednote-hilab), following transformers' modeling_dots1 numerically: Qwen3's
attention over DeepSeek-V3's MoE block, GLM-4-MoE's shape (models/glm4_moe.py) with Qwen3's attention.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads.

- Attention: grouped-query (layers/attention.py) with per-head RMSNorm on q and k, full rotary, a bias on
  q/k/v and o only with `attention_bias`; layer i slides over `sliding_window` positions iff
  i >= max_window_layers (transformers' layer_types, which ignore `use_sliding_window`: a config whose
  use_sliding_window false disagrees with the layers that rule makes sliding is refused, by field).
- Layer i is MoE iff i >= first_k_dense_replace, as the registry's DeepSeek layout reads it (its family's; it
  refuses a moe_layer_freq or mlp_layer_types that would say otherwise).
- MoE: DeepSeek-V3's block (deepseek_v3.DeepseekV3MoE): the sigmoid router with e_score_correction_bias and
  group-limited top-k, top-k weights renormalised only with `norm_topk_prob` (false by default here), and
  n_shared_experts shared experts, one MLP of n_shared x the width (dots.llm1 ships 2: so the registry's
  DeepSeek gate never fuses them, and it is not the fused architecture anyway: DESIGN 5.2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from loadplan.layouts import deepseek_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..parallel.tensor import TensorParallel
from .causal_lm import DecoderLayer
from .config import ConfigError, get_field as _get, moe_layout
from .deepseek_v3 import moe_or_dense_mlp
from .glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Dots1Config(Glm4MoeConfig):
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, d: dict) -> "Dots1Config":
        layout = moe_layout(deepseek_layout, d)          # the registry's reader of the layer and expert fields
        partial = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise ConfigError(f"config.partial_rotary_factor: {partial!r} not supported; Qwen3's attention rotates "
                              f"whole heads (1.0)")
        # Glm4MoeConfig reads the fields both share, with dots.llm1's defaults where they differ.
        glm = Glm4MoeConfig.from_layout(dict(d, partial_rotary_factor=d.get("partial_rotary_factor", 1.0),
                                             norm_topk_prob=d.get("norm_topk_prob", False),
                                             max_position_embeddings=d.get("max_position_embeddings", 2048),
                                             rms_norm_eps=d.get("rms_norm_eps", 1e-6), use_qk_norm=True), layout)
        n = glm.num_hidden_layers
        # transformers' default window is 4096; null: no layer slides.
        window = None if d.get("sliding_window", 4096) is None else _get(d, "sliding_window", 4096, int)
        if window is not None and window < 1:
            raise ConfigError(f"config.sliding_window: must be >= 1, got {window}")
        if d.get("layer_types") is not None:
            types = d["layer_types"]
            if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
                raise ConfigError(f"config.layer_types: expected {n} entries of {', '.join(LAYER_TYPES)}, got "
                                  f"{types!r}"[:300])
        else:
            first_sliding = _get(d, "max_window_layers", n, int)
            types = ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                     for i in range(n)]
            if "sliding_attention" in types and d.get("use_sliding_window") is False:
                raise ConfigError(f"config.use_sliding_window: false, but sliding_window={window} and "
                                  f"max_window_layers={first_sliding} make layers {first_sliding}..{n - 1} slide "
                                  f"(transformers' rule, which ignores use_sliding_window): say which by setting "
                                  f"sliding_window null or max_window_layers {n}")
        if "sliding_attention" in types and window is None:
            raise ConfigError("config.sliding_window: null, but layer_types has sliding_attention layers")
        return cls(**{f.name: getattr(glm, f.name) for f in dataclasses.fields(Glm4MoeConfig)},
                   sliding_window=window, layer_types=tuple(types))


class Dots1DecoderLayer(DecoderLayer):
    def __init__(self, cfg: Dots1Config, plan, layer_id: int, dtype: torch.dtype):
        tp = TensorParallel.of(plan)   # heads and dense features split over the TP ranks (the experts: RoutedExperts)
        window = cfg.sliding_window if cfg.layer_types[layer_id] == "sliding_attention" else None
        attn = GQAttention(AttentionSpec(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                         cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, qkv_bias=cfg.attention_bias,
                                         o_bias=cfg.attention_bias, qk_norm="head", rotary_dim=cfg.rotary_dim,
                                         sliding_window=window), tp=tp, dtype=dtype)
        super().__init__(layer_id, attn, moe_or_dense_mlp(cfg, plan, layer_id, dtype, tp), cfg.hidden_size,
                         cfg.rms_norm_eps, dtype)


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    ARCHITECTURE = "Dots1ForCausalLM"
    CONFIG = Dots1Config
    DECODER_LAYER = Dots1DecoderLayer
