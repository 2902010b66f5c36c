"""Which layers exist and which of them are MoE, per family (from config.json).

Conventions follow the architectures' reference implementations:
- DeepSeek/GLM: layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0.
- Qwen2/Qwen3-MoE and Qwen3-Next: layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0;
  Qwen3.5-MoE: every layer. A shared expert (Qwen2-MoE, Qwen3-Next, Qwen3.5) unless shared_expert_intermediate_size
  is 0.
- Mixtral, OLMoE, FlexOlmo, gpt-oss, MiniMax-M2, Granite MoE and Phi-3.5-MoE: every layer is MoE (num_experts
  routed experts for OLMoE and FlexOlmo, num_local_experts for the others; no shared expert).
- GLM-4-MoE-Lite: layer i is MoE iff mlp_layer_types[i] is "sparse" (by default every layer
  but the first).
- Llama 4: layer i is MoE iff i is in moe_layers, or else i % interleave_moe_layer_step ==
  interleave_moe_layer_step - 1; every MoE layer has one shared expert.
- ERNIE-4.5: layer i is MoE iff (i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <=
  moe_layer_end_index (-1: the last layer), with moe_num_experts routed experts, moe_k of them a token and
  moe_num_shared_experts shared ones.
- MiMo-V2-Flash: layer i is MoE iff mlp_layer_types[i] is "sparse" (by default all but the first), with
  n_routed_experts routed experts; no shared one.
- DBRX: every one of n_layers is MoE, with ffn_config.moe_num_experts routed experts, moe_top_k a token; no shared
  expert.
- LFM2-MoE: layer i is MoE iff i >= num_dense_layers (2), with num_experts routed experts; no shared one.
- AFMoE: layer i is MoE iff i >= num_dense_layers (1), with num_experts routed experts and
  num_shared_experts (2) shared ones.
- EXAONE-MoE: layer i is MoE iff mlp_layer_types[i] is "sparse" (by default every layer from
  first_k_dense_replace, 1), with num_experts routed experts and num_shared_experts shared ones.
- Hunyuan (A13B): every layer is MoE, with num_experts routed experts, moe_topk of them a token and
  num_shared_expert shared MLPs (1 by default); the Hub's configs write these per layer (lists that agree).
- Kimi-Linear: layer i is MoE iff mlp_layer_types[i] is "sparse" (by default every layer from
  first_k_dense_replace, 1), with num_experts routed experts, num_experts_per_token of them a token and
  num_shared_experts shared ones (transformers' names for DeepSeek-V3's fields).
- Ling 3 hybrids (Bailing): Kimi-Linear's, with 512 experts and the first 2 layers dense by default.
- LongCat-Flash: each of num_layers layers is MoE (its two sublayers share one MoE block), with n_routed_experts
  routed experts and no shared one; its zero-computation experts are not placed.
- Solar Open: every layer MoE, with n_routed_experts routed experts and n_shared_experts (1) shared ones.
- Step-3.5 (Step-3.7's text model): layer i is MoE iff mlp_layer_types[i] is "sparse" (else the layers moe_layers_enum
  lists, else every layer from the fourth), with n_routed_experts (288) routed experts, num_experts_per_tok (8) of
  them a token and one shared expert; the Hub's per-layer lists that also cover its MTP layers
  (num_nextn_predict_layers) are cut to the model's layers.
- HY-V3: layer i is MoE iff mlp_layer_types[i] is "sparse" (by default every layer but the first), with num_experts
  (192) routed experts, num_experts_per_tok (8) of them a token and num_shared_experts (1) shared ones.
- Laguna: layer i is MoE iff mlp_layer_types[i] is "sparse" (by default all but the first), with num_experts (256)
  routed experts, num_experts_per_tok (8) of them a token and one shared expert.
- A.X K1: DeepSeek-V3's layout with transformers' AXK1Config defaults, or mlp_layer_types where the config has it.
- Flint: Qwen's layout (mlp_only_layers by default [0, 1]) with num_experts (256) routed experts, top-6, and one
  shared expert.
- Kolibri-1: every one of num_hidden_layers (50) is MoE, with num_experts (384) routed experts, top-6, and one shared
  expert.
- Mellum: layer i is MoE iff mlp_layer_types[i] is "sparse" (by default every layer), with num_experts (64) routed
  experts, num_experts_per_tok (8) of them a token; no shared expert.
- Mistral 4: DeepSeek-V3's layout with transformers' Mistral4Config defaults (every layer MoE; 128 experts, top-4,
  one shared).
- Sarvam (sarvam-105b's MLA, sarvam-30b's MoE): DeepSeek-V3's and GLM-4-MoE's layouts under Sarvam's names
  (num_experts, num_shared_experts) and defaults (the first layer dense; 128 experts, top-8 or top-6).
- Cohere2-MoE: layer i is MoE iff mlp_layer_types[i] is "sparse" (by default every layer from
  first_k_dense_replace, 0), with num_experts (8) routed experts, num_experts_per_tok (2) of them a token and
  num_shared_experts (0) shared ones.
- A NextN draft has num_nextn_predict_layers MoE layers numbered after the target's.

A config is read as the references read it (transformers' config class and model; SGLang's, for what SGLang
builds): a field left out as their config class fills it in, a field under another name as its attribute map reads
it, a field they do not read not at all (tests/conformance/test_layout_defaults.py). Where their defaults or names
disagree, the field is required, or refused where it says otherwise; never read one way for an engine that reads it
another. Which layers are MoE is transformers' reading (loadplan's engine is held to transformers' logits); where
SGLang places them otherwise, the sglang profile refuses the config (sglang.SGLANG_MOE_LAYERS).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import InvalidArgument
from .config_view import ConfigView, quote

# Layers are enumerated (ids, MoE ids, a stage's EPLB layers): an absurd count from a
# config would make one request take the registry's memory. Real models have < 200.
MAX_LAYERS = 4096


def _or_required(default: int | None) -> tuple[int, ...]:
    """`ConfigView.int`'s default argument: `default`, or none (the field is required) for None."""
    return () if default is None else (default,)


@dataclass(frozen=True)
class MoeLayout:
    layer_ids: tuple[int, ...]     # global ids of every decoder layer, in order
    moe_layers: tuple[int, ...]    # global ids of the MoE ones
    n_routed: int
    n_shared: int
    top_k: int


