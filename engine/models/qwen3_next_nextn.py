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

from loadplan.layouts import qwen_nextn_layout
from ..shown_tensors import renamed
from .config import moe_layout
from .nextn import NextNDraft
from .qwen3_next import Qwen3NextConfig, Qwen3NextDecoderLayer

ARCHITECTURE = "Qwen3NextForCausalLMMTP"


def mtp_names(n_layers: int) -> tuple[tuple[str, str], ...]:
    """The checkpoint's prefixes -> nextn.py's, for a target of `n_layers` layers (the MTP layer is number n_layers)."""
    mtp = f"model.layers.{n_layers}."
    return (("mtp.layers.0.", mtp), ("mtp.fc.", f"{mtp}eh_proj."), ("mtp.pre_fc_norm_embedding.", f"{mtp}enorm."),
            ("mtp.pre_fc_norm_hidden.", f"{mtp}hnorm."), ("mtp.norm.", f"{mtp}shared_head.norm."))


def one_mtp_layer(d: dict) -> tuple[int, ...]:
    """The draft's MoE layer as the registry reads it (its layout, which refuses another count than the one MTP
    layer Qwen's checkpoints ship and SGLang builds; numbered after the target's layers): `(num_hidden_layers,)`."""
    return moe_layout(qwen_nextn_layout, d).moe_layers


class Qwen3NextForCausalLMMTP(NextNDraft):
    ARCHITECTURE = ARCHITECTURE

    @classmethod
    def parse_config(cls, hf_config: dict) -> Qwen3NextConfig:
        mtp_layer = one_mtp_layer(hf_config)
        cfg = Qwen3NextConfig.from_hf(hf_config)
        return dataclasses.replace(cfg, layer_types=(*cfg.layer_types, "full_attention"), moe_layers=mtp_layer)

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        cfg = self.parse_config(hf_config)
        super().__init__(cfg, plan, Qwen3NextDecoderLayer, cfg.head_dim, dtype, n_routed=cfg.num_experts)

    def checkpoint_view(self, ckpt):
        return renamed(ckpt, mtp_names(self.config.num_hidden_layers))
