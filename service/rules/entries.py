"""The entry classes the registry knows: data, like vLLM's model registry.

The entry classes themselves are one table shared with the engine (`loadplan.entry_classes`); this module holds
the families they build (layout reader, gate or never-fuses row) and reads the table into `Direct` / `Wrapper`.

A `Family` is built directly from a checkpoint's config; a `Wrapper` builds an
inner entry class from part of its config (and a quantization it hands down), so
its gate is the inner family's gate asked with exactly those. Every wrapper must
reach a family (`check_table`, run at server start-up and in the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from loadplan import entry_classes as shared_table
from loadplan import layouts
from loadplan.config_view import ConfigView
from loadplan.errors import FailedPrecondition, InvalidArgument, NotFound
from loadplan.layouts import MoeLayout
from . import gates
from .quantization import Quantization, quantization_of


@dataclass(frozen=True)
class NeverFuses:
    """A family whose shared experts never fuse, whatever the runner: a structural fact (no fused layout or
    kernel exists), so enforce_shared_experts_fusion does not skip it. `reason` may name `{n_shared}`."""

    rule: str
    reason: str

    def verdict(self, layout: MoeLayout) -> gates.Verdict:
        return gates.Verdict(self.rule, self.reason.format(n_shared=layout.n_shared))


@dataclass(frozen=True)
class Family:
    name: str
    layout: Callable[[ConfigView], MoeLayout]
    gate: Callable[[gates.GateContext], gates.Verdict | None] | None
    has_shared_experts: bool
    fused_architecture: str | None = None   # None: the entry class itself
    never_fuses: NeverFuses | None = None   # instead of a gate: the row says why it never fuses

    @property
    def gated(self) -> bool:
        """Its fusion is decided: by a gate, or by its never-fuses row."""
        return self.gate is not None or self.never_fuses is not None


@dataclass(frozen=True)
class Direct:
    family: str
    fused_architecture: str | None = None   # overrides the family's (a NextN draft declares its own)
    # Reads its text model's config from `text_config` when the config has one (a multimodal target's
    # config.json), with the quantization a wrapper hands down; else the config itself.
    text_config_if_present: bool = False


@dataclass(frozen=True)
class Wrapper:
    inner: str                               # the entry class it constructs
    config_field: str                        # the part of its config the inner constructor receives
    quantization: Callable[[ConfigView, str | None, Mapping[str, Any] | None], Quantization]


def _embedded_qconfig(cfg: ConfigView) -> Mapping[str, Any] | None:
    """The `quantization_config` a config.json declares itself, if any."""
    value = cfg.raw("quantization_config")
    if value is not None and not isinstance(value, Mapping):
        raise InvalidArgument(cfg.field("quantization_config"), f"must be a JSON object, got {type(value).__name__}")
    return value


def _top_level_quantization(cfg: ConfigView, explicit: str | None, qconfig: Mapping[str, Any] | None) -> Quantization:
    """The wrapper hands its inner constructor the checkpoint-level quantization,
    falling back to one declared inside the text config."""
    inner = cfg.raw("text_config")
    inner_q = _embedded_qconfig(ConfigView(inner, cfg.field("text_config"))) if isinstance(inner, Mapping) else None
    return quantization_of(explicit, qconfig or inner_q)


def _experts_beside(family: str, shown: str) -> NeverFuses:
    return NeverFuses(f"{family}.structural.no_fused_layout",
                      f"its {{n_shared}} shared expert(s) run beside the routed experts: no fused layout exists for {shown}")


def _mlp_beside(family: str, shown: str) -> NeverFuses:
    return NeverFuses(f"{family}.structural.no_fused_layout",
                      f"its shared MLP runs beside the routed experts: no fused layout exists for {shown}")


def _expert_of_own_width(family: str, shown: str, why: str) -> NeverFuses:
    return NeverFuses(f"{family}.structural.no_fused_layout",
                      f"its shared expert runs beside the routed experts ({why}): no fused layout exists for {shown}")


# Llama 4 (our choice; not in DESIGN 5.2): its routed experts take their input scaled by the router score, so a
# fused slot could not carry the normal path's 1/ep_size share as a routing weight (the experts are not linear).
LLAMA4_NEVER_FUSES = NeverFuses(
    "llama4.structural.input_scaled_experts",
    "its routed experts scale their input by the router score: a shared expert fused as a routed slot would not "
    "count once (no fused layout exists for Llama 4)")

# The other never-fusing families (our choice, as SGLang, vLLM and transformers run them; not in DESIGN 5.2): their
# shared experts run beside the routed ones, sized on their own (Granite's, Nemotron-H's and Hunyuan's shared MLP;
# Step-3.5's, Laguna's, Flint's and Kolibri-1's shared expert of its own width), or under a family of their own
# whose published checkpoints and kernels have no fused layout (ERNIE-4.5's two shared experts, AFMoE, EXAONE-MoE,
# Kimi-Linear, the Ling hybrids, Solar Open, Cohere2-MoE, HY-V3).


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("deepseek", layouts.deepseek_layout, gates.deepseek_gate, True,
               fused_architecture="DeepseekV3ForCausalLM"),
        Family("deepseek_nextn", layouts.deepseek_nextn_layout, gates.deepseek_gate, True),
        # Rules only (SGLang builds them with DeepSeek's MoE block and its own config class, whose defaults differ)
        Family("deepseek_v4", layouts.deepseek_v4_layout, gates.deepseek_gate, True,
               fused_architecture="DeepseekV3ForCausalLM"),
        Family("dots3", layouts.dots3_layout, gates.deepseek_gate, True, fused_architecture="DeepseekV3ForCausalLM"),
        Family("glm4_moe", layouts.glm4_moe_layout, gates.glm4_moe_gate, True),
        Family("glm4_moe_nextn", layouts.glm4_moe_nextn_layout, gates.glm4_moe_gate, True),
        Family("qwen2_moe", layouts.qwen2_moe_layout, gates.qwen2_moe_gate, True),
        Family("qwen3_moe", layouts.qwen3_moe_layout, None, False),
        # A dense decoder (no experts), e.g. SGLang's standalone Qwen3 draft beside a Qwen3-MoE target
        Family("dense", layouts.dense_layout, None, False),
        Family("mixtral", layouts.mixtral_layout, None, False),
        Family("olmoe", layouts.olmoe_layout, None, False),
        # MiMo-V2-Flash: DeepSeek-V3's router without shared experts, under windowed and global attention layers
        Family("mimo_v2_flash", layouts.mimo_v2_flash_layout, None, False),
        # DBRX: every layer MoE, no shared expert (its expert fields under ffn_config)
        Family("dbrx", layouts.dbrx_layout, None, False),
        # Jamba: Mamba and attention layers, Mixtral's experts on every expert_layer_period-th, no shared expert
        Family("jamba", layouts.jamba_layout, None, False),
        # LFM2-MoE: short-conv and attention layers over a sigmoid-routed MoE, no shared expert
        Family("lfm2_moe", layouts.lfm2_moe_layout, None, False),
        # FlexOlmo: OLMoE's attention and MoE in OLMo 2's post-norm layer
        Family("flex_olmo", layouts.olmoe_layout, None, False),
        Family("gpt_oss", layouts.mixtral_layout, None, False),
        Family("minimax_m2", layouts.mixtral_layout, None, False),
        # MiniMax-Text-01 / M1: lightning and softmax attention layers over Mixtral's experts, no shared expert
        Family("minimax", layouts.mixtral_layout, None, False),
        Family("granitemoe", layouts.granitemoe_layout, None, False),
        Family("phimoe", layouts.mixtral_layout, None, False),
        # GraniteMoeShared: Granite MoE with an ungated shared MLP, never fused
        Family("granitemoe_shared", layouts.granitemoe_shared_layout, None, True,
               never_fuses=_mlp_beside("granitemoe_shared", "Granite MoE")),
        # Granite MoE SWA (granite-swash): Granite MoE's layer, its optional shared MLP never fused
        Family("granitemoe_swa", layouts.granitemoe_shared_layout, None, True,
               never_fuses=_mlp_beside("granitemoe_swa", "Granite MoE SWA")),
        # Granite 4.0-H: Granite MoE's layer under Mamba2 or attention token mixers, its shared MLP never fused
        Family("granitemoe_hybrid", layouts.granitemoe_hybrid_layout, None, True,
               never_fuses=_mlp_beside("granitemoe_hybrid", "Granite 4.0-H")),
        # Nemotron-H: Mamba2, attention, MLP and MoE blocks; ungated experts and a shared MLP, never fused
        Family("nemotron_h", layouts.nemotron_h_layout, None, True,
               never_fuses=_mlp_beside("nemotron_h", "Nemotron-H")),
        Family("llama4", layouts.llama4_layout, None, True,
               never_fuses=LLAMA4_NEVER_FUSES),
        # GLM-4.7-Flash: GLM-4-MoE's MoE block and gate (DESIGN 5.2's GLM conditions) over DeepSeek's MLA
        Family("glm4_moe_lite", layouts.glm4_moe_lite_layout, gates.glm4_moe_gate, True),
        # GLM-4.7-Flash's NextN draft (SGLang's Glm4MoeLiteForCausalLMNextN): its MTP layer after the target's, the
        # target's expert fields (DeepSeek's names) and GLM-4-MoE's gate
        Family("glm4_moe_lite_nextn", layouts.glm4_moe_lite_nextn_layout, gates.glm4_moe_gate, True),
        # Qwen3-Next: linear-attention layers, but Qwen2-MoE's MoE block (a sigmoid-gated shared expert) and gate
        Family("qwen3_next", layouts.qwen2_moe_layout, gates.qwen2_moe_gate, True),
        Family("qwen3_5_moe", layouts.qwen3_5_moe_layout, gates.qwen2_moe_gate, True),
        Family("qwen3_next_nextn", layouts.qwen_nextn_layout, gates.qwen2_moe_gate, True),
        Family("qwen3_5_nextn", layouts.qwen_nextn_layout, gates.qwen2_moe_gate, True),
        # ERNIE-4.5: DeepSeek-V3's MoE block with a softmax router and ungated shared experts, never fused
        Family("ernie4_5_moe", layouts.ernie4_5_moe_layout, None, True,
               never_fuses=_experts_beside("ernie4_5_moe", "ERNIE-4.5")),
        # AFMoE (Arcee's Trinity): DeepSeek-V3's MoE block, one group, its shared experts beside it, never fused
        Family("afmoe", layouts.afmoe_layout, None, True,
               never_fuses=_experts_beside("afmoe", "AFMoE")),
        # EXAONE-MoE (K-EXAONE): DeepSeek-V3's MoE block with its shared experts beside it, never fused
        Family("exaone_moe", layouts.exaone_moe_layout, None, True,
               never_fuses=_experts_beside("exaone_moe", "EXAONE-MoE")),
        # Ling 3 hybrids: Kimi-Linear's shape with gated MLA and bounded KDA decays, shared experts never fused
        Family("bailing_hybrid", layouts.bailing_hybrid_layout, None, True,
               never_fuses=_experts_beside("bailing_hybrid", "the Ling hybrids")),
        # Solar Open: Llama's attention over GLM-4-MoE's MoE block on every layer, its shared experts never fused
        Family("solar_open", layouts.solar_open_layout, None, True,
               never_fuses=_experts_beside("solar_open", "Solar Open")),
        # LongCat-Flash: two MLA / MLP sublayers and one MoE block a layer, zero-computation experts, no shared one
        Family("longcat_flash", layouts.longcat_flash_layout, None, False),
        # Kimi-Linear: KDA and NoPE-MLA layers over DeepSeek-V3's MoE block, its shared experts never fused
        Family("kimi_linear", layouts.kimi_linear_layout, None, True,
               never_fuses=_experts_beside("kimi_linear", "Kimi-Linear")),
        # Cohere2-MoE: parallel attention / MoE blocks; its shared experts summed or averaged with the routed
        # experts' output, never fused
        Family("cohere2_moe", layouts.cohere2_moe_layout, None, True,
               never_fuses=_experts_beside("cohere2_moe", "Cohere2-MoE")),
        # Step-3.5 (and Step-3.7's text model): a biased sigmoid router, one shared expert of its own width, never
        # fused
        Family("step3p5", layouts.step3p5_layout, None, True,
               never_fuses=_expert_of_own_width("step3p5", "Step-3.5", "its own width and clamps")),
        # Sarvam's: DeepSeek-V3's and GLM-4-MoE's models under Sarvam's names, asked their gates; not the fused
        # architectures (our choice: transformers runs them as those families, SGLang under entry classes of
        # their own), so never fused
        # HY-V3 (Hunyuan V3): Qwen3's attention over DeepSeek-V3's MoE block, its shared experts never fused
        Family("hy_v3", layouts.hy_v3_layout, None, True,
               never_fuses=_experts_beside("hy_v3", "HY-V3")),
        # Laguna: per-layer head counts, softplus-gated attention, a shared expert of its own width, never fused
        Family("laguna", layouts.laguna_layout, None, True,
               never_fuses=_expert_of_own_width("laguna", "Laguna", "its own width")),
        # Mistral 4: DeepSeek-V3's model with a softmax router and position-scaled queries; not the fused
        # architecture, so never fused
        # A.X K1: DeepSeek-V3's model with its MoE output normalised; not the fused architecture, so never fused
        Family("axk1", layouts.axk1_layout, gates.deepseek_gate, True, fused_architecture="DeepseekV3ForCausalLM"),
        # Mellum: Qwen3-MoE's layer with windowed layers; no shared expert
        Family("mellum", layouts.mellum_layout, None, False),
        # Flint: Qwen3-MoE's layer with sinks and windows, a sigmoid router, an ungated shared expert never fused
        Family("flint", layouts.flint_layout, None, True,
               never_fuses=_expert_of_own_width("flint", "Flint", "its own width")),
        # Kolibri-1: sandwich norms, a router biased on its logits, an ungated shared expert never fused
        Family("kolibri1", layouts.kolibri1_layout, None, True,
               never_fuses=_expert_of_own_width("kolibri1", "Kolibri-1", "its own width")),
        Family("mistral4", layouts.mistral4_layout, gates.deepseek_gate, True,
               fused_architecture="DeepseekV3ForCausalLM"),
        Family("sarvam_mla", layouts.sarvam_mla_layout, gates.deepseek_gate, True,
               fused_architecture="DeepseekV3ForCausalLM"),
        Family("sarvam_moe", layouts.sarvam_moe_layout, gates.glm4_moe_gate, True,
               fused_architecture="Glm4MoeForCausalLM"),
        # MiniMax-M3 (rules only): Mixtral-style experts plus n_shared_experts shared ones on moe_layer_freq's layers.
        # loadplan's rules have no fused layout for it (its fusion under engine sglang is SGLang's own gate,
        # service/rules/sglang.py)
        Family("minimax_m3", layouts.minimax_m3_layout, None, True,
               never_fuses=_experts_beside("minimax_m3", "MiniMax-M3")),
        # Hunyuan-A13B: every layer MoE with an ungated shared MLP beside the experts, never fused
        Family("hunyuan_v1_moe", layouts.hunyuan_v1_moe_layout, None, True,
               never_fuses=_mlp_beside("hunyuan_v1_moe", "Hunyuan")),
    )
}

# What a wrapper hands its inner constructor, by the shared table's name for it.
_HANDOFFS: dict[str, Callable[[ConfigView, str | None, Mapping[str, Any] | None], Quantization]] = {
    "top_level": _top_level_quantization,
    "none": lambda cfg, explicit, qconfig: Quantization(None),
}


def _rules_row(row: shared_table.EntryClass) -> Direct | Wrapper:
    if row.is_wrapper:
        return Wrapper(row.inner, row.config_field, _HANDOFFS[row.quantization])
    return Direct(row.family, row.fused_architecture, row.text_config_if_present)


# The rules' reading of the one entry-class table (`loadplan.entry_classes`, which the engine reads too).
ENTRY_CLASSES: dict[str, Direct | Wrapper] = {name: _rules_row(row) for name, row in shared_table.ENTRY_CLASSES.items()}


def rules_only(name: str) -> bool:
    """`name` is planned by the registry but not built by loadplan's engine (the shared table says no module)."""
    row = shared_table.ENTRY_CLASSES.get(name)
    return row is None or row.rules_only


