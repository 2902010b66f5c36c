"""Qwen3-Next's Multi-Token-Prediction module as a speculative draft: `Qwen3NextForCausalLMMTP`.

The module and the speculative contract are engine/models/nextn.py's (SGLang's entry-class name and
conventions: the target's final hidden states after its final norm, the draft's normed output for a
further step). Qwen3-Next's parts: its config (the target's), its decoder layer as a full-attention,
MoE layer (gated attention, Qwen2-MoE's MoE block), its norms (weights stored as offsets from 1) and
its rotary width (head_dim; partial_rotary_factor of it rotated).

Its checkpoint spells the module under `mtp.`, beside the target's tensors, and has no embedding or
head of its own (the target's `model.embed_tokens` and `lm_head` are read):
    mtp.pre_fc_norm_embedding   the embedding's norm     (nextn.py's enorm)
    mtp.pre_fc_norm_hidden      the hidden state's norm  (hnorm)
    mtp.fc                      [D, 2D]                  (eh_proj)
    mtp.layers.0.*              the decoder layer        (model.layers.{L})
    mtp.norm                    the output norm          (shared_head.norm)
Qwen3-Next ships one MTP layer; more are refused by field.
"""

from __future__ import annotations

import dataclasses

import torch

from ..shown_tensors import renamed
from ...service.rules.layouts import qwen_nextn_layout
from .config import ConfigError, moe_layout
from .nextn import NextNDraft
from .qwen3_next import Qwen3NextConfig, Qwen3NextDecoderLayer

ARCHITECTURE = "Qwen3NextForCausalLMMTP"


def mtp_names(n_layers: int) -> tuple[tuple[str, str], ...]:
    """The checkpoint's prefixes -> nextn.py's, for a target of `n_layers` layers (the MTP layer is number n_layers)."""
    mtp = f"model.layers.{n_layers}."
    return (("mtp.layers.0.", mtp), ("mtp.fc.", f"{mtp}eh_proj."), ("mtp.pre_fc_norm_embedding.", f"{mtp}enorm."),
            ("mtp.pre_fc_norm_hidden.", f"{mtp}hnorm."), ("mtp.norm.", f"{mtp}shared_head.norm."))


def one_mtp_layer(d: dict, family: str) -> tuple[int, ...]:
    """The draft's MoE layer as the registry reads it (its layout: num_nextn_predict_layers, else
    mtp_num_hidden_layers, 1 when absent; numbered after the target's layers): `(num_hidden_layers,)`. More than the
    one MTP layer `family` ships are refused."""
    layout = moe_layout(qwen_nextn_layout, d)
    if len(layout.layer_ids) != 1:
        # The refusal names the field the reader took the count from (the layout does not say which): SGLang's
        # num_nextn_predict_layers where the config has it, else Qwen3.5's mtp_num_hidden_layers.
        field = "num_nextn_predict_layers" if d.get("num_nextn_predict_layers") is not None else "mtp_num_hidden_layers"
        raise ConfigError(f"config.{field}: {len(layout.layer_ids)} not supported by the engine; supported: 1 (the "
                          f"one MTP layer {family} ships)")
    return layout.moe_layers


class Qwen3NextForCausalLMMTP(NextNDraft):
    ARCHITECTURE = ARCHITECTURE

    @classmethod
    def parse_config(cls, hf_config: dict) -> Qwen3NextConfig:
        mtp_layer = one_mtp_layer(hf_config, "Qwen3-Next")
        cfg = Qwen3NextConfig.from_hf(hf_config)
        return dataclasses.replace(cfg, layer_types=(*cfg.layer_types, "full_attention"), moe_layers=mtp_layer)

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        cfg = self.parse_config(hf_config)
        super().__init__(cfg, plan, Qwen3NextDecoderLayer, cfg.head_dim, dtype, n_routed=cfg.num_experts)

    def checkpoint_view(self, ckpt):
        return renamed(ckpt, mtp_names(self.config.num_hidden_layers))
