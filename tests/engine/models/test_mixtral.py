"""Mixtral from save_pretrained checkpoints (the Hub's spelling, `block_sparse_moe.experts.{e}.w1/w2/w3`): logits
and greedy tokens against transformers, float32; its sliding window, with and without the KV cache; the spelling
table; refusals by field; an int4 compressed-tensors copy; two pipeline stages with EPLB through `loadplan generate`.
Every backend on EP 2, TP 2 and EP 2 x TP 2: tests/engine/parallel."""

from __future__ import annotations

import json

import pytest
import torch

from loadplan.cli.main import main
from loadplan.engine.generate import generate
from loadplan.engine.models.config import ConfigError
from loadplan.engine.models.mixtral import MIXTRAL_NAMES, mixtral_config
from loadplan.engine.moe import RoutedExperts
from loadplan.engine.weights import DuplicateTensor, MissingTensor, Target, WeightLayout, remap
from loadplan.plan import Keys

from engine_helpers import (MIXTRAL_TINY, compressed_quantization, hf_greedy, hf_logits_of_order_one, load_local,
                            logits_of, make_compressed_copies, make_mixtral_checkpoint, prompt, with_config,
                            with_tensors)

ARCH = "MixtralForCausalLM"
TOL = 1e-4
N_NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_mixtral_checkpoint(tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=9)


@pytest.fixture(scope="module")
def reference(ckpt, ids):
    return hf_logits_of_order_one(ckpt, ARCH, ids)


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids, reference):
    model = load_local(ckpt)
    fusion = model.plan.decisions[Keys.SHARED_EXPERTS_FUSION]
    assert (fusion.value, fusion.rule) == (False, "mixtral.no_shared_experts")
    assert model.moe_layer_ids == (0, 1, 2) and list(model.routed_experts_weights_of_layer) == [0, 1, 2]
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, RoutedExperts) and tuple(experts.gate_up_proj.shape) == (8, 64, 64)
    attn = model.model.layers[0].self_attn
    assert attn.q_norm is None and attn.q_proj.bias is None and attn.sliding_window is None
    assert (logits_of(model, ids) - reference).abs().max().item() <= TOL
    assert generate(model, ids[0], N_NEW)[0].tolist() == hf_greedy(ckpt, ARCH, ids[0].tolist(), N_NEW)


def test_the_rope_theta_default_is_mixtrals(ckpt, ids, reference, tmp_path):
    """A config.json that gives no theta: both read 1e6 (transformers' MixtralConfig default), not 10000."""
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg.pop("rope_parameters")["rope_theta"] == 1e6
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    (bare / "config.json").write_text(json.dumps(cfg))
    assert mixtral_config(cfg).rope.theta == 1e6
    assert (logits_of(load_local(bare), ids) - reference).abs().max().item() <= TOL


def test_a_sliding_window_matches_transformers_and_bites(ckpt, ids, reference, tmp_path):
    """Window 3 over 9 tokens, then 8 cached steps: the same logits and tokens as transformers, and not those
    of full attention (so the window is really applied, with and without the cache)."""
    windowed = with_config(ckpt, tmp_path / "sw3", sliding_window=3)
    want = hf_logits_of_order_one(windowed, ARCH, ids)
    assert (want - reference).abs().max().item() > 1e-2
    model = load_local(windowed)
    assert model.model.layers[1].self_attn.sliding_window == 3
    assert (logits_of(model, ids) - want).abs().max().item() <= TOL
    tokens = generate(model, ids[0], N_NEW)[0].tolist()
    assert tokens == hf_greedy(windowed, ARCH, ids[0].tolist(), N_NEW)
    assert tokens != hf_greedy(ckpt, ARCH, ids[0].tolist(), N_NEW)


# --- the checkpoint's spelling ------------------------------------------------------------------

