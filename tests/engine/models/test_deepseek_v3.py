"""DeepSeek-V3 and the Kimi-K2.5 wrapper from save_pretrained checkpoints: logits against transformers, float32.

256 routed experts so that the registry's fusion gate passes (DESIGN 5.2), tiny widths.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from loadplan.engine.generate import generate
from loadplan.engine.layers.mlp import GatedMLP
from loadplan.engine.models.deepseek_v3 import ConfigError, DeepseekV3Config, DeepseekV3MoE
from loadplan.engine.weights import LayoutMismatch

from engine_helpers import DEEPSEEK_TINY as TINY
from engine_helpers import (hf_greedy, hf_logits, hf_logits_of_order_one, load_local, logits_of,
                            make_deepseek_checkpoint, make_plan, prompt)

transformers = pytest.importorskip("transformers")

ARCH = "DeepseekV3ForCausalLM"
ATOL = 1e-3
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def make_deepseek(path, *, seed=0, legacy_rope=False, **overrides):
    kw = dict(TINY, rope_parameters=dict(YARN))
    kw.update(overrides)
    make_deepseek_checkpoint(path, seed=seed, **kw)
    f = path / "config.json"
    cfg = json.loads(f.read_text())
    if legacy_rope:
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        params.pop("rope_type", None)
        cfg["rope_scaling"] = {**params, "type": "yarn"}
    f.write_text(json.dumps(cfg, indent=2))
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_deepseek(tmp_path_factory.mktemp("ds"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=9)


@pytest.fixture(scope="module")
def reference(ckpt, ids):
    return hf_logits_of_order_one(ckpt, ARCH, ids)


def test_fused_and_unfused_match_transformers_and_each_other(ckpt, ids, reference):
    fused, unfused = load_local(ckpt), load_local(ckpt, disable_shared_experts_fusion=True)
    assert fused.plan.decisions["moe.shared_experts_fusion"].value is True
    assert unfused.plan.decisions["moe.shared_experts_fusion"].value is False
    mf, mu = fused.model.layers[1].mlp, unfused.model.layers[1].mlp
    assert mf.experts.gate_up_proj.shape[0] == 257 and mf.shared_experts is None
    assert mu.experts.gate_up_proj.shape[0] == 256 and mu.shared_experts is not None
    assert isinstance(fused.model.layers[0].mlp, GatedMLP)   # below first_k_dense_replace
    assert fused.moe_layer_ids == (1, 2) and list(fused.routed_experts_weights_of_layer) == [1, 2]
    lf, lu = logits_of(fused, ids), logits_of(unfused, ids)
    assert (lf - reference).abs().max().item() <= ATOL
    assert (lu - reference).abs().max().item() <= ATOL
    assert (lf - lu).abs().max().item() <= 1e-4


def test_without_renormalisation_the_fused_shared_expert_still_counts_once(tmp_path, ids):
    """norm_topk_prob false: sum(routed)/rsf would make the shared expert count sum(routed) times."""
    path = make_deepseek(tmp_path, seed=3, norm_topk_prob=False, routed_scaling_factor=1.7)
    want = hf_logits(path, ARCH, ids)
    lf = logits_of(load_local(path), ids)
    lu = logits_of(load_local(path, disable_shared_experts_fusion=True), ids)
    assert (lf - want).abs().max().item() <= ATOL
    assert (lu - want).abs().max().item() <= ATOL


def test_no_q_lora_legacy_rope_spelling_and_plain_rope(tmp_path, ids):
    a = make_deepseek(tmp_path / "a", seed=1, q_lora_rank=None, legacy_rope=True)
    assert "rope_scaling" in json.loads((a / "config.json").read_text())
    model = load_local(a)
    assert not hasattr(model.model.layers[0].self_attn, "q_a_proj")
    assert (logits_of(model, ids) - hf_logits(a, ARCH, ids)).abs().max().item() <= ATOL
    b = make_deepseek(tmp_path / "b", seed=2, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                      rope_interleave=False, n_group=1, topk_group=1)
    assert (logits_of(load_local(b), ids) - hf_logits(b, ARCH, ids)).abs().max().item() <= ATOL


def test_greedy_generation_equals_transformers(ckpt):
    prompt_ids = [3, 17, 42, 9, 100]
    ours = generate(load_local(ckpt), prompt_ids, 6)[0].tolist()
    assert ours == hf_greedy(ckpt, ARCH, prompt_ids, 6)


def test_prefused_checkpoint_into_an_unfused_model_is_refused(tmp_path, ckpt):
    """A checkpoint whose shared expert was pre-fused as expert 256 cannot load unfused."""
    path = tmp_path / "prefused"
    path.mkdir()
    (path / "config.json").write_text((ckpt / "config.json").read_text())
    state = load_file(ckpt / "model.safetensors")
    state = {k.replace("mlp.shared_experts.", "mlp.experts.256."): v for k, v in state.items()}
    save_file(state, path / "model.safetensors")
    with pytest.raises(LayoutMismatch, match=r"experts\.256\..*fused layout"):
        load_local(path, disable_shared_experts_fusion=True)
    load_local(path)  # fused, the pre-fused slot is accepted


def _moe_layers(cfg_dict, ranks, **runtime):
    cfg = DeepseekV3Config.from_hf(cfg_dict)
    return [DeepseekV3MoE(cfg, make_plan(cfg_dict, ep_size=len(ranks), ep_rank=r, **runtime), 1, torch.float32)
            for r in ranks]


@pytest.mark.parametrize("fused", [True, False])
def test_expert_parallel_ranks_sum_the_shared_expert_once(fused):
    """ep_size=2, normal path: each rank's partial sum, all-reduced, plus (unfused) the replicated shared
    expert equals the single-rank layer. Fused, each rank holds the shared slot at the plan's 1/2 scale."""
    cfg_dict = dict(TINY, architectures=[ARCH], rope_theta=10000.0)
    g = torch.Generator().manual_seed(0)
    (full,) = _moe_layers(cfg_dict, [0], disable_shared_experts_fusion=True)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 3))
    runtime = {} if fused else {"disable_shared_experts_fusion": True}
    ranks = _moe_layers(cfg_dict, [0, 1], **runtime)
    sh = full.shared_experts
    with torch.no_grad():
        for r, layer in enumerate(ranks):
            assert layer.experts.num_fused_shared_experts == int(fused)
            assert layer.gate.fused_shared_expert_scale == (0.5 if fused else 1.0)
            layer.gate.load_state_dict(full.gate.state_dict())
            gate_up = full.experts.gate_up_proj[128 * r:128 * (r + 1)]
            down = full.experts.down_proj[128 * r:128 * (r + 1)]
            if fused:
                gate_up = torch.cat([gate_up, torch.cat([sh.gate_proj.weight, sh.up_proj.weight])[None]])
                down = torch.cat([down, sh.down_proj.weight[None]])
            else:
                layer.shared_experts.load_state_dict(sh.state_dict())
            layer.experts.gate_up_proj.copy_(gate_up)
            layer.experts.down_proj.copy_(down)
        x = torch.randn(11, TINY["hidden_size"], generator=g)
        full.experts.reduce = lambda y: y
        want = full(x)
        partial = []
        for layer in ranks:
            layer.experts.reduce = lambda y: partial.append(y) or y
            layer(x)
        for layer in ranks:   # what torch.distributed's all-reduce would hand each rank
            layer.experts.reduce = lambda y: partial[0] + partial[1]
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def _kimi_from(ckpt, path, text_overrides=None):
    """A Kimi-K2.5-shaped checkpoint: the DeepSeek body under language_model., plus a vision tower."""
    path.mkdir()
    text = json.loads((ckpt / "config.json").read_text())
    text.update(text_overrides or {})
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
           "vision_config": {"model_type": "moonvit", "vt_hidden_size": 8}}
    (path / "config.json").write_text(json.dumps(cfg))
    state = {f"language_model.{k}": v for k, v in load_file(ckpt / "model.safetensors").items()}
    state.update({"vision_tower.patch_embed.weight": torch.randn(8, 3), "vision_tower.blocks.0.norm.weight":
                  torch.ones(8), "mm_projector.proj.weight": torch.randn(32, 8)})
    save_file(state, path / "model.safetensors")
    return path


