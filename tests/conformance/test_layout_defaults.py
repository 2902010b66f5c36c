"""The layout readers leave a field out of a config only as the references do (tests/conformance/layout_defaults.py):
transformers' config classes, for the entry classes loadplan's engine builds (its logits are held to transformers'),
and the classes SGLang 0.5.23 reads with, for the entry classes SGLang builds (run live in SGLang's environment)."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from loadplan.entry_classes import ENTRY_CLASSES
from loadplan.service.rules import entries
from loadplan.config_view import ConfigView
from loadplan.layouts import MoeLayout, glm4_moe_layout, jamba_layout, qwen2_moe_layout

from .layout_defaults import MODEL_TYPES, disagreements, transformers_config_class
from .sglang_agreement import ROOT

SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
SCRIPT = ROOT / "tests" / "conformance" / "layout_defaults.py"
ENGINE_BUILT = sorted(a for a, row in ENTRY_CLASSES.items() if not row.is_wrapper and not row.rules_only)


def test_every_entry_class_built_directly_names_its_model_type():
    assert set(MODEL_TYPES) == {a for a, row in ENTRY_CLASSES.items() if not row.is_wrapper}


def test_every_engine_built_entry_class_has_a_transformers_config_class():
    assert [a for a in ENGINE_BUILT if transformers_config_class(MODEL_TYPES[a]) is None] == []


def test_left_out_fields_are_read_as_transformers_fills_them_in_or_refused():
    assert list(disagreements(transformers_config_class, ENGINE_BUILT, unread=True)) == []


def test_the_check_finds_a_reader_that_reads_a_left_out_field_as_something_else(monkeypatch):
    """The registry's Qwen2-MoE reader before it required shared_expert_intermediate_size: left out, no shared
    expert, where transformers' Qwen2MoeConfig fills in 5632 (a shared expert)."""
    def no_shared_when_left_out(cfg: ConfigView) -> MoeLayout:
        if cfg.has("shared_expert_intermediate_size"):
            return qwen2_moe_layout(cfg)
        return qwen2_moe_layout(ConfigView({**cfg.data, "shared_expert_intermediate_size": 0}))

    family = entries.FAMILIES["qwen2_moe"]
    monkeypatch.setitem(entries.FAMILIES, "qwen2_moe", dataclasses.replace(family, layout=no_shared_when_left_out))
    found = list(disagreements(transformers_config_class, ["Qwen2MoeForCausalLM"], unread=True))
    assert len(found) == 1 and "without shared_expert_intermediate_size" in found[0] and "n_shared" in found[0]


def _jamba_without_its_alias(cfg: ConfigView) -> MoeLayout:
    """Jamba's reader as it was: num_local_experts (JambaConfig's name of num_experts) not read."""
    return jamba_layout(ConfigView({k: v for k, v in cfg.data.items() if k != "num_local_experts"}))


def _glm4_skipping_by_moe_layer_freq(cfg: ConfigView) -> MoeLayout:
    """GLM-4-MoE's reader as it was: moe_layer_freq read, which neither transformers nor SGLang reads for it."""
    lay = glm4_moe_layout(cfg)
    freq = cfg.int("moe_layer_freq", 1)
    return dataclasses.replace(lay, moe_layers=tuple(i for i in lay.moe_layers if i % freq == 0))


@pytest.mark.parametrize("family,arch,reader,found", [
    ("jamba", "JambaForCausalLM", _jamba_without_its_alias, "num_local_experts=17, JambaConfig's name of num_experts"),
    ("glm4_moe", "Glm4MoeForCausalLM", _glm4_skipping_by_moe_layer_freq,
     "moe_layer_freq=3, which Glm4MoeConfig does not read"),
])
def test_the_check_finds_a_reader_that_reads_a_name_otherwise_than_the_config_class(monkeypatch, family, arch, reader,
                                                                                     found):
    monkeypatch.setitem(entries.FAMILIES, family, dataclasses.replace(entries.FAMILIES[family], layout=reader))
    assert any(found in line for line in disagreements(transformers_config_class, [arch], unread=True))


def test_left_out_fields_are_read_as_sglang_fills_them_in_or_refused():
    if not SGLANG_PY.exists():
        pytest.skip(f"{SGLANG_PY} missing: `make sglang-env` makes SGLang's environment (`make test` does)")
    proc = subprocess.run([str(SGLANG_PY), str(SCRIPT)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    # SGLang builds these with config classes of its own (Qwen3.5's, DeepSeek-V4's alias, Kimi-Linear's, ...)
    assert {"DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "Qwen3_5MoeForCausalLM", "KimiLinearForCausalLM",
            "LongcatFlashForCausalLM", "NemotronHForCausalLM", "Dots3NoteForCausalLM"} <= set(answer["checked"])
    assert answer["disagreements"] == []
