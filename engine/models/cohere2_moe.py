"""Cohere2-MoE (`Cohere2MoeForCausalLM`), following transformers' modeling_cohere2_moe numerically.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab, H/H_kv heads.

- Parallel block: one norm a layer, and x + attn(norm(x)) + mlp(norm(x)). The norms are LayerNorm without a bias
  (`layer_norm_eps`) unless the config gives `rms_norm_eps`, then RMSNorm; the final norm is of the same kind.
- Attention: grouped-query (layers/attention.py), biases on q/k/v/o with `attention_bias`. Layer i is windowed
  (`sliding_window`) unless layer_types says full_attention; windowed layers rotate q and k, the global ones do not
  (NoPE), except the dense prefix layers when prefix_dense_sliding_window_pattern is 1 (transformers' force_rope).
  The rotation turns (even, odd) feature pairs (Cohere's interleaved rotary: `rope_interleave`).
- Layer i is MoE iff mlp_layer_types[i] is "sparse" (by default every layer from first_k_dense_replace, 0); the
  dense ones are a gated MLP of prefix_dense_intermediate_size.
- MoE: the router takes the top-k of its logits first, then scores them: softmax over the K (what softmax over all
  E, top-k and renormalising gives), or sigmoid (renormalised with norm_topk_prob); num_experts experts of width
  intermediate_size; num_shared_experts shared experts as one MLP of that many times the width, added to the
  experts' output after their reduction ("sum") or averaged with it ("average"), which the registry never fuses
  (our choice: no fused layout exists).
- The logits are multiplied by `logit_scale`; the head is tied to the embedding unless the config says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loadplan.layouts import cohere2_moe_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.mlp import activation
from ..layers.norm import BiaslessLayerNorm
from ..parallel.tensor import TensorParallel
from ..weights import CheckpointNames
from .causal_lm import DeclaredCausalLM
from .config import ConfigError, get_field as _get, moe_layout, per_layer, read_rope
from .qwen_moe import QwenDecoderLayer, QwenMoeConfig, SharedMlpMoeBlock

ARCHITECTURE = "Cohere2MoeForCausalLM"

# (checkpoint, engine) suffixes under model.layers.{i}.
COHERE2_MOE_NAMES = CheckpointNames(tuple(
    (f"mlp.shared_experts.{p}.weight", f"mlp.shared_mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")))

_SHARED_COMBINATIONS = ("sum", "average")
_EXPERT_SELECTIONS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Cohere2MoeConfig(QwenMoeConfig):
    # QwenMoeConfig's fields as this family fills them: intermediate_size sizes the dense prefix layers,
    # moe_intermediate_size the experts; rms_norm_eps is the norms' epsilon, whichever their kind (`layer_norm`).
    layer_types: tuple[str, ...] = ()
    rotated_layers: tuple[int, ...] = ()     # layers whose q and k are rotated
    layer_norm: bool = True                  # LayerNorm without a bias (else RMSNorm)
    logit_scale: float = 1.0
    shared_average: bool = True              # the shared experts' output averaged with the routed one (else summed)
    sigmoid_router: bool = False             # the top-k logits scored by sigmoid (else softmax)

    @classmethod
    def from_hf(cls, d: dict) -> "Cohere2MoeConfig":
        """transformers' Cohere2MoeConfig defaults where a checkpoint may leave a field out."""
        partial = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise ConfigError(f"config.partial_rotary_factor: {partial!r} not supported; Cohere2-MoE rotates whole "
                              f"heads")
        # The registry's reader of the layer and expert fields: layer i is MoE iff mlp_layer_types[i] is "sparse"
        # (by default every layer from first_k_dense_replace).
        layout = moe_layout(cohere2_moe_layout, d)
        n = len(layout.layer_ids)
        hidden = _get(d, "hidden_size", 8192, int)
        heads = _get(d, "num_attention_heads", 64, int)
        width = _get(d, "intermediate_size", 22528, int)
        combination = _choice(d, "shared_expert_combination_strategy", "average", _SHARED_COMBINATIONS)
        selection = _choice(d, "expert_selection_fn", "softmax", _EXPERT_SELECTIONS)
        act = _get(d, "hidden_act", "silu", str)
        activation(act)   # refuses unknown activations by name

        # first_k_dense_replace also sets the attention pattern (layer_types) of the dense prefix when layer_types is
        # absent, whatever mlp_layer_types says (transformers' Cohere2MoeConfig).
        first_dense = _get(d, "first_k_dense_replace", 0, int)
        if not 0 <= first_dense <= n:
            raise ConfigError(f"config.first_k_dense_replace: must be in [0, num_hidden_layers={n}], got {first_dense}")
        prefix_every = _every(d, "prefix_dense_sliding_window_pattern", 1)
        every = _every(d, "sliding_window_pattern", 4)
        # transformers' default: the first first_k_dense_replace layers by the prefix pattern, the rest by the other
        types = per_layer(d, "layer_types", n, ("full_attention", "sliding_attention"),
                          [_kind(i, prefix_every) for i in range(first_dense)]
                          + [_kind(i, every) for i in range(n - first_dense)])
        window = _get(d, "sliding_window", 4096, int) if d.get("sliding_window", 0) is not None else None
        if window is None and "sliding_attention" in types:
            raise ConfigError("config.sliding_window: null is not supported with sliding_attention layers "
                              "(transformers would neither window nor rotate them)")
        if window is not None and window < 1:
            raise ConfigError(f"config.sliding_window: must be >= 1, got {window}")
        rotated = tuple(i for i in range(n) if types[i] == "sliding_attention"
                        or (i not in layout.moe_layers and prefix_every == 1))

        rms_eps = d.get("rms_norm_eps")
        layer_norm = rms_eps is None
        eps = float(_get(d, "layer_norm_eps", 1e-5, (int, float))) if layer_norm \
            else float(_get(d, "rms_norm_eps", kind=(int, float)))
        bias = bool(_get(d, "attention_bias", False, bool))
        logit_scale = _get(d, "logit_scale", 0.0625, (int, float))
        return cls(
            architecture=ARCHITECTURE,
            vocab_size=_get(d, "vocab_size", 256000, int),
            hidden_size=hidden,
            intermediate_size=_get(d, "prefix_dense_intermediate_size", width, int),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=_get(d, "num_key_value_heads", heads, int),
            head_dim=_get(d, "head_dim", 128, int),
            rms_norm_eps=eps,
            hidden_act=act,
            max_position_embeddings=_get(d, "max_position_embeddings", 8192, int),
            tie_word_embeddings=bool(_get(d, "tie_word_embeddings", True, bool)),
            rope=read_rope(d, default_theta=10000.0),
            num_experts=layout.n_routed,
            num_experts_per_tok=layout.top_k,
            moe_intermediate_size=width,
            norm_topk_prob=bool(_get(d, "norm_topk_prob", True, bool)),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=False,
            shared_intermediate_size=width * layout.n_shared,
            moe_layers=layout.moe_layers,
            sliding_window=window,
            layer_types=tuple(types),
            rotated_layers=rotated,
            layer_norm=layer_norm,
            logit_scale=float(logit_scale),
            shared_average=combination == "average",
            sigmoid_router=selection == "sigmoid",
        )


