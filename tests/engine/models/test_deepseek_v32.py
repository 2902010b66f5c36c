"""DeepSeek-V3.2 (DeepSeek Sparse Attention) from save_pretrained checkpoints: logits and greedy tokens against
transformers, float32, with an index_topk small enough that the indexer chooses (and shown to matter: with every
key kept it is DeepSeek-V3's dense MLA); never fused (not the fused architecture, DESIGN 5.2); a prompt longer
than the cache's prefill then decoding (the index keys cached per position); the fields transformers' V3.2 does
not read refused when they would change the arithmetic. TP 2 (the indexer whole on each rank):
tests/engine/parallel/test_tensor_parallel.py; EP 2 with every backend: test_expert_parallel.py. Its MTP layer as
a NextN draft (DeepseekV3ForCausalLMNextN, as SGLang plans a V3.2 draft), sparse attention included."""

from __future__ import annotations

import pytest

from loadplan.engine.layers.dsa_indexer import SparseIndexer
from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (DEEPSEEK_V32_TINY, check_nextn_draft, check_refused_before_any_plan,
                            check_speculative_gives_the_targets_greedy_tokens, hf_greedy, hf_logits_of_order_one,
                            hf_mtp, load_local, logits_of, make_deepseek_v32_checkpoint, make_mtp_checkpoint, prompt,
                            target_hidden_states, with_config)

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
    ({"q_lora_rank": None}, r"config\.q_lora_rank: sparse attention needs a query latent"),
    ({"rope_interleave": False}, r"config\.rope_interleave: False not supported; DeepSeek-V3\.2 and GLM-5 run True"),
    ({"index_topk": 0}, r"config\.index_topk: must be >= 1, got 0"),
    ({"index_head_dim": 4}, r"config\.index_head_dim: 4 must hold qk_rope_head_dim=8"),
    ({"mlp_layer_types": ["dense", "dense", "sparse"]},
     r"config\.mlp_layer_types: disagrees with first_k_dense_replace=1"),
    ({"index_n_heads": None}, r"config\.index_n_heads: missing"),
])
def test_a_config_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    """With 256 experts, so that the draft's fusion gate passes (the target's never does)."""
    root = tmp_path_factory.mktemp("deepseek_v32_mtp")
    target, draft = make_mtp_checkpoint(root, "DeepseekV32", draft_arch="DeepseekV3ForCausalLMNextN",
                                        **dict(DEEPSEEK_V32_TINY, n_routed_experts=256))
    return root, target, draft


def test_its_mtp_layer_drafts_with_sparse_attention_fused_while_the_target_is_not(mtp_ckpt):
    """The draft (DeepseekV3ForCausalLMNextN over a V3.2 checkpoint: its MTP layer's MLA has the indexer) matches
    transformers' V3.2 decoder layer composed as the MTP module, fused and unfused; one plan per runner: the
    draft fuses (its own fused architecture), the target does not."""
    root, target_dir, draft_dir = mtp_ckpt
    ids = prompt(B=1, T=10)
    h_ref, logits_ref, out_ref = hf_mtp(root, target_dir, ids, ARCH)
    h = target_hidden_states(target_dir, ids, ARCH, h_ref, 1e-3)
    assert load_local(target_dir).plan.decisions[Keys.SHARED_EXPERTS_FUSION].value is False
    for fused in (True, False):
        draft, _ = check_nextn_draft(draft_dir, ids, h, (h_ref, logits_ref, out_ref), 1e-3,
                                     disable_shared_experts_fusion=not fused)
        assert draft.plan.decisions[Keys.SHARED_EXPERTS_FUSION].value is fused
        assert draft.mtp.self_attn.indexer is not None and draft.mtp.self_attn.indexer.topk == 4
    check_speculative_gives_the_targets_greedy_tokens(target_dir, draft_dir, ids, 3)
