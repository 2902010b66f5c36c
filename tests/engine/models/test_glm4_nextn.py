"""GLM-4-MoE's Multi-Token-Prediction layer as a NextN draft (engine/models/glm4_moe_nextn.py): the registry plans
`Glm4MoeForCausalLMNextN` with GLM's gate, and the draft matches transformers' GLM-4-MoE decoder layer, RMSNorm and
partial rotary embedding composed as the MTP module, fused and unfused; speculative decoding with it gives the
target's greedy tokens, on one process and on two EP ranks."""

from __future__ import annotations

import pytest

from engine_helpers import (GLM4_TINY, check_nextn_draft, check_speculative_gives_the_targets_greedy_tokens, hf_mtp,
                            load_local, make_mtp_checkpoint, prompt, target_hidden_states)

ARCH = "Glm4MoeForCausalLM"
L = GLM4_TINY["num_hidden_layers"]
ATOL = 1e-3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm_mtp")
    target, draft = make_mtp_checkpoint(root, "Glm4Moe", **dict(GLM4_TINY, partial_rotary_factor=0.5))
    return root, target, draft


@pytest.fixture(scope="module")
def ids():
    return prompt(B=1, T=10)


def test_fused_and_unfused_match_transformers_glm_composed_as_the_mtp_module(ckpt, ids):
    root, target_dir, draft_dir = ckpt
    h_ref, logits_ref, out_ref = hf_mtp(root, target_dir, ids, ARCH)
    assert 0.5 < logits_ref.abs().max() < 50                   # O(1): the tolerance means something
    h = target_hidden_states(target_dir, ids, ARCH, h_ref, ATOL)
    got = {}
    for fused in (True, False):
        draft, got[fused] = check_nextn_draft(draft_dir, ids, h, (h_ref, logits_ref, out_ref), ATOL,
                                              disable_shared_experts_fusion=not fused)
        d = draft.plan.decisions
        assert (draft.plan.entry_class, d["model.family"].value) == ("Glm4MoeForCausalLMNextN", "glm4_moe_nextn")
        assert d["moe.shared_experts_fusion"].value is fused and d["pp.layer_range"].value == [L, L + 1]
        assert d["moe.shared_experts_fusion"].rule == ("glm4_moe_nextn.fused" if fused
                                                       else "intent.disable_shared_experts_fusion")
        assert draft.mtp.mlp.experts.gate_up_proj.shape[0] == (17 if fused else 16)
        assert draft.mtp.self_attn.q_proj.bias is not None and draft.rotary.rotary_dim == 8   # GLM's attention
    assert (got[True] - got[False]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_decoding_with_the_glm_nextn_draft_gives_the_targets_greedy_tokens(ckpt, ids, k):
    _, target_dir, draft_dir = ckpt
    check_speculative_gives_the_targets_greedy_tokens(target_dir, draft_dir, ids, k)


def test_the_glm_nextn_draft_on_two_ep_ranks_drafts_as_on_one_process(ckpt, registry_address):
    """Target and draft each resolve their plan per rank (GLM's gate: the torch runner fuses under EP) and
    give one process's tokens and acceptance."""
    from loadplan.engine.speculative import speculative_generate
    from loadplan.engine.worker import WorkerSpec, generate_distributed

    _, target_dir, draft_dir = ckpt
    prompt_ids = [5, 17, 42]
    want, stats = speculative_generate(load_local(target_dir), load_local(draft_dir, role="speculative"),
                                       prompt_ids, 10, 2)
    spec = WorkerSpec(model=str(target_dir), draft=str(draft_dir), num_draft_tokens=2, prompt_ids=tuple(prompt_ids),
                      max_new_tokens=10, ep_size=2, registry=registry_address)
    run = generate_distributed(spec, nproc=2, timeout_s=240)
    assert (run["tokens"], run["accepted"], run["proposed"]) == (want, stats["accepted"], stats["proposed"])