def _choice(d: dict, name: str, default: str, choices: tuple[str, ...]) -> str:
    value = _get(d, name, default, str)
    if value not in choices:
        raise ConfigError(f"config.{name}: {value!r} is not supported; one of {', '.join(choices)}")
    return value


def _every(d: dict, name: str, default: int) -> int:
    every = _get(d, name, default, int)
    if every < 1:
        raise ConfigError(f"config.{name}: must be >= 1, got {every}")
    return every


def _kind(i: int, every: int) -> str:
    """Layer i of a run patterned by `every`: each every-th one global, the others windowed."""
    return "sliding_attention" if (i + 1) % every else "full_attention"


class Cohere2MoeBlock(SharedMlpMoeBlock):
    """The router's top-k logits scored (softmax or sigmoid), the routed experts, and the shared MLP summed with or
    averaged with their output."""

    def __init__(self, cfg: Cohere2MoeConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        self.sigmoid_router = cfg.sigmoid_router
        self.shared_average = cfg.shared_average

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        logits, ids = torch.topk(self.router_logits(x), self.top_k, dim=-1)  # [T, K] each
        if self.sigmoid_router:
            weights = torch.sigmoid(logits)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            weights = torch.softmax(logits, dim=-1, dtype=torch.float)
        y = self.experts(x, ids, weights.to(x.dtype))                         # [T, D], reduced if the plan says
        if self.shared_mlp is None:
            return y
        y = y + self.shared_mlp(x)
        return y / 2 if self.shared_average else y


class Cohere2MoeDecoderLayer(QwenDecoderLayer):
    """x + attn(n) + mlp(n), n = input_layernorm(x): the parallel block, RMSNorm's variant."""

    MOE_BLOCK = Cohere2MoeBlock

    @classmethod
    def make_attention(cls, cfg: Cohere2MoeConfig, layer_id: int, dtype: torch.dtype,
                       tp: TensorParallel) -> GQAttention:
        windowed = cfg.layer_types[layer_id] == "sliding_attention"
        return GQAttention(AttentionSpec.of(cfg, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
                                            sliding_window=cfg.sliding_window if windowed else None,
                                            use_rope=layer_id in cfg.rotated_layers, rope_interleave=True),
                           tp=tp, dtype=dtype)

    def __init__(self, cfg: Cohere2MoeConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        self.post_attention_layernorm = None         # one norm feeds both branches

    def forward(self, x, cos, sin, input_pos=None):
        """x [B, T, D] -> [B, T, D]"""
        B, T, D = x.shape
        h = self.input_layernorm(x)
        return x + self.mixer(h, cos, sin, input_pos) + self.mlp(h.reshape(B * T, D)).view(B, T, D)


class Cohere2MoeLayerNormDecoderLayer(Cohere2MoeDecoderLayer):
    """The parallel block under LayerNorm without a bias (transformers' default: rms_norm_eps null)."""

    NORM = BiaslessLayerNorm


class Cohere2MoeForCausalLM(DeclaredCausalLM):
    ARCHITECTURE = ARCHITECTURE
    TENSOR_PARALLEL = True
    CHECKPOINT_NAMES = COHERE2_MOE_NAMES
    CONFIG = Cohere2MoeConfig

    @classmethod
    def decoder_layer(cls, cfg: Cohere2MoeConfig) -> type[Cohere2MoeDecoderLayer]:
        return Cohere2MoeLayerNormDecoderLayer if cfg.layer_norm else Cohere2MoeDecoderLayer

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return super()._head(h) * self.config.logit_scale

