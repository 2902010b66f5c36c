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
The router takes the top-k of the logits and a softmax over them, which is the renormalised top-k of the softmax
(`norm_topk_prob`). Its checkpoints keep each layer's experts stacked, `block_sparse_moe.input_linear.weight`
[E, 2I, D] (gate, then up) and `output_linear.weight` [E, D, I], and the router as
`block_sparse_moe.router.layer.weight`: shown to the weight remapping one expert at a time (engine/
stacked_experts.py) under the engine's names (`GRANITE_NAMES`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..stacked_experts import StackedExperts
from ..weights import CheckpointNames, ShapeMismatch
from .causal_lm import CausalLM
from .config import ConfigError, get_field as _get
from .qwen_moe import QwenDecoderLayer, QwenLayerCausalLM, QwenMoeConfig, SharedMlpMoeBlock, every_layer_moe_fields

ARCHITECTURE = "GraniteMoeForCausalLM"
SHARED_ARCHITECTURE = "GraniteMoeSharedForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}: the stacked experts as StackedExperts reads them.
GRANITE_NAMES = CheckpointNames((
    ("block_sparse_moe.input_linear.weight", "mlp.experts.gate_up_proj"),
    ("block_sparse_moe.output_linear.weight", "mlp.experts.down_proj"),
    ("block_sparse_moe.router.layer.weight", "mlp.gate.weight"),
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
    def from_hf(cls, d: dict, architecture: str = ARCHITECTURE) -> "GraniteMoeConfig":
        """transformers' GraniteMoeConfig defaults where a checkpoint may leave a field out."""
        common = every_layer_moe_fields(d, experts_field="num_local_experts", rms_norm_eps=1e-6,
                                        max_position_embeddings=2048, rope_theta=10000.0)
        hidden, heads = common["hidden_size"], common["num_attention_heads"]
        multipliers = {name: float(_get(d, name, 1.0, (int, float)))
                       for name in ("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                                    "logits_scaling")}
        if multipliers["logits_scaling"] == 0:
            raise ConfigError("config.logits_scaling: must not be 0 (the logits are divided by it)")
        bias = bool(_get(d, "attention_bias", False, bool))
        shared = _get(d, "shared_intermediate_size", 0, int) if architecture == SHARED_ARCHITECTURE else 0
        if shared < 0:
            raise ConfigError(f"config.shared_intermediate_size: must be >= 0, got {shared}")
        return cls(
            architecture=architecture,
            **common,
            num_key_value_heads=_get(d, "num_key_value_heads", heads, int),
            head_dim=_get(d, "head_dim", hidden // heads, int),
            norm_topk_prob=True,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=False,
            shared_intermediate_size=shared,
            **multipliers,
        )


class GraniteMoeDecoderLayer(QwenDecoderLayer):
    MOE_BLOCK = SharedMlpMoeBlock   # the shared MLP only where shared_intermediate_size > 0

    def __init__(self, cfg: GraniteMoeConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
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

    @classmethod
    def parse_config(cls, hf_config: dict) -> GraniteMoeConfig:
        return GraniteMoeConfig.from_hf(hf_config, cls.ARCHITECTURE)

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        cfg = self.parse_config(hf_config)
        CausalLM.__init__(self, cfg, plan, GraniteMoeDecoderLayer, n_routed=cfg.num_experts,
                          rope_head_dim=cfg.head_dim, dtype=dtype)

    def checkpoint_view(self, ckpt):
        return StackedExperts(_EngineNames(ckpt), self.config.num_experts, gate_up="concatenated",
                              hidden_size=self.config.hidden_size, expert_width=self.config.moe_intermediate_size,
                              as_held=True)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.config.embedding_multiplier

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return super()._head(h) / self.config.logits_scaling


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE with an ungated shared MLP of `shared_intermediate_size` beside the experts of every layer."""

    ARCHITECTURE = SHARED_ARCHITECTURE


class _EngineNames:
    """The checkpoint (`names`/`shape`/`get`) with Granite's stacked experts, router and shared MLP under the
    names StackedExperts and the engine read (`GRANITE_NAMES`; the shared MLP's [2S, D] as its gate and up)."""

    def __init__(self, ckpt):
        self._ckpt = ckpt
        self._source: dict[str, tuple[str, int | None]] = {}     # shown -> (checkpoint name, half or None)
        for name in ckpt.names():
            if name.endswith(SHARED_GATE_UP):
                head = name[:-len(SHARED_GATE_UP)]
                self._source[f"{head}mlp.shared_mlp.gate_proj.weight"] = (name, 0)
                self._source[f"{head}mlp.shared_mlp.up_proj.weight"] = (name, 1)
            else:
                self._source[GRANITE_NAMES.to_engine(name)] = (name, None)

    def names(self) -> list[str]:
        return list(self._source)

    def source_name(self, name: str) -> str:
        """The checkpoint's name of the tensor shown as `name` (for errors)."""
        return self._source[name][0] if name in self._source else name

    def shape(self, name: str) -> tuple[int, ...]:
        source, half = self._source[name]
        shape = tuple(self._ckpt.shape(source))
        if half is None:
            return shape
        if len(shape) != 2 or shape[0] % 2:
            raise ShapeMismatch(f"tensor {source!r} has shape {list(shape)}: expected [2 x shared width, hidden]")
        return (shape[0] // 2, shape[1])

    def get(self, name: str) -> torch.Tensor:
        source, half = self._source[name]
        tensor = self._ckpt.get(source)
        return tensor if half is None else tensor.chunk(2, dim=0)[half]
