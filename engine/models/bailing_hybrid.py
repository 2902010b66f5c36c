"""The Ling 3 hybrids (`BailingHybridForCausalLM`: inclusionAI's Ling-3.0-Flash), following transformers'
modeling_bailing_hybrid.py numerically: Kimi-Linear's shape (models/kimi_linear.py) with the Ling variants.

Shapes: B batch, T tokens, D hidden, E routed experts.

- Token mixers: Kimi Delta Attention (layers/kimi_delta_attention.py, style "ling": full-rank forget and output
  gate projections, float32 convolutions, and with kda_safe_gate the bounded decay kda_lower_bound *
  sigmoid(exp(A_log) f)) on most layers, and every layer_group_size-th (or as layer_types says) DeepSeek's MLA with
  interleaved rope (rope theta 6e6 by default) and a sigmoid output gate per head (g_proj). The KDA layers have
  num_attention_heads heads of head_dim.
- MLP: DeepSeek-V3's (deepseek_v3.py), dense on the first first_k_dense_replace layers (or where mlp_layer_types
  says "dense"), else the grouped sigmoid router over num_experts routed experts and num_shared_experts shared ones
  beside them, never fused (our choice: the registry's bailing_hybrid gate).
- Its config names DeepSeek-V3's fields as Kimi-Linear's does (num_experts, num_experts_per_token, ...). Its
  checkpoints spell the embedding `word_embeddings`, the mixers `attention` (their output `dense`) and the routing
  bias `expert_bias` (`BAILING_HYBRID_NAMES`); the Multi-Token-Prediction layers stored after the last decoder layer
  (num_mtp_layers of them, 1 by default) are skipped, as transformers skips them. It never ties its head.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from loadplan.layouts import bailing_hybrid_layout
from ..layers.kimi_delta_attention import KimiDeltaAttention
from ..layers.mla import MLASpec, MultiHeadLatentAttention
from ..parallel.tensor import TensorParallel
from ..weights import CheckpointNames
from .config import ConfigError, get_field as _get, moe_layout, per_layer
from .deepseek_v3 import DeepseekMoeLayer, DeepseekV3Config, LatentCausalLM
from .kimi_linear import LAYER_TYPES, RENAMED, deepseek_fields_renamed

ARCHITECTURE = "BailingHybridForCausalLM"

_MIXER_TENSORS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
                  "v_conv1d.weight", "f_proj.weight", "g_proj.weight", "b_proj.weight", "dt_bias", "A_log",
                  "o_norm.weight", "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight",
                  "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight")
# (checkpoint, engine) suffixes.
BAILING_HYBRID_NAMES = CheckpointNames((
    ("model.word_embeddings.weight", "model.embed_tokens.weight"),
    ("attention.dense.weight", "self_attn.o_proj.weight"),
    ("mlp.gate.expert_bias", "mlp.gate.e_score_correction_bias"),
    *((f"attention.{t}", f"self_attn.{t}") for t in _MIXER_TENSORS),
))

# transformers' BailingHybridConfig defaults of the fields DeepSeek-V3's config reads without one (or another one).
DEFAULTS = dict(routed_scaling_factor=2.5, rms_norm_eps=1e-6, kv_lora_rank=512, qk_rope_head_dim=64,
                qk_nope_head_dim=128, v_head_dim=128, topk_group=4, hidden_size=2560, intermediate_size=6144,
                moe_intermediate_size=768, num_attention_heads=32, vocab_size=157184)
# Its own defaults for the renamed fields: experts in 8 groups; and num_mtp_layers MTP layers (skipped at load).
LING_RENAMED = tuple((ours, deepseek, {"num_expert_group": 8, "model_max_length": 262144}.get(ours, default))
                     for ours, deepseek, default in RENAMED) + (
    ("num_mtp_layers", "num_nextn_predict_layers", 1),)
DEFAULT_ROPE_THETA = 6_000_000.0
# Fields transformers' Ling hybrids do not read (it always interleaves, derives the MoE layers from
# mlp_layer_types / first_k_dense_replace), and the value that changes nothing.
NOT_RUN = (("rope_interleave", True), ("moe_layer_freq", 1))


@dataclass(frozen=True)
class BailingHybridConfig(DeepseekV3Config):
    layer_types: tuple[str, ...] = ()
    head_dim: int = 128                      # the KDA layers' heads (num_attention_heads of them)
    short_conv_kernel_size: int = 4
    kda_lower_bound: float | None = -5.0     # None: the softplus decay (kda_safe_gate false)

    @classmethod
    def from_hf(cls, d: dict, architecture: str = ARCHITECTURE) -> "BailingHybridConfig":
        for field, harmless in NOT_RUN:
            if d.get(field) not in (None, harmless):
                raise ConfigError(f"config.{field}: {d[field]!r} not supported; the Ling hybrids run {harmless!r}")
        named = dict(d)
        if d.get("rope_parameters") is None and d.get("rope_scaling") is None:
            named["rope_theta"] = d.get("rope_theta", DEFAULT_ROPE_THETA)
        layout = moe_layout(bailing_hybrid_layout, d)    # the registry's reader of the layer and expert fields
        ds = deepseek_fields_renamed(named, layout, LING_RENAMED, DEFAULTS)
        n = ds.num_hidden_layers
        group = _get(d, "layer_group_size", 6, int)
        if group < 1:
            raise ConfigError(f"config.layer_group_size: must be >= 1, got {group}")
        layer_types = per_layer(d, "layer_types", n, LAYER_TYPES,
                                [LAYER_TYPES[(i + 1) % group == 0] for i in range(n)])
        kernel = _get(d, "short_conv_kernel_size", 4, int)
        head_dim = _get(d, "head_dim", 128, int)
        if kernel < 1 or head_dim < 1:
            bad = "short_conv_kernel_size" if kernel < 1 else "head_dim"
            raise ConfigError(f"config.{bad}: must be >= 1, got {d[bad]}")
        bound = float(_get(d, "kda_lower_bound", -5.0, (int, float)))
        return cls(**{f.name: getattr(ds, f.name) for f in dataclasses.fields(DeepseekV3Config)
                      if f.name != "tie_word_embeddings"},
                   # transformers' Ling hybrids tie no head whatever the config says (their checkpoints keep lm_head)
                   tie_word_embeddings=False,
                   layer_types=tuple(layer_types), head_dim=head_dim, short_conv_kernel_size=kernel,
                   kda_lower_bound=bound if _get(d, "kda_safe_gate", True, bool) else None)


class BailingHybridDecoderLayer(DeepseekMoeLayer):
    @classmethod
    def make_attention(cls, cfg: BailingHybridConfig, layer_id: int, dtype: torch.dtype, tp: TensorParallel):
        if cfg.layer_types[layer_id] == "linear_attention":
            return KimiDeltaAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim,
                                      cfg.short_conv_kernel_size, cfg.rms_norm_eps, dtype, tp, style="ling",
                                      lower_bound=cfg.kda_lower_bound, heads_field="num_attention_heads")
        return MultiHeadLatentAttention(MLASpec.of(cfg, output_gate=True), tp=tp, dtype=dtype)


class BailingHybridForCausalLM(LatentCausalLM):
    ARCHITECTURE = ARCHITECTURE
    CHECKPOINT_NAMES = BAILING_HYBRID_NAMES
    CONFIG = BailingHybridConfig
    DECODER_LAYER = BailingHybridDecoderLayer
