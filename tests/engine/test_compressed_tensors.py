"""compressed-tensors `pack-quantized` checkpoints (engine/compressed_tensors.py): packed by that library's own
compressor, loaded by the engine fused and unfused, against transformers on the weights as the library
decompresses them; the Kimi-K2.5 wrapper the same way; the unpacking against the library's for every width."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from safetensors.torch import load_file, save_file

from loadplan.engine.compressed_tensors import (CompressedTensorsConfigError, IntWeights, PackedIntCheckpoint, Scheme,
                                                dequantize, scheme, unpack)
from loadplan.engine.weights import DuplicateTensor, MissingTensor, ShapeMismatch, UnexpectedTensor

from engine_helpers import (COMPRESSED_GROUPS, DEEPSEEK_TINY, DictCheckpoint, check_ranks_give_one_process_logits,
                            check_refused_before_any_plan, compressed_quantization, hf_logits, load_local,
                            make_compressed_copies, make_deepseek_checkpoint, prompt, with_config)

pytestmark = pytest.mark.heavy(16)

ARCH = "DeepseekV3ForCausalLM"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_deepseek_checkpoint(tmp_path_factory.mktemp("plain"), **dict(DEEPSEEK_TINY, rope_theta=10000.0))


@pytest.fixture(scope="module")
def checkpoints(plain, tmp_path_factory):
    """(packed checkpoint, the same weights as compressed-tensors decompresses them)."""
    packed, dequantized, n = make_compressed_copies(plain, tmp_path_factory.mktemp("ct"))
    assert n == 2 * 256 * 3 + 3            # two MoE layers' experts (int4 groups), layer 0's dense MLP (int8 rows)
    return packed, dequantized


@pytest.mark.parametrize("bits", range(1, 9))
def test_unpack_reads_what_the_library_packs(bits):
    g = torch.Generator().manual_seed(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    for k in (1, 7, 32, 37, 100):                    # values that straddle words, rows that end mid-word
        values = torch.randint(lo, hi + 1, (5, k), generator=g, dtype=torch.int8)
        assert torch.equal(unpack(pack_to_int32(values, bits), bits, k), values), (bits, k)


def test_dequantize_scales_each_group_row_or_tensor():
    q = torch.tensor([[1, -2, 3, -4, 5], [-1, 0, 7, -8, 2]], dtype=torch.int8)
    packed = pack_to_int32(q, 4)
    s = torch.tensor([[2.0, 3.0, 5.0], [7.0, 11.0, 13.0]])                    # groups of 2 over 5 columns
    want = q.float() * torch.tensor([[2.0, 2, 3, 3, 5], [7, 7, 11, 11, 13]])
    assert torch.equal(dequantize(packed, s, (2, 5), IntWeights(4, "group", 2)), want)
    assert torch.equal(dequantize(packed, torch.tensor([[2.0], [3.0]]), (2, 5), IntWeights(4, "channel")),
                       q.float() * torch.tensor([[2.0], [3.0]]))
    assert torch.equal(dequantize(packed, torch.tensor([0.5]), (2, 5), IntWeights(4, "tensor")), q.float() * 0.5)


def test_packed_checkpoint_fused_and_unfused_matches_transformers_on_the_decompressed_weights(plain, checkpoints):
    packed, dequantized = checkpoints
    ids = prompt(T=9)
    want = hf_logits(dequantized, ARCH, ids)
    assert 0.5 < want.abs().max() < 50
    assert (want - hf_logits(plain, ARCH, ids)).abs().max().item() > 1e-2      # int4 changed the model: seen
    got = {}
    for fused in (True, False):
        model = load_local(packed, disable_shared_experts_fusion=not fused)
        assert model.plan.quantization == "compressed_tensors"
        assert model.plan.decisions["moe.shared_experts_fusion"].value is fused
        with torch.no_grad():
            got[fused] = model(ids)
        assert (got[fused] - want).abs().max().item() <= 1e-4
    assert (got[True] - got[False]).abs().max().item() <= 1e-4


def test_packed_checkpoint_on_tp_or_ep_ranks_gives_the_single_process_logits(checkpoints):
    """Each rank dequantizes the packed tensors and then takes its part (its heads, features or experts)."""
    check_ranks_give_one_process_logits(checkpoints[0], prompt(T=5))


KIMI_K25 = json.loads((Path(__file__).parents[1] / "data/configs/kimi-k2.5/config.json").read_text())


def test_kimi_k25s_own_quantization_config_reads_as_int4_groups_of_32():
    assert scheme(KIMI_K25["quantization_config"]) == Scheme(((("Linear",), IntWeights(4, "group", 32)),))


def test_the_kimi_wrapper_reads_its_packed_experts_by_kimi_k25s_own_quantization_config(tmp_path):
    """Kimi-K2.5's layout and quantization_config as shipped: the DeepSeek body under language_model., only the
    routed experts packed (int4, groups of 32; attention, shared experts and dense MLP left by `ignore`)."""
    plain = make_deepseek_checkpoint(tmp_path / "plain", **dict(DEEPSEEK_TINY, rope_theta=10000.0,
                                                                moe_intermediate_size=32))
    text = json.loads((plain / "config.json").read_text())
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}
    packed, dequantized, n = make_compressed_copies(plain, tmp_path, KIMI_K25["quantization_config"],
                                                    prefix="language_model.", config=kimi)
    # The experts, and the head: `ignore` lists it as "lm_head", an exact name, and here it is
    # "language_model.lm_head" (the engine reads it packed or plain alike).
    assert n == 2 * 256 * 3 + 1
    ids = prompt(T=6)
    model = load_local(packed)
    assert (model.plan.entry_class, model.plan.quantization) == ("KimiK25ForConditionalGeneration",
                                                                 "compressed_tensors")
    with torch.no_grad():
        got, want = model(ids), load_local(dequantized)(ids)
    assert (got - want).abs().max().item() <= 1e-5
    # Kimi's text body is DeepSeek-V3's: transformers on the decompressed weights, names unprefixed.
    body = tmp_path / "body"
    body.mkdir()
    save_file({k.removeprefix("language_model."): v for k, v in load_file(dequantized / "model.safetensors").items()},
              body / "model.safetensors")
    (body / "config.json").write_text(json.dumps(text))
    assert (got - hf_logits(body, ARCH, ids)).abs().max().item() <= 1e-4


INT4 = scheme(compressed_quantization())


def _packed(module="a", n=4, k=16, scale_shape=(4, 2)):
    q = torch.zeros(n, k, dtype=torch.int8)
    return {f"{module}.weight_packed": pack_to_int32(q, 4), f"{module}.weight_scale": torch.ones(scale_shape),
            f"{module}.weight_shape": torch.tensor([n, k])}


def test_the_checkpoint_view_shows_plain_weights_and_consumes_the_parts():
    tensors = {**_packed("x.mlp.experts.0.up_proj"), "x.norm.weight": torch.ones(3)}
    ck = PackedIntCheckpoint(DictCheckpoint(tensors), INT4)
    assert ck.names() == ["x.mlp.experts.0.up_proj.weight", "x.norm.weight"]
    assert ck.shape("x.mlp.experts.0.up_proj.weight") == (4, 16)
    assert torch.equal(ck.get("x.mlp.experts.0.up_proj.weight"), torch.zeros(4, 16))
    assert torch.equal(ck.get("x.norm.weight"), torch.ones(3))


def test_checkpoint_faults_name_the_tensor():
    m = "x.mlp.experts.0.up_proj"
    with pytest.raises(MissingTensor, match=rf"'{m}\.weight_scale' is missing"):
        PackedIntCheckpoint(DictCheckpoint({k: v for k, v in _packed(m).items() if not k.endswith("scale")}), INT4)
    with pytest.raises(MissingTensor, match=r"'b\.weight_shape' belongs to 'b\.weight_packed', which is not in"):
        PackedIntCheckpoint(DictCheckpoint({"b.weight_shape": torch.tensor([1, 2])}), INT4)
    with pytest.raises(UnexpectedTensor, match=rf"'{m}\.weight_zero_point': a tensor of a scheme"):
        PackedIntCheckpoint(DictCheckpoint({**_packed(m), f"{m}.weight_zero_point": torch.zeros(1, 2)}), INT4)
    with pytest.raises(DuplicateTensor, match=rf"'{m}\.weight' is in the checkpoint both plain and packed"):
        PackedIntCheckpoint(DictCheckpoint({**_packed(m), f"{m}.weight": torch.zeros(4, 16)}), INT4)
    with pytest.raises(ShapeMismatch, match=rf"'{m}\.weight_scale' has shape \[4, 3\], expected \[4, 2\] for "
                                            r"strategy group over \[4, 16\]"):
        PackedIntCheckpoint(DictCheckpoint(_packed(m, scale_shape=(4, 3))), INT4).get(f"{m}.weight")
    wrong = {**_packed(m), f"{m}.weight_shape": torch.tensor([4, 24])}
    with pytest.raises(ShapeMismatch, match=rf"'{m}\.weight_packed' is torch\.int32 \[4, 2\], expected torch\.int32 "
                                            r"\[4, 3\] for 4-bit values of shape \[4, 24\]"):
        PackedIntCheckpoint(DictCheckpoint(wrong), INT4).get(f"{m}.weight")
    with pytest.raises(UnexpectedTensor, match=r"'q\.weight_packed' matches none of the config groups' targets"):
        PackedIntCheckpoint(DictCheckpoint(_packed("q", scale_shape=(4, 1))), INT4).get("q.weight")


def _group(**weights):
    return {"group_0": dict(COMPRESSED_GROUPS["group_0"], weights=dict(COMPRESSED_GROUPS["group_0"]["weights"],
                                                                         **weights))}


@pytest.mark.parametrize("quantization, field", [
    (dict(compressed_quantization(), format="float-quantized"), "format"),
    (dict(compressed_quantization(), config_groups={}), "config_groups"),
    (dict(compressed_quantization(), kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    (dict(compressed_quantization(), transform_config={"config_groups": {}}), "transform_config"),
    (compressed_quantization({"group_0": dict(COMPRESSED_GROUPS["group_0"], input_activations={"num_bits": 8})}),
     "config_groups.group_0.input_activations"),
    (compressed_quantization(_group(symmetric=False)), "config_groups.group_0.weights.symmetric"),
    (compressed_quantization(_group(type="float")), "config_groups.group_0.weights.type"),
    (compressed_quantization(_group(num_bits=16)), "config_groups.group_0.weights.num_bits"),
    (compressed_quantization(_group(actorder="group")), "config_groups.group_0.weights.actorder"),
    (compressed_quantization(_group(strategy="block")), "config_groups.group_0.weights.strategy"),
    (compressed_quantization(_group(group_size=None)), "config_groups.group_0.weights.group_size"),
])
def test_config_refusals_come_before_any_plan(checkpoints, tmp_path, quantization, field):
    bad = with_config(checkpoints[0], tmp_path / "bad", quantization_config=quantization)
    check_refused_before_any_plan(bad, CompressedTensorsConfigError, rf"config\.quantization_config\.{field}: ")


def test_compressed_tensors_asked_of_an_unquantized_checkpoint_is_refused(checkpoints):
    _, dequantized = checkpoints
    with pytest.raises(NotImplementedError, match="does not quantize online"):
        load_local(dequantized, quantization="compressed-tensors")
