"""MiniMax-Text-01 / MiniMax-M1 (`MiniMaxForCausalLM`), following transformers' modeling_minimax numerically.

Shapes: B batch, T tokens, D hidden, E experts, K top-k, V vocab.

A hybrid: layer i's token mixer is, by `layer_types`, lightning attention (layers/lightning_attention.py,
"linear_attention") or grouped-query attention with a whole-head rotary embedding ("full_attention"); every layer's
MLP is Mixtral's routed experts (softmax top-k, renormalised; no shared expert, so no fusion), spelled as Mixtral's
checkpoints spell them (`MIXTRAL_NAMES`). Its residuals run from the NORMED input, each scaled by its own factor:
    h = input_layernorm(x);          x = alpha_attn h + beta_attn mixer(h)
    h = post_attention_layernorm(x); x = alpha_mlp h + beta_mlp moe(h)
(`linear_attn_*` or `full_attn_*_factor` by the layer's kind, `mlp_*_factor`). transformers' checkpoints also store
each lightning layer's decay tables (`slope_rate`, `query_decay`, `key_decay`, `diagonal_decay`): the engine computes
them from the layer's position; `checkpoint_view` checks the stored slopes against its own and drops the tables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..layers.attention import GQAttention
from ..layers.lightning_attention import LightningAttention, slopes
from ..parallel.tensor import TensorParallel
from ..shown_tensors import ShownTensors
from ..weights import ShapeMismatch
from .config import ConfigError, get_field as _get, per_layer
from .mixtral import MIXTRAL_NAMES, mixtral_config
from .qwen_moe import QwenDecoderLayer, QwenLayerCausalLM, QwenMoeConfig

ARCHITECTURE = "MiniMaxForCausalLM"
LAYER_TYPES = ("linear_attention", "full_attention")
# What transformers' checkpoints store of a lightning layer besides its weights: tables derived from its position.
DECAY_TABLES = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
FACTORS = ("full_attn_alpha_factor", "full_attn_beta_factor", "linear_attn_alpha_factor", "linear_attn_beta_factor",
           "mlp_alpha_factor", "mlp_beta_factor")


@dataclass(frozen=True)
class MiniMaxConfig(QwenMoeConfig):
    layer_types: tuple[str, ...] = ()
    factors: tuple[tuple[str, float], ...] = ()   # FACTORS' values

    def factor(self, name: str) -> float:
        return dict(self.factors)[name]

    @classmethod
    def from_hf(cls, d: dict) -> "MiniMaxConfig":
        """transformers' MiniMaxConfig defaults where a checkpoint may leave a field out (every other layer, from the
        second, linear)."""
        if d.get("sliding_window") is not None:
            raise ConfigError(f"config.sliding_window: {d['sliding_window']!r} not supported; supported: null")
        base = mixtral_config(d)   # rope theta 1e6 unless the config says otherwise, as transformers
        if base.rope.partial_rotary_factor != 1.0:   # transformers' MiniMax turns whole heads, whatever it says
            raise ConfigError(f"config.partial_rotary_factor: {base.rope.partial_rotary_factor} not supported; "
                              f"MiniMax rotates whole heads (1.0)")
        n = base.num_hidden_layers
        types = per_layer(d, "layer_types", n, LAYER_TYPES,
                          ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n)])
        factors = tuple((name, float(_get(d, name, 1, (int, float)))) for name in FACTORS)
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(QwenMoeConfig)},
                   layer_types=tuple(types), factors=factors)


class MiniMaxDecoderLayer(QwenDecoderLayer):
    """Mixtral's experts after lightning or rotary attention, each residual from the normed input, scaled."""

    @classmethod
    def make_attention(cls, cfg: MiniMaxConfig, layer_id: int, dtype: torch.dtype, tp) -> GQAttention | None:
        return None if cfg.layer_types[layer_id] == "linear_attention" else super().make_attention(cfg, layer_id,
                                                                                                      dtype, tp)

    def __init__(self, cfg: MiniMaxConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        kind = "linear" if cfg.layer_types[layer_id] == "linear_attention" else "full"
        if kind == "linear":   # under the checkpoint's name for it (its slopes depend on the rank's heads)
            self.self_attn = LightningAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, layer_id,
                                                cfg.num_hidden_layers, dtype=dtype, tp=TensorParallel.of(plan),
                                                tp_rank=plan.request.parallel.tp_rank)
        self.attn_alpha, self.attn_beta = cfg.factor(f"{kind}_attn_alpha_factor"), cfg.factor(f"{kind}_attn_beta_factor")
        self.mlp_alpha, self.mlp_beta = cfg.factor("mlp_alpha_factor"), cfg.factor("mlp_beta_factor")

    def forward(self, x, cos, sin, input_pos=None):
        """x [B, T, D] -> [B, T, D]"""
        h = self.input_layernorm(x)
        x = h * self.attn_alpha + self.mixer(h, cos, sin, input_pos) * self.attn_beta
        B, T, D = x.shape
        h = self.post_attention_layernorm(x)
        return h * self.mlp_alpha + self.mlp(h.reshape(B * T, D)).view(B, T, D) * self.mlp_beta


class MiniMaxForCausalLM(QwenLayerCausalLM):
    ARCHITECTURE = ARCHITECTURE
    DECODER_LAYER = MiniMaxDecoderLayer
    CHECKPOINT_NAMES = MIXTRAL_NAMES

    @classmethod
    def parse_config(cls, hf_config: dict) -> MiniMaxConfig:
        return MiniMaxConfig.from_hf(hf_config)

    def checkpoint_view(self, ckpt):
        """The checkpoint without its lightning layers' decay tables, once their stored slopes are checked to be the
        ones the engine computes (a checkpoint of another layer count or head count is refused, named)."""
        cfg = self.config
        view = ShownTensors(ckpt)
        for name in ckpt.names():
            table = next((t for t in DECAY_TABLES if name.endswith(f".self_attn.{t}")), None)
            if table is None:
                view.show(name, name)
                continue
            layer = int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else -1
            if table == "slope_rate" and 0 <= layer < cfg.num_hidden_layers:
                want = slopes(cfg.num_attention_heads, layer, cfg.num_hidden_layers)
                stored = ckpt.get(name).float().flatten()
                if stored.shape != want.shape or not torch.allclose(stored, want, rtol=1e-4, atol=1e-7):
                    raise ShapeMismatch(f"tensor {name!r}: the stored decay slopes are not the ones layer {layer} of "
                                        f"{cfg.num_hidden_layers} with {cfg.num_attention_heads} heads has")
        return view
