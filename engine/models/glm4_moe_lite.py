"""GLM-4-MoE-Lite (GLM-4.7-Flash), following transformers' modeling_glm4_moe_lite numerically.

Shapes: as deepseek_v3.py.

transformers builds it from DeepSeek-V3's attention (MLA: low-rank q and kv, the rope part of
each head rotated in interleaved pairs) and GLM-4-MoE's MoE block, which is DeepSeek-V3's
(the sigmoid router with e_score_correction_bias, one shared expert, routed_scaling_factor):
so the engine builds it as `DeepseekV3ForCausalLM`, from the same config read with this
family's own defaults (transformers' Glm4MoeLiteConfig: 1.8 scaling, one shared expert,
rms_norm_eps 1e-5) and its own layer list: `mlp_layer_types` says which layers are
"sparse" (MoE) and which "dense" (by default the first dense, the others sparse), where
DeepSeek counts first_k_dense_replace (read, with the expert counts, by the registry's
glm4_moe_lite_layout; first_k_dense_replace and moe_layer_freq are not read, as transformers
reads neither). Its fusion gate is GLM-4-MoE's (the registry).
"""

from __future__ import annotations


from loadplan.layouts import glm4_moe_lite_layout
from .config import moe_layout
from .deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

ARCHITECTURE = "Glm4MoeLiteForCausalLM"
# transformers' Glm4MoeLiteConfig where DeepSeek-V3's reader would assume otherwise (its layer and expert fields:
# the registry's reader, below).
DEFAULTS = {"routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 202752}


def glm4_moe_lite_config(d: dict) -> DeepseekV3Config:
    layout = moe_layout(glm4_moe_lite_layout, d)     # the registry's reader of the layer and expert fields
    given = {k: v for k, v in d.items() if v is not None}
    # DeepSeek-V3's reading of the rest, its layers and experts the layout's.
    return DeepseekV3Config.from_layout({**DEFAULTS, **given}, layout, "DeepseekV3ForCausalLM")


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    ARCHITECTURE = ARCHITECTURE

    @classmethod
    def parse_config(cls, hf_config: dict) -> DeepseekV3Config:
        return glm4_moe_lite_config(hf_config)
