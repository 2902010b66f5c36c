"""DeepSeek-V3 (and the Kimi-K2.5 wrapper, text only), following transformers numerically.
DeepSeek-V2 (`DeepseekV2ForCausalLM`, below) is the same model with V2's router; DeepSeek-V3.2
(`DeepseekV32ForCausalLM`) the same with DeepSeek Sparse Attention (layers/dsa_indexer.py), and GLM-5
(`GlmMoeDsaForCausalLM`) V3.2's model with the indexer's rope pairs interleaved.

Shapes: B batch, T tokens, D hidden, E routed experts, K top-k, V vocab.

- Attention: Multi-head Latent Attention (layers/mla.py), with or without q_lora_rank,
  interleaved RoPE (`rope_interleave`, default true as in the original code), YaRN.
- Layer i is MoE iff i >= first_k_dense_replace (loadplan/layouts.py reads it,
  and refuses a moe_layer_freq or mlp_layer_types that would say otherwise); the
  others are dense SwiGLU MLPs of intermediate_size.
- MoE: sigmoid router with e_score_correction_bias and group-limited top-k
  (layers/deepseek_router.py; V2: softmax, greedy or group-limited, layers/
  deepseek_v2_router.py), routed experts (engine/moe.py) whose weights already
  carry routed_scaling_factor, and the shared expert:
    unfused: out = routed(x) + shared_experts(x)   (computed replicated, after any reduction)
    fused (plan): the shared expert is expert slot n_routed_experts, selected by every
    token with a weight that makes it count x1 (DESIGN 5.3), times the plan's scale.
- The checkpoint's Multi-Token-Prediction layers (model.layers.{num_hidden_layers}...)
  are not part of the causal LM: skipped at load, as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loadplan.layouts import deepseek_layout, deepseek_nextn_layout
from ..layers.deepseek_router import DeepseekV3Router, RouterSpec
from ..layers.deepseek_v2_router import TOPK_METHODS as V2_TOPK_METHODS
from ..layers.deepseek_v2_router import DeepseekV2Router
from ..layers.dsa_indexer import SparseIndexer, TopKSelection
from ..layers.mla import MLASpec, MultiHeadLatentAttention
from ..layers.mlp import GatedMLP
from ..moe import RoutedExperts
from ..parallel.tensor import TensorParallel
from .causal_lm import BlockLayer, DeclaredCausalLM, DecoderLayer
from .config import REQUIRED, ConfigError, DecoderConfig, Family, get_field as _get
from .text_wrapper import TextOnlyWrapper


@dataclass(frozen=True)
class DeepseekMoeConfig(DecoderConfig):
    """The fields of DeepSeek's MoE layers (DeepseekV3MoE and the dense MLPs before them), the part of their configs
    DeepSeek-V3's and GLM-4-MoE's families share."""

    intermediate_size: int            # dense layers
    moe_intermediate_size: int        # each routed expert; the shared one is n_shared_experts times wider
    num_attention_heads: int
    attention_bias: bool
    hidden_act: str
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int          # the first MoE layer (num_hidden_layers: none)
    num_nextn_predict_layers: int
    moe_layers: tuple[int, ...]
    scoring_func: str = "sigmoid"       # V2, ERNIE-4.5: softmax
    topk_method: str = "noaux_tc"       # V2: greedy or group_limited_greedy
    renorm_min: float | None = None     # the router's (layers/deepseek_router.py); None: V3's + 1e-20

    @property
    def num_experts(self) -> int:
        """The routed experts (DeclaredCausalLM's name for n_routed_experts)."""
        return self.n_routed_experts

    @classmethod
    def layout_fields(cls, layout, d: dict, draft: bool = False) -> dict:
        """The fields the registry's layout gives (`moe_layout`); a draft's layers are numbered after the target's
        num_hidden_layers (what its config dataclass counts)."""
        return dict(num_hidden_layers=layout.layer_ids[0] if draft else len(layout.layer_ids),
                    n_routed_experts=layout.n_routed, n_shared_experts=layout.n_shared,
                    num_experts_per_tok=layout.top_k, first_k_dense_replace=first_moe_layer(layout),
                    moe_layers=layout.moe_layers)


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Config(DeepseekMoeConfig):
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    index_n_heads: int = 0              # V3.2's sparse attention indexer (0: none)
    index_head_dim: int = 0
    index_topk: int = 0
    index_rope_interleave: bool = False # GLM-5's indexer rotates interleaved pairs
    index_shared_layers: tuple[int, ...] = ()   # GLM-5: layers that reuse the previous full layer's top-k

    @classmethod
    def from_hf(cls, d: dict, architecture: str = "DeepseekV3ForCausalLM") -> "DeepseekV3Config":
        return DEEPSEEK_FAMILIES[architecture].read(d, cls)

    @classmethod
    def from_layout(cls, d: dict, layout, architecture: str = "DeepseekV3ForCausalLM") -> "DeepseekV3Config":
        """config.json `d` read as DeepSeek's fields, its layers and experts as `layout` says (`moe_layout` of the
        family's reader: a family of DeepSeek's model under other names or defaults reads them with its own)."""
        return DEEPSEEK_FAMILIES[architecture].read(d, cls, layout=layout)


def expert_groups(d: dict, fields, *, of_two: bool = True) -> None:
    """A step of `config.Family.own`: n_group and topk_group split the routed experts into groups; `of_two`: a group
    is scored by its two best experts (V3's router), so it needs two."""
    n_routed, n_group, topk_group = fields.n_routed_experts, fields.n_group, fields.topk_group
    if n_group < 1 or n_routed % n_group or not 0 < topk_group <= n_group:
        raise ConfigError(f"config.n_group/topk_group: {n_group}/{topk_group} do not split "
                          f"{n_routed} experts into groups")
    if of_two and n_group > 1 and n_routed // n_group < 2:
        raise ConfigError(f"config.n_group: groups of {n_routed // n_group} expert(s); group scores need 2")


def first_moe_layer(layout) -> int:
    """The first MoE layer of `layout` (its number of layers when it has none): where the dense prefix ends."""
    return layout.moe_layers[0] if layout.moe_layers else len(layout.layer_ids)


SPARSE_ATTENTION_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
NEXTN_ARCHITECTURE = "DeepseekV3ForCausalLMNextN"     # models/deepseek_nextn.py


def _glm5_indexer_fields(d: dict, n_layers: int, *, nextn: bool) -> dict:
    """GLM-5's indexer: interleaved rope, and which layers reuse the previous full layer's top-k instead of running
    their own indexer (transformers' GLM-MoE-DSA: `indexer_types`, else `index_topk_pattern`, else every
    `index_topk_freq`-th layer from `index_skip_topk_offset` (default 2) full, the rest shared).

    An MTP draft (`nextn`) runs its own indexer: its layer is separate from the target's, so there is no previous
    layer's selection to reuse; a list that names its layer (number num_hidden_layers: `n_layers`, the target's)
    shared is refused."""
    types = _indexer_types(d, n_layers)
    if nextn:
        if len(types) > n_layers and types[n_layers] == "shared":
            field = "indexer_types" if d.get("indexer_types") is not None else "index_topk_pattern"
            raise ConfigError(f"config.{field}: layer {n_layers} (the MTP layer) is 'shared': the draft cannot "
                              f"reuse the target's top-k; supported: 'full'")
        return {"index_rope_interleave": True}
    return {"index_rope_interleave": True,
            "index_shared_layers": tuple(i for i, t in enumerate(types[:n_layers]) if t == "shared")}


def _indexer_types(d: dict, n: int) -> list[str]:
    """'full' or 'shared' for each of the `n` layers, as transformers' GlmMoeDsaConfig derives them: from the
    config's list (which may go on to name an MTP layer after them), else from the schedule."""
    types, pattern = d.get("indexer_types"), d.get("index_topk_pattern")
    if types is not None:
        field = "indexer_types"
    elif pattern is not None:
        field, types = "index_topk_pattern", pattern
        if isinstance(pattern, str):
            if set(pattern) - {"F", "S"}:
                raise ConfigError(f"config.index_topk_pattern: {pattern[:200]!r}: letters F (full) and S (shared) "
                                  f"only")
            types = ["full" if c == "F" else "shared" for c in pattern]
    else:
        freq = _get(d, "index_topk_freq", 1, int)
        offset = _get(d, "index_skip_topk_offset", 2, int)
        if freq < 1:
            raise ConfigError(f"config.index_topk_freq: must be >= 1, got {freq}")
        return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if not isinstance(types, list) or any(t not in ("full", "shared") for t in types):
        raise ConfigError(f"config.{field}: {str(types)[:200]}: expected a list of 'full' and 'shared'")
    if len(types) < n:
        raise ConfigError(f"config.{field}: {len(types)} entries for {n} layers")
    if types[0] == "shared":
        raise ConfigError(f"config.{field}: layer 0 is 'shared', but a shared layer reuses the top-k of a previous "
                          f"'full' layer")
    return types


def _sparse_attention_fields(d: dict) -> dict:
    """DeepSeek-V3.2's indexer fields, and the fields transformers' V3.2 does not read refused where they would
    change the arithmetic: its MLA always has a query latent and interleaved rope. (Its dense layers are the first
    first_k_dense_replace, as mlp_layer_types spells them: the registry's reader refuses a list that disagrees.)"""
    if d.get("q_lora_rank") is None:
        raise ConfigError("config.q_lora_rank: sparse attention needs a query latent (its indexer reads it)")
    if d.get("rope_interleave") is False:
        raise ConfigError("config.rope_interleave: False not supported; DeepSeek-V3.2 and GLM-5 run True")
    fields = {name: _get(d, name, kind=int) for name in ("index_n_heads", "index_head_dim", "index_topk")}
    if fields["index_topk"] < 1 or fields["index_n_heads"] < 1:
        bad = "index_topk" if fields["index_topk"] < 1 else "index_n_heads"
        raise ConfigError(f"config.{bad}: must be >= 1, got {fields[bad]}")
    rope = _get(d, "qk_rope_head_dim", kind=int)
    if not rope <= fields["index_head_dim"]:
        raise ConfigError(f"config.index_head_dim: {fields['index_head_dim']} must hold qk_rope_head_dim={rope}")
    return fields


def _refuse_where_v2_references_differ(d: dict) -> None:
    """transformers' DeepSeek-V2 ignores these fields where DeepSeek's own V2 code honours them (or has no
    bias-free MLP for them): a config that sets them has no single reference to match, so it is refused."""
    if _get(d, "norm_topk_prob", False, bool):
        raise ConfigError("config.norm_topk_prob: true not supported for DeepseekV2ForCausalLM (transformers does "
                          "not renormalise V2's top-k weights); supported: false")
    if _get(d, "mlp_bias", False, bool):
        raise ConfigError("config.mlp_bias: true not supported; supported: false")


def _router(v2: bool):
    """A step of `Family.own`: the router DeepseekV3MoE builds for the config's scoring_func and topk_method (V2's
    softmax, greedy or group-limited; else V3's sigmoid with the bias-corrected top-k), its groups checked."""
    scoring, methods = ("softmax", V2_TOPK_METHODS) if v2 else ("sigmoid", ("noaux_tc",))

    def check(d: dict, fields) -> None:
        if fields.scoring_func != scoring:
            raise ConfigError(f"config.scoring_func: {fields.scoring_func!r} not supported; supported: {scoring}")
        if fields.topk_method not in methods:
            raise ConfigError(f"config.topk_method: {fields.topk_method!r} not supported; supported: "
                              f"{', '.join(methods)}")
        if v2:
            _refuse_where_v2_references_differ(d)
        expert_groups(d, fields, of_two=not v2)
    return check


def _q_lora_rank(d: dict, fields) -> dict:
    """q_lora_rank: the query latent's width, or null (none)."""
    q_lora_rank = d.get("q_lora_rank")
    if q_lora_rank is not None and (not isinstance(q_lora_rank, int) or isinstance(q_lora_rank, bool)):
        raise ConfigError(f"config.q_lora_rank: expected int or null, got {q_lora_rank!r}")
    return {"q_lora_rank": q_lora_rank}


def _indexer(architecture: str):
    """A step of `Family.own`: V3.2's sparse attention fields for its entry classes and for the NextN draft of a V3.2
    checkpoint (whose MTP layer's attention has the indexer too; SGLang plans it as DeepseekV3ForCausalLMNextN with
    index_topk set); GLM-5's indexer, and its MTP layer's (SGLang plans a GLM-5 draft as DeepseekV3ForCausalLMNextN
    too: its config still says model_type glm_moe_dsa)."""
    nextn = architecture == NEXTN_ARCHITECTURE

    def read(d: dict, fields) -> dict:
        v32 = architecture in SPARSE_ATTENTION_ARCHITECTURES or (nextn and d.get("index_topk") is not None)
        index = _sparse_attention_fields(d) if v32 else {}
        if architecture == "GlmMoeDsaForCausalLM" or (v32 and d.get("model_type") == "glm_moe_dsa"):
            index.update(_glm5_indexer_fields(d, fields.num_hidden_layers, nextn=nextn))
        return index
    return read


# What DeepSeek-V3's and GLM-4-MoE's families read alike (transformers has no default for the sizes).
DEEPSEEK_MOE_FIELDS = dict(vocab_size=REQUIRED, hidden_size=REQUIRED, intermediate_size=REQUIRED,
                           moe_intermediate_size=REQUIRED, num_attention_heads=REQUIRED, attention_bias=False,
                           hidden_act="silu", tie_word_embeddings=False, n_group=1, topk_group=lambda f: f.n_group,
                           norm_topk_prob=True, routed_scaling_factor=1.0, **{"num_nextn_predict_layers": 0})
# transformers' DeepseekV3Config defaults where a checkpoint may leave a field out (rope_interleave: true, as in
# DeepSeek's own code).
DEEPSEEK_FIELDS = dict(DEEPSEEK_MOE_FIELDS, kv_lora_rank=REQUIRED, qk_nope_head_dim=REQUIRED,
                       qk_rope_head_dim=REQUIRED, v_head_dim=REQUIRED, rope_interleave=True,
                       max_position_embeddings=4096, rms_norm_eps=1e-6, scoring_func="sigmoid", topk_method="noaux_tc")


def deepseek_family(architecture: str) -> Family:
    """DeepSeek-V3's row for `architecture`: V2's router and defaults (its rope always rotates (even, odd) pairs:
    transformers multiplies them as complex numbers), V3.2's and GLM-5's indexer, a NextN draft's layers (the
    registry's reader of its MTP layers after the target's)."""
    v2, nextn = architecture == "DeepseekV2ForCausalLM", architecture == NEXTN_ARCHITECTURE
    defaults = dict(DEEPSEEK_FIELDS, norm_topk_prob=False, scoring_func="softmax", topk_method="greedy") if v2 \
        else DEEPSEEK_FIELDS
    if v2:
        defaults = {k: v for k, v in defaults.items() if k != "rope_interleave"}
    return Family(architecture, deepseek_nextn_layout if nextn else deepseek_layout, defaults,
                  fixed={"rope_interleave": True} if v2 else {},
                  own=(_router(v2), _q_lora_rank, _indexer(architecture)), draft=nextn)


DEEPSEEK_FAMILIES = {a: deepseek_family(a) for a in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM",
                                                     *SPARSE_ATTENTION_ARCHITECTURES, NEXTN_ARCHITECTURE)}


