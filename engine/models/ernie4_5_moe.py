"""ERNIE-4.5 MoE (`Ernie4_5_MoeForCausalLM`: ERNIE-4.5-21B-A3B, -300B-A47B, their Thinking and Base releases),
following transformers' modeling_ernie4_5_moe numerically: Llama's attention over DeepSeek-V3's MoE block with a
softmax router, GLM-4-MoE's shape (models/glm4_moe.py) with ERNIE's config names.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads.

- Attention: grouped-query (layers/attention.py), no biases, no q/k norm, the rotary embedding over whole heads
  turning (even, odd) feature pairs (transformers' ERNIE rotate_half), rope theta 5e5 unless the config says.
- Layer i is MoE iff (i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <= moe_layer_end_index
  (-1: the last layer); the others are dense SwiGLU MLPs of intermediate_size.
- MoE: DeepSeek-V3's block (deepseek_v3.DeepseekV3MoE) with the router's softmax scores: the top-k chosen on the
  scores plus a per-expert correction bias (`moe_statics.e_score_correction_bias`, load balancing only), weighted
  by the scores themselves, renormalised with the sum clamped at moe_norm_min; moe_num_shared_experts shared
  experts, one MLP of n_shared x moe_intermediate_size, added ungated:
    out = routed(x) + shared_experts(x)
  The registry never fuses them (service/rules/gates.py, `ernie4_5_moe_gate`: our choice, no fused layout).
- The checkpoint's Multi-Token-Prediction tensors (`model.mtp_*`) are not part of the causal LM: skipped at
  load, as transformers does.
What transformers' ERNIE does not run the same way is refused by field: `use_bias: true` (biases on every
projection and the head), an end index of null, a gate activation other than softmax.
"""

from __future__ import annotations


from loadplan.layouts import ernie4_5_moe_layout
from ..layers.attention import AttentionSpec
from ..shown_tensors import ShownTensors
from ..weights import ShapeMismatch
from .config import ConfigError, Family, get_field as _get
from .glm4_moe import GLM_FIELDS, Glm4MoeConfig, Glm4MoeDecoderLayer, Glm4MoeForCausalLM

ARCHITECTURE = "Ernie4_5_MoeForCausalLM"
# The routing bias as the Hub stores it ([1, E]: one group of experts) and where the router keeps it ([E]).
STATICS, ROUTER_BIAS = "mlp.moe_statics.e_score_correction_bias", "mlp.gate.e_score_correction_bias"


def _as_published(d: dict, fields: dict) -> None:
    """No biases, a softmax gate, whole heads rotated, a renormalisation clamp > 0."""
    if _get(d, "use_bias", False, bool):
        raise ConfigError("config.use_bias: true not supported; the engine's ERNIE-4.5 has no biases (the "
                          "published checkpoints have none)")
    gate_act = d.get("moe_gate_act")
    if gate_act not in (None, "softmax"):
        raise ConfigError(f"config.moe_gate_act: {gate_act!r} not supported; supported: softmax")
    if not fields.renorm_min > 0:
        raise ConfigError(f"config.moe_norm_min: must be > 0, got {fields.renorm_min}")
    if fields.rope.partial_rotary_factor != 1.0:
        raise ConfigError(f"config.partial_rotary_factor: {fields.rope.partial_rotary_factor} not supported; "
                          f"ERNIE-4.5 rotates whole heads (1.0)")


# GLM-4-MoE's fields as ERNIE-4.5's config spells and defaults them (rope theta 500000, a tied head); its router a
# softmax of one group, the top-k renormalised with the moe_norm_min clamp; its MTP tensors are model.mtp_*
# (MTP_PREFIXES), not layers.
ERNIE4_5_MOE = Family(ARCHITECTURE, ernie4_5_moe_layout, dict(
    GLM_FIELDS, tie_word_embeddings=True, renorm_min=1e-12), names=dict(renorm_min="moe_norm_min"),
    rope={"default_theta": 500000.0},
    fixed=dict(rotary_dim=lambda f: f.head_dim, attention_bias=False, use_qk_norm=False, n_group=1, topk_group=1,
               norm_topk_prob=True, routed_scaling_factor=1.0, num_nextn_predict_layers=0, scoring_func="softmax"),
    own=(_as_published,))


class Ernie45MoeDecoderLayer(Glm4MoeDecoderLayer):
    @classmethod
    def attention_spec(cls, cfg: Glm4MoeConfig, layer_id: int) -> AttentionSpec:
        return AttentionSpec.of(cfg, rope_interleave=True)


def router_bias_of_one_group(ckpt) -> ShownTensors:
    """The checkpoint with each layer's `mlp.moe_statics.e_score_correction_bias` [1, E] shown as the router's
    `mlp.gate.e_score_correction_bias` [E]. A bias of several groups (ERNIE-4.5-VL keeps one for its text experts and
    one for its vision experts) is refused, naming the tensor."""
    view = ShownTensors(ckpt)
    for name in ckpt.names():
        if not name.endswith(STATICS):
            view.show(name, name)
            continue
        shape = tuple(ckpt.shape(name))
        if len(shape) != 2 or shape[0] != 1:
            raise ShapeMismatch(f"{name}: shape {list(shape)}; one group of experts ([1, E]) expected")
        view.show(name[:-len(STATICS)] + ROUTER_BIAS, name, shape[1:], lambda t, n=shape[1]: t.reshape(n))
    return view


class Ernie4_5_MoeForCausalLM(Glm4MoeForCausalLM):
    ARCHITECTURE = ARCHITECTURE
    MTP_PREFIXES = ("model.mtp_",)
    FAMILY = ERNIE4_5_MOE
    CONFIG = Glm4MoeConfig
    DECODER_LAYER = Ernie45MoeDecoderLayer


    def checkpoint_view(self, ckpt):
        return router_bias_of_one_group(ckpt)
