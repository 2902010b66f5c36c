"""Llama 4 text (Llama-4-Scout, Llama-4-Maverick), numerically following transformers' modeling_llama4.

Shapes: B batch, T tokens, D hidden, E experts, K top-k, H heads, hd head_dim.

- attention: rope layers (`no_rope_layers[i]` 1) rotate q and k in interleaved pairs with
  Llama 3's frequency scaling, then (with `use_qk_norm`) normalise each head by its RMS
  without a weight (an L2 norm); the other layers (NoPE, every `no_rope_layer_interval`-th)
  do not rotate and instead scale q by log1p(floor((pos + 1) / floor_scale)) * attn_scale
  + 1 (`attn_temperature_tuning`). `layer_types` says which layers attend only within
  their chunk of `attention_chunk_size` positions (chunked attention: by default the rope
  layers); the others attend to everything before.
- MoE layers (`moe_layers`, or every `interleave_moe_layer_step`-th): the router's top-k
  logits through a sigmoid give each chosen expert a score that scales the expert's INPUT
  (not its output: the experts are not linear); plus one shared expert of the experts'
  width on every token, never fused (the registry's gate, `llama4.structural.*`), run
  replicated and added after the experts' reduction. The other layers are dense MLPs of
  `intermediate_size_mlp`.

`Llama4ForConditionalGeneration` (the Hub's checkpoints) runs it text-only (models/text_wrapper.py).
Checkpoints spell the block `feed_forward` (the engine's `mlp`: `LLAMA4_NAMES`) and keep the
experts stacked with gate and up concatenated (`feed_forward.experts.gate_up_proj` [E, D, 2I],
`down_proj` [E, I, D]): engine/stacked_experts.py shows them one expert at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loadplan.layouts import llama4_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.mlp import GatedMLP, activation
from ..moe import RoutedExperts
from ..parallel.tensor import TensorParallel
from ..stacked_experts import StackedExperts
from ..weights import CheckpointNames
from .causal_lm import DeclaredCausalLM, DecoderLayer
from .config import (REQUIRED, ConfigError, DecoderConfig, get_field as _get, moe_layout, per_layer, read_fields,
                     read_rope)
from .text_wrapper import TextOnlyWrapper

ARCHITECTURE = "Llama4ForCausalLM"
LAYER_TYPES = ("chunked_attention", "full_attention")

# (checkpoint, engine) suffixes under model.layers.{i}.
LLAMA4_NAMES = CheckpointNames(
    (("feed_forward.router.weight", "mlp.router.weight"),)
    + tuple((f"feed_forward.shared_expert.{p}_proj.weight", f"mlp.shared_expert.{p}_proj.weight")
            for p in ("gate", "up", "down"))
    + tuple((f"feed_forward.{p}_proj.weight", f"mlp.{p}_proj.weight") for p in ("gate", "up", "down"))
    + tuple((f"feed_forward.experts.{{e}}.{p}_proj.weight", f"mlp.experts.{{e}}.{p}_proj.weight")
            for p in ("gate", "up", "down"))
)


def _flags(d: dict, name: str, n: int) -> list[int] | None:
    value = d.get(name)
    if value is None or value == []:
        return None
    if not isinstance(value, list) or len(value) != n or any(v not in (0, 1) or isinstance(v, bool) for v in value):
        raise ConfigError(f"config.{name}: expected {n} entries of 0 or 1, got {value!r}"[:300])
    return value


@dataclass(frozen=True)
class Llama4Config(DecoderConfig):
    intermediate_size: int              # every expert's width, and the shared expert's
    intermediate_size_mlp: int          # the dense layers'
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    num_experts: int
    num_experts_per_tok: int
    moe_layers: tuple[int, ...]
    rope_layers: tuple[bool, ...]       # per layer: rotates (else NoPE)
    chunked_layers: tuple[bool, ...]    # per layer: attends within its chunk
    attention_chunk_size: int | None
    use_qk_norm: bool
    attn_temperature_tuning: bool
    floor_scale: float
    attn_scale: float
    attention_bias: bool

    @classmethod
    def from_hf(cls, d: dict) -> "Llama4Config":
        """config.json with transformers' Llama4TextConfig defaults where a checkpoint may leave a field out."""
        layout = moe_layout(llama4_layout, d)            # the registry's reader of the layer and expert fields
        n_layers = len(layout.layer_ids)
        act = _get(d, "hidden_act", "silu", str)
        activation(act)   # refuses unknown activations by name
        interval = _get(d, "no_rope_layer_interval", 4, int)
        if interval < 1:
            raise ConfigError(f"config.no_rope_layer_interval: must be >= 1, got {interval}")
        rope_flags = _flags(d, "no_rope_layers", n_layers) or [int((i + 1) % interval != 0) for i in range(n_layers)]
        chunk = d.get("attention_chunk_size", 8192)
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ConfigError(f"config.attention_chunk_size: must be an integer >= 1 or null, got {chunk!r}")
        types = per_layer(d, "layer_types", n_layers, LAYER_TYPES,
                          ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope_flags])
        if chunk is None and "chunked_attention" in types:
            raise ConfigError("config.attention_chunk_size: null, but layer_types has chunked_attention layers")
        dense = len(layout.moe_layers) < n_layers
        floor_scale = float(_get(d, "floor_scale", 8192, (int, float)))
        if floor_scale <= 0:
            raise ConfigError(f"config.floor_scale: must be > 0, got {floor_scale}")
        # transformers' num_key_value_heads default, 8, fits no particular head count: a config must say it
        return cls(
            **read_fields(d, cls, dict(vocab_size=REQUIRED, hidden_size=REQUIRED, intermediate_size=REQUIRED,
                                       num_attention_heads=REQUIRED, num_key_value_heads=REQUIRED, head_dim=128,
                                       rms_norm_eps=1e-5, max_position_embeddings=4096 * 32, tie_word_embeddings=False,
                                       use_qk_norm=True, attn_temperature_tuning=True, attn_scale=0.1,
                                       attention_bias=False)),
            intermediate_size_mlp=_get(d, "intermediate_size_mlp", kind=int) if dense else 0,
            num_hidden_layers=n_layers, hidden_act=act, rope=read_rope(d, default_theta=500000.0),
            num_experts=layout.n_routed, num_experts_per_tok=layout.top_k, moe_layers=layout.moe_layers,
            rope_layers=tuple(bool(r) for r in rope_flags),
            chunked_layers=tuple(t == "chunked_attention" for t in types), attention_chunk_size=chunk,
            floor_scale=floor_scale)


