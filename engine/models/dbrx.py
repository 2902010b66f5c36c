"""DBRX (`DbrxForCausalLM`: Databricks' DBRX), following transformers' modeling_dbrx numerically.

Shapes: B batch, T tokens, D hidden, E experts, F expert width, K top-k, V vocab, H/H_kv heads.

Mixtral's layer (qwen_moe.py's: every layer sparse, no shared expert, so no fusion) with:
- LayerNorms without bias for every norm, the final one too;
- one fused q/k/v projection (`Wqkv` [D + 2 H_kv hd, D]) whose output is clamped to +-clip_qkv;
- the router: softmax of the logits, top-k, the top-k weights divided by their p-norm
  (`moe_normalize_expert_weights` = p; none: not divided).
Its checkpoints hold the whole model under `transformer.` with their own names, the projection fused and each
layer's experts flattened (`ffn.experts.mlp.w1` / `v1` / `w2`, each [E x F, D]; w2 is the down projection transposed):
`dbrx_view` shows them to the weight remapping as the engine spells them, q, k and v as three matrices and every
expert's projections apart, so tensor and expert parallelism split them as any other family's.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from loadplan.layouts import dbrx_layout
from ..layers.mlp import activation
from ..layers.norm import BiaslessLayerNorm
from ..layers.rope import RopeConfig
from ..shown_tensors import ShownTensors
from ..weights import ShapeMismatch
from .causal_lm import DeclaredCausalLM
from .config import ConfigError, get_field as _get, moe_layout
from .qwen_moe import QwenDecoderLayer, QwenMoeConfig, QwenSparseMoeBlock

ARCHITECTURE = "DbrxForCausalLM"


@dataclass(frozen=True)
class DbrxConfig(QwenMoeConfig):
    normalize_p: float | None = 1.0          # moe_normalize_expert_weights: the p of the top-k weights' norm

    @classmethod
    def from_hf(cls, d: dict) -> "DbrxConfig":
        """transformers' DbrxConfig defaults where a checkpoint may leave a field out (attn_config and ffn_config
        are objects of their own: `config.attn_config.kv_n_heads` and so on)."""
        # The registry's reader of the layer and expert fields (n_layers, ffn_config.moe_num_experts and moe_top_k):
        # every layer MoE, no shared expert. ffn_config is read here too for the experts' width and activation.
        layout = moe_layout(dbrx_layout, d)
        attn, ffn = _sub(d, "attn_config"), _sub(d, "ffn_config")
        hidden, heads = _get(d, "d_model", 2048, int), _get(d, "n_heads", 16, int)
        kv = _sub_int(attn, "attn_config", "kv_n_heads", 1)
        if hidden % heads or heads % kv:
            raise ConfigError(f"config.n_heads: {heads} heads must divide d_model={hidden} and be a multiple of "
                              f"attn_config.kv_n_heads={kv}")
        clip = attn.get("clip_qkv")
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0):
            raise ConfigError(f"config.attn_config.clip_qkv: must be > 0 or null, got {clip!r}")
        width = _sub_int(ffn, "ffn_config", "ffn_hidden_size", 3584)
        act = (ffn.get("ffn_act_fn") or {}).get("name", "silu")
        try:
            activation(act)
        except ValueError as e:
            raise ConfigError(f"config.ffn_config.ffn_act_fn: {e}") from None
        p = ffn.get("moe_normalize_expert_weights", 1.0)
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or p <= 0):
            raise ConfigError(f"config.ffn_config.moe_normalize_expert_weights: must be > 0 or null, got {p!r}")
        params = d.get("rope_parameters") or {}
        if params.get("rope_type", "default") != "default" or d.get("rope_scaling"):
            raise ConfigError("config.rope_parameters: only the default rope is supported (DBRX's)")
        theta = params.get("rope_theta", attn.get("rope_theta", 10000.0))
        return cls(
            architecture=ARCHITECTURE, vocab_size=_get(d, "vocab_size", 32000, int), hidden_size=hidden,
            intermediate_size=width, num_hidden_layers=len(layout.layer_ids), num_attention_heads=heads,
            num_key_value_heads=kv, head_dim=hidden // heads, rms_norm_eps=1e-5, hidden_act=act,
            max_position_embeddings=_get(d, "max_seq_len", 2048, int),
            tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False, bool)), rope=RopeConfig(theta=float(theta)),
            num_experts=layout.n_routed, num_experts_per_tok=layout.top_k, moe_intermediate_size=width,
            norm_topk_prob=False, qkv_bias=False, o_bias=False, qk_norm=False,
            moe_layers=layout.moe_layers, clip_qkv=None if clip is None else float(clip),
            normalize_p=None if p is None else float(p))


def _sub(d: dict, name: str) -> dict:
    value = d.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"config.{name}: expected an object, got {value!r}"[:200])
    return value


def _sub_int(sub: dict, where: str, name: str, default: int) -> int:
    value = sub.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.{where}.{name}: expected an integer >= 1, got {value!r}")
    return value


class DbrxMoeBlock(QwenSparseMoeBlock):
    """Softmax router, top-k weights divided by their p-norm, and the routed experts."""

    def __init__(self, cfg: DbrxConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, plan, layer_id, dtype)
        self.normalize_p = cfg.normalize_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        logits = self.router_logits(x)                                     # [T, E]
        weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=logits.dtype), self.top_k, dim=-1)   # [T, K]
        if self.normalize_p is not None:
            weights = weights / torch.norm(weights, p=self.normalize_p, dim=-1, keepdim=True)
        return self.experts(x, ids, weights.to(x.dtype))                   # reduced if the plan says


class DbrxDecoderLayer(QwenDecoderLayer):
    NORM = BiaslessLayerNorm
    MOE_BLOCK = DbrxMoeBlock


class DbrxForCausalLM(DeclaredCausalLM):
    ARCHITECTURE = ARCHITECTURE
    TENSOR_PARALLEL = True
    CONFIG = DbrxConfig
    DECODER_LAYER = DbrxDecoderLayer

    def checkpoint_view(self, ckpt):
        return dbrx_view(ckpt, self.config)


# checkpoint name -> the engine's, outside the blocks
RENAMES = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.norm_f.weight": "model.norm.weight"}
# under transformer.blocks.{i}. -> under model.layers.{i}.
IN_BLOCK = {"norm_attn_norm.norm_1.weight": "input_layernorm.weight",
            "norm_attn_norm.norm_2.weight": "post_attention_layernorm.weight",
            "norm_attn_norm.attn.out_proj.weight": "self_attn.o_proj.weight",
            "ffn.router.layer.weight": "mlp.gate.weight"}
EXPERT_PROJ = {"w1": "gate", "v1": "up", "w2": "down"}


def dbrx_view(ckpt, cfg: DbrxConfig) -> ShownTensors:
    """The checkpoint as the engine spells it: `transformer.` as `model.`, the fused q/k/v as three matrices, each
    layer's flattened experts one at a time (down as [D, F])."""
    view = ShownTensors(ckpt)
    E, F, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for name in ckpt.names():
        head, sep, rest = name.partition(".blocks.")
        layer, _, suffix = rest.partition(".")
        if head != "transformer" or not sep or not layer.isdigit():
            view.show(RENAMES.get(name, name), name)    # lm_head as it is; anything unknown is refused later
            continue
        out = f"model.layers.{layer}."
        shape = tuple(ckpt.shape(name))
        if suffix in IN_BLOCK:
            view.show(out + IN_BLOCK[suffix], name)
        elif suffix == "norm_attn_norm.attn.Wqkv.weight":
            _expect(name, shape, (q + 2 * kv, D))
            for part, lo, hi in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)):
                view.show(f"{out}self_attn.{part}_proj.weight", name, (hi - lo, D), lambda t, lo=lo, hi=hi: t[lo:hi])
        elif suffix.startswith("ffn.experts.mlp.") and suffix.rsplit(".", 1)[1] in EXPERT_PROJ:
            _expect(name, shape, (E * F, D))
            proj = EXPERT_PROJ[suffix.rsplit(".", 1)[1]]
            for e in range(E):
                if proj == "down":                          # w2 is the down projection transposed
                    view.show(f"{out}mlp.experts.{e}.down_proj.weight", name, (D, F),
                              lambda t, e=e: t.view(E, F, D)[e].t())
                else:
                    view.show(f"{out}mlp.experts.{e}.{proj}_proj.weight", name, (F, D),
                              lambda t, e=e: t.view(E, F, D)[e])
        else:
            view.show(name, name)
    return view


def _expect(name: str, shape: tuple[int, ...], want: tuple[int, int]) -> None:
    if shape != want:
        raise ShapeMismatch(f"tensor {name!r} has shape {list(shape)}: expected {list(want)}")
