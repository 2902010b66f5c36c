"""Nemotron-H (`NemotronHForCausalLM`: NVIDIA's Nemotron 3 Nano 30B-A3B and the other hybrid Nemotrons), following
transformers' modeling_nemotron_h numerically.

Shapes: B batch, T tokens, D hidden, E experts, K top-k, V vocab.

Each layer is ONE block, x + mixer(norm(x)), whose mixer is by `layers_block_type` (or the older
`hybrid_override_pattern`: M, *, E, -) one of:
- "linear_attention" (M): a Mamba2 layer (layers/mamba2.py; its dt clamped below at `time_step_min`, as
  transformers does);
- "full_attention" (*): grouped-query attention without rotary embedding or biases (NoPE);
- "moe" (E): DeepSeek-V3's sigmoid router (a routing bias, group-limited top-k, renormalised, scaled) over
  experts WITHOUT a gate, down(relu(up(x))^2) (engine/moe.py's `gated=False`), plus one shared relu^2 MLP of
  `moe_shared_expert_intermediate_size` beside them, which the registry never fuses;
- "mlp" (-): a dense relu^2 MLP.
The norms multiply their weight before the cast back (`WeightFirstRMSNorm`). Its checkpoints keep the model under
`backbone.` (`embeddings`, `norm_f`) and every block's mixer as `mixer.`: shown to the loader under the engine's names
by the layer's kind (`engine_names`). The Multi-Token-Prediction layers (`mtp.*`) are skipped by name. A latent MoE
(`moe_latent_size` L, Nemotron 3 Super's) routes on the hidden state but runs its experts on fc1_latent_proj(x)
[T, L] and returns fc2_latent_proj of their reduced sum (both projections replicated; the shared MLP reads x).
Under tensor parallelism the attention heads, the Mamba2 heads (layers/mamba2.py), the dense MLP's and every
expert's features split; the shared MLP is replicated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from loadplan.layouts import nemotron_h_layout
from ..layers.attention import AttentionSpec, GQAttention
from ..layers.deepseek_router import DeepseekV3Router, RouterSpec
from ..layers.mamba2 import Mamba2Mixer, Mamba2Spec, rows_by_rank
from ..layers.mlp import UNGATED_ACTIVATIONS, UngatedMLP
from ..layers.norm import WeightFirstRMSNorm
from ..layers.rope import RopeConfig
from ..moe import RoutedExperts
from ..parallel.tensor import TensorParallel
from ..shown_tensors import ShownTensors
from .causal_lm import DeclaredCausalLM
from .config import ConfigError, get_field as _get, moe_layout

ARCHITECTURE = "NemotronHForCausalLM"
# A layer's kind as configs spell it (transformers 5, its older names, hybrid_override_pattern) -> the engine's.
KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
         "moe": "moe", "mlp": "mlp"}
PATTERN = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
# The checkpoint's name of a block's mixer -> the engine's, by the block's kind.
MIXER_NAME = {"mamba": "mamba", "attention": "self_attn", "moe": "mlp", "mlp": "mlp"}


@dataclass(frozen=True)
class NemotronHConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_kinds: tuple[str, ...]          # mamba / attention / moe / mlp per layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int                # the dense relu^2 MLP layers
    mlp_act: str                          # mlp_hidden_act: the MLPs' and experts' activation
    mlp_bias: bool
    rms_norm_eps: float                   # layer_norm_epsilon
    max_position_embeddings: int
    tie_word_embeddings: bool
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool                        # the Mamba2 layers' in_proj and out_proj
    time_step_min: float                  # each position's dt is clamped below at it
    num_experts: int                      # n_routed_experts
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_nextn_predict_layers: int
    moe_layers: tuple[int, ...]
    moe_latent_size: int | None = None    # the experts' width in and out (None: hidden_size, no projections)
    rope: RopeConfig = RopeConfig()       # unused: no layer turns q or k (CausalLM builds its tables anyway)

    @classmethod
    def from_hf(cls, d: dict) -> "NemotronHConfig":
        """transformers' NemotronHConfig defaults where a checkpoint may leave a field out, its older field names
        (mamba_n_groups, mamba_d_conv, ...) read first as transformers reads them."""
        layout = moe_layout(nemotron_h_layout, d)        # the registry's reader of the layer and expert fields
        kinds = _layer_kinds(d)
        latent = d.get("moe_latent_size")
        if latent is not None and (isinstance(latent, bool) or not isinstance(latent, int) or latent < 1):
            raise ConfigError(f"config.moe_latent_size: expected an integer >= 1 or null, got {latent!r}")
        for field, default in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
            act = _get(d, field, default, str)
            if act != default and not (field == "mlp_hidden_act" and act in UNGATED_ACTIVATIONS):
                raise ConfigError(f"config.{field}: {act!r} not supported; supported: {default}")
        hidden = _get(d, "hidden_size", 4096, int)
        heads, m_heads = _get(d, "num_attention_heads", 32, int), _get(d, "mamba_num_heads", 128, int)
        groups = _legacy(d, "mamba_n_groups", "n_groups", 8)
        if groups < 1 or m_heads % groups:
            raise ConfigError(f"config.n_groups: {groups} must be >= 1 and divide mamba_num_heads={m_heads}")
        kernel = _legacy(d, "mamba_d_conv", "conv_kernel", 4)
        if kernel < 1:
            raise ConfigError(f"config.conv_kernel: must be >= 1, got {kernel}")
        n_experts = layout.n_routed
        n_group = _get(d, "n_group", 1, int)
        if n_group < 1 or n_experts % n_group:
            raise ConfigError(f"config.n_group: {n_group} must be >= 1 and divide n_routed_experts={n_experts}")
        topk_group = _get(d, "topk_group", 1, int)
        if not 1 <= topk_group <= n_group:
            raise ConfigError(f"config.topk_group: {topk_group} must be in [1, n_group={n_group}]")
        dt_min = d.get("mamba_dt_min", d.get("time_step_min", 0.001))
        if isinstance(dt_min, bool) or not isinstance(dt_min, (int, float)) or not 0 <= dt_min < math.inf:
            raise ConfigError(f"config.time_step_min: expected a number >= 0, got {dt_min!r}")
        return cls(
            vocab_size=_get(d, "vocab_size", 131072, int),
            hidden_size=hidden,
            num_hidden_layers=len(layout.layer_ids),
            layer_kinds=kinds,
            num_attention_heads=heads,
            num_key_value_heads=_get(d, "num_key_value_heads", 8, int),
            head_dim=_get(d, "head_dim", 128, int),
            intermediate_size=_get(d, "intermediate_size", 21504, int),
            mlp_act=_get(d, "mlp_hidden_act", "relu2", str),
            mlp_bias=bool(_get(d, "mlp_bias", False, bool)),
            rms_norm_eps=float(_get(d, "layer_norm_epsilon", 1e-5, (int, float))),
            max_position_embeddings=_get(d, "max_position_embeddings", 4096, int),
            # transformers never ties its head to the embedding (no tied weights, whatever the config says)
            tie_word_embeddings=False,
            mamba_num_heads=m_heads,
            mamba_head_dim=_get(d, "mamba_head_dim", 64, int),
            n_groups=groups,
            ssm_state_size=_get(d, "ssm_state_size", 128, int),
            conv_kernel=kernel,
            use_conv_bias=bool(_legacy(d, "mamba_conv_bias", "use_conv_bias", True, bool)),
            use_bias=bool(_get(d, "use_bias", False, bool)),
            time_step_min=float(dt_min),
            num_experts=n_experts,
            num_experts_per_tok=layout.top_k,
            moe_intermediate_size=_get(d, "moe_intermediate_size", 7688, int),
            moe_shared_expert_intermediate_size=_get(d, "moe_shared_expert_intermediate_size", 7688, int),
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(_get(d, "norm_topk_prob", True, bool)),
            routed_scaling_factor=float(_get(d, "routed_scaling_factor", 1.0, (int, float))),
            num_nextn_predict_layers=_get(d, "num_nextn_predict_layers", 0, int),
            moe_layers=layout.moe_layers,
            moe_latent_size=latent,
        )


def _legacy(d: dict, old: str, new: str, default, kind=int):
    """A field transformers reads by its older name first (`old`), else by `new`."""
    return _get(d, old, kind=kind) if d.get(old) is not None else _get(d, new, default, kind)


def _layer_kinds(d: dict) -> tuple[str, ...]:
    """Each layer's kind, for its token mixer (the layout gives only which layers are MoE): `layers_block_type` (its
    alias `layer_types`), else `hybrid_override_pattern`, else transformers' default [mamba, moe, attention, mlp].
    The registry's reader (`nemotron_h_layout`) has refused what these do not name."""
    field = next((f for f in ("layers_block_type", "layer_types") if d.get(f) is not None), None)
    if field is not None:
        return tuple(KINDS[k] for k in d[field])
    pattern = d.get("hybrid_override_pattern")
    return ("mamba", "moe", "attention", "mlp") if pattern is None else tuple(PATTERN[c] for c in pattern)