class Llama4Attention(GQAttention):
    """GQA with Llama 4's rotation (interleaved pairs, or none on NoPE layers), its L2 q/k norm on rope layers,
    the temperature of NoPE layers, and chunked attention where its layer type says."""

    def __init__(self, cfg: Llama4Config, layer_id: int, dtype: torch.dtype, tp: TensorParallel):
        # Pairs (x0, x1), (x2, x3), ... (transformers' complex rotation) on rope layers only: q and k come out in the
        # same de-interleaved order, which neither their dot product nor the L2 norm sees.
        self.rotates = cfg.rope_layers[layer_id]
        super().__init__(AttentionSpec.of(cfg, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                                          rope_interleave=True, use_rope=self.rotates), tp=tp, dtype=dtype)
        self.l2_eps = cfg.rms_norm_eps if cfg.use_qk_norm and self.rotates else None
        self.temperature = (cfg.floor_scale, cfg.attn_scale) if cfg.attn_temperature_tuning and not self.rotates \
            else None
        self.chunk_size = cfg.attention_chunk_size if cfg.chunked_layers[layer_id] else None

    def _after_rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q [B, H, T, hd], k [B, H_kv, T, hd], positions [T] (absolute)."""
        if self.l2_eps is not None:
            q, k = _l2_norm(q, self.l2_eps), _l2_norm(k, self.l2_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0   # [T]
            q = (q * scale.view(1, 1, -1, 1)).to(q.dtype)
        return q, k


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head's vector divided by its RMS (no weight), in float32 (transformers' Llama4TextL2Norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4MoeBlock(nn.Module):
    """Top-k of the router's logits, a sigmoid score per chosen expert scaling its input; the shared expert."""

    def __init__(self, cfg: Llama4Config, plan, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False, dtype=dtype)
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, plan,
                                     layer_id=layer_id, dtype=dtype, weight_inputs=True)
        if self.experts.num_fused_shared_experts:
            raise ValueError(f"plan fuses {self.experts.num_fused_shared_experts} shared expert slot(s) but Llama 4's "
                             f"experts scale their inputs: a fused slot would not count once")
        # replicated (never split by TP), added after the experts' reduction
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        logits = self.router(x)                                            # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)                  # [T, K]
        scores = torch.sigmoid(top.float()).to(x.dtype)                    # [T, K]
        return self.experts(x, ids, scores) + self.shared_expert(x)


class Llama4DecoderLayer(DecoderLayer):
    def __init__(self, cfg: Llama4Config, plan, layer_id: int, dtype: torch.dtype):
        tp = TensorParallel.of(plan)
        attn = Llama4Attention(cfg, layer_id, dtype, tp)
        if layer_id in cfg.moe_layers:
            mlp = Llama4MoeBlock(cfg, plan, layer_id, dtype)
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size_mlp, cfg.hidden_act, dtype, tp=tp)
        super().__init__(layer_id, attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Llama4ForCausalLM(DeclaredCausalLM):
    ARCHITECTURE = ARCHITECTURE
    TENSOR_PARALLEL = True
    CHECKPOINT_NAMES = LLAMA4_NAMES
    CONFIG = Llama4Config
    DECODER_LAYER = Llama4DecoderLayer

    def checkpoint_view(self, ckpt):
        return StackedExperts(ckpt, self.config.num_experts, gate_up="concatenated")


class Llama4ForConditionalGeneration(TextOnlyWrapper):
    """Llama 4 as the Hub ships it (Scout, Maverick), run text-only: `Llama4ForCausalLM` from text_config, its
    tensors under `language_model.`; the vision model's and projector's skipped."""

    INNER = Llama4ForCausalLM
    TENSOR_PARALLEL = True
    OTHER_TOWERS = ("vision_model.", "multi_modal_projector.")