def deepseek_layout(cfg: ConfigView) -> MoeLayout:
    """DeepSeek-V2/V3/V3.2, GLM-5, dots.llm1, Mistral Large 3: first_k_dense_replace and n_shared_experts required
    (transformers' config classes default them otherwise than the Hub's code and SGLang's wrappers); moe_layer_freq
    and mlp_layer_types refused where they would place the MoE layers otherwise than first_k_dense_replace (SGLang
    reads the first, transformers' V3.2 and GLM-5 the second, transformers' others neither)."""
    n_layers = cfg.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int(_named(cfg, "n_routed_experts", *DEEPSEEK_ALIASES), minimum=1)
    n_shared = cfg.int("n_shared_experts", minimum=0)
    top_k = cfg.int("num_experts_per_tok", minimum=1)
    _check_top_k(cfg, top_k, n_routed)
    first = cfg.int("first_k_dense_replace", minimum=0)
    moe = _moe_from_first(cfg, n_layers, first, REFUSED)
    types = cfg.raw("mlp_layer_types")
    if types is not None and types != ["dense" if i not in moe else "sparse" for i in range(n_layers)]:
        raise InvalidArgument(cfg.field("mlp_layer_types"), f"disagrees with first_k_dense_replace={first} (makes "
                                                            f"layers {_shown(moe)} MoE): {quote(types)}")
    return MoeLayout(tuple(range(n_layers)), moe, n_routed, n_shared, top_k)


# The names transformers' DeepSeek classes (and SGLang's, built on them) also read n_routed_experts by: V2's
# num_experts; V3's, V3.2's and GLM-5's num_local_experts.
DEEPSEEK_ALIASES = ("num_local_experts", "num_experts")


# How a family's references read moe_layer_freq (layer i MoE only if i % moe_layer_freq == 0): every one reads it,
# none does, or they differ (then it is refused where it would change the layout).
READ, IGNORED, REFUSED = "read", "ignored", "refused"


def _moe_from_first(cfg: ConfigView, n_layers: int, first: int, freq_rule: str) -> tuple[int, ...]:
    """The layers from `first` on, less those moe_layer_freq skips as `freq_rule` says."""
    every = tuple(range(first, n_layers))
    if freq_rule == IGNORED:
        return every
    freq = cfg.int("moe_layer_freq", 1, minimum=1)
    moe = tuple(i for i in every if i % freq == 0)
    if freq_rule == REFUSED and moe != every:
        raise InvalidArgument(cfg.field("moe_layer_freq"), f"{freq} makes layers {_shown(moe)} MoE for SGLang and "
                                                           f"{_shown(every)} for transformers, which does not read "
                                                           f"it: give 1")
    return moe


def deepseek_v4_layout(cfg: ConfigView) -> MoeLayout:
    """DeepSeek-V4 (rules only; SGLang's models/deepseek_v4.py): every layer MoE, its first n_hash_layers routed by
    hash (still its experts), whatever first_k_dense_replace or moe_layer_freq say. 256 routed experts and one
    shared by default; the layer count and top-k are required (SGLang reads the config with transformers'
    DeepseekV3Config under V4's name: 61 and 8, transformers' DeepseekV4Config says 43 and 6)."""
    if cfg.raw("model_type") == "deepseek_v41" and cfg.has("text_config"):
        raise InvalidArgument(cfg.field("text_config"), "SGLang's DeepseekV41Config reads its fields in place of the "
                                                        "top level's: not read here")
    n_layers = cfg.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int(_named(cfg, "n_routed_experts", "num_local_experts"), 256, minimum=1)
    top_k = cfg.int("num_experts_per_tok", minimum=1)
    _check_top_k(cfg, top_k, n_routed)
    layers = tuple(range(n_layers))
    return MoeLayout(layers, layers, n_routed, cfg.int("n_shared_experts", 1, minimum=0), top_k)


def dots3_layout(cfg: ConfigView) -> MoeLayout:
    """dots.llm3 (rules only; SGLang's models/dots3_common): DeepSeek's layout with SGLang's Dots3Config defaults (30
    layers, the first dense; 128 experts, top-6, one shared)."""
    for name in ("n_routed_experts", "n_shared_experts"):
        if name in cfg.data and cfg.raw(name) is None:
            raise InvalidArgument(cfg.field(name), "null: SGLang's Dots3Config keeps it (no MoE layer, no shared "
                                                   "expert), not its default; give a number")
    return _deepseek_defaults_layout(cfg, layers=30, experts=128, top_k=6, first_dense=1, freq_rule=READ, aliases=())


def glm4_moe_layout(cfg: ConfigView) -> MoeLayout:
    """GLM-4-MoE: DeepSeek's layout with transformers' Glm4MoeConfig defaults (the first layer dense, one shared
    expert) and its alias num_local_experts for n_routed_experts; moe_layer_freq is read by neither transformers nor
    SGLang."""
    return _deepseek_defaults_layout(cfg, layers=None, experts=None, top_k=None, first_dense=1, freq_rule=IGNORED)


def dense_layout(cfg: ConfigView) -> MoeLayout:
    """A dense decoder (no MoE layer): a draft model beside an MoE target (Qwen3's dense models)."""
    n_layers = cfg.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    return MoeLayout(tuple(range(n_layers)), (), 0, 0, 0)


