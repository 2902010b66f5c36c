"""One reader of each layout field: which layers exist and which are MoE, the routed and shared expert counts and
top-k are read from config.json by the registry's readers (`loadplan.service.rules.layouts`) alone. An engine family
takes them from `moe_layout(<its family's reader>, config)`, so the engine builds the very layout its plan was
decided for, and a field read twice cannot be read two ways.

The fields are the ones the readers name; a family may read one of them itself only for what the layout does not
give (a width, a token mixer), listed below with the reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LAYOUTS = ROOT / "service" / "rules" / "layouts.py"
MODELS = ROOT / "engine" / "models"

# Values the readers compare a field with, not fields.
VALUES = {"attention", "dense", "full_attention", "linear_attention", "mamba", "mlp", "moe", "sparse"}

# (file, field): why that family reads the field itself too.
ALSO_READ: dict[tuple[str, str], str] = {
}


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
            if node.value in fields and (path.name, node.value) not in ALSO_READ:
                found.append(f"{path.name}:{node.lineno}: {node.value}")
    assert found == []


def test_every_exception_is_still_needed():
    fields = layout_fields()
    stale = []
    for (name, field), why in ALSO_READ.items():
        values = {n.value for n in _strings(ast.parse((MODELS / name).read_text()))}
        if field not in values or field not in fields or not why:
            stale.append((name, field))
    assert stale == []
