"""One reader of each layout field: which layers exist and which are MoE, the routed and shared expert counts and
top-k are read from config.json by the registry's readers (`loadplan.layouts`) alone. An engine family
takes them from `moe_layout(<its family's reader>, config)`, so the engine builds the very layout its plan was
decided for, and a field read twice cannot be read two ways.

The fields are the ones the readers name; a family may read one of them itself only for what the layout does not
give (a width, a token mixer, its MTP layers) or to refuse what its model cannot build, listed below with the
reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LAYOUTS = ROOT / "loadplan" / "layouts.py"
MODELS = ROOT / "engine" / "models"

# Values the readers compare a field with, and the fields they read only to refuse a config their family's
# references read otherwise (a model_type, DeepSeek-V4.1's text_config), which the engine reads for its own reasons.
VALUES = {"attention", "dense", "full_attention", "linear_attention", "mamba", "mlp", "moe", "sparse",
          "deepseek_v41", "granitemoe_swa", "granitemoeshared", "qwen3_5_text", "model_type", "text_config"}

MTP = "the MTP layers a target skips at load, or the one a draft builds: the layout counts the decoder's layers"

# field: (why these engine modules read it themselves too, the modules)
ALSO_READ: dict[str, tuple[str, set[str]]] = {
    "layer_types": ("each layer's attention kind or token mixer (Nemotron-H's reader reads it as its block pattern)",
                    {"bailing_hybrid.py", "cohere2_moe.py", "config.py", "dots1.py", "gpt_oss.py",
                     "granitemoe.py", "granitemoe_hybrid.py", "kimi_linear.py", "laguna.py",
                     "lfm2_moe.py", "llama4.py", "mellum.py", "mimo_v2_flash.py", "minimax.py", "nemotron_h.py",
                     "qwen3_next.py", "qwen_moe.py", "step3p5.py"}),
    "layers_block_type": ("each layer's token mixer (Mamba2, attention, MLP)", {"granitemoe_hybrid.py", "nemotron_h.py"}),
    "hybrid_override_pattern": ("Nemotron-H's older spelling of its token mixers", {"nemotron_h.py"}),
    "num_nextn_predict_layers": (MTP, {"bailing_hybrid.py", "causal_lm.py", "deepseek_v3.py",
                                       "nemotron_h.py", "qwen3_5_nextn.py",
                                       "sarvam.py", "solar_open.py", "step3p5.py"}),
    "num_mtp_layers": (MTP, {"bailing_hybrid.py", "sarvam.py", "solar_open.py", "step3p5.py"}),
    "shared_expert_intermediate_size": ("the shared expert's width: the layout says only whether there is one",
                                        {"flint.py", "kolibri1.py", "laguna.py", "qwen3_next.py", "qwen_moe.py"}),
    "shared_intermediate_size": ("the shared MLP's width (MiniMax-M2: refused, it has none)",
                                 {"granitemoe.py", "granitemoe_hybrid.py", "minimax_m2.py"}),
    "moe_layer_freq": ("refused unless 1 among the fields of later models its transformers model does not run "
                       "(Kimi-Linear, the Ling hybrids)", {"bailing_hybrid.py", "kimi_linear.py"}),
    "first_k_dense_replace": ("Cohere2-MoE: also the attention kind of the dense layers when layer_types is absent",
                              {"cohere2_moe.py"}),
    "ffn_config": ("DBRX's experts' width, activation and weight normalisation", {"dbrx.py"}),
    "zero_expert_num": ("LongCat-Flash: the zero-computation experts its router scores", {"longcat_flash.py"}),
}


def _also_read(module: str, field: str) -> bool:
    return field in ALSO_READ and module in ALSO_READ[field][1]


def _strings(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of `tree` that are not docstrings."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def layout_fields() -> set[str]:
    names = {n.value for n in _strings(ast.parse(LAYOUTS.read_text())) if re.fullmatch(r"[a-z][a-z0-9_]*", n.value)}
    return names - VALUES


def test_the_readers_name_the_fields_this_test_looks_for():
    fields = layout_fields()
    assert {"num_hidden_layers", "num_experts_per_tok", "n_routed_experts", "mlp_layer_types"} <= fields
    assert not fields & VALUES


def test_engine_families_read_no_layout_field_themselves():
    fields = layout_fields()
    found = []
    for path in sorted(MODELS.glob("*.py")):
        for node in _strings(ast.parse(path.read_text(), str(path))):
            if node.value in fields and not _also_read(path.name, node.value):
                found.append(f"{path.name}:{node.lineno}: {node.value}")
    assert found == []


def test_every_exception_is_still_needed():
    fields = layout_fields()
    stale = []
    for field, (why, modules) in ALSO_READ.items():
        for name in sorted(modules):
            values = {n.value for n in _strings(ast.parse((MODELS / name).read_text()))}
            if field not in values or field not in fields or not why:
                stale.append((name, field))
    assert stale == []