def deepseek_nextn_layout(cfg: ConfigView) -> MoeLayout:
    n_target = cfg.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    n_nextn = cfg.int(_named(cfg, "num_nextn_predict_layers", "num_mtp_layers"), 1, minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int(_named(cfg, "n_routed_experts", *DEEPSEEK_ALIASES), minimum=1)
    n_shared = cfg.int("n_shared_experts", minimum=0)
    top_k = cfg.int("num_experts_per_tok", minimum=1)
    _check_top_k(cfg, top_k, n_routed)
    ids = tuple(range(n_target, n_target + n_nextn))
    return MoeLayout(ids, ids, n_routed, n_shared, top_k)


def glm4_moe_nextn_layout(cfg: ConfigView) -> MoeLayout:
    """A GLM-4-MoE NextN draft: its num_nextn_predict_layers MoE layers after the target's, the target's expert
    fields under GLM-4-MoE's names and defaults (one shared expert unless the config says otherwise)."""
    return _draft_after(glm4_moe_layout(cfg), cfg.int(_named(cfg, "num_nextn_predict_layers", "num_mtp_layers"), 1,
                                                      minimum=1, maximum=MAX_LAYERS))


def qwen_nextn_layout(cfg: ConfigView) -> MoeLayout:
    """A Qwen3-Next or Qwen3.5 MTP draft: one MoE layer after the target's (Qwen's expert fields). SGLang builds one
    MTP layer whatever the config counts (num_nextn_predict_layers; Qwen3.5's mtp_num_hidden_layers): another count
    is refused."""
    _refuse_dense_qwen3_5(cfg)
    count = "num_nextn_predict_layers" if cfg.has("num_nextn_predict_layers") else "mtp_num_hidden_layers"
    if cfg.int(count, 1, minimum=1, maximum=MAX_LAYERS) != 1:
        raise InvalidArgument(cfg.field(count), f"{cfg.int(count)} MTP layers: SGLang builds one")
    return _draft_after(qwen_moe_layout(cfg, shared=True), 1)


def _draft_after(target: MoeLayout, n_nextn: int) -> MoeLayout:
    """A draft of `n_nextn` MoE layers numbered after `target`'s, with its expert counts."""
    ids = tuple(range(len(target.layer_ids), len(target.layer_ids) + n_nextn))
    return MoeLayout(ids, ids, target.n_routed, target.n_shared, target.top_k)


def qwen2_moe_layout(cfg: ConfigView) -> MoeLayout:
    """Qwen2-MoE and Qwen3-Next: Qwen's layout with a shared expert unless shared_expert_intermediate_size is 0."""
    return qwen_moe_layout(cfg, shared=True)


def qwen3_5_moe_layout(cfg: ConfigView) -> MoeLayout:
    """Qwen3.5-MoE: every layer MoE (transformers' and SGLang's Qwen3.5-MoE read neither decoder_sparse_step nor
    mlp_only_layers, which its config class inherits from Qwen3-Next's), Qwen's expert fields."""
    _refuse_dense_qwen3_5(cfg)
    return qwen_moe_layout(cfg, shared=True, sparse_fields=False)


def qwen3_moe_layout(cfg: ConfigView) -> MoeLayout:
    """Qwen3-MoE: Qwen's layout without a shared expert; its config class reads num_experts as num_local_experts."""
    return qwen_moe_layout(cfg, shared=False, experts=_named(cfg, "num_experts", "num_local_experts"))


def qwen_moe_layout(cfg: ConfigView, *, shared: bool, experts: str = "num_experts",
                    sparse_fields: bool = True) -> MoeLayout:
    """Qwen's expert fields (`experts` names the routed count: transformers' Qwen2-MoE, Qwen3-Next and Qwen3.5 classes
    map no other name to it). Layer i is MoE unless (`sparse_fields`) i is in mlp_only_layers or
    (i + 1) % decoder_sparse_step != 0 (transformers' reading; SGLang's, every layer, is the sglang profile's)."""
    n_layers = cfg.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int(experts, minimum=1)
    top_k = cfg.int("num_experts_per_tok", minimum=1)
    _check_top_k(cfg, top_k, n_routed)
    # Required: left out, the reference builds a shared expert of its config class's default width (5632 for
    # Qwen2-MoE, 512 for Qwen3-Next and Qwen3.5), which the plan and the engine could only guess at.
    n_shared = 1 if shared and cfg.int("shared_expert_intermediate_size", minimum=0) > 0 else 0
    layers = tuple(range(n_layers))
    moe = layers
    if sparse_fields:
        step = cfg.int("decoder_sparse_step", 1, minimum=1)
        mlp_only = set(cfg.int_list("mlp_only_layers"))
        moe = tuple(i for i in layers if i not in mlp_only and (i + 1) % step == 0)
    return MoeLayout(layers, moe, n_routed, n_shared, top_k)


def _refuse_dense_qwen3_5(cfg: ConfigView) -> None:
    """A dense Qwen3.5's text config (model_type qwen3_5_text): SGLang builds dense layers (and a dense MTP layer) for
    it, whatever its expert fields say."""
    if cfg.raw("model_type") == "qwen3_5_text":
        raise InvalidArgument(cfg.field("model_type"), "qwen3_5_text is a dense Qwen3.5 (SGLang builds no MoE layer "
                                                       "for it); a Qwen3.5-MoE says qwen3_5_moe_text")


def every_layer_moe_layout(cfg: ConfigView, experts_field: str, *aliases: str) -> MoeLayout:
    """Every decoder layer is MoE, with `experts_field` routed experts (or its config class's `aliases` of it) and no
    shared expert."""
    n_layers = cfg.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int(_named(cfg, experts_field, *aliases), minimum=1)
    top_k = cfg.int("num_experts_per_tok", minimum=1)
    _check_top_k(cfg, top_k, n_routed)
    layers = tuple(range(n_layers))
    return MoeLayout(layers, layers, n_routed, 0, top_k)


def mixtral_layout(cfg: ConfigView) -> MoeLayout:
    """Mixtral's names: every layer MoE with num_local_experts routed experts (also gpt-oss, MiniMax-M2, MiniMax-Text,
    Granite MoE and Phi-3.5-MoE)."""
    return every_layer_moe_layout(cfg, "num_local_experts", "num_experts")


def olmoe_layout(cfg: ConfigView) -> MoeLayout:
    """OLMoE's names: every layer MoE with num_experts routed experts (also FlexOlmo)."""
    return every_layer_moe_layout(cfg, "num_experts", "num_local_experts")


def minimax_m3_layout(cfg: ConfigView) -> MoeLayout:
    """MiniMax-M3 (SGLang's models/minimax_m3.py): num_local_experts routed experts and n_shared_experts shared ones
    (none when unset) on the layers whose moe_layer_freq entry is non-zero (every layer when it is unset)."""
    n_layers = cfg.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int("num_local_experts", minimum=1)
    n_shared = cfg.int("n_shared_experts", 0, minimum=0)
    top_k = cfg.int("num_experts_per_tok", minimum=1)
    _check_top_k(cfg, top_k, n_routed)
    moe = tuple(range(n_layers)) if cfg.raw("moe_layer_freq") is None else layer_flags(cfg, "moe_layer_freq", n_layers)
    return MoeLayout(tuple(range(n_layers)), moe, n_routed, n_shared, top_k)


def layer_flags(cfg: ConfigView, name: str, n_layers: int) -> tuple[int, ...]:
    """The layers `name`, a list of one integer per layer, flags non-zero (MiniMax-M3's and MiMo's moe_layer_freq,
    EXAONE's is_moe_layer)."""
    flags = cfg.raw(name)
    if not isinstance(flags, list) or len(flags) != n_layers or not all(isinstance(f, int) for f in flags):
        raise InvalidArgument(cfg.field(name), f"must be a list of {n_layers} integers (one per layer; 0 = dense)")
    return tuple(i for i, f in enumerate(flags) if f != 0)


def _transformers_alias(cfg: ConfigView, name: str, alias: str) -> None:
    """Refuses `alias` where it says other than `name`: transformers' config class reads it as `name`, SGLang's does
    not (it reads `name`, or its default)."""
    if cfg.has(alias) and cfg.raw(alias) != cfg.raw(name):
        raise InvalidArgument(cfg.field(alias), f"{quote(cfg.raw(alias))}: transformers reads it as {name}, SGLang "
                                                f"does not (it reads {name}={quote(cfg.raw(name))}); give {name}")


def granitemoe_layout(cfg: ConfigView) -> MoeLayout:
    """Granite MoE: Mixtral's names; no shared MLP (refused where SGLang would build one: its model_type says a
    shared Granite and shared_intermediate_size is set)."""
    _granite_shared_mlp(cfg, False)
    return mixtral_layout(cfg)


def granitemoe_shared_layout(cfg: ConfigView) -> MoeLayout:
    """Granite MoE with an ungated shared MLP beside the experts of every layer (none when
    shared_intermediate_size is 0, transformers' default)."""
    lay = mixtral_layout(cfg)
    return replace(lay, n_shared=1 if _granite_shared_mlp(cfg, True) else 0)


_GRANITE_SHARED_TYPES = ("granitemoeshared", "granitemoe_swa")


def _granite_shared_mlp(cfg: ConfigView, by_class: bool) -> bool:
    """Whether a Granite MoE has a shared MLP: transformers builds one where its entry class has one (`by_class`) and
    shared_intermediate_size is set, SGLang where its model_type is a shared one's; a config they read two ways is
    refused."""
    sized = cfg.int("shared_intermediate_size", 0, minimum=0) > 0
    model_type = cfg.raw("model_type")
    if sized and model_type is not None and (model_type in _GRANITE_SHARED_TYPES) != by_class:
        raise InvalidArgument(cfg.field("model_type"), f"{quote(model_type)}: SGLang builds the shared MLP by "
                                                       f"model_type ({', '.join(_GRANITE_SHARED_TYPES)}), transformers "
                                                       f"by the entry class")
    return by_class and sized


def granitemoe_hybrid_layout(cfg: ConfigView) -> MoeLayout:
    """Granite 4.0-H: Granite MoE's experts and shared MLP on every layer, whether its token mixer is Mamba2 or
    attention; transformers' GraniteMoeHybridConfig defaults where a config leaves a field out (a shared MLP of 1024:
    one shared MLP unless sized 0), but num_hidden_layers, num_local_experts and num_experts_per_tok, required
    (transformers says 32, 8 and 2, SGLang's GraniteMoeHybridConfig 40, 0 and 0)."""
    n_layers = cfg.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int("num_local_experts", minimum=1)
    top_k = cfg.int("num_experts_per_tok", minimum=1)
    _check_top_k(cfg, top_k, n_routed)
    layers = tuple(range(n_layers))
    return MoeLayout(layers, layers, n_routed, 1 if cfg.int("shared_intermediate_size", 1024, minimum=0) else 0,
                     top_k)


# Nemotron-H's hybrid_override_pattern letters, and its layer kinds' spellings (transformers 5's and older).
_NEMOTRON_H_PATTERN = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
_NEMOTRON_H_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
                     "attention": "attention", "moe": "moe", "mlp": "mlp"}


