"""GLM-4-MoE's Multi-Token-Prediction layer as a speculative draft: `Glm4MoeForCausalLMNextN`.

The module, its checkpoint layout and the speculative contract are engine/models/nextn.py's;
GLM-4.5 ships DeepSeek-V3's MTP layout (`model.layers.{num_hidden_layers}`: enorm, hnorm,
eh_proj, shared_head, embed_tokens) around its own decoder layer, which is what this takes
from GLM: the target's config read as GLM-4-MoE, its decoder layer (grouped-query attention
with q/k/v bias, qk norm and partial rotary; DeepSeek-V3's MoE block) and its rotary width
(head_dim; the rotated part is partial_rotary_factor of it). The entry-class name is
SGLang's (models/glm4_moe_nextn.py).
"""

from __future__ import annotations

import torch

from .glm4_moe import Glm4MoeConfig, Glm4MoeDecoderLayer
from .nextn import NextNDraft, mtp_config


class Glm4MoeForCausalLMNextN(NextNDraft):
    ARCHITECTURE = "Glm4MoeForCausalLMNextN"

    @classmethod
    def parse_config(cls, hf_config: dict) -> Glm4MoeConfig:
        return mtp_config(Glm4MoeConfig.from_hf(hf_config, nextn=True))

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        cfg = self.parse_config(hf_config)
        super().__init__(cfg, plan, Glm4MoeDecoderLayer, cfg.head_dim, dtype)
