"""GPTQ checkpoints (engine/gptq.py): the unpacking against AutoGPTQ's packing loops (restated here: the library
needs CUDA to install) for every width and both checkpoint formats, activation-ordered groups included; a
Qwen2-MoE whose linear layers are all packed (zero biases beside them, as AutoGPTQ writes) loaded fused and
unfused against transformers on the dequantized weights; what cannot be read refused by field or by tensor."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.gptq import GptqCheckpoint, GptqConfigError, GptqScheme, scheme
from loadplan.engine.weights import MissingTensor, ShapeMismatch
from loadplan.plan import Keys

from engine_helpers import (DictCheckpoint, as_int32, check_ranks_give_one_process_logits,
                            check_refused_before_any_plan, hf_logits, load_local, logits_of, make_checkpoint,
                            make_packed_linear_copies, prompt, quantize_groups, with_config)

ARCH = "Qwen2MoeForCausalLM"
GROUP = 32


def autogptq_pack(q: torch.Tensor, zeros: torch.Tensor, bits: int, zero_offset: int) -> tuple[torch.Tensor, ...]:
    """AutoGPTQ's QuantLinear.pack, restated: q [K, N] -> qweight, packing rows i..i+32/b-1 into one row, row i + j
    at bits b*j; zero points minus `zero_offset` (v1 stores them minus one), wrapped to b bits, packed the same way
    along the outputs."""
    per, mask = 32 // bits, (1 << bits) - 1
    qweight = torch.zeros(q.shape[0] // per, q.shape[1], dtype=torch.int64)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= q[row * per + j] << (bits * j)
    stored = (zeros - zero_offset) & mask
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // per, dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= stored[:, col * per + j] << (bits * j)
    return as_int32(qweight), as_int32(qzeros)


def gptq_parts(w: torch.Tensor, bits: int, *, desc_act: bool = False, zero_offset: int = 1, seed: int = 0):
    """(parts, dequantized w) of w [N, K] quantized in groups of GROUP inputs; with `desc_act` the groups follow a
    random order of the inputs (g_idx), as GPTQ's activation order leaves them."""
    K = w.shape[1]
    order = torch.randperm(K, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(K)
    g_idx = torch.empty(K, dtype=torch.int64)
    g_idx[order] = torch.arange(K) // GROUP
    q, zeros, scales, deq = quantize_groups(w, bits, g_idx)
    qweight, qzeros = autogptq_pack(q, zeros, bits, zero_offset)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx.to(torch.int32)}, deq


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("fmt, offset", [("gptq", 1), ("gptq_v2", 0)])
@pytest.mark.parametrize("desc_act", [False, True])
def test_a_packed_layer_reads_as_its_dequantized_weight(bits, fmt, offset, desc_act):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(bits))
    parts, want = gptq_parts(w, bits, desc_act=desc_act, zero_offset=offset)
    ckpt = GptqCheckpoint(DictCheckpoint({f"x.{k}": v for k, v in parts.items()}), GptqScheme(bits, GROUP, offset))
    assert ckpt.names() == ["x.weight"] and ckpt.shape("x.weight") == (16, 64)
    got = ckpt.get("x.weight")
    assert torch.equal(got, want) and (got - w).abs().max() < 2 ** (5 - bits)      # and near the original
    if not desc_act:                                           # without g_idx: input k is in group k // group_size
        del parts["g_idx"]
        plain = GptqCheckpoint(DictCheckpoint({f"x.{k}": v for k, v in parts.items()}), GptqScheme(bits, GROUP, offset))
        assert torch.equal(plain.get("x.weight"), want)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    plain = make_checkpoint(tmp_path_factory.mktemp("plain"), ARCH)
    qconfig = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
               "checkpoint_format": "gptq"}
    packed, dequantized, n = make_packed_linear_copies(plain, tmp_path_factory.mktemp("gptq"),
                                                       lambda w: gptq_parts(w, 4, desc_act=True), qconfig)
    assert n == 3 * (4 + 3 * 8 + 3)            # per layer: q, k, v, o; 8 experts' 3; the shared expert's 3
    return packed, dequantized


def test_a_gptq_qwen2_moe_matches_transformers_on_its_dequantized_weights_fused_and_unfused(checkpoints):
    packed, dequantized = checkpoints
    ids = prompt(T=9)
    want = hf_logits(dequantized, ARCH, ids)
    assert 0.5 < want.abs().max() < 50
    for fused in (True, False):
        model = load_local(packed, disable_shared_experts_fusion=not fused)
        assert model.plan.quantization == "gptq"
        assert model.plan.decisions[Keys.SHARED_EXPERTS_FUSION].value is fused
        assert (logits_of(model, ids) - want).abs().max().item() <= 1e-4


def test_on_tp_or_ep_ranks_it_gives_the_single_process_logits(checkpoints):
    """Activation-ordered groups included: each rank dequantizes a whole layer, then takes its rows or columns."""
    check_ranks_give_one_process_logits(checkpoints[0], prompt(T=5))


@pytest.mark.parametrize("overrides, match", [
    ({"bits": 3}, r"quantization_config\.bits: 3 not supported; supported: 2, 4, 8"),
    ({"group_size": 0}, r"quantization_config\.group_size: 0 not supported"),
    ({"checkpoint_format": "marlin"}, r"quantization_config\.checkpoint_format: 'marlin' not supported"),
    ({"dynamic": {"-:.*experts.*": {}}}, r"quantization_config\.dynamic: .* per-module overrides"),
    ({"checkpoint_format": None, "format": "bitblas"}, r"quantization_config\.format: 'bitblas' not supported"),
    ({"pack_dtype": "int16"}, r"quantization_config\.pack_dtype: 'int16' not supported; supported: int32"),
])
def test_a_config_it_cannot_read_is_refused_by_field_before_any_plan(checkpoints, tmp_path, overrides, match):
    packed, _ = checkpoints
    import json
    qconfig = json.loads((packed / "config.json").read_text())["quantization_config"]
    check_refused_before_any_plan(with_config(packed, tmp_path / "bad", quantization_config=dict(qconfig, **overrides)),
                                  GptqConfigError, match)


def test_scheme_reads_the_defaults_and_gptqmodels_spelling():
    assert scheme({"quant_method": "gptq", "bits": 8}) == GptqScheme(8, -1, 1)
    assert scheme({"quant_method": "gptq", "bits": 4, "group_size": 128, "format": "gptq_v2",
                   "pack_dtype": "int32"}) == GptqScheme(4, 128, 0)


def test_a_layer_missing_a_part_or_of_mismatched_parts_is_named():
    parts, _ = gptq_parts(torch.randn(16, 64), 4)
    with pytest.raises(MissingTensor, match=r"'x\.scales' is missing: 'x\.qweight' cannot be dequantized"):
        GptqCheckpoint(DictCheckpoint({"x.qweight": parts["qweight"], "x.qzeros": parts["qzeros"]}),
                       GptqScheme(4, GROUP, 1))
    with pytest.raises(MissingTensor, match=r"'y\.qzeros' belongs to 'y\.qweight'"):
        GptqCheckpoint(DictCheckpoint({"y.qzeros": parts["qzeros"]}), GptqScheme(4, GROUP, 1))
    bad = GptqCheckpoint(DictCheckpoint({"x.qweight": parts["qweight"], "x.qzeros": parts["qzeros"],
                                         "x.scales": parts["scales"][:, :8]}), GptqScheme(4, GROUP, 1))
    with pytest.raises(ShapeMismatch, match=r"x: qweight \[8, 16\], qzeros \[2, 2\] and scales \[2, 8\] do not fit"):
        bad.get("x.weight")
