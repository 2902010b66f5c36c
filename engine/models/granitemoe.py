"""Granite MoE (`GraniteMoeForCausalLM`: IBM's granite-3.x MoE models, PowerMoE), following transformers'
modeling_granitemoe numerically.

Shapes: B batch, T tokens, D hidden, E experts, K top-k, V vocab.

Mixtral's layer (built by qwen_moe.py's, as models/mixtral.py does: every layer sparse, no shared expert, so no
fusion; `GraniteMoeSharedForCausalLM` adds an ungated shared MLP of `shared_intermediate_size`, stored as
`shared_mlp.input_linear` [2S, D] (gate, then up) and `output_linear`, which the registry never fuses) with four
multipliers from its config:
- `embedding_multiplier`: the token embeddings are scaled by it;
- `attention_multiplier`: the attention scores' scale, instead of 1/sqrt(head_dim);
- `residual_multiplier`: each block's output (attention, then MoE) is scaled by it before the residual sum;
- `logits_scaling`: the logits are divided by it.
`GraniteMoeSWAForCausalLM` (granite-swash) adds to that layer a sink logit per head on every layer (as gpt-oss's),
a window on its "sliding_attention" layers and a rope theta per layer (`layer_rope_theta`; 0: no rotary
embedding), each layer turning q and k with its own tables.
The router takes the top-k of the logits and a softmax over them, which is the renormalised top-k of the softmax
(`norm_topk_prob`). Its checkpoints keep each layer's experts stacked, `block_sparse_moe.input_linear.weight`
[E, 2I, D] (gate, then up) and `output_linear.weight` [E, D, I], and the router as
`block_sparse_moe.router.layer.weight`: shown to the weight remapping one expert at a time (engine/
stacked_experts.py) under the engine's names (`GRANITE_NAMES`, through `engine_names`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

import torch

from loadplan.layouts import granitemoe_layout, granitemoe_shared_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.rope import RotaryEmbedding
from ..shown_tensors import ShownTensors
from ..stacked_experts import StackedExperts
from ..weights import CheckpointNames, ShapeMismatch
from .config import ConfigError, Family, as_heads, heads_wide, per_layer, sliding_window
from .qwen_moe import EXPERTS_AS_WIDE, MOE_FIELDS, QwenDecoderLayer, QwenLayerCausalLM, QwenMoeConfig, SharedMlpMoeBlock

ARCHITECTURE = "GraniteMoeForCausalLM"
SHARED_ARCHITECTURE = "GraniteMoeSharedForCausalLM"
SWA_ARCHITECTURE = "GraniteMoeSWAForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}: the stacked experts as StackedExperts reads them.
GRANITE_NAMES = CheckpointNames((
    ("block_sparse_moe.input_linear.weight", "mlp.experts.gate_up_proj"),
    ("block_sparse_moe.output_linear.weight", "mlp.experts.down_proj"),
    ("block_sparse_moe.router.layer.weight", "mlp.gate.weight"),
    ("shared_mlp.output_linear.weight", "mlp.shared_mlp.down_proj.weight"),
))
# Granite MoE SWA's checkpoints keep transformers 5's names for the experts and the router ([E, 2I, D], [E, D, I]).
GRANITE_SWA_NAMES = CheckpointNames((
    ("block_sparse_moe.experts.gate_up_proj", "mlp.experts.gate_up_proj"),
    ("block_sparse_moe.experts.down_proj", "mlp.experts.down_proj"),
    ("block_sparse_moe.router.weight", "mlp.gate.weight"),
    ("shared_mlp.output_linear.weight", "mlp.shared_mlp.down_proj.weight"),
))
# GraniteMoeShared's shared MLP keeps gate and up in one matrix [2S, D]: shown as the two halves.
SHARED_GATE_UP = "shared_mlp.input_linear.weight"


@dataclass(frozen=True)
class GraniteMoeConfig(QwenMoeConfig):
    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @classmethod
    def from_hf(cls, d: dict, architecture: str = ARCHITECTURE, reader=None) -> "GraniteMoeConfig":
        """`reader`: the registry's reader of the family's layer and expert fields (by default Granite MoE's, or
        GraniteMoeShared's for the architectures with a shared MLP)."""
        if reader is None:
            reader = granitemoe_layout if architecture == ARCHITECTURE else granitemoe_shared_layout
        return Family(architecture, reader, GRANITE_FIELDS, **GRANITE_ROW).read(d, GraniteMoeConfig)


def _logits_scaling(d: dict, fields: dict) -> None:
    if fields.logits_scaling == 0:
        raise ConfigError("config.logits_scaling: must not be 0 (the logits are divided by it)")


# transformers' GraniteMoeConfig defaults where a checkpoint may leave a field out; the shared MLP's width where the
# layout has one.
GRANITE_FIELDS = dict(MOE_FIELDS, rms_norm_eps=1e-6, max_position_embeddings=2048, num_key_value_heads=as_heads,
                      head_dim=heads_wide, qkv_bias=False, embedding_multiplier=1.0, attention_multiplier=1.0,
                      residual_multiplier=1.0, logits_scaling=1.0)
GRANITE_ROW = dict(names={"qkv_bias": "attention_bias"}, rope={"default_theta": 10000.0},
                   fixed=dict(EXPERTS_AS_WIDE, norm_topk_prob=True, o_bias=lambda f: f.qkv_bias, qk_norm=False),
                   shared="shared_intermediate_size", own=(_logits_scaling,))


class GraniteMoeDecoderLayer(QwenDecoderLayer):
    MOE_BLOCK = SharedMlpMoeBlock   # the shared MLP only where shared_intermediate_size > 0

    def __init__(self, cfg: GraniteMoeConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        if self.self_attn is not None:   # None: a layer whose token mixer is not attention (granitemoe_hybrid.py)
            self.self_attn.scale = cfg.attention_multiplier
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x, cos, sin, input_pos=None):
        """x [B, T, D] -> [B, T, D]"""
        x = x + self.mixer(self.input_layernorm(x), cos, sin, input_pos) * self.residual_multiplier
        B, T, D = x.shape
        h = self.post_attention_layernorm(x).reshape(B * T, D)
        return x + self.mlp(h).view(B, T, D) * self.residual_multiplier


class GraniteMoeForCausalLM(QwenLayerCausalLM):
    ARCHITECTURE = ARCHITECTURE
    CONFIG: type[GraniteMoeConfig] = GraniteMoeConfig
    DECODER_LAYER: type[GraniteMoeDecoderLayer] = GraniteMoeDecoderLayer
    NAMES = GRANITE_NAMES                      # its checkpoints' spellings of the experts, router, shared MLP

    @classmethod
    def parse_config(cls, hf_config: dict) -> GraniteMoeConfig:
        return cls.CONFIG.from_hf(hf_config, cls.ARCHITECTURE)


    def checkpoint_view(self, ckpt):
        return StackedExperts(engine_names(ckpt, self.NAMES), self.config.num_experts, gate_up="concatenated",
                              hidden_size=self.config.hidden_size, expert_width=self.config.moe_intermediate_size,
                              as_held=True)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.config.embedding_multiplier

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return super()._head(h) / self.config.logits_scaling


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE with an ungated shared MLP of `shared_intermediate_size` beside the experts of every layer."""

    ARCHITECTURE = SHARED_ARCHITECTURE


@dataclass(frozen=True)
class GraniteMoeSwaConfig(GraniteMoeConfig):
    layer_types: tuple[str, ...] = ()           # "sliding_attention" layers see sliding_window positions
    layer_rope_theta: tuple[float, ...] = ()    # each layer's rope theta; 0: no rotary embedding (NoPE)

    @classmethod
    def from_hf(cls, d: dict, architecture: str = SWA_ARCHITECTURE) -> "GraniteMoeSwaConfig":
        """transformers' GraniteMoeSWAConfig defaults where a checkpoint may leave a field out."""
        base = GraniteMoeConfig.from_hf(d, architecture)
        n = base.num_hidden_layers
        window = sliding_window(d, 128)
        types = per_layer(d, "layer_types", n, ("full_attention", "sliding_attention"),
                          ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)])
        thetas = d.get("layer_rope_theta")
        if thetas is None:
            thetas = [base.rope.theta] * n
        if not isinstance(thetas, list) or len(thetas) != n or \
                any(isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 for t in thetas):
            raise ConfigError(f"config.layer_rope_theta: expected {n} numbers >= 0 (0: no rotary embedding), got "
                              f"{thetas!r}"[:300])
        if base.rope.rope_type != "default" and any(thetas):
            raise ConfigError(f"config.rope_parameters: rope type {base.rope.rope_type!r} with per-layer thetas is "
                              f"not supported; supported: default")
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(GraniteMoeConfig)
                      if f.name != "sliding_window"},
                   sliding_window=window, layer_types=tuple(types), layer_rope_theta=tuple(float(t) for t in thetas))


