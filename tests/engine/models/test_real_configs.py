"""The config.json each model ships (tests/data/configs), shrunk in its sizes only, with random weights: the engine's
logits against transformers', fused and unfused where the plan allows.

Everything that changes the arithmetic is kept as shipped: rope scaling (DeepSeek's and Kimi's YaRN, with Kimi's
beta_fast 1), routing (groups, top-k, scoring, normalisation, routed_scaling_factor), expert counts (the fusion
gate reads them), dense-layer counts, partial rotary, qk norm, biases, shared-expert widths relative to the
experts', the spelling (`rope_scaling` with `type`, `rope_theta`), and for Kimi-K2.5 the wrapper and its int4
quantization_config. A field the engine read wrongly or ignored shows here, not in production."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_helpers import (_save_random_model, hf_logits_of_order_one, hf_mtp, load_local, make_compressed_copies,
                            make_mtp_checkpoint, prompt)

CONFIGS = Path(__file__).parents[2] / "data" / "configs"
TOL = 1e-4
HEADS = 4

# Sizes only. Widths are 32-multiples: Kimi-K2.5's int4 groups are 32 wide.
SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, head_dim=16,
             q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
DROP = ("auto_map", "torch_dtype", "transformers_version", "quantization_config",
        "bos_token_id", "eos_token_id", "pad_token_id")                 # token ids of the real vocabulary


def shrink(cfg: dict) -> dict:
    out = {k: v for k, v in cfg.items() if k not in DROP}
    out.update({k: v for k, v in SIZES.items() if k in cfg})
    if "shared_expert_intermediate_size" in cfg:   # Qwen1.5-MoE: 4x the experts' width (not fusable), kept so
        ratio = cfg["shared_expert_intermediate_size"] // cfg["moe_intermediate_size"]
        out["shared_expert_intermediate_size"] = SIZES["moe_intermediate_size"] * ratio
    out["num_attention_heads"] = HEADS
    out["num_key_value_heads"] = max(1, HEADS * cfg["num_key_value_heads"] // cfg["num_attention_heads"])
    out["num_hidden_layers"] = cfg.get("first_k_dense_replace", 0) + 2     # the dense layers, then two MoE layers
    if "layer_types" in cfg:                                                # gpt-oss: one per layer
        out["layer_types"] = cfg["layer_types"][:out["num_hidden_layers"]]
    return out


def _checkpoint(name: str, family: str, root: Path) -> tuple[Path, Path, dict]:
    """transformers' model of the shrunk config: (its weights with config.json as shipped, shrunk; the same
    weights with the config transformers reads; the shipped config)."""
    shipped = json.loads((CONFIGS / name / "config.json").read_text())
    text = shrink(shipped.get("text_config", shipped))
    # Kimi's model_type kimi_k2 is not transformers': its DeepseekV3 reads the checkpoint only without it.
    hf = {k: v for k, v in text.items() if k != "model_type"}
    reference = root / "transformers"
    _save_random_model(reference, family, 0, hf)
    (reference / "config.json").write_text(json.dumps(hf))
    path = root / "shipped"
    path.mkdir()
    (path / "model.safetensors").symlink_to(reference / "model.safetensors")
    (path / "config.json").write_text(json.dumps(text))
    return path, reference, shipped


CASES = [("deepseek-v3", "DeepseekV3"), ("kimi-k2", "DeepseekV3"), ("glm-4.5", "Glm4Moe"),
         ("qwen1.5-moe-a2.7b", "Qwen2Moe"), ("qwen3-30b-a3b", "Qwen3Moe"), ("mixtral-8x7b", "Mixtral"),
         ("gpt-oss-20b", "GptOss")]
# What the plan decides for each, on one CPU rank (DESIGN 5.2): DeepSeek-V3's 256 experts fuse; Kimi-K2's 384
# need quark; GLM-4.5 fuses; Qwen1.5-MoE's shared expert is 4x wider than its experts; Qwen3, Mixtral and gpt-oss
# have none.
FUSES = {"deepseek-v3": True, "kimi-k2": False, "glm-4.5": True, "qwen1.5-moe-a2.7b": False, "qwen3-30b-a3b": False,
         "mixtral-8x7b": False, "gpt-oss-20b": False}


@pytest.mark.parametrize("name, family", CASES)
def test_shipped_config_shrunk_matches_transformers_fused_and_unfused(name, family, tmp_path):
    path, reference, shipped = _checkpoint(name, family, tmp_path)
    ids = prompt(T=8)
    want = hf_logits_of_order_one(reference, f"{family}ForCausalLM", ids)
    for disable in (False, True):
        model = load_local(path, disable_shared_experts_fusion=disable)
        assert model.plan.entry_class == shipped["architectures"][0]
        assert model.plan.decisions["moe.shared_experts_fusion"].value is (FUSES[name] and not disable)
        with torch.no_grad():
            got = model(ids)
        assert (got - want).abs().max().item() <= TOL, (name, disable)


def test_kimi_k25_as_shipped_wrapper_and_int4_experts_matches_transformers_on_its_body(tmp_path):
    """The wrapper's config (text_config inside, a vision tower's config beside it, the int4 quantization_config
    at the top) over a shrunk body whose routed experts are packed as its quantization_config says."""
    body, _, shipped = _checkpoint("kimi-k2.5", "DeepseekV3", tmp_path / "body")
    text = json.loads((body / "config.json").read_text())
    wrapper = dict({k: v for k, v in shipped.items() if k != "quantization_config"}, text_config=text)
    packed, dequantized, n = make_compressed_copies(body, tmp_path, shipped["quantization_config"],
                                                    prefix="language_model.", config=wrapper)
    assert n >= 2 * 384 * 3                      # both MoE layers' routed experts, int4 in groups of 32
    reference = tmp_path / "reference"           # the dequantized body, unprefixed, for transformers
    reference.mkdir()
    save_file({k.removeprefix("language_model."): v for k, v in load_file(dequantized / "model.safetensors").items()},
              reference / "model.safetensors")
    (reference / "config.json").write_text(json.dumps({k: v for k, v in text.items() if k != "model_type"}))
    ids = prompt(T=8)
    want = hf_logits_of_order_one(reference, "DeepseekV3ForCausalLM", ids)
    model = load_local(packed)
    assert (model.plan.entry_class, model.plan.quantization) == ("KimiK25ForConditionalGeneration",
                                                                 "compressed_tensors")
    assert model.plan.decisions["moe.shared_experts_fusion"].value is False      # 384 experts need quark
    with torch.no_grad():
        assert (model(ids) - want).abs().max().item() <= TOL


@pytest.mark.parametrize("name, family", [("deepseek-v3", "DeepseekV3"), ("glm-4.5", "Glm4Moe")])
def test_shipped_config_shrunk_as_its_nextn_draft_matches_transformers_composed_as_the_mtp_module(name, family,
                                                                                                 tmp_path):
    """Both ship one MTP layer (num_nextn_predict_layers 1): the draft of the shipped config (its YaRN, GLM's
    partial rotary and qk norm in the MTP layer's attention) against transformers' layer composed as the module."""
    shipped = json.loads((CONFIGS / name / "config.json").read_text())
    assert shipped["num_nextn_predict_layers"] == 1
    text = shrink(shipped)
    target, draft = make_mtp_checkpoint(tmp_path, family, **{k: v for k, v in text.items() if k != "model_type"})
    L = text["num_hidden_layers"]
    for folder, arch in ((target, f"{family}ForCausalLM"), (draft, f"{family}ForCausalLMNextN")):
        (folder / "config.json").write_text(json.dumps(dict(text, architectures=[arch])))   # as shipped, shrunk
    ids = prompt(B=1, T=8)
    h, want, _ = hf_mtp(tmp_path, target, ids, f"{family}ForCausalLM")
    assert 0.5 < want.abs().max() < 50
    model = load_local(draft, role="speculative")
    assert model.plan.decisions["pp.layer_range"].value == [L, L + 1]
    with torch.no_grad():
        got = model(ids[:, 1:], hidden_states=h[:, :-1])
    assert (got - want).abs().max().item() <= TOL
