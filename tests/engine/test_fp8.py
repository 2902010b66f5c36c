"""Block-quantized FP8 checkpoints (engine/fp8.py): DeepSeek-V3 quantized the way DeepSeek ships it, loaded by the
engine fused and unfused, against transformers on the same weights dequantized block by block by the test helpers."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.fp8 import Fp8BlockCheckpoint, Fp8ConfigError, dequantize
from loadplan.engine.weights import MissingTensor, ShapeMismatch, UnexpectedTensor

from engine_helpers import (DEEPSEEK_TINY, DictCheckpoint, check_refused_before_any_plan, hf_logits, load_local,
                            make_checkpoint, make_deepseek_checkpoint, make_fp8_copies, prompt, with_config)

pytest.importorskip("transformers")

ARCH = "DeepseekV3ForCausalLM"
BLOCK = [16, 8]           # not square; kv_b_proj [40, 16]: blocks that do not divide every matrix
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(fp8 checkpoint, the same weights dequantized as a plain one)."""
    root = tmp_path_factory.mktemp("fp8")
    plain = make_deepseek_checkpoint(root / "plain", **dict(DEEPSEEK_TINY, rope_theta=10000.0))
    fp8, dequantized, quantized = make_fp8_copies(plain, root, BLOCK)
    assert quantized > 500                    # every expert's matrices, attention, the dense MLPs
    return fp8, dequantized


def test_fp8_checkpoint_fused_and_unfused_match_transformers_on_the_dequantized_weights(checkpoints):
    fp8, dequantized = checkpoints
    ids = prompt(T=9)
    want = hf_logits(dequantized, ARCH, ids)
    assert 0.5 < want.abs().max() < 50
    got = {}
    for fused in (True, False):
        model = load_local(fp8, disable_shared_experts_fusion=not fused)
        assert model.plan.quantization == "fp8"
        assert model.plan.decisions["moe.shared_experts_fusion"].value is fused
        assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float32
        with torch.no_grad():
            got[fused] = model(ids)
        assert (got[fused] - want).abs().max().item() <= 1e-4
    assert (got[True] - got[False]).abs().max().item() <= 1e-4


def test_a_qwen3_moe_fp8_checkpoint_matches_transformers_on_the_dequantized_weights(tmp_path):
    """Qwen3-30B-A3B-FP8's format (the same block FP8): the reader is the family's too, not DeepSeek's only."""
    plain = make_checkpoint(tmp_path / "plain", "Qwen3MoeForCausalLM")
    fp8, dequantized, quantized = make_fp8_copies(plain, tmp_path, BLOCK)
    assert quantized == 3 * (4 + 8 * 3)         # per layer: q/k/v/o, and each of 8 experts' three matrices
    ids = prompt(T=9)
    want = hf_logits(dequantized, "Qwen3MoeForCausalLM", ids)
    model = load_local(fp8)
    assert model.plan.quantization == "fp8"
    with torch.no_grad():
        assert (model(ids) - want).abs().max().item() <= 1e-4


def test_dequantize_crops_the_edge_blocks():
    w = torch.arange(5 * 3, dtype=torch.float32).view(5, 3).to(torch.float8_e4m3fn)
    s = torch.tensor([[2.0, 3.0], [5.0, 7.0]])          # blocks [4, 2]: rows 0-3 / 4, columns 0-1 / 2
    out = dequantize(w, s, (4, 2))
    assert out.shape == (5, 3)
    assert torch.equal(out[:4, :2], w[:4, :2].float() * 2) and torch.equal(out[:4, 2:], w[:4, 2:].float() * 3)
    assert torch.equal(out[4:, :2], w[4:, :2].float() * 5) and torch.equal(out[4:, 2:], w[4:, 2:].float() * 7)


def test_checkpoint_faults_name_the_tensor():
    q = torch.zeros(32, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(MissingTensor, match=r"'a\.weight_scale_inv' scales 'a\.weight'"):
        Fp8BlockCheckpoint(DictCheckpoint({"a.weight_scale_inv": torch.ones(2, 2)}), (16, 16))
    ck = Fp8BlockCheckpoint(DictCheckpoint({"a.weight": q, "a.weight_scale_inv": torch.ones(2, 3), "b.weight": q,
                                   "c.weight": torch.ones(3)}), (16, 16))
    assert ck.names() == ["a.weight", "b.weight", "c.weight"]           # scales are consumed, not loaded
    with pytest.raises(ShapeMismatch, match=r"'a\.weight_scale_inv' has shape \[2, 3\], expected \[2, 2\]"):
        ck.get("a.weight")
    with pytest.raises(UnexpectedTensor, match=r"'b\.weight' is torch\.float8_e4m3fn without 'b\.weight_scale_inv'"):
        ck.get("b.weight")
    assert torch.equal(ck.get("c.weight"), torch.ones(3))


def test_a_stack_of_matrices_is_dequantized_each_in_its_own_blocks():
    """A layer's experts stacked [E, N, K] with scales [E, n, k] (Step-3.5-Flash-FP8's form)."""
    q = torch.ones(2, 32, 16, dtype=torch.float8_e4m3fn)
    scales = torch.tensor([[[2.0], [3.0]], [[5.0], [7.0]]])                 # [2, 2, 1]: blocks of [16, 16]
    ck = Fp8BlockCheckpoint(DictCheckpoint({"m.weight": q, "m.weight_scale_inv": scales,
                                            "n.weight": q, "n.weight_scale_inv": torch.ones(2, 2)}), (16, 16))
    got = ck.get("m.weight")
    assert got.shape == (2, 32, 16)
    assert [float(got[e, r, 0]) for e in range(2) for r in (0, 16)] == [2.0, 3.0, 5.0, 7.0]
    with pytest.raises(ShapeMismatch, match=r"'n\.weight_scale_inv' has shape \[2, 2\], expected \[2, 2, 1\]"):
        ck.get("n.weight")
    with pytest.raises(ShapeMismatch, match=r"'o\.weight' has shape \[1, 1, 16, 16\]; block-quantized weights are "
                                            r"matrices, or a stack of them"):
        Fp8BlockCheckpoint(DictCheckpoint({"o.weight": torch.ones(1, 1, 16, 16, dtype=torch.float8_e4m3fn),
                                           "o.weight_scale_inv": torch.ones(1, 1, 1, 1)}), (16, 16)).get("o.weight")


@pytest.mark.parametrize("quantization, field", [
    ({"quant_method": "fp8"}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    (dict(QUANTIZATION, activation_scheme="static"), "activation_scheme"),
])
def test_config_refusals_come_before_any_plan(checkpoints, tmp_path, quantization, field):
    bad = with_config(checkpoints[0], tmp_path / "bad", quantization_config=quantization)
    check_refused_before_any_plan(bad, Fp8ConfigError, rf"config\.quantization_config\.{field}")


def test_fp8_asked_of_an_unquantized_checkpoint_is_refused(checkpoints):
    _, dequantized = checkpoints
    with pytest.raises(NotImplementedError, match="does not quantize online"):
        load_local(dequantized, quantization="fp8")