class DeepseekV3MoE(nn.Module):
    """gate (router), experts (stacked, + fused shared slot when the plan fuses), shared_experts (unfused).
    GLM-4-MoE's block too (glm4_moe.py): `cfg` is any config naming the MoE fields read here."""

    def __init__(self, cfg: DeepseekV3Config, plan, layer_id: int, dtype: torch.dtype):
        super().__init__()
        D = cfg.hidden_size
        self.experts = RoutedExperts(cfg.n_routed_experts, D, cfg.moe_intermediate_size, plan,
                                     layer_id=layer_id, dtype=dtype)
        fused = self.experts.num_fused_shared_experts
        if fused and (fused != 1 or cfg.n_shared_experts != 1):
            raise ValueError(f"layer {layer_id}: plan fuses {fused} shared expert slot(s) but the config has "
                             f"n_shared_experts={cfg.n_shared_experts}; only one shared expert can be a slot")
        if cfg.topk_method != "noaux_tc":   # DeepSeek-V2's greedy or group-limited top-k, no score bias
            if fused:
                raise ValueError(f"layer {layer_id}: plan fuses the shared experts but DeepSeek-V2's router has no "
                                 f"fused slot (the registry never fuses V2: not the fused architecture)")
            self.gate = DeepseekV2Router(D, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.topk_method,
                                         cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
        else:
            # The experts layer read the plan's fused-slot count and scale; the router writes that column.
            spec = RouterSpec(D, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                              cfg.norm_topk_prob, cfg.routed_scaling_factor, scoring=cfg.scoring_func,
                              renorm_min=cfg.renorm_min, routing_bias=getattr(cfg, "routing_bias", True))  # Mistral 4
            self.gate = DeepseekV3Router(spec, num_fused_shared_experts=fused,
                                         fused_shared_expert_scale=self.experts.fused_shared_expert_scale)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = GatedMLP(D, shared, cfg.hidden_act, dtype) if shared and not fused else None
        # HY-V3 (models/hy_v3.py) sums the routed and shared outputs in float32; the others in the model's dtype
        self.fp32_combine = getattr(cfg, "moe_fp32_combine", False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]"""
        ids, weights = self.gate(x)                                 # [T, K(+1)], rsf already applied
        y = self.experts(x, ids, weights.to(x.dtype))               # reduced if the plan says
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            y = (y.float() + shared.float()).to(x.dtype) if self.fp32_combine else y + shared
        return y


def moe_or_dense_mlp(cfg, plan, layer_id: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
    """A DeepSeek-style layer's MLP: `DeepseekV3MoE` on cfg.moe_layers (its unfused shared experts run
    replicated), else the dense GatedMLP, split over the TP ranks. `cfg`: any config naming those fields
    (DeepSeek-V3's, GLM-4-MoE's, dots.llm1's)."""
    if layer_id in cfg.moe_layers:
        return DeepseekV3MoE(cfg, plan, layer_id, dtype)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, dtype, tp=tp)