@pytest.mark.parametrize("checkpoint, engine", [
    ("model.layers.7.block_sparse_moe.experts.5.w1.weight", "model.layers.7.mlp.experts.5.gate_proj.weight"),
    ("model.layers.7.block_sparse_moe.experts.12.w3.weight", "model.layers.7.mlp.experts.12.up_proj.weight"),
    ("model.layers.0.block_sparse_moe.experts.0.w2.weight", "model.layers.0.mlp.experts.0.down_proj.weight"),
    ("model.layers.3.block_sparse_moe.gate.weight", "model.layers.3.mlp.gate.weight"),
    ("language_model.model.layers.1.block_sparse_moe.gate.weight", "language_model.model.layers.1.mlp.gate.weight"),
])
def test_the_spelling_table_reads_both_ways(checkpoint, engine):
    assert MIXTRAL_NAMES.to_engine(checkpoint) == engine
    assert MIXTRAL_NAMES.to_checkpoint(engine) == checkpoint


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight",
                                  "model.layers.0.block_sparse_moe.experts.5.w4.weight",
                                  "model.layers.0.xblock_sparse_moe.gate.weight",
                                  "model.layers.0.block_sparse_moe.experts.x.w1.weight"])
def test_other_names_pass_through_the_table(name):
    assert MIXTRAL_NAMES.to_engine(name) == name


def test_remap_reads_the_family_spelling_into_the_stacked_experts():
    layout = WeightLayout(n_routed=8, names=MIXTRAL_NAMES)
    assert remap("model.layers.1.block_sparse_moe.experts.3.w3.weight", layout) == \
        Target("model.layers.1.mlp.experts.gate_up_proj", 3, "up")
    assert remap("model.layers.1.block_sparse_moe.experts.3.w2.weight", layout) == \
        Target("model.layers.1.mlp.experts.down_proj", 3)
    # Without the table the same name is an unknown parameter, as for any other family.
    assert remap("model.layers.1.block_sparse_moe.experts.3.w2.weight", WeightLayout(n_routed=8)) == \
        Target("model.layers.1.block_sparse_moe.experts.3.w2.weight")


def test_a_missing_expert_is_named_as_the_checkpoint_spells_it(ckpt, tmp_path):
    gone = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    bad = with_tensors(ckpt, tmp_path / "bad", lambda t: t.pop(gone))
    with pytest.raises(MissingTensor, match=r"1 tensor\(s\) missing from the checkpoint, e\.g\. (\S+)$") as err:
        load_local(bad)
    assert str(err.value).endswith(f"e.g. {gone}")


def test_one_tensor_in_both_spellings_is_refused(ckpt, tmp_path):
    def both(t):
        w1 = t["model.layers.0.block_sparse_moe.experts.2.w1.weight"]
        t["model.layers.0.mlp.experts.2.gate_proj.weight"] = w1.clone()
    with pytest.raises(DuplicateTensor, match="experts.2"):
        load_local(with_tensors(ckpt, tmp_path / "both", both))


# --- refusals by field ---------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("num_key_value_heads", None, "missing"),
    ("num_local_experts", None, "missing"),
    ("sliding_window", 0, "must be >= 1 or null"),
    ("sliding_window", "4096", "expected int"),
    ("num_experts_per_tok", 9, "exceeds the number of routed experts"),
    ("hidden_act", "swishy", "swishy"),
])
def test_config_fields_are_refused_by_name(field, value, message):
    cfg = dict(MIXTRAL_TINY, architectures=[ARCH])
    cfg[field] = value
    if value is None:
        del cfg[field]
    with pytest.raises((ConfigError, ValueError), match=rf"config\.{field}: .*{message}|{message}"):
        mixtral_config(cfg)


def test_a_refused_field_reaches_the_caller_of_load_model(ckpt, tmp_path):
    with pytest.raises(ConfigError, match=r"config\.sliding_window: must be >= 1 or null, got -2"):
        load_local(with_config(ckpt, tmp_path / "neg", sliding_window=-2))


# --- two pipeline stages with EPLB, through the CLI ---------------------------------------------------