def nemotron_h_layout(cfg: ConfigView) -> MoeLayout:
    """Nemotron-H: one block a layer, by layers_block_type (or hybrid_override_pattern: M Mamba2, * attention, E MoE,
    - MLP); the MoE ones have n_routed_experts routed experts and one shared MLP (n_shared_experts other than 1 is
    refused: transformers builds one whatever it says). transformers' NemotronHConfig defaults where a config leaves
    a field out, but the layers' kinds: required (SGLang's NemotronHConfig and transformers' default to different
    patterns); layer_types, which transformers reads and SGLang does not, refused where the pattern says otherwise."""
    field = next((f for f in ("layers_block_type", "layer_types") if cfg.has(f)), None)
    pattern = _nemotron_h_pattern(cfg) if cfg.has("hybrid_override_pattern") else None
    if field is not None:
        kinds = cfg.raw(field)
        if not isinstance(kinds, list) or not kinds or any(k not in _NEMOTRON_H_KINDS for k in kinds):
            raise InvalidArgument(cfg.field(field), f"expected a list of {', '.join(_NEMOTRON_H_KINDS)}, got "
                                                    f"{quote(kinds)}")
        kinds = [_NEMOTRON_H_KINDS[k] for k in kinds]
        if field == "layer_types" and pattern is not None and pattern != kinds:
            raise InvalidArgument(cfg.field("layer_types"), "disagrees with hybrid_override_pattern, which SGLang "
                                                            "reads in its place")
    elif pattern is not None:
        kinds = pattern
    else:
        raise InvalidArgument(cfg.field("layers_block_type"), "missing (or hybrid_override_pattern): the layers' "
                                                              "kinds have no default the references agree on")
    if len(kinds) > MAX_LAYERS:
        raise InvalidArgument(cfg.field(field or "hybrid_override_pattern"),
                              f"{len(kinds)} layers: more than {MAX_LAYERS}")
    _transformers_alias(cfg, "n_routed_experts", "num_local_experts")
    n_routed = cfg.int("n_routed_experts", 8, minimum=1)
    top_k = cfg.int("num_experts_per_tok", 2, minimum=1)
    _check_top_k(cfg, top_k, n_routed)
    if cfg.int("n_shared_experts", 1, minimum=0) != 1:
        raise InvalidArgument(cfg.field("n_shared_experts"), "not 1: transformers builds one shared MLP whatever it "
                                                             "says, SGLang none for 0 and one that many times as "
                                                             "wide else")
    return MoeLayout(tuple(range(len(kinds))), tuple(i for i, k in enumerate(kinds) if k == "moe"), n_routed, 1,
                     top_k)


