"""MXFP4 checkpoints (gpt-oss's experts): the dequantization against transformers' own
(`integrations.mxfp4.convert_moe_packed_tensors`), a gpt-oss whose experts are packed as the Hub's are against
transformers on what its dequantizer makes of them, and the refusals, by tensor and by field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from loadplan.engine.checkpoint import Checkpoint
from loadplan.engine.mxfp4 import FP4_VALUES, Mxfp4Checkpoint, Mxfp4ConfigError, dequantize
from loadplan.engine.weights import DuplicateTensor, MissingTensor, ShapeMismatch

from engine_helpers import (check_refused_before_any_plan, hf_logits_of_order_one, load_local, logits_of,
                            make_gpt_oss_checkpoint, prompt, with_tensors)

ARCH = "GptOssForCausalLM"
TOL = 1e-4
QUANTIZATION = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
PACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _convert_moe_packed_tensors():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    return mxfp4.convert_moe_packed_tensors


def pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, K, N] (transformers' stacked layout) -> (blocks uint8 [E, N, K/32, 16], scales uint8 [E, N, K/32]):
    each block of 32 along K scaled by a power of two that brings its largest value within FP4's 6, each value
    the nearest FP4 code. (Any rounding would do: the references are dequantized from these same bytes.)"""
    E, K, N = w.shape
    g = w.transpose(1, 2).reshape(E, N, K // 32, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)
    grid = torch.tensor(FP4_VALUES)
    codes = (g / torch.exp2(exp)[..., None])[..., None].sub(grid).abs().argmin(-1)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def test_dequantize_matches_transformers_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=g, dtype=torch.uint8)   # every code, both nibbles
    scales = torch.randint(118, 136, (3, 5, 4), generator=g, dtype=torch.uint8)
    want = _convert_moe_packed_tensors()(blocks, scales, dtype=torch.float32)
    got = dequantize(blocks, scales)
    assert got.shape == want.shape == (3, 4 * 32, 5)
    assert torch.equal(got, want)


def test_pack_is_read_back_close_to_the_weights():
    w = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(1))
    back = dequantize(*pack(w))
    assert back.shape == w.shape
    assert (back - w).abs().max() <= 0.5 * w.abs().max()     # the format's coarseness, not a layout error
    assert (back - w).abs().mean() < 0.15 * w.abs().mean()   # FP4: 1 bit of mantissa


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """(the packed gpt-oss as the Hub ships it, the same dequantized by transformers, the plain original)."""
    root = tmp_path_factory.mktemp("mxfp4")
    plain = make_gpt_oss_checkpoint(root / "plain")
    tensors = load_file(plain / "model.safetensors")
    packed, dequantized = {}, {}
    convert = _convert_moe_packed_tensors()
    for name, t in tensors.items():
        if name.endswith(PACKED):
            blocks, scales = pack(t)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            dequantized[name] = convert(blocks, scales, dtype=torch.float32)
        else:
            packed[name] = dequantized[name] = t
    cfg = json.loads((plain / "config.json").read_text())
    for folder, weights, config in ((root / "packed", packed, dict(cfg, quantization_config=QUANTIZATION)),
                                    (root / "dequantized", dequantized, cfg)):
        folder.mkdir()
        save_file(weights, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(config))
    return root / "packed", root / "dequantized", plain


def test_a_packed_gpt_oss_matches_transformers_on_its_dequantized_weights(copies):
    packed, dequantized, plain = copies
    ids = prompt(T=9)
    want = hf_logits_of_order_one(dequantized, ARCH, ids)
    assert (want - hf_logits_of_order_one(plain, ARCH, ids)).abs().max().item() > 1e-2   # the packing shows
    model = load_local(packed)
    assert model.plan.quantization == "mxfp4"
    assert (logits_of(model, ids) - want).abs().max().item() <= TOL


def test_two_expert_parallel_ranks_read_their_halves_of_the_packed_experts(copies):
    """Each rank's experts are its slice of the dequantized stack (EP 2: experts 0-3, then 4-7)."""
    packed, dequantized, _ = copies
    whole = load_file(dequantized / "model.safetensors")["model.layers.1.mlp.experts.down_proj"]   # [E, I, D]
    for rank in (0, 1):
        experts = load_local(packed, ep_size=2, ep_rank=rank).model.layers[1].mlp.experts
        assert torch.equal(experts.down_proj, whole[4 * rank:4 * rank + 4].transpose(1, 2))




NAME = "model.layers.0.mlp.experts.down_proj"


@pytest.mark.parametrize("edit, error, match", [
    (lambda t: t.pop(NAME + "_scales"), MissingTensor, r"down_proj_blocks' has no .*down_proj_scales"),
    (lambda t: t.pop(NAME + "_blocks"), MissingTensor, r"down_proj_scales' scales .*down_proj_blocks'"),
    (lambda t: t.update({NAME + "_scales": t[NAME + "_scales"][:, :, :0]}), ShapeMismatch, r"do not fit"),
    (lambda t: t.update({NAME: torch.zeros(8, 32, 64)}), DuplicateTensor, r"both plain and as"),
])
def test_a_packed_tensor_it_cannot_read_is_named(copies, tmp_path, edit, error, match):
    with pytest.raises(error, match=match):
        Mxfp4Checkpoint(Checkpoint(with_tensors(copies[0], tmp_path / "edited", edit)))


@pytest.mark.parametrize("quantization, match", [
    ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, r"modules_to_not_convert: 'lm_head'"),
])
def test_a_config_it_cannot_read_is_refused_by_field_before_any_plan(copies, tmp_path, quantization, match):
    packed = copies[0]
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(packed / "model.safetensors")
    cfg = json.loads((packed / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, quantization_config=quantization)))
    check_refused_before_any_plan(folder, Mxfp4ConfigError, match)


def test_loadplan_generate_on_two_expert_parallel_ranks_gives_transformers_tokens(copies, capsys, tmp_path):
    """The whole worker path on the packed checkpoint: two EP ranks over DeepEP's all-to-all, each planned by
    the embedded registry, against transformers' greedy tokens on the dequantized weights."""
    from loadplan.cli.main import main

    from engine_helpers import hf_greedy

    packed, dequantized, _ = copies
    prompt_ids = [5, 17, 99, 3, 64, 12]             # longer than the window of 4
    db = f"sqlite:///{tmp_path / 'plans.db'}"
    rc = main(["generate", "--model", str(packed), "--prompt-ids", ",".join(map(str, prompt_ids)),
               "--max-new-tokens", "6", "--nproc", "2", "--ep-size", "2", "--a2a-backend", "deepep", "--db", db,
               "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["tokens"] == hf_greedy(dequantized, ARCH, prompt_ids, 6)
    assert main(["plans", "list", "--db", db, "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    plans = plans["plans"] if isinstance(plans, dict) else plans
    assert sorted((p["quantization"], p["decisions"]["moe.forward_path"]["value"],
                   p["decisions"]["moe.num_local_routed_experts"]["value"]) for p in plans) == [("mxfp4", "a2a", 4)] * 2