def test_kimi_wrapper_runs_its_deepseek_body_text_only(tmp_path, ckpt, ids, reference, caplog):
    path = _kimi_from(ckpt, tmp_path / "kimi")
    with caplog.at_level(logging.INFO, logger="loadplan.engine.weights"):
        model = load_local(path)
    assert model.plan.entry_class == "KimiK25ForConditionalGeneration"
    assert model.plan.decisions["moe.shared_experts_fusion"].value is True   # gate asked with text_config
    assert list(model.routed_experts_weights_of_layer) == [1, 2]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1, skipped                       # one line for all towers, counting them
    assert "skipped 3 checkpoint tensors" in skipped[0], skipped
    assert "'vision_tower.': 2" in skipped[0] and "'mm_projector.': 1" in skipped[0], skipped
    assert (logits_of(model, ids) - reference).abs().max().item() <= ATOL
    assert generate(model, [1, 2, 3], 3).shape == (1, 3)


def test_config_refusals_name_the_field():
    base = dict(TINY, rope_theta=10000.0)
    DeepseekV3Config.from_hf(base)
    with pytest.raises(ConfigError, match="config.scoring_func: 'softmax' not supported; supported: sigmoid"):
        DeepseekV3Config.from_hf({**base, "scoring_func": "softmax"})
    with pytest.raises(ConfigError, match="config.topk_method"):
        DeepseekV3Config.from_hf({**base, "topk_method": "greedy"})
    with pytest.raises(ConfigError, match="config.kv_lora_rank: missing"):
        DeepseekV3Config.from_hf({k: v for k, v in base.items() if k != "kv_lora_rank"})
    with pytest.raises(ConfigError, match="n_group"):
        DeepseekV3Config.from_hf({**base, "n_group": 7})
    with pytest.raises(ConfigError, match="config.n_group/topk_group: 0/0"):    # not a ZeroDivisionError
        DeepseekV3Config.from_hf({**base, "n_group": 0, "topk_group": 0})
    with pytest.raises(ConfigError, match="supported: default, linear, yarn"):
        DeepseekV3Config.from_hf({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    # SGLang (and the original code) skip layers by moe_layer_freq, transformers does not: refused where it would
    with pytest.raises(ConfigError, match=r"config\.moe_layer_freq: 2 makes layers \[2, 4\] MoE for SGLang"):
        DeepseekV3Config.from_hf({**base, "num_hidden_layers": 6, "first_k_dense_replace": 1, "moe_layer_freq": 2})
    cfg = DeepseekV3Config.from_hf({**base, "num_hidden_layers": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1})
    assert cfg.moe_layers == (1, 2, 3, 4, 5)
    assert cfg.rope_interleave is True   # the original code always interleaves
