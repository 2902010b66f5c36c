"""GLM-5 (`GlmMoeDsaForCausalLM`: DeepSeek-V3.2's sparse attention with the indexer's rope pairs interleaved) from
save_pretrained checkpoints: logits and greedy tokens against transformers, float32, fused (its own fused
architecture: the DeepSeek gate passes with 256 experts) and unfused; the interleaved pairs shown to matter (V3.2's
model on the same weights gives other logits); layers that reuse the previous full layer's top-k (transformers'
indexer_types, index_topk_pattern, index_topk_freq) against transformers too (on two pipeline stages:
tests/engine/parallel/test_pipeline_parallel.py), and what cannot run refused by field.
Its MTP layer as a NextN draft (DeepseekV3ForCausalLMNextN over a GLM-5 config, as SGLang plans it) keeps
the interleaved pairs. TP 2 and EP 2 with every backend: tests/engine/parallel."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (GLM_MOE_DSA_TINY, check_nextn_draft, check_refused_before_any_plan,
                            check_speculative_gives_the_targets_greedy_tokens, hf_greedy, hf_logits_of_order_one,
                            hf_mtp, load_local, logits_of, make_glm_moe_dsa_checkpoint, make_mtp_checkpoint, prompt,
                            target_hidden_states, with_config)

ARCH = "GlmMoeDsaForCausalLM"
TOL = 1e-4
N_NEW = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_glm_moe_dsa_checkpoint(tmp_path_factory.mktemp("glm_moe_dsa"))


@pytest.fixture(scope="module")
def ids():
    return prompt(T=11)


@pytest.fixture(scope="module")
def reference(ckpt, ids):
    return hf_logits_of_order_one(ckpt, ARCH, ids)


def test_logits_and_greedy_tokens_match_transformers_fused_and_unfused(ckpt, ids, reference):
    from loadplan.engine.generate import generate

    for fused in (True, False):
        model = load_local(ckpt, disable_shared_experts_fusion=not fused)
        fusion = model.plan.decisions[Keys.SHARED_EXPERTS_FUSION]
        assert fusion.value is fused and fusion.rule == ("deepseek.fused" if fused
                                                         else "intent.disable_shared_experts_fusion")
        assert model.model.layers[0].self_attn.indexer.rope_interleave
        assert (logits_of(model, ids) - reference).abs().max().item() <= TOL
    assert generate(model, ids[0], N_NEW)[0].tolist() == hf_greedy(ckpt, ARCH, ids[0].tolist(), N_NEW)


def test_the_indexers_interleaved_pairs_matter(ckpt, ids, reference, tmp_path):
    """The same weights read as DeepSeek-V3.2 (rotate-half pairs in the indexer) select other keys."""
    as_v32 = load_local(with_config(ckpt, tmp_path / "as_v32", architectures=["DeepseekV32ForCausalLM"],
                                    model_type="deepseek_v32", indexer_types=None))
    assert not as_v32.model.layers[0].self_attn.indexer.rope_interleave
    assert (logits_of(as_v32, ids) - reference).abs().max().item() > 1e-2


@pytest.mark.parametrize("fields, shared", [
    ({"index_topk_freq": 2}, [2]),                        # every 2nd layer from index_skip_topk_offset 2 is full
    ({"index_topk_pattern": "FSS"}, [1, 2]),
    ({"indexer_types": ["full", "shared", "full", "shared"]}, [1]),   # an entry past the layers is the MTP layer's
])
def test_layers_that_reuse_the_previous_full_layers_top_k_match_transformers(ids, tmp_path, fields, shared):
    """A shared layer has no indexer of its own; it attends to the keys the full layer before it picked (index_topk 4
    of up to 11 visible keys), in the prompt's forward and in every decode step."""
    from loadplan.engine.generate import generate

    ckpt = make_glm_moe_dsa_checkpoint(tmp_path / "shared", **fields)
    want = hf_logits_of_order_one(ckpt, ARCH, ids)
    model = load_local(ckpt)
    assert [i for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is None] == shared
    assert (logits_of(model, ids) - want).abs().max().item() <= TOL
    assert generate(model, ids[0], N_NEW)[0].tolist() == hf_greedy(ckpt, ARCH, ids[0].tolist(), N_NEW)


@pytest.mark.parametrize("overrides, match", [
    ({"indexer_types": ["shared", "full", "full"]}, r"config\.indexer_types: layer 0 is 'shared'"),
    ({"indexer_types": ["full", "sparse", "full"]}, r"config\.indexer_types: .*a list of 'full' and 'shared'"),
    ({"indexer_types": ["full", "full"]}, r"config\.indexer_types: 2 entries for 3 layers"),
    ({"indexer_types": None, "index_topk_pattern": "FXF"}, r"config\.index_topk_pattern: 'FXF': letters F"),
    ({"indexer_types": None, "index_topk_freq": 0}, r"config\.index_topk_freq: must be >= 1, got 0"),
    ({"q_lora_rank": None}, r"config\.q_lora_rank: sparse attention needs a query latent"),
])
def test_a_config_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, tmp_path, overrides, match):
    check_refused_before_any_plan(with_config(ckpt, tmp_path / "bad", **overrides), ConfigError, match)


def test_its_mtp_layer_as_a_nextn_draft_keeps_the_interleaved_indexer(tmp_path):
    root = tmp_path / "mtp"
    root.mkdir()
    target_dir, draft_dir = make_mtp_checkpoint(root, "GlmMoeDsa", draft_arch="DeepseekV3ForCausalLMNextN",
                                                **GLM_MOE_DSA_TINY)
    ids = prompt(B=1, T=10)
    h_ref, logits_ref, out_ref = hf_mtp(root, target_dir, ids, ARCH)
    h = target_hidden_states(target_dir, ids, ARCH, h_ref, 1e-3)
    draft, _ = check_nextn_draft(draft_dir, ids, h, (h_ref, logits_ref, out_ref), 1e-3)
    assert draft.mtp.self_attn.indexer.rope_interleave
    # Its layer cannot reuse a top-k: the target's full layer runs in another model.
    L = GLM_MOE_DSA_TINY["num_hidden_layers"]
    check_refused_before_any_plan(with_config(draft_dir, tmp_path / "shared", indexer_types=["full"] * L + ["shared"]),
                                  ConfigError, rf"config\.indexer_types: layer {L} \(the MTP layer\) is 'shared'",
                                  role="speculative")
    check_speculative_gives_the_targets_greedy_tokens(target_dir, draft_dir, ids, 2)
