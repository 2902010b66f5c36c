"""DeepSeek-V3's Multi-Token-Prediction layer as a speculative draft: `DeepseekV3ForCausalLMNextN`.

The module, its checkpoint layout and the speculative contract are engine/models/nextn.py's;
here DeepSeek-V3's parts: its config (the target's, read as DeepSeek-V3), its decoder layer
(Multi-head Latent Attention and the DeepSeek-V3 MoE block) and its rotary width
(qk_rope_head_dim). DeepSeek-V3/R1 ship one MTP layer, `model.layers.61`.
"""

from __future__ import annotations

import torch

from .deepseek_v3 import DeepseekV3Config, DeepseekV3DecoderLayer
from .nextn import NextNDraft, mtp_config


class DeepseekV3ForCausalLMNextN(NextNDraft):
    ARCHITECTURE = "DeepseekV3ForCausalLMNextN"

    @classmethod
    def parse_config(cls, hf_config: dict) -> DeepseekV3Config:
        return mtp_config(DeepseekV3Config.from_hf(hf_config, cls.ARCHITECTURE))

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        cfg = self.parse_config(hf_config)
        super().__init__(cfg, plan, DeepseekV3DecoderLayer, cfg.qk_rope_head_dim, dtype)
