"""DeepSeek-V3.2 (DeepSeek Sparse Attention) from save_pretrained checkpoints: logits and greedy tokens against
transformers, float32, with an index_topk small enough that the indexer chooses (and shown to matter: with every
key kept it is DeepSeek-V3's dense MLA); never fused (not the fused architecture, DESIGN 5.2); a prompt longer
than the cache's prefill then decoding (the index keys cached per position); the fields transformers' V3.2 does
not read refused when they would change the arithmetic. TP 2 (the indexer whole on each rank):
tests/engine/parallel/test_tensor_parallel.py (EP: its MoE is DeepSeek-V3's, checked with every backend there)."""

from __future__ import annotations

import pytest

from loadplan.engine.layers.dsa_indexer import SparseIndexer
from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (DEEPSEEK_V32_TINY, check_refused_before_any_plan, hf_greedy, hf_logits_of_order_one,
                            load_local, logits_of, make_deepseek_v32_checkpoint, prompt, with_config)

ARCH = "DeepseekV32ForCausalLM"
TOL = 1e-4
N_NEW = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_deepseek_v32_checkpoint(tmp_path_factory.mktemp("deepseek_v32"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=11)


@pytest.fixture(scope="module")
def reference(ckpt, ids):
    return hf_logits_of_order_one(ckpt, ARCH, ids)


def generate_tokens(model, ids):
    from loadplan.engine.generate import generate

    return generate(model, ids[0], N_NEW)[0].tolist()


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids, reference):
    model = load_local(ckpt)
    fusion = model.plan.decisions[Keys.SHARED_EXPERTS_FUSION]
    assert (fusion.value, fusion.rule) == (False, "deepseek.structural.architecture")
    indexers = [m for m in model.modules() if isinstance(m, SparseIndexer)]
    assert len(indexers) == DEEPSEEK_V32_TINY["num_hidden_layers"] and indexers[0].topk == 4
    assert (logits_of(model, ids) - reference).abs().max().item() <= TOL
    assert generate_tokens(model, ids) == hf_greedy(ckpt, ARCH, ids[0].tolist(), N_NEW)


def test_the_indexer_chooses_and_with_every_key_kept_it_is_dense_mla(ckpt, ids, reference, tmp_path):
    """index_topk at least the sequence: every visible key kept (dense attention), transformers agrees, and the
    logits differ from those with 4 keys a query: the selection is what runs."""
    every_key = with_config(ckpt, tmp_path / "every_key", index_topk=64)
    want = hf_logits_of_order_one(every_key, ARCH, ids)
    assert (want - reference).abs().max().item() > 1e-2
    assert (logits_of(load_local(every_key), ids) - want).abs().max().item() <= TOL


@pytest.mark.parametrize("overrides, match", [
    ({"q_lora_rank": None}, r"config\.q_lora_rank: DeepseekV32ForCausalLM needs a query latent"),
    ({"rope_interleave": False}, r"config\.rope_interleave: False not supported; DeepSeek-V3\.2 runs True"),
    ({"index_topk": 0}, r"config\.index_topk: must be >= 1, got 0"),
    ({"index_head_dim": 4}, r"config\.index_head_dim: 4 must hold qk_rope_head_dim=8"),
    ({"mlp_layer_types": ["dense", "dense", "sparse"]},
     r"config\.mlp_layer_types: \['dense', 'dense', 'sparse'\] disagrees with first_k_dense_replace=1"),
    ({"index_n_heads": None}, r"config\.index_n_heads: missing"),
])
def test_a_config_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)
