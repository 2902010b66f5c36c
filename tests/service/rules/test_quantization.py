"""Quantization as the gates see it: a normalised name and the excluded modules."""

from __future__ import annotations

import pytest

from loadplan.service.rules.quantization import NO_FUSION_QUANTIZATIONS, quantization_of


def test_unquantized():
    q = quantization_of(None, None)
    assert q.name is None and q.excluded_modules == ()
    assert quantization_of(None, {}).name is None
    assert quantization_of("", {}).name is None


def test_explicit_name_wins_over_the_config():
    assert quantization_of("quark", {"quant_method": "fp8"}).name == "quark"
    assert quantization_of("", {"quant_method": "fp8"}).name == "fp8"
    assert quantization_of(None, {"quant_method": "fp8"}).name == "fp8"


@pytest.mark.parametrize("raw,name", [("FP8", "fp8"), ("Compressed-Tensors", "compressed_tensors"),
                                      ("W4AFP8", "w4afp8"), (" quark ", "quark")])
def test_names_are_normalised(raw, name):
    assert quantization_of(raw, None).name == name
    assert quantization_of(None, {"quant_method": raw}).name == name


@pytest.mark.parametrize("algo,name", [("NVFP4", "modelopt_fp4"), ("nvfp4_awq", "modelopt_fp4"),
                                       ("FP8", "modelopt_fp8"), ("MXFP8", "mxfp8"), (None, "modelopt")])
def test_modelopt_writes_its_format_in_quant_algo(algo, name):
    assert quantization_of(None, {"quant_method": "modelopt", "quant_algo": algo}).name == name


def test_a_modelopt_mixed_precision_checkpoint_is_modelopt_mixed_with_nvfp4_layers_else_w4afp8():
    layers = {"model.layers.1.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4"}}
    mixed = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": layers}
    assert quantization_of(None, mixed).name == "modelopt_mixed"
    layers = {"model.layers.1.mlp.experts.0.gate_proj": {"quant_algo": "W4A8_AWQ"}}
    assert quantization_of(None, dict(mixed, quantized_layers=layers)).name == "w4afp8"


@pytest.mark.parametrize("key", ["exclude_modules", "ignore", "modules_to_not_convert", "ignored_layers"])
def test_excluded_modules_from_each_known_key(key):
    q = quantization_of(None, {"quant_method": "x", key: ["lm_head", "model.layers.3.mlp.shared_experts"]})
    assert q.excludes("shared_experts")
    assert q.excludes("lm_head")
    assert not q.excludes("self_attn")


def test_non_list_exclusions_are_ignored():
    assert quantization_of(None, {"quant_method": "x", "ignore": "shared_experts"}).excluded_modules == ()


def test_no_fusion_quantizations_are_the_design_three():
    assert set(NO_FUSION_QUANTIZATIONS) == {"w4afp8", "wint4afp8", "wint4a16"}