class NemotronHMoE(nn.Module):
    """The router, the ungated routed experts (in the latent width, between its projections, where the config has
    one), and the shared MLP added after their reduction (replicated)."""

    def __init__(self, cfg: NemotronHConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__()
        D, L = cfg.hidden_size, cfg.moe_latent_size
        self.gate = DeepseekV3Router(RouterSpec(D, cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group,
                                                cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor))
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if L is not None:
            self.fc1_latent_proj = nn.Linear(D, L, bias=cfg.mlp_bias, dtype=dtype)
            self.fc2_latent_proj = nn.Linear(L, D, bias=cfg.mlp_bias, dtype=dtype)
        act = UNGATED_ACTIVATIONS[cfg.mlp_act]
        self.experts = RoutedExperts(cfg.num_experts, L or D, cfg.moe_intermediate_size, plan,
                                     layer_id=layer_id, dtype=dtype, activation=act, gated=False)
        if self.experts.num_fused_shared_experts:
            raise ValueError(f"layer {layer_id}: the plan fuses a shared expert, but Nemotron-H's experts have no "
                             f"fused layout")
        self.shared_experts = UngatedMLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.mlp_act,
                                         cfg.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        ids, weights = self.gate(x)                                    # [T, K], rsf applied
        if self.fc1_latent_proj is None:
            return self.experts(x, ids, weights.to(x.dtype)) + self.shared_experts(x)
        y = self.experts(self.fc1_latent_proj(x), ids, weights.to(x.dtype))   # [T, L], reduced if the plan says
        return self.fc2_latent_proj(y) + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    """x + mixer(norm(x)): a token mixer (Mamba2, attention: `mixer`, which holds the cache) or an MLP / MoE (`mlp`,
    over the tokens flattened)."""

    NORM = WeightFirstRMSNorm

    def __init__(self, cfg: NemotronHConfig, plan, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.layer_id, self.kind = layer_id, cfg.layer_kinds[layer_id]
        self.rotary = None   # no layer of its turns q or k
        tp = TensorParallel.of(plan)
        self.norm = WeightFirstRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mamba = self.self_attn = self.mlp = None
        if self.kind == "mamba":
            self.mamba = Mamba2Mixer(Mamba2Spec(cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups,
                                                cfg.ssm_state_size, cfg.conv_kernel, cfg.use_conv_bias, cfg.use_bias,
                                                cfg.rms_norm_eps, (cfg.time_step_min, math.inf),
                                                fields=("mamba_num_heads", "n_groups")), tp=tp, dtype=dtype)
        elif self.kind == "attention":
            self.self_attn = GQAttention(AttentionSpec.of(cfg, use_rope=False), tp=tp, dtype=dtype)
        elif layer_id in cfg.moe_layers:     # the layout's MoE layers: its "moe" blocks
            self.mlp = NemotronHMoE(cfg, plan, layer_id, dtype)
        else:
            self.mlp = UngatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act, cfg.mlp_bias, dtype, tp=tp)

    @property
    def mixer(self) -> nn.Module | None:
        """The token mixer and its cache; None on an MLP or MoE layer (nothing cached)."""
        return self.mamba if self.mamba is not None else self.self_attn

    def forward(self, x, cos, sin, input_pos=None):
        """x [B, T, D] -> [B, T, D]"""
        h = self.norm(x)
        if self.mlp is None:
            return x + self.mixer(h, cos, sin, input_pos)
        B, T, D = x.shape
        return x + self.mlp(h.reshape(B * T, D)).view(B, T, D)


class NemotronHForCausalLM(DeclaredCausalLM):
    ARCHITECTURE = ARCHITECTURE
    MTP_PREFIXES = ("mtp.",)
    CONFIG = NemotronHConfig
    DECODER_LAYER = NemotronHBlock
    TENSOR_PARALLEL = True


    def checkpoint_view(self, ckpt):
        """`backbone.` and each block's `mixer.` under the engine's names; with tp_size > 1 the Mamba2 layers' rows
        regrouped by rank (layers/mamba2.py)."""
        cfg = self.config
        view = engine_names(ckpt, cfg.layer_kinds)
        tp = self.plan.request.parallel.tp_size
        if tp == 1:
            return view
        return rows_by_rank(view, [f"model.layers.{i}.mamba." for i, k in enumerate(cfg.layer_kinds) if k == "mamba"],
                            tp, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size)


_BLOCK = re.compile(r"^backbone\.layers\.(\d+)\.mixer\.")
_RENAMES = (("backbone.embeddings.", "model.embed_tokens."), ("backbone.norm_f.", "model.norm."),
            ("backbone.", "model."))


def engine_names(ckpt, kinds: tuple[str, ...]) -> ShownTensors:
    """The checkpoint under the engine's names: `backbone.` as `model.` (its `embeddings` and `norm_f` as
    `embed_tokens` and `norm`), and layer i's `mixer.` as the engine's module of its kind (MIXER_NAME). A layer
    beyond `kinds` keeps its mixer's name: the loader refuses it as another model's."""
    view = ShownTensors(ckpt)
    for name in ckpt.names():
        shown = name
        m = _BLOCK.match(name)
        if m and int(m[1]) < len(kinds):
            shown = f"model.layers.{m[1]}.{MIXER_NAME[kinds[int(m[1])]]}.{name[m.end():]}"
        else:
            shown = next((new + name[len(old):] for old, new in _RENAMES if name.startswith(old)), name)
        view.show(shown, name)
    return view