class GraniteMoeSwaDecoderLayer(GraniteMoeDecoderLayer):
    """Granite MoE's layer whose attention has a sink logit per head on every layer, a window on the
    "sliding_attention" ones, and its own rope theta (0: none)."""

    @classmethod
    def make_attention(cls, cfg: GraniteMoeSwaConfig, layer_id: int, dtype: torch.dtype, tp) -> GQAttention:
        windowed = cfg.layer_types[layer_id] == "sliding_attention"
        return GQAttention(AttentionSpec.of(cfg, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
                                            sliding_window=cfg.sliding_window if windowed else None, sinks=True,
                                            use_rope=cfg.layer_rope_theta[layer_id] > 0), tp=tp, dtype=dtype)

    def __init__(self, cfg: GraniteMoeSwaConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        theta = cfg.layer_rope_theta[layer_id]
        # its own theta's tables (the model hands it those); none where its attention turns nothing (NoPE)
        self.rotary = RotaryEmbedding(cfg.head_dim, replace(cfg.rope, theta=theta), cfg.max_position_embeddings) \
            if theta else None


class GraniteMoeSWAForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE with attention sinks, windowed layers and a rope theta per layer (NoPE where 0)."""

    ARCHITECTURE = SWA_ARCHITECTURE
    CONFIG = GraniteMoeSwaConfig
    DECODER_LAYER = GraniteMoeSwaDecoderLayer
    NAMES = GRANITE_SWA_NAMES


def engine_names(ckpt, names: CheckpointNames = GRANITE_NAMES) -> ShownTensors:
    """The checkpoint with Granite's stacked experts, router and shared MLP under the names StackedExperts and the
    engine read (`names`: the family's table, GRANITE_NAMES or GRANITE_SWA_NAMES; the shared MLP's [2S, D] as its
    gate and up)."""
    view = ShownTensors(ckpt)
    for name in ckpt.names():
        if not name.endswith(SHARED_GATE_UP):
            view.show(names.to_engine(name), name)
            continue
        shape = tuple(ckpt.shape(name))
        if len(shape) != 2 or shape[0] % 2:
            raise ShapeMismatch(f"tensor {name!r} has shape {list(shape)}: expected [2 x shared width, hidden]")
        head = name[:-len(SHARED_GATE_UP)]
        for half, proj in enumerate(("gate", "up")):
            view.show(f"{head}mlp.shared_mlp.{proj}_proj.weight", name, (shape[0] // 2, shape[1]),
                      lambda t, half=half: t.chunk(2, dim=0)[half])
    return view