def test_loadplan_generate_on_two_pipeline_stages_with_eplb_gives_transformers_tokens(ckpt, capsys, tmp_path):
    prompt_ids = [5, 17, 99, 3]
    rc = main(["generate", "--model", str(ckpt), "--prompt-ids", ",".join(map(str, prompt_ids)),
               "--max-new-tokens", str(N_NEW), "--nproc", "2", "--pp-size", "2", "--enable-eplb",
               "--ep-num-redundant-experts", "2", "--db", f"sqlite:///{tmp_path / 'plans.db'}", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["tokens"] == hf_greedy(ckpt, ARCH, prompt_ids, N_NEW)
    assert main(["plans", "list", "--db", f"sqlite:///{tmp_path / 'plans.db'}", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    plans = plans["plans"] if isinstance(plans, dict) else plans
    stages = sorted(tuple(p["decisions"][Keys.PP_LAYER_RANGE]["value"]) for p in plans)
    eplb = sorted(tuple(p["decisions"][Keys.EPLB_LAYERS]["value"]) for p in plans)
    assert len(plans) == 2 and stages[0][0] == 0 and stages[0][1] == stages[1][0] and stages[1][1] == 3
    assert eplb == sorted(tuple(range(*s)) for s in stages)      # each stage balances its own layers


# --- an llm-compressor W4A16 checkpoint ---------------------------------------------------------------

def test_a_w4a16_checkpoint_as_llm_compressor_writes_mixtrals_matches_transformers_on_its_weights(ckpt, ids,
                                                                                                reference, tmp_path):
    """Every Linear packed int4 in groups, the router and the head left plain (`ignore`, as the W4A16 Mixtrals
    on the Hub say): the names table comes before the format, so the packed w1/w2/w3 load like any expert."""
    quantization = compressed_quantization({"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"type": "int", "num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 16,
                    "dynamic": False, "actorder": None, "observer": "minmax"}}})
    quantization["ignore"] = ["lm_head", r"re:.*block_sparse_moe.gate"]
    packed, dequantized, n = make_compressed_copies(ckpt, tmp_path, quantization)
    assert n == 3 * (4 + 8 * 3)                       # per layer: q/k/v/o and each expert's w1/w2/w3
    want = hf_logits_of_order_one(dequantized, ARCH, ids)
    assert (want - reference).abs().max().item() > 1e-2   # int4 visibly changes the model
    model = load_local(packed)
    assert model.plan.quantization == "compressed_tensors"
    assert (logits_of(model, ids) - want).abs().max().item() <= TOL


def test_speculative_decoding_through_window_rings_gives_transformers_tokens(ckpt, tmp_path):
    """Target and draft (the target with noise in its last layer: it agrees often, not always) with windows of 3:
    their sliding-window caches are rings of window + k + 1 slots, and rolled-back rounds leave the target's
    greedy tokens, as transformers makes them."""
    from loadplan.engine.layers.kv_cache import WindowKVCache
    from loadplan.engine.speculative import speculative_generate

    target_dir = with_config(ckpt, tmp_path / "target", sliding_window=3)
    g = torch.Generator().manual_seed(5)

    def noise(tensors):
        for name, t in tensors.items():
            if name.startswith("model.layers.2.block_sparse_moe.experts."):
                tensors[name] = t + 0.05 * torch.randn(t.shape, generator=g)
    draft_dir = with_tensors(target_dir, tmp_path / "draft", noise)
    target, draft = load_local(target_dir), load_local(draft_dir, role="speculative")
    prompt_ids = [5, 17, 99, 3, 64, 12, 7]
    rings = []
    setup = target.setup_caches

    def spy(*args):
        setup(*args)
        rings.extend(layer.self_attn.kv_cache for layer in target.model.layers)
    target.setup_caches = spy
    tokens, stats = speculative_generate(target, draft, prompt_ids, 10, 3)
    assert {(type(c), c.capacity) for c in rings} == {(WindowKVCache, 3 + 3 + 1)}
    assert 0 < stats["accepted"] < stats["proposed"]                 # some rounds were rolled back
    assert tokens == hf_greedy(target_dir, ARCH, prompt_ids, 10)