def _nemotron_h_pattern(cfg: ConfigView) -> list[str]:
    """hybrid_override_pattern's layer kinds."""
    pattern = cfg.raw("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern or any(c not in _NEMOTRON_H_PATTERN for c in pattern):
        raise InvalidArgument(cfg.field("hybrid_override_pattern"),
                              f"expected a string of {''.join(_NEMOTRON_H_PATTERN)}, got {quote(pattern)}")
    if cfg.has("num_hidden_layers") and cfg.int("num_hidden_layers") != len(pattern):
        raise InvalidArgument(cfg.field("hybrid_override_pattern"),
                              f"{len(pattern)} layers, but num_hidden_layers={cfg.int('num_hidden_layers')}")
    return [_NEMOTRON_H_PATTERN[c] for c in pattern]


def jamba_layout(cfg: ConfigView) -> MoeLayout:
    """Jamba: layer i is MoE iff i % expert_layer_period == expert_layer_offset (whatever its token mixer); no shared
    expert. transformers' JambaConfig defaults where a config leaves a field out."""
    n_layers = cfg.int("num_hidden_layers", 32, minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int(_named(cfg, "num_experts", "num_local_experts"), 16, minimum=2)
    top_k = cfg.int("num_experts_per_tok", 2, minimum=1)
    _check_top_k(cfg, top_k, n_routed)
    period = cfg.int("expert_layer_period", 2, minimum=1)
    offset = cfg.int("expert_layer_offset", 1, minimum=0, maximum=period - 1)
    return MoeLayout(tuple(range(n_layers)), tuple(i for i in range(n_layers) if i % period == offset), n_routed, 0,
                     top_k)


def dbrx_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' DbrxConfig defaults where a config leaves a field out (ffn_config is an object of its own)."""
    n_layers = cfg.int(_named(cfg, "n_layers", "num_hidden_layers"), 24, minimum=1, maximum=MAX_LAYERS)
    ffn = cfg.sub("ffn_config") if cfg.has("ffn_config") else ConfigView({}, cfg.field("ffn_config"))
    n_routed = ffn.int("moe_num_experts", 4, minimum=1)
    top_k = ffn.int("moe_top_k", 1, minimum=1)
    _check_top_k(ffn, top_k, n_routed, "moe_top_k")
    layers = tuple(range(n_layers))
    return MoeLayout(layers, layers, n_routed, 0, top_k)


def lfm2_moe_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' Lfm2MoeConfig defaults where a config leaves a field out."""
    return _moe_after_dense_layers(cfg, layers=32, experts=32, top_k=4, dense=2, shared=0, has_shared=False)


def afmoe_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' AfmoeConfig defaults where a config leaves a field out, but num_dense_layers and
    num_shared_experts, required: SGLang's AfmoeConfig defaults them to 0 and 0, transformers' to 1 and 2."""
    return _moe_after_dense_layers(cfg, layers=None, experts=64, top_k=6, dense=None, shared=None)


def _moe_after_dense_layers(cfg: ConfigView, *, layers: int | None, experts: int, top_k: int, dense: int | None,
                            shared: int | None, has_shared: bool = True) -> MoeLayout:
    """Every layer from num_dense_layers MoE, num_experts routed experts, num_experts_per_tok a token, and
    num_shared_experts shared ones (none when not `has_shared`). The keywords are the family's defaults for fields
    a config leaves out (None: the field is required)."""
    n_layers = cfg.int("num_hidden_layers", *_or_required(layers), minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int("num_experts", experts, minimum=1)
    k = cfg.int("num_experts_per_tok", top_k, minimum=1)
    _check_top_k(cfg, k, n_routed)
    first_moe = cfg.int("num_dense_layers", *_or_required(dense), minimum=0)
    n_shared = cfg.int("num_shared_experts", *_or_required(shared), minimum=0) if has_shared else 0
    return MoeLayout(tuple(range(n_layers)), tuple(range(first_moe, n_layers)), n_routed, n_shared, k)


def exaone_moe_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' ExaoneMoeConfig defaults where a config leaves a field out (SGLang places the MoE layers by
    is_moe_layer instead: the sglang profile's)."""
    return _num_experts_by_mlp_layer_types(cfg, layers=None, experts=64, shared=1, top_k=8, first_dense=1)


def _num_experts_by_mlp_layer_types(cfg: ConfigView, *, layers: int | None, experts: int, shared: int, top_k: int,
                                    first_dense: int) -> MoeLayout:
    """num_experts routed experts, num_shared_experts shared ones, num_experts_per_tok a token, the MoE layers by
    mlp_layer_types (else every layer from first_k_dense_replace); the keyword arguments are the family's defaults
    (`layers` None: num_hidden_layers is required)."""
    n_layers = cfg.int("num_hidden_layers", *_or_required(layers), minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int("num_experts", experts, minimum=1)
    n_shared = cfg.int("num_shared_experts", shared, minimum=0)
    k = cfg.int("num_experts_per_tok", top_k, minimum=1)
    _check_top_k(cfg, k, n_routed)
    first = cfg.int("first_k_dense_replace", first_dense, minimum=0)
    return MoeLayout(tuple(range(n_layers)), _sparse_by_mlp_layer_types(cfg, n_layers, first), n_routed, n_shared, k)


def kimi_linear_layout(cfg: ConfigView) -> MoeLayout:
    """Kimi-Linear's names for DeepSeek-V3's fields (num_experts, num_shared_experts, num_experts_per_token) and
    transformers' KimiLinearConfig defaults, but:
    - num_experts and num_shared_experts required, and first_k_dense_replace where mlp_layer_types is absent (SGLang
      builds no MoE layer without num_experts, and its class defaults the other two to 0 and 0, transformers' to 1
      and 1); DeepSeek's names, which transformers maps and SGLang does not, refused where they say otherwise;
    - the MoE layers by mlp_layer_types (which transformers' configs write in place of first_k_dense_replace),
      else first_k_dense_replace (SGLang's placement, by first_k_dense_replace and moe_layer_freq, is the sglang
      profile's)."""
    for name, alias in (("num_experts", "num_local_experts"), ("num_experts", "n_routed_experts"),
                        ("num_shared_experts", "n_shared_experts")):
        _transformers_alias(cfg, name, alias)
    cfg.int("num_experts", minimum=1)
    return _deepseek_renamed_layout(cfg, layers=None, experts=256, first_dense=None, shared=None)


def _shown(layers: tuple[int, ...]) -> str:
    return str(list(layers[:8]))[:-1] + (", ...]" if len(layers) > 8 else "]")


def bailing_hybrid_layout(cfg: ConfigView) -> MoeLayout:
    """The Ling 3 hybrids: Kimi-Linear's names, transformers' BailingHybridConfig defaults (SGLang builds no such
    model)."""
    return _deepseek_renamed_layout(cfg, layers=42, experts=512, first_dense=2, shared=1)


def _deepseek_renamed_layout(cfg: ConfigView, *, layers: int | None, experts: int | None, first_dense: int | None,
                             shared: int | None) -> MoeLayout:
    """DeepSeek-V3's layout under Kimi-Linear's names, with the family's defaults (None: required)."""
    n_layers = cfg.int("num_hidden_layers", *_or_required(layers), minimum=1, maximum=MAX_LAYERS)

    def named(ours: str, deepseek: str) -> str:
        return deepseek if cfg.raw(ours) is None and cfg.raw(deepseek) is not None else ours

    n_routed = cfg.int(named(_named(cfg, "num_experts", "num_local_experts"), "n_routed_experts"),
                       *_or_required(experts), minimum=1)
    n_shared = cfg.int(named("num_shared_experts", "n_shared_experts"), *_or_required(shared), minimum=0)
    k_field = _named(cfg, "num_experts_per_token", "num_experts_per_tok")
    top_k = cfg.int(k_field, 8, minimum=1)
    _check_top_k(cfg, top_k, n_routed, k_field)
    # transformers' configs write mlp_layer_types in its place
    first = None if cfg.has("mlp_layer_types") else cfg.int("first_k_dense_replace", *_or_required(first_dense),
                                                             minimum=0)
    return MoeLayout(tuple(range(n_layers)), _sparse_by_mlp_layer_types(cfg, n_layers, first), n_routed,
                     n_shared, top_k)


def longcat_flash_layout(cfg: ConfigView) -> MoeLayout:
    """LongCat-Flash: num_layers layers, every one MoE, with n_routed_experts routed experts and zero_expert_num
    zero-computation ones (identity, on every rank: not among the experts EP places), moe_topk picks a token among
    both; no shared expert. transformers' defaults. A config that gives num_hidden_layers without num_layers is refused:
    transformers reads it as the count of sublayers (two a layer), SGLang as the count of layers."""
    if cfg.raw("num_layers") is None and cfg.raw("num_hidden_layers") is not None:
        raise InvalidArgument(cfg.field("num_layers"), "missing: num_hidden_layers alone counts LongCat-Flash's "
                                                       "sublayers for transformers and its layers for SGLang")
    n_layers = cfg.int("num_layers", 28, minimum=1, maximum=MAX_LAYERS)
    if cfg.has("num_hidden_layers") and cfg.raw("num_hidden_layers") != n_layers:
        raise InvalidArgument(cfg.field("num_hidden_layers"), f"{quote(cfg.raw('num_hidden_layers'))}: SGLang counts "
                                                              f"the layers by it, transformers by num_layers="
                                                              f"{n_layers}")
    _transformers_alias(cfg, "n_routed_experts", "num_local_experts")
    _transformers_alias(cfg, "moe_topk", "num_experts_per_tok")
    n_routed = cfg.int("n_routed_experts", 512, minimum=1)
    zero = cfg.int("zero_expert_num", 256, minimum=0)
    top_k = cfg.int("moe_topk", 12, minimum=1)
    if top_k > n_routed + zero:
        raise InvalidArgument(cfg.field("moe_topk"), f"{top_k} exceeds the number of experts ({n_routed} routed and "
                                                     f"{zero} zero-computation ones)")
    layers = tuple(range(n_layers))
    return MoeLayout(layers, layers, n_routed, 0, top_k)


def solar_open_layout(cfg: ConfigView) -> MoeLayout:
    """Solar Open: every layer MoE, with n_routed_experts routed experts (num_local_experts, transformers' alias)
    and n_shared_experts shared ones; transformers' SolarOpenConfig defaults."""
    n_layers = cfg.int("num_hidden_layers", 48, minimum=1, maximum=MAX_LAYERS)
    field = "num_local_experts" if cfg.has("num_local_experts") and not cfg.has("n_routed_experts") \
        else "n_routed_experts"
    n_routed = cfg.int(field, 128, minimum=1)
    n_shared = cfg.int("n_shared_experts", 1, minimum=0)
    top_k = cfg.int("num_experts_per_tok", 8, minimum=1)
    _check_top_k(cfg, top_k, n_routed)
    layers = tuple(range(n_layers))
    return MoeLayout(layers, layers, n_routed, n_shared, top_k)


def step3p5_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' Step3p7TextConfig defaults, and its readings of the Hub's older fields, where a config leaves a
    field out."""
    n_layers = cfg.int("num_hidden_layers", 45, minimum=1, maximum=MAX_LAYERS)
    n_mtp = cfg.int(_named(cfg, "num_nextn_predict_layers", "num_mtp_layers"), 0, minimum=0, maximum=MAX_LAYERS)
    n_routed = cfg.int(_named(cfg, "n_routed_experts", "num_local_experts", "moe_num_experts"), 288, minimum=1)
    top_k_field = _named(cfg, "num_experts_per_tok", "moe_top_k")
    top_k = cfg.int(top_k_field, 8, minimum=1)
    _check_top_k(cfg, top_k, n_routed, top_k_field)
    types = cfg.raw("mlp_layer_types")
    if isinstance(types, list) and n_mtp and len(types) == n_layers + n_mtp:
        types = types[:n_layers]                  # the Hub's list covers the MTP layers too
    if types is None:
        enum = cfg.raw("moe_layers_enum")
        if enum is None:
            types = ["dense" if i < 3 else "sparse" for i in range(n_layers)]
        else:
            sparse = layer_numbers(cfg, "moe_layers_enum", enum)
            types = ["sparse" if i in sparse else "dense" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in ("dense", "sparse") for t in types):
        raise InvalidArgument(cfg.field("mlp_layer_types"),
                              f"expected {n_layers} entries of dense or sparse, got {str(types)[:200]}")
    return MoeLayout(tuple(range(n_layers)), tuple(i for i, t in enumerate(types) if t == "sparse"), n_routed, 1,
                     top_k)


def _named(cfg: ConfigView, name: str, *aliases: str) -> str:
    """The field the config gives: `name`, else the first of its `aliases` it has (else `name`, for its default or
    its refusal as missing). Two of the names with different values are refused: which one a model reads differs
    (transformers' attribute maps take the alias), so the layout would be a guess."""
    given = [x for x in (name, *aliases) if cfg.has(x)]
    for other in given[1:]:
        if cfg.raw(other) != cfg.raw(given[0]):
            raise InvalidArgument(cfg.field(other), f"{quote(cfg.raw(other))} disagrees with "
                                  f"{cfg.field(given[0])}={quote(cfg.raw(given[0]))} (two names of one field)")
    return given[0] if given else name


def sarvam_mla_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' SarvamMLAConfig defaults and names (its attribute_map) where a config leaves DeepSeek's out."""
    return _deepseek_defaults_layout(cfg, layers=32, experts=128, top_k=8, first_dense=1, freq_rule=REFUSED,
                                     aliases=SARVAM_ALIASES,
                                     shared_aliases=("num_shared_experts",))


def sarvam_moe_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' SarvamMoEConfig defaults and names (its attribute_map) where a config leaves GLM-4-MoE's out."""
    return _deepseek_defaults_layout(cfg, layers=19, experts=128, top_k=6, first_dense=1, freq_rule=REFUSED,
                                     aliases=SARVAM_ALIASES,
                                     shared_aliases=("num_shared_experts",))


# Sarvam's config classes map the original checkpoints' names of the routed experts (num_experts) too.
SARVAM_ALIASES = ("num_experts", "num_local_experts")


def axk1_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' AXK1Config defaults (61 layers; 192 experts, top-8, one shared): layer i is MoE iff
    mlp_layer_types[i] is "sparse", else as DeepSeek's first_k_dense_replace (1) and moe_layer_freq say."""
    lay = _deepseek_defaults_layout(cfg, layers=61, experts=192, top_k=8, first_dense=1, freq_rule=READ)
    if cfg.raw("mlp_layer_types") is None:
        return lay
    n_layers = len(lay.layer_ids)
    return replace(lay, moe_layers=_sparse_by_mlp_layer_types(cfg, n_layers, 0))


def flint_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' FlintConfig defaults (49 layers; 256 experts, top-6, one shared): Qwen's layout, the first two
    layers dense unless mlp_only_layers says otherwise."""
    n_layers = cfg.int("num_hidden_layers", 49, minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int("num_experts", 256, minimum=1)
    k = cfg.int("num_experts_per_tok", 6, minimum=1)
    _check_top_k(cfg, k, n_routed)
    step = cfg.int("decoder_sparse_step", 1, minimum=1)
    mlp_only = set(cfg.int_list("mlp_only_layers", [0, 1]))
    moe = tuple(i for i in range(n_layers) if i not in mlp_only and (i + 1) % step == 0)
    return MoeLayout(tuple(range(n_layers)), moe, n_routed, 1, k)


def kolibri1_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' Kolibri1Config defaults (50 layers, all MoE; 384 experts, top-6, one shared)."""
    n_layers = cfg.int("num_hidden_layers", 50, minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int(_named(cfg, "num_local_experts", "num_experts"), 384, minimum=1)
    k = cfg.int("num_experts_per_tok", 6, minimum=1)
    _check_top_k(cfg, k, n_routed)
    layers = tuple(range(n_layers))
    return MoeLayout(layers, layers, n_routed, 1, k)


def mellum_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' MellumConfig defaults (28 layers, all MoE; 64 experts, top-8, no shared one) where a config
    leaves a field out."""
    n_layers = cfg.int("num_hidden_layers", 28, minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int(_named(cfg, "num_local_experts", "num_experts"), 64, minimum=1)
    k = cfg.int("num_experts_per_tok", 8, minimum=1)
    _check_top_k(cfg, k, n_routed)
    return MoeLayout(tuple(range(n_layers)), _sparse_by_mlp_layer_types(cfg, n_layers, 0), n_routed, 0, k)


def mistral4_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' Mistral4Config defaults (36 layers, all MoE; 128 experts, top-4, one shared) where a config
    leaves a field out; moe_layer_freq is not read (by transformers; SGLang builds no Mistral 4)."""
    return _deepseek_defaults_layout(cfg, layers=36, experts=128, top_k=4, first_dense=0, freq_rule=IGNORED)


def _deepseek_defaults_layout(cfg: ConfigView, *, layers: int | None, experts: int | None, top_k: int | None,
                              first_dense: int, freq_rule: str, aliases: tuple[str, ...] = ("num_local_experts",),
                              shared_aliases: tuple[str, ...] = ()) -> MoeLayout:
    """DeepSeek's layout (layer i MoE iff i >= first_k_dense_replace, and moe_layer_freq as `freq_rule` says) with a
    family's defaults (None: the field is required), its expert counts also under the names its config class's
    attribute map gives them (`aliases` of n_routed_experts, `shared_aliases` of n_shared_experts: one shared expert
    by default); a name the class does not map is not read (the reference reads the default then)."""
    n_layers = cfg.int("num_hidden_layers", *_or_required(layers), minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int(_named(cfg, "n_routed_experts", *aliases), *_or_required(experts), minimum=1)
    n_shared = cfg.int(_named(cfg, "n_shared_experts", *shared_aliases), 1, minimum=0)
    k = cfg.int("num_experts_per_tok", *_or_required(top_k), minimum=1)
    _check_top_k(cfg, k, n_routed)
    first = cfg.int("first_k_dense_replace", first_dense, minimum=0)
    return MoeLayout(tuple(range(n_layers)), _moe_from_first(cfg, n_layers, first, freq_rule), n_routed, n_shared, k)


def layer_numbers(cfg: ConfigView, name: str, value) -> set[int]:
    """Layer numbers written "3,4,5" or as a list."""
    items = value.split(",") if isinstance(value, str) else value
    try:
        if isinstance(items, list):
            return {int(i) for i in items if str(i).strip() and not isinstance(i, bool)}
    except ValueError:
        pass
    raise InvalidArgument(cfg.field(name), f"expected layer numbers (\"3,4,5\" or a list), got {quote(value)}")


def hy_v3_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' HYV3Config defaults (80 layers, the first dense; 192 experts, top-8, one shared) where a config
    leaves a field out (SGLang places the MoE layers by first_k_dense_replace instead: the sglang profile's)."""
    n_layers = cfg.int("num_hidden_layers", 80, minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int(_named(cfg, "num_experts", "num_local_experts"), 192, minimum=1)
    n_shared = cfg.int("num_shared_experts", 1, minimum=0)
    k = cfg.int("num_experts_per_tok", 8, minimum=1)
    _check_top_k(cfg, k, n_routed)
    return MoeLayout(tuple(range(n_layers)), _sparse_by_mlp_layer_types(cfg, n_layers, 1), n_routed, n_shared, k)


def laguna_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' LagunaConfig defaults (40 layers, the first dense; 256 experts, top-8, one shared) where a config
    leaves a field out."""
    n_layers = cfg.int("num_hidden_layers", 40, minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int("num_experts", 256, minimum=1)
    k = cfg.int("num_experts_per_tok", 8, minimum=1)
    _check_top_k(cfg, k, n_routed)
    return MoeLayout(tuple(range(n_layers)), _sparse_by_mlp_layer_types(cfg, n_layers, 1), n_routed, 1, k)


def cohere2_moe_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' Cohere2MoeConfig defaults where a config leaves a field out (SGLang places the MoE layers by
    first_k_dense_replace alone: the sglang profile's)."""
    return _num_experts_by_mlp_layer_types(cfg, layers=40, experts=8, shared=0, top_k=2, first_dense=0)


def mimo_v2_flash_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' MiMoV2FlashConfig defaults where a config leaves a field out: the MoE layers by mlp_layer_types
    (by default every layer but the first; SGLang's, by the Hub's moe_layer_freq flags, are the sglang profile's)."""
    n_layers = cfg.int("num_hidden_layers", 48, minimum=1, maximum=MAX_LAYERS)
    field = "num_local_experts" if cfg.has("num_local_experts") and not cfg.has("n_routed_experts") \
        else "n_routed_experts"
    n_routed = cfg.int(field, 256, minimum=1)
    top_k = cfg.int("num_experts_per_tok", 8, minimum=1)
    _check_top_k(cfg, top_k, n_routed)
    return MoeLayout(tuple(range(n_layers)), _sparse_by_mlp_layer_types(cfg, n_layers, 1), n_routed, 0, top_k)


def _sparse_by_mlp_layer_types(cfg: ConfigView, n_layers: int, first_sparse: int | None) -> tuple[int, ...]:
    """The layers mlp_layer_types says "sparse"; absent, every layer from `first_sparse` (None only when present)."""
    types = cfg.raw("mlp_layer_types")
    if types is None:
        assert first_sparse is not None
        types = ["dense" if i < first_sparse else "sparse" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in ("dense", "sparse") for t in types):
        raise InvalidArgument(cfg.field("mlp_layer_types"),
                              f"expected {n_layers} entries of dense or sparse, got {str(types)[:200]}")
    return tuple(i for i, t in enumerate(types) if t == "sparse")


def hunyuan_v1_moe_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' HunYuanMoEV1Config defaults (top-1) where a config leaves a field out, but num_experts, required
    (transformers says 1, with which SGLang builds no MoE block; at least 2). One shared MLP:
    transformers always builds one of intermediate_size, SGLang one of num_shared_expert times that where
    use_mixed_mlp_moe says so, none else; a config they read two ways (num_shared_expert other than 1,
    use_mixed_mlp_moe false) is refused."""
    n_layers = cfg.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    # SGLang builds no MoE block for one expert (a dense MLP): at least two
    experts = _named(cfg, "num_experts", "num_local_experts")
    n_routed = _one_per_model(cfg, experts, n_layers, None, minimum=2)
    k_field = _named(cfg, "moe_topk", "num_experts_per_tok")
    top_k = _one_per_model(cfg, k_field, n_layers, 1, minimum=1)
    _check_top_k(cfg, top_k, n_routed, k_field)
    if _one_per_model(cfg, "num_shared_expert", n_layers, 1, minimum=0) != 1:
        raise InvalidArgument(cfg.field("num_shared_expert"), "not 1: transformers builds one shared MLP of "
                                                              "intermediate_size whatever it says, SGLang one this "
                                                              "many times as wide")
    if cfg.has("use_mixed_mlp_moe") and not cfg.raw("use_mixed_mlp_moe"):
        raise InvalidArgument(cfg.field("use_mixed_mlp_moe"), "false: SGLang builds no shared MLP then, transformers "
                                                              "one")
    layers = tuple(range(n_layers))
    return MoeLayout(layers, layers, n_routed, 1, top_k)


def _one_per_model(cfg: ConfigView, name: str, n_layers: int, default: int | None, *, minimum: int) -> int:
    """`name` as an integer, or as a list of one integer per layer that all agree (Hunyuan's per-layer fields);
    `default` where the config leaves it out (None: required)."""
    value = cfg.raw(name)
    if not isinstance(value, list):
        return cfg.int(name, *_or_required(default), minimum=minimum)
    values = cfg.int_list(name)
    if len(values) != n_layers:
        raise InvalidArgument(cfg.field(name), f"expected one value per layer ({n_layers}), got {len(values)}")
    if len(set(values)) != 1:
        raise InvalidArgument(cfg.field(name), f"per-layer values {sorted(set(values))[:8]} differ; every layer "
                                               f"must have the same")
    if values[0] < minimum:
        raise InvalidArgument(cfg.field(name), f"must be >= {minimum}, got {values[0]}")
    return values[0]


def glm4_moe_lite_layout(cfg: ConfigView) -> MoeLayout:
    """GLM-4.7-Flash: transformers' Glm4MoeLiteConfig defaults; the MoE layers by mlp_layer_types (by default every
    layer but the first; SGLang's, by first_k_dense_replace, are the sglang profile's)."""
    n_layers = cfg.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int(_named(cfg, "n_routed_experts", "num_local_experts"), minimum=1)
    n_shared = cfg.int("n_shared_experts", 1, minimum=0)
    top_k = cfg.int("num_experts_per_tok", 4, minimum=1)
    _check_top_k(cfg, top_k, n_routed)
    return MoeLayout(tuple(range(n_layers)), _sparse_by_mlp_layer_types(cfg, n_layers, 1), n_routed, n_shared, top_k)


def glm4_moe_lite_nextn_layout(cfg: ConfigView) -> MoeLayout:
    """A GLM-4.7-Flash NextN draft: its num_nextn_predict_layers MoE layers after the target's, the target's expert
    fields under GLM-4-MoE-Lite's names and defaults (one shared expert unless the config says otherwise)."""
    return _draft_after(glm4_moe_lite_layout(cfg),
                        cfg.int("num_nextn_predict_layers", 1, minimum=1, maximum=MAX_LAYERS))


def llama4_layout(cfg: ConfigView) -> MoeLayout:
    n_layers = cfg.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int("num_local_experts", minimum=1)
    top_k = cfg.int("num_experts_per_tok", 1, minimum=1)        # transformers' Llama4TextConfig default
    _check_top_k(cfg, top_k, n_routed)
    if cfg.has("moe_layers"):      # SGLang places them by interleave_moe_layer_step alone: the sglang profile's
        moe = tuple(sorted(set(cfg.int_list("moe_layers"))))
        if moe and not 0 <= moe[0] <= moe[-1] < n_layers:
            raise InvalidArgument(cfg.field("moe_layers"), f"layer ids must be in [0, num_hidden_layers={n_layers})")
    else:
        moe = interleaved_moe_layers(cfg, n_layers)
    return MoeLayout(tuple(range(n_layers)), moe, n_routed, 1, top_k)


def interleaved_moe_layers(cfg: ConfigView, n_layers: int) -> tuple[int, ...]:
    """Llama 4's every interleave_moe_layer_step-th layer."""
    step = cfg.int("interleave_moe_layer_step", 1, minimum=1)
    return tuple(range(step - 1, n_layers, step))


def ernie4_5_moe_layout(cfg: ConfigView) -> MoeLayout:
    """transformers' Ernie4_5_MoeConfig defaults where a config leaves a field out (SGLang counts
    moe_layer_interval from moe_layer_start_index, not from layer 0: the sglang profile's)."""
    n_layers = cfg.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    n_routed = cfg.int(_named(cfg, "moe_num_experts", "num_experts"), 64, minimum=1)
    n_shared = cfg.int("moe_num_shared_experts", 2, minimum=0)
    k_field = _named(cfg, "moe_k", "num_experts_per_tok")
    top_k = cfg.int(k_field, 6, minimum=1)
    _check_top_k(cfg, top_k, n_routed, k_field)
    start, end, interval = ernie_moe_span(cfg, n_layers)
    moe = tuple(i for i in range(n_layers) if (i + 1) % interval == 0 and start <= i <= end)
    return MoeLayout(tuple(range(n_layers)), moe, n_routed, n_shared, top_k)


def ernie_moe_span(cfg: ConfigView, n_layers: int) -> tuple[int, int, int]:
    """ERNIE-4.5's first and last MoE-capable layers and its moe_layer_interval, with transformers' defaults."""
    start = cfg.int("moe_layer_start_index", 1, minimum=0)
    if "moe_layer_end_index" in cfg.data and cfg.raw("moe_layer_end_index") is None:
        raise InvalidArgument(cfg.field("moe_layer_end_index"), "null; say -1 (the last layer) or a layer number")
    end = cfg.int("moe_layer_end_index", -1, minimum=-1)
    return start, n_layers - 1 if end == -1 else end, cfg.int("moe_layer_interval", 1, minimum=1)


def _check_top_k(cfg: ConfigView, top_k: int, n_routed: int, field: str = "num_experts_per_tok") -> None:
    if top_k > n_routed:
        raise InvalidArgument(cfg.field(field),
                              f"{top_k} exceeds the number of routed experts ({n_routed})")
