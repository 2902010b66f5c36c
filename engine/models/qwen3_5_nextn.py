"""Qwen3.5-MoE's Multi-Token-Prediction module as a speculative draft: `Qwen3_5ForCausalLMMTP`.

SGLang gives every Qwen3.5 draft this entry class, whatever its target's (the Hub's
`Qwen3_5MoeForConditionalGeneration` or the text model `Qwen3_5MoeForCausalLM`), and hands it the
target's config.json: the wrapper's keeps the text model's config under `text_config`, which is read
then (a refusal names its field there). The module is Qwen3-Next's (models/qwen3_next_nextn.py: the
same `mtp.*` names, engine/models/nextn.py's contract) with Qwen3.5-MoE's config (models/qwen3_5_moe.py)
and so its decoder layer: gated attention, every MoE router renormalising its top-k weights.

The checkpoint is the target's. The wrapper's spells the text model under `model.language_model.`
(the draft reads the target's embedding there, and `lm_head`), keeps a vision tower under
`model.visual.` (skipped), and may stack the MTP layer's experts ([E, 2I, D] gate_up, [E, D, I] down:
engine/stacked_experts.py). Qwen3.5 ships one MTP layer (`mtp_num_hidden_layers`, or SGLang's
`num_nextn_predict_layers`), reading the target's embedding; other counts, and a dedicated
embedding, are refused by field.
"""

from __future__ import annotations

import dataclasses

import torch

from ..shown_tensors import renamed
from ..stacked_experts import StackedExperts
from ..weights import WeightLayout
from .config import ConfigError, get_field as _get
from .nextn import NextNDraft
from .qwen3_5_moe import read_config
from .qwen3_next import Qwen3NextConfig, Qwen3NextDecoderLayer
from .qwen3_next_nextn import mtp_names, one_mtp_layer
from .text_wrapper import read_text_config

ARCHITECTURE = "Qwen3_5ForCausalLMMTP"
# The wrapper's names of the text model's tensors -> the text model's own.
TEXT_PREFIX = (("model.language_model.", "model."),)
VISION_TOWER = "model.visual."


def _read_text(d: dict) -> Qwen3NextConfig:
    mtp_layer = one_mtp_layer(d)
    if d.get("mtp_use_dedicated_embeddings"):
        raise ConfigError("config.mtp_use_dedicated_embeddings: true not supported; the engine's Qwen3.5 MTP layer "
                          "reads the target's embedding")
    cfg = read_config(d)
    return dataclasses.replace(cfg, layer_types=(*cfg.layer_types, "full_attention"), moe_layers=mtp_layer)


class Qwen3_5ForCausalLMMTP(NextNDraft):
    ARCHITECTURE = ARCHITECTURE

    @classmethod
    def parse_config(cls, hf_config: dict) -> Qwen3NextConfig:
        text = hf_config.get("text_config")
        if text is None:
            return _read_text(hf_config)
        if not isinstance(text, dict):
            raise ConfigError(f"config.text_config: must be a JSON object, got {type(text).__name__}")
        # SGLang sets the count on the outer config, where the registry's layout (of text_config) does not look
        n = _get(hf_config, "num_nextn_predict_layers", 1, int)
        if n != 1:
            raise ConfigError(f"config.num_nextn_predict_layers: {n} not supported by the engine; supported: 1 (the "
                              f"one MTP layer Qwen3.5 ships)")
        return read_text_config(_read_text, text)

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        cfg = self.parse_config(hf_config)
        super().__init__(cfg, plan, Qwen3NextDecoderLayer, cfg.head_dim, dtype, n_routed=cfg.num_experts)

    def checkpoint_view(self, ckpt):
        cfg = self.config
        shown = renamed(ckpt, (*TEXT_PREFIX, *mtp_names(cfg.num_hidden_layers)))
        return StackedExperts(shown, cfg.num_experts, gate_up="concatenated", hidden_size=cfg.hidden_size,
                              expert_width=cfg.moe_intermediate_size)

    def weight_layout(self) -> WeightLayout:
        layout = super().weight_layout()
        return dataclasses.replace(layout, ignore_prefixes=(VISION_TOWER, *layout.ignore_prefixes))
