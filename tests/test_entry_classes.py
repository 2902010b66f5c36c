"""The one entry-class table (`loadplan.entry_classes`) that the rules and the engine both read."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loadplan import entry_classes as table
from loadplan.engine import registry as engine_registry
from loadplan.service import coverage
from loadplan.service.rules import entries


def test_the_table_imports_neither_torch_nor_grpc():
    code = ("import sys, loadplan.entry_classes\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'grpc', 'sqlalchemy'})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_rules_and_the_engine_read_the_same_rows():
    built = {n for n, row in table.ENTRY_CLASSES.items() if not row.rules_only}
    assert set(engine_registry.ENGINE_ENTRY_CLASSES) == built
    assert set(entries.ENTRY_CLASSES) == set(table.ENTRY_CLASSES)
    for name, row in table.ENTRY_CLASSES.items():
        rules_row = entries.ENTRY_CLASSES[name]
        if row.is_wrapper:
            assert (rules_row.inner, rules_row.config_field) == (row.inner, row.config_field)
            if name in built:
                assert engine_registry.ENGINE_WRAPPERS[name].inner == row.inner
        else:
            assert rules_row.family == row.family
    for name, (module, cls) in engine_registry.ENGINE_ENTRY_CLASSES.items():
        assert module == f"loadplan.engine.models.{table.ENTRY_CLASSES[name].engine}" and cls == name


def test_a_rules_only_row_is_planned_but_not_built(monkeypatch):
    monkeypatch.setitem(table.ENTRY_CLASSES, "FooMoeForCausalLM", table.direct("qwen3_moe", None))
    monkeypatch.setitem(entries.ENTRY_CLASSES, "FooMoeForCausalLM", entries._rules_row(table.ENTRY_CLASSES["FooMoeForCausalLM"]))
    assert table.engine_module("FooMoeForCausalLM") is None
    cov = coverage.coverage_of("FooMoeForCausalLM")
    assert cov.ok and cov.message.endswith("rules only (loadplan's engine does not build it)")
    assert coverage.coverage_of("Qwen3MoeForCausalLM").message.endswith("built by loadplan's engine")
    with pytest.raises(engine_registry.UnsupportedModel):
        engine_registry.model_class("FooMoeForCausalLM")


def test_a_wrapper_that_hands_down_no_quantization_reads_none():
    row = entries._rules_row(table.wrapper("DeepseekV2ForCausalLM", "language_config", None, quantization="none"))
    from loadplan.config_view import ConfigView
    assert row.quantization(ConfigView({}), "fp8", {"quant_method": "fp8"}).name is None
