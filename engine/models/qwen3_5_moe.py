"""Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`; the Hub's `Qwen3_5MoeForConditionalGeneration` run text-only):
Qwen3-Next's hybrid (models/qwen3_next.py) with three differences, as transformers' modeling_qwen3_5_moe.py:
- the linear layers' input projections are separate (`in_proj_qkv` in the conv's channel order,
  `in_proj_z`, `in_proj_b`, `in_proj_a`: layers/gated_delta_net.py, projections="separate");
- every layer is MoE and the router always renormalises its top-k weights (its model reads no
  decoder_sparse_step, mlp_only_layers nor norm_topk_prob: the first two are ignored, as transformers and
  SGLang do, and a config that says norm_topk_prob false is refused);
- the wrapper's multimodal rotary embedding (MRoPE, `rope_parameters.mrope_section`), which with
  text alone is the plain one (a text token's three position ids are equal: models/qwen3_vl_moe.py).
The wrapper keeps the text model under `model.language_model.`, the vision tower under `model.visual.`
(skipped) and the Multi-Token-Prediction module under `mtp.` (skipped).
"""

from __future__ import annotations

import dataclasses

from loadplan.layouts import qwen3_5_moe_layout
from ..shown_tensors import renamed
from ..stacked_experts import StackedExperts
from .config import ConfigError
from .qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from .qwen3_vl_moe import PREFIXES
from .text_wrapper import TextOnlyWrapper

# Fields transformers' Qwen3.5-MoE does not read, and the only values its model has.
FIXED_FIELDS = {"norm_topk_prob": True, "attn_output_gate": True}


def read_config(d: dict) -> Qwen3NextConfig:
    for name, value in FIXED_FIELDS.items():
        if d.get(name) is not None and d[name] != value:
            raise ConfigError(f"config.{name}: {d[name]!r} not supported; Qwen3.5-MoE runs {value!r}")
    # No dense layer: intermediate_size (the dense MLP's width) is not needed.
    # Every layer is MoE (the registry's Qwen3.5 reader), as in transformers' Qwen3.5-MoE.
    cfg = Qwen3NextConfig.from_hf(dict(d, **FIXED_FIELDS, intermediate_size=d.get("intermediate_size") or 0),
                                  reader=qwen3_5_moe_layout)
    return dataclasses.replace(cfg, linear_projections="separate")


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> Qwen3NextConfig:
        return read_config(hf_config)


class Qwen3_5MoeForConditionalGeneration(TextOnlyWrapper):
    INNER = Qwen3_5MoeForCausalLM
    TENSOR_PARALLEL = True
    OTHER_TOWERS = ("model.visual.", "mtp.")

    def checkpoint_view(self, ckpt):
        """Renamed into the wrapper's names; experts stacked or one by one (engine/stacked_experts.py); the
        inner model's own view (its linear layers' channels regrouped under TP)."""
        cfg = self.config
        return self.language_model.checkpoint_view(
            StackedExperts(renamed(ckpt, PREFIXES), cfg.num_experts, gate_up="concatenated",
                           hidden_size=cfg.hidden_size, expert_width=cfg.moe_intermediate_size))
