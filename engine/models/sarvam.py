"""Sarvam's MoE models as their Hub checkpoints declare them, each run by the family transformers runs it with.

- `SarvamMLAForCausalLM` (sarvam-105b): DeepSeek-V3's model (models/deepseek_v3.py) whose config.json, written for
  Sarvam's own code, says some fields otherwise: num_experts / num_shared_experts / num_mtp_layers for DeepSeek's
  n_routed_experts / n_shared_experts / num_nextn_predict_layers, `head_dim` as its MLA cache width (kv_lora_rank +
  qk_rope_head_dim: not read), rope_scaling's "deepseek_yarn" for YaRN; and its defaults differ (one expert group,
  the first layer dense, no q LoRA, 128 experts). Read as transformers' SarvamMLAConfig reads them.
- `SarvamMoEForCausalLM` (sarvam-30b): GLM-4-MoE's model (models/glm4_moe.py) whose checkpoints are spelled as
  Bailing's: `model.word_embeddings`, each layer's `attention.query_key_value` (q, k and v rows fused: shown as the
  three projections, their biases too), `attention.dense`, `attention.query_layernorm` / `key_layernorm`, and
  `mlp.gate.expert_bias`; its config.json's names as above, plus use_qkv_bias for attention_bias; whole heads rotated
  (rope theta 8e6) unless it says otherwise. Read as transformers' SarvamMoEConfig and its checkpoint conversion read
  them.
"""

from __future__ import annotations

from loadplan.layouts import sarvam_mla_layout, sarvam_moe_layout
from ..shown_tensors import ShownTensors
from ..weights import CheckpointNames
from .config import ConfigError, moe_layout
from .deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from .glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM

# Sarvam's config.json names -> the ones the families read (transformers' attribute_map for both configs), for the
# fields the layout does not give; its layer and expert fields, under either name, are the registry's readers'.
ALIASES = {"num_mtp_layers": "num_nextn_predict_layers", "use_qkv_bias": "attention_bias"}


def with_family_names(d: dict, defaults: dict) -> dict:
    """config.json under the names the family reads, `defaults` where it gives neither name. A field given under
    both names, differently, is refused (which one counts cannot be told)."""
    out = dict(defaults)
    out.update({k: v for k, v in d.items() if k not in ALIASES})
    for alias, name in ALIASES.items():
        if d.get(alias) is None:
            continue
        if d.get(name) is not None and d[name] != d[alias]:
            raise ConfigError(f"config.{alias}: {d[alias]!r} disagrees with {name}={d[name]!r} (the same field)")
        out[name] = d[alias]
    return out


# transformers' SarvamMLAConfig defaults where they differ from DeepSeek-V3's, or where DeepSeek-V3's are required (its
# layer and expert fields: sarvam_mla_layout's)
SARVAM_MLA_DEFAULTS = {"vocab_size": 262144, "hidden_size": 4096, "intermediate_size": 16384,
                       "moe_intermediate_size": 2048, "num_attention_heads": 64, "n_group": 1, "topk_group": 1,
                       "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "v_head_dim": 128,
                       "qk_nope_head_dim": 128}


class SarvamMLAForCausalLM(DeepseekV3ForCausalLM):
    ARCHITECTURE = "SarvamMLAForCausalLM"

    @classmethod
    def parse_config(cls, hf_config: dict) -> DeepseekV3Config:
        # head_dim (the MLA cache width vLLM reads) and q_head_dim (derived): not read, as DeepSeek-V3's reading
        # reads neither
        layout = moe_layout(sarvam_mla_layout, hf_config)   # the registry's reader of the layer and expert fields
        d = with_family_names(hf_config, SARVAM_MLA_DEFAULTS)
        scaling = d.get("rope_scaling") or {}
        if "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type")):
            d.pop("rope_scaling")
            d["rope_parameters"] = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": "yarn"}
        # DeepSeek-V3's reading of the rest (its refusals name the fields as they are spelled here); the layers and
        # experts are the layout's (moe_layer_freq included)
        return DeepseekV3Config.from_layout(d, layout, "DeepseekV3ForCausalLM")


SARVAM_MOE_DEFAULTS = {"vocab_size": 262144, "intermediate_size": 8192, "num_attention_heads": 64,
                       "num_key_value_heads": 4, "head_dim": 64, "rms_norm_eps": 1e-6, "moe_intermediate_size": 1024,
                       "routed_scaling_factor": 2.5, "use_qk_norm": True, "partial_rotary_factor": 1.0,
                       "hidden_size": 4096}
SARVAM_MOE_THETA = 8_000_000.0

# (checkpoint, engine) suffixes under model.layers.{i}.
SARVAM_MOE_NAMES = CheckpointNames((
    ("attention.dense.weight", "self_attn.o_proj.weight"),
    ("attention.query_layernorm.weight", "self_attn.q_norm.weight"),
    ("attention.key_layernorm.weight", "self_attn.k_norm.weight"),
    ("mlp.gate.expert_bias", "mlp.gate.e_score_correction_bias"),
))


class SarvamMoEForCausalLM(Glm4MoeForCausalLM):
    ARCHITECTURE = "SarvamMoEForCausalLM"
    CHECKPOINT_NAMES = SARVAM_MOE_NAMES

    @classmethod
    def parse_config(cls, hf_config: dict) -> Glm4MoeConfig:
        layout = moe_layout(sarvam_moe_layout, hf_config)   # the registry's reader of the layer and expert fields
        d = with_family_names(hf_config, SARVAM_MOE_DEFAULTS)
        if d.get("rope_theta") is None and not (d.get("rope_parameters") or {}).get("rope_theta"):
            d["rope_theta"] = SARVAM_MOE_THETA
        return Glm4MoeConfig.from_layout(d, layout)

    def checkpoint_view(self, ckpt):
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return fused_qkv_shown_apart(ckpt, (q, kv, kv))


def fused_qkv_shown_apart(ckpt, rows: tuple[int, int, int]) -> ShownTensors:
    """Bailing's spelling as the engine's: `model.word_embeddings` as `model.embed_tokens`, and each layer's fused
    `attention.query_key_value.{weight,bias}` (q, k, v rows: `rows`) as `self_attn.{q,k,v}_proj.*`. A fused tensor
    whose rows are not their sum is shown whole, for the loader to refuse by name."""
    view = ShownTensors(ckpt)
    starts = (0, rows[0], rows[0] + rows[1])
    for name in ckpt.names():
        head, sep, tail = name.rpartition(".attention.query_key_value.")
        shape = tuple(ckpt.shape(name))
        if not sep or not shape or shape[0] != sum(rows):
            view.show("model.embed_tokens.weight" if name == "model.word_embeddings.weight" else name, name)
            continue
        for proj, start, n in zip("qkv", starts, rows):
            view.show(f"{head}.self_attn.{proj}_proj.{tail}", name, (n, *shape[1:]),
                      lambda t, start=start, n=n: t[start:start + n])
    return view

