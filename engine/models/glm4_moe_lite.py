"""GLM-4-MoE-Lite (GLM-4.7-Flash), following transformers' modeling_glm4_moe_lite numerically.

Shapes: as deepseek_v3.py.

transformers builds it from DeepSeek-V3's attention (MLA: low-rank q and kv, the rope part of
each head rotated in interleaved pairs) and GLM-4-MoE's MoE block, which is DeepSeek-V3's
(the sigmoid router with e_score_correction_bias, one shared expert, routed_scaling_factor):
so the engine builds it as `DeepseekV3ForCausalLM`, from the same config read with this
family's own defaults (transformers' Glm4MoeLiteConfig: 1.8 scaling, one shared expert,
rms_norm_eps 1e-5) and its own layer list: `mlp_layer_types` says which layers are
"sparse" (MoE) and which "dense" (by default the first dense, the others sparse), where
DeepSeek counts first_k_dense_replace. Its fusion gate is GLM-4-MoE's (the registry).
"""

from __future__ import annotations

import dataclasses

from .config import ConfigError, get_field as _get, per_layer
from .deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

ARCHITECTURE = "Glm4MoeLiteForCausalLM"
MLP_LAYER_TYPES = ("dense", "sparse")
# transformers' Glm4MoeLiteConfig where DeepSeek-V3's reader would assume otherwise.
DEFAULTS = {"n_shared_experts": 1, "routed_scaling_factor": 1.8, "num_experts_per_tok": 4, "n_group": 1,
            "topk_group": 1, "norm_topk_prob": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752}


def glm4_moe_lite_config(d: dict) -> DeepseekV3Config:
    n_layers = _get(d, "num_hidden_layers", kind=int)
    types = per_layer(d, "mlp_layer_types", n_layers, MLP_LAYER_TYPES, ["dense"] + ["sparse"] * (n_layers - 1))
    # transformers reads neither; a config that carries them (as GLM-4.5's do) must agree with the layer list.
    first_dense = d.get("first_k_dense_replace")
    if first_dense is not None and types != ["dense"] * first_dense + ["sparse"] * (n_layers - first_dense):
        raise ConfigError(f"config.first_k_dense_replace: {first_dense!r} disagrees with mlp_layer_types {types!r}, "
                          f"which {ARCHITECTURE} follows"[:300])
    if d.get("moe_layer_freq") not in (None, 1):
        raise ConfigError(f"config.moe_layer_freq: {d['moe_layer_freq']!r} disagrees with mlp_layer_types, which "
                          f"{ARCHITECTURE} follows")
    given = {k: v for k, v in d.items() if v is not None and k not in ("first_k_dense_replace", "moe_layer_freq")}
    cfg = DeepseekV3Config.from_hf({**DEFAULTS, **given}, "DeepseekV3ForCausalLM")
    return dataclasses.replace(cfg, moe_layers=tuple(i for i, t in enumerate(types) if t == "sparse"))


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    ARCHITECTURE = ARCHITECTURE

    @classmethod
    def parse_config(cls, hf_config: dict) -> DeepseekV3Config:
        return glm4_moe_lite_config(hf_config)