@dataclass(frozen=True)
class Resolved:
    """An entry class followed down to the family it builds."""

    chain: tuple[str, ...]        # outermost first, the built class last
    family: Family
    fused_architecture: str
    cfg: ConfigView
    quantization: Quantization


def entry(name: str) -> Direct | Wrapper:
    try:
        return ENTRY_CLASSES[name]
    except KeyError:
        raise NotFound("entry class", name, ENTRY_CLASSES, field="config.architectures") from None


def chain_of(name: str) -> tuple[str, ...]:
    """The delegation chain from `name` to the class that builds a family."""
    chain = [name]
    node = entry(name)
    while isinstance(node, Wrapper):
        if node.inner in chain:
            raise FailedPrecondition(f"entry class table: wrapper cycle {' -> '.join(chain + [node.inner])}")
        chain.append(node.inner)
        node = entry(node.inner)
    return tuple(chain)


def resolve_entry(name: str, cfg: ConfigView, explicit_q: str | None,
                  qconfig: Mapping[str, Any] | None) -> Resolved:
    """Follow wrappers, handing down config and quantization as their constructors do."""
    chain = chain_of(name)
    if qconfig is None:
        # A config.json that declares its own quantization is quantized even when
        # the request did not repeat it separately (never read it as unquantized).
        qconfig = _embedded_qconfig(cfg)
    quant = quantization_of(explicit_q, qconfig)
    for outer in chain[:-1]:
        w = ENTRY_CLASSES[outer]
        assert isinstance(w, Wrapper)
        inner = cfg.sub(w.config_field, f"{outer} builds {w.inner} from it")  # checked before it is read
        quant = w.quantization(cfg, explicit_q, qconfig)
        cfg = inner
    built = ENTRY_CLASSES[chain[-1]]
    assert isinstance(built, Direct)
    if built.text_config_if_present and cfg.has("text_config"):
        quant = _top_level_quantization(cfg, explicit_q, qconfig)
        cfg = cfg.sub("text_config", f"{chain[-1]} reads its text model's config from it")
    family = FAMILIES[built.family]
    fused = built.fused_architecture or family.fused_architecture or chain[-1]
    return Resolved(chain, family, fused, cfg, quant)


def check_table() -> list[str]:
    """Problems with the table itself; the server refuses to start unless empty."""
    problems = []
    for name, node in ENTRY_CLASSES.items():
        try:
            chain = chain_of(name)
        except (NotFound, FailedPrecondition) as e:
            problems.append(f"{name}: {e}")
            continue
        built = ENTRY_CLASSES[chain[-1]]
        if not isinstance(built, Direct) or built.family not in FAMILIES:
            problems.append(f"{name}: does not reach a family")
            continue
        fam = FAMILIES[built.family]
        if fam.has_shared_experts and not fam.gated:
            problems.append(f"{name}: family {fam.name} has shared experts but no gate")
    return problems