class DeepseekMoeLayer(BlockLayer):
    """A layer over DeepSeek's MoE block or the dense MLP (`moe_or_dense_mlp`); its token mixer the subclass's."""

    @classmethod
    def make_mlp(cls, cfg, plan, layer_id: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        return moe_or_dense_mlp(cfg, plan, layer_id, dtype, tp)


class DeepseekV3DecoderLayer(DeepseekMoeLayer):
    @classmethod
    def make_attention(cls, cfg: DeepseekV3Config, layer_id: int, dtype: torch.dtype,
                       tp: TensorParallel) -> MultiHeadLatentAttention:
        indexer = None
        shared = layer_id in cfg.index_shared_layers   # GLM-5: reuses the previous full layer's top-k
        if cfg.index_topk and not shared:   # DeepSeek-V3.2
            indexer = SparseIndexer(cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim,
                                    cfg.qk_rope_head_dim, cfg.index_topk, dtype, cfg.index_rope_interleave)
        return MultiHeadLatentAttention(MLASpec.of(cfg, rope_interleave=cfg.rope_interleave), tp=tp, dtype=dtype,
                                        indexer=indexer, reuses_selection=shared)


class LatentCausalLM(DeclaredCausalLM):
    """An entry class of Multi-head Latent Attention layers (layers/mla.py): its rotary tables cover
    qk_rope_head_dim."""

    TENSOR_PARALLEL = True

    @classmethod
    def rope_head_dim(cls, cfg) -> int:
        return cfg.qk_rope_head_dim


class DeepseekV3ForCausalLM(LatentCausalLM):
    ARCHITECTURE = "DeepseekV3ForCausalLM"
    FAMILY = DEEPSEEK_FAMILIES[ARCHITECTURE]
    CONFIG = DeepseekV3Config
    DECODER_LAYER: type[DecoderLayer] = DeepseekV3DecoderLayer   # a family of V3's model with layers of its own

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        super().__init__(hf_config, plan, dtype=dtype)
        cfg = self.config
        self.selection: TopKSelection | None = None
        if cfg.index_shared_layers:
            # GLM-5's shared layers read the top-k of the full layer before them: one selection for the stage's
            # layers, written by each full layer, read by the shared ones after it, and handed to the next
            # pipeline stage (whose first layers may be shared).
            self.selection = TopKSelection()
            lo, hi = self.layer_range
            for layer in self.model.layers[lo:hi]:
                layer.self_attn.selection = self.selection

    def stage_carry(self) -> list[torch.Tensor]:
        if self.selection is None:
            return []
        return [self.selection.latest()]                  # [B, 1, T, S]

    def take_stage_carry(self, tensors: list[torch.Tensor]) -> None:
        if self.selection is None:
            return super().take_stage_carry(tensors)
        if len(tensors) != 1:
            raise ValueError(f"pipeline stage {self.layer_range} takes the previous stage's top-k selection, got "
                             f"{len(tensors)} tensors")
        self.selection.keep(tensors[0])


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2 / V2-Lite: V3's model with a softmax router (greedy or group-limited top-k, no score bias,
    no renormalisation), layer i MoE iff i >= first_k_dense_replace; shared experts never fused."""

    ARCHITECTURE = "DeepseekV2ForCausalLM"
    FAMILY = DEEPSEEK_FAMILIES[ARCHITECTURE]


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: V3's model whose MLA attends to the keys a lightning indexer picks (layers/dsa_indexer.py).
    Not the fused architecture (DESIGN 5.2): its shared expert runs unfused."""

    ARCHITECTURE = "DeepseekV32ForCausalLM"
    FAMILY = DEEPSEEK_FAMILIES[ARCHITECTURE]


class GlmMoeDsaForCausalLM(DeepseekV3ForCausalLM):
    """GLM-5: V3.2's model (DeepSeek-V3's MoE, MLA with the sparse attention indexer) whose indexer rotates
    interleaved pairs. Its own fused architecture (as SGLang's): its shared expert fuses where the gate allows."""

    ARCHITECTURE = "GlmMoeDsaForCausalLM"
    FAMILY = DEEPSEEK_FAMILIES[ARCHITECTURE]


class KimiK25ForConditionalGeneration(TextOnlyWrapper):
    """Kimi-K2.5 run text-only: its DeepSeek-V3 body built from config["text_config"], kept under
    `language_model.` as in the checkpoint; the vision tower and projector weights are skipped."""

    INNER = DeepseekV3ForCausalLM
    TENSOR_PARALLEL = True            # its DeepSeek-V3 body's
    OTHER_TOWERS = ("vision_tower.", "mm_projector.", "multi_modal_projector.")

