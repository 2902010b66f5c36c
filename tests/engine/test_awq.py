"""AWQ checkpoints (engine/awq.py): the unpacking against AutoAWQ's gemm packing loop (restated here: the library
needs CUDA to install), its interleaved order included; a Qwen3-MoE whose linear layers are all packed loaded
against transformers on the dequantized weights; what cannot be read refused by field or by tensor."""

from __future__ import annotations

import json

import pytest
import torch

from loadplan.engine.awq import AwqCheckpoint, AwqConfigError, AwqScheme, scheme
from loadplan.engine.weights import ShapeMismatch

from engine_helpers import (DictCheckpoint, as_int32, check_ranks_give_one_process_logits,
                            check_refused_before_any_plan, hf_logits, load_local, logits_of, make_checkpoint,
                            make_packed_linear_copies, prompt, quantize_groups, with_config)

ARCH = "Qwen3MoeForCausalLM"
GROUP = 32
ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]       # AutoAWQ's pack order: slot i of a word takes column order_map[i]


def autoawq_pack(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM.from_linear packing, restated: values [R, N] (4 bits) -> int32 [R, N / 8]."""
    out = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for col in range(out.shape[1]):
        for i in range(8):
            out[:, col] |= values[:, col * 8 + ORDER_MAP[i]] << (i * 4)
    return as_int32(out)


def awq_parts(w: torch.Tensor):
    """(parts, dequantized w) of w [N, K] in groups of GROUP inputs."""
    q, zeros, scales, deq = quantize_groups(w, 4, torch.arange(w.shape[1]) // GROUP)
    return {"qweight": autoawq_pack(q), "qzeros": autoawq_pack(zeros), "scales": scales}, deq


def test_a_packed_layer_reads_as_its_dequantized_weight():
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    parts, want = awq_parts(w)
    ckpt = AwqCheckpoint(DictCheckpoint({f"x.{k}": v for k, v in parts.items()}), AwqScheme(GROUP))
    assert ckpt.names() == ["x.weight"] and ckpt.shape("x.weight") == (24, 64)
    got = ckpt.get("x.weight")
    assert torch.equal(got, want) and (got - w).abs().max() < 0.5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    plain = make_checkpoint(tmp_path_factory.mktemp("plain"), ARCH)
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
               "modules_to_not_convert": None}
    packed, dequantized, n = make_packed_linear_copies(plain, tmp_path_factory.mktemp("awq"), awq_parts, qconfig)
    assert n == 3 * (4 + 3 * 8)                # per layer: q, k, v, o; 8 experts' 3
    return packed, dequantized


def test_an_awq_qwen3_moe_matches_transformers_on_its_dequantized_weights(checkpoints):
    packed, dequantized = checkpoints
    ids = prompt(T=9)
    want = hf_logits(dequantized, ARCH, ids)
    assert 0.5 < want.abs().max() < 50
    model = load_local(packed)
    assert model.plan.quantization == "awq"
    assert (logits_of(model, ids) - want).abs().max().item() <= 1e-4


def test_on_tp_or_ep_ranks_it_gives_the_single_process_logits(checkpoints):
    """Activation-ordered groups included: each rank dequantizes a whole layer, then takes its rows or columns."""
    check_ranks_give_one_process_logits(checkpoints[0], prompt(T=5))


@pytest.mark.parametrize("overrides, match", [
    ({"bits": 8}, r"quantization_config\.bits: 8 not supported; supported: 4"),
    ({"version": "gemv"}, r"quantization_config\.version: 'gemv' not supported; supported: gemm"),
    ({"zero_point": False}, r"quantization_config\.zero_point: False not supported"),
    ({"group_size": -1}, r"quantization_config\.group_size: -1 not supported"),
])
def test_a_config_it_cannot_read_is_refused_by_field_before_any_plan(checkpoints, tmp_path, overrides, match):
    packed, _ = checkpoints
    qconfig = json.loads((packed / "config.json").read_text())["quantization_config"]
    check_refused_before_any_plan(with_config(packed, tmp_path / "bad", quantization_config=dict(qconfig, **overrides)),
                                  AwqConfigError, match)


def test_autoawqs_own_field_names_are_read():
    assert scheme({"quant_method": "awq", "w_bit": 4, "q_group_size": 64}) == AwqScheme(64)


def test_parts_that_do_not_fit_are_named():
    parts, _ = awq_parts(torch.randn(24, 64))
    bad = AwqCheckpoint(DictCheckpoint({"x.qweight": parts["qweight"], "x.qzeros": parts["qzeros"][:1],
                                        "x.scales": parts["scales"]}), AwqScheme(GROUP))
    with pytest.raises(ShapeMismatch, match=r"x: qweight \[64, 3\], qzeros \[1, 3\] and scales \[2, 24\] do not fit"):
        bad.get("x.weight")
