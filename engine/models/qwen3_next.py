"""Qwen3-Next (`Qwen3NextForCausalLM`), numerically following transformers' modeling_qwen3_next.py.

Shapes: B batch, T tokens, D hidden. A hybrid: most layers mix tokens with Gated DeltaNet linear
attention (layers/gated_delta_net.py: a recurrent state instead of a KV cache), every
`full_attention_interval`-th with gated attention: q_proj writes each head's query and an output gate,
the attention output is scaled by sigmoid(gate), q and k have per-head norms, and only
`partial_rotary_factor` (0.25) of each head is rotated. Every norm stores its weight as an offset
from 1 (`OffsetRMSNorm`) but the linear attention's gated output norm. The MoE block is Qwen2-MoE's
(models/qwen_moe.py): softmax top-k routing and one shared expert scaled by sigmoid(shared_expert_gate(x)),
fused as routed slot E when the plan says so. The checkpoint's Multi-Token-Prediction module (`mtp.*`)
is not part of the model: skipped by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loadplan.layouts import qwen2_moe_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.gated_delta_net import GatedDeltaNet
from ..layers.mlp import GatedMLP, activation
from ..layers.norm import OffsetRMSNorm
from ..parallel.tensor import TensorParallel
from ..shown_tensors import rows_by_rank
from .causal_lm import DeclaredCausalLM, DecoderLayer
from .config import (REQUIRED, ConfigError, DecoderConfig, get_field as _get, moe_layout, per_layer, read_fields,
                     read_rope)
from .qwen_moe import QwenSparseMoeBlock

# transformers' Qwen3NextConfig defaults for fields a config.json may leave out.
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen3NextConfig(DecoderConfig):
    intermediate_size: int              # the dense MLP of mlp_only / non-sparse layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int                     # head_dim * partial_rotary_factor
    attention_bias: bool
    hidden_act: str
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]
    linear_projections: str = "grouped"   # the linear layers' input projections (layers/gated_delta_net.py)

    @classmethod
    def from_hf(cls, d: dict, reader=qwen2_moe_layout) -> "Qwen3NextConfig":
        # The registry's reader of the layer and expert fields (Qwen's: layer i is MoE iff it is not in
        # mlp_only_layers and (i + 1) % decoder_sparse_step == 0; `reader`: Qwen3.5's, every layer), so the engine
        # builds the layout planned for.
        layout = moe_layout(reader, d)
        n_layers = len(layout.layer_ids)
        hidden = _get(d, "hidden_size", kind=int)
        heads = _get(d, "num_attention_heads", kind=int)
        head_dim = _get(d, "head_dim", hidden // heads, int)
        act = _get(d, "hidden_act", "silu", str)
        if act != "silu":   # the linear attention's conv runs the config's activation; only SiLU is tested
            raise ConfigError(f"config.hidden_act: {act!r} not supported; Qwen3-Next runs 'silu'")
        activation(act)
        rope = read_rope(d, partial_rotary_factor=DEFAULT_PARTIAL_ROTARY_FACTOR)
        rotary_dim = int(head_dim * rope.partial_rotary_factor)
        if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ConfigError(f"config.partial_rotary_factor: {rope.partial_rotary_factor} of head_dim={head_dim} "
                              f"gives {rotary_dim} rotated features; needs an even number in (0, head_dim]")
        interval = _get(d, "full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL, int)
        if interval < 1:
            raise ConfigError(f"config.full_attention_interval: must be >= 1, got {interval}")
        layer_types = per_layer(d, "layer_types", n_layers, LAYER_TYPES,
                                [LAYER_TYPES[(i + 1) % interval == 0] for i in range(n_layers)])
        k_heads = _get(d, "linear_num_key_heads", kind=int)
        v_heads = _get(d, "linear_num_value_heads", kind=int)
        if k_heads < 1 or v_heads % k_heads:
            raise ConfigError(f"config.linear_num_value_heads: {v_heads} must be a multiple of "
                              f"linear_num_key_heads={k_heads}")
        kernel = _get(d, "linear_conv_kernel_dim", kind=int)
        if kernel < 1:
            raise ConfigError(f"config.linear_conv_kernel_dim: must be >= 1, got {kernel}")
        # The shared expert's width (the layout says only whether there is one, and requires it).
        shared = _get(d, "shared_expert_intermediate_size", kind=int)
        if shared < 1:
            raise ConfigError(f"config.shared_expert_intermediate_size: must be >= 1, got {shared} (Qwen3-Next's "
                              f"MoE block always has a shared expert)")
        return cls(
            **read_fields(d, cls, dict(vocab_size=REQUIRED, intermediate_size=REQUIRED, num_key_value_heads=heads,
                                       attention_bias=False, rms_norm_eps=1e-6, max_position_embeddings=32768,
                                       tie_word_embeddings=False, linear_key_head_dim=REQUIRED,
                                       linear_value_head_dim=REQUIRED, moe_intermediate_size=REQUIRED,
                                       norm_topk_prob=True)),
            hidden_size=hidden, num_hidden_layers=n_layers, num_attention_heads=heads, head_dim=head_dim,
            rotary_dim=rotary_dim, hidden_act=act, rope=rope, layer_types=tuple(layer_types),
            linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_conv_kernel_dim=kernel,
            num_experts=layout.n_routed, num_experts_per_tok=layout.top_k, shared_expert_intermediate_size=shared,
            moe_layers=layout.moe_layers)


class Qwen3NextDecoderLayer(DecoderLayer):
    NORM = OffsetRMSNorm

    def __init__(self, cfg: Qwen3NextConfig, plan, layer_id: int, dtype: torch.dtype):
        tp = TensorParallel.of(plan)
        self.linear = cfg.layer_types[layer_id] == "linear_attention"
        if self.linear:
            mixer = GatedDeltaNet(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                  cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
                                  cfg.rms_norm_eps, dtype, tp=tp, projections=cfg.linear_projections)
        else:
            mixer = GQAttention(AttentionSpec.of(cfg, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                                                 qk_norm="head", gate="in_q", rotary_dim=cfg.rotary_dim,
                                                 norm=OffsetRMSNorm), tp=tp, dtype=dtype)
        if layer_id in cfg.moe_layers:
            mlp = QwenSparseMoeBlock(cfg, plan, layer_id, dtype)
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, tp=tp)
        super().__init__(layer_id, mixer, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if self.linear:   # the checkpoint's name for it
            self.linear_attn = self.self_attn
            del self.self_attn

    @property
    def mixer(self):
        return self.linear_attn if self.linear else self.self_attn


class Qwen3NextForCausalLM(DeclaredCausalLM):
    CONFIG = Qwen3NextConfig
    DECODER_LAYER = Qwen3NextDecoderLayer
    TENSOR_PARALLEL = True
    MTP_PREFIXES = ("mtp.",)

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        super().__init__(hf_config, plan, dtype=dtype)
        # The rotary tables cover the rotated share of a head only (the layers rotate rotary_dim features).
        assert self.rotary.rotary_dim == self.config.rotary_dim, (self.rotary.rotary_dim, self.config.rotary_dim)

    def checkpoint_view(self, ckpt):
        tp = self.plan.request.parallel.tp_size
        if tp == 1:
            return ckpt
        # the linear-attention tensors whose rows are the conv's channels, [q of every key head | k | v] (the conv's
        # weight, Qwen3.5's in_proj_qkv), regrouped rank by rank: each rank's block holds its key heads' channels
        cfg = self.config
        key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        layout = ([key, key, cfg.linear_num_value_heads * cfg.linear_value_head_dim], [False, False, False])
        return rows_by_rank(ckpt, tp, {"linear_attn.conv1d.weight": layout, "linear_attn.in_proj_qkv.weight": layout})
