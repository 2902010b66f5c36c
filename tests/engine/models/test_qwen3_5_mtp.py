"""Qwen3.5-MoE's Multi-Token-Prediction module as a NextN draft (engine/models/qwen3_5_nextn.py): the registry plans
`Qwen3_5ForCausalLMMTP` (SGLang's name for any Qwen3.5 draft) with the Qwen2-MoE gate. From the text model's
checkpoint the draft matches transformers' Qwen3.5-MoE decoder layer, norms and rotary embedding composed as the
module, fused and unfused; from the Hub wrapper's (text model under `model.language_model.`, a vision tower, the
MTP layer's experts stacked) it drafts the same, and speculative decoding behind the wrapper target gives the
target's greedy tokens, on two EP or TP ranks as on one process."""

from __future__ import annotations

import json

import pytest
import torch

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (QWEN3_5_MOE_TINY, check_nextn_draft, check_refused_before_any_plan,
                            check_speculative_gives_the_targets_greedy_tokens, hf_qwen_mtp, load_local,
                            make_qwen3_5_mtp_checkpoint, prompt, target_hidden_states, with_config)

TEXT, WRAPPER, DRAFT = "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5ForCausalLMMTP"
L = QWEN3_5_MOE_TINY["num_hidden_layers"]
ATOL = 1e-3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5_mtp")
    # Experts 16 wide, so that a stacked [E, 2I, D] is not [E, D, 2I] (engine/stacked_experts.py tells them apart).
    target, draft = make_qwen3_5_mtp_checkpoint(root, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    return root, target, draft


@pytest.fixture(scope="module")
def wrapped(ckpt, tmp_path_factory):
    """The same tensors as the Hub wrapper keeps them: (target folder, draft folder)."""
    from safetensors.torch import load_file, save_file

    _, target, _ = ckpt
    root = tmp_path_factory.mktemp("qwen3_5_mtp_wrapper")
    tensors = {}
    for name, t in load_file(target / "model.safetensors").items():
        tensors[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    E, experts = QWEN3_5_MOE_TINY["num_experts"], "mtp.layers.0.mlp.experts"
    one = lambda e, p: tensors.pop(f"{experts}.{e}.{p}_proj.weight")          # noqa: E731
    tensors[f"{experts}.gate_up_proj"] = torch.stack([torch.cat([one(e, "gate"), one(e, "up")]) for e in range(E)])
    tensors[f"{experts}.down_proj"] = torch.stack([one(e, "down") for e in range(E)])
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    text = {k: v for k, v in json.loads((target / "config.json").read_text()).items() if k != "architectures"}
    folders = []
    for name, arch in (("target", WRAPPER), ("draft", DRAFT)):
        folder = root / name
        folder.mkdir()
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "qwen3_5_moe",
                                                        "text_config": text, "tie_word_embeddings": False}))
        folders.append(folder)
    return tuple(folders)


@pytest.fixture(scope="module")
def ids():
    return prompt(B=1, T=10)


def test_fused_and_unfused_match_transformers_qwen3_5_composed_as_the_module(ckpt, ids):
    root, target_dir, draft_dir = ckpt
    h_ref, logits_ref, out_ref = hf_qwen_mtp(root, target_dir, ids, TEXT)
    assert 0.5 < logits_ref.abs().max() < 50                   # O(1): the tolerance means something
    h = target_hidden_states(target_dir, ids, TEXT, h_ref, ATOL)
    got = {}
    for fused in (True, False):
        draft, got[fused] = check_nextn_draft(draft_dir, ids, h, (h_ref, logits_ref, out_ref), ATOL,
                                              disable_shared_experts_fusion=not fused)
        d = draft.plan.decisions
        assert (draft.plan.entry_class, d[Keys.ENTRY_FAMILY].value) == (DRAFT, "qwen3_5_nextn")
        assert d[Keys.SHARED_EXPERTS_FUSION].value is fused and d[Keys.PP_LAYER_RANGE].value == [L, L + 1]
        assert draft.mtp.mlp.experts.gate_up_proj.shape[0] == (9 if fused else 8)
        assert draft.mtp.self_attn.output_gate and draft.rotary.rotary_dim == 4
    assert (got[True] - got[False]).abs().max().item() <= 1e-4


def test_from_the_wrappers_checkpoint_it_drafts_as_from_the_text_models(ckpt, wrapped, ids):
    _, _, text_draft_dir = ckpt
    target_dir, draft_dir = wrapped
    with torch.no_grad():
        _, h = load_local(target_dir).logits_and_hidden(ids)
        want = load_local(text_draft_dir, role="speculative").logits_and_hidden(ids[:, 1:], hidden_states=h[:, :-1])
        draft = load_local(draft_dir, role="speculative")
        got = draft.logits_and_hidden(ids[:, 1:], hidden_states=h[:, :-1])
    assert draft.plan.decisions[Keys.ENTRY_FAMILY].value == "qwen3_5_nextn"
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_speculative_decoding_behind_the_wrapper_gives_the_targets_greedy_tokens(wrapped, ids):
    target_dir, draft_dir = wrapped
    check_speculative_gives_the_targets_greedy_tokens(target_dir, draft_dir, ids, 2)


@pytest.mark.parametrize("parallel", [{"ep_size": 2}, {"tp_size": 2}], ids=["ep2", "tp2"])
def test_behind_the_wrapper_on_two_ranks_it_drafts_as_on_one_process(wrapped, registry_address, parallel):
    """Its stacked experts split by EP rank, or its heads and experts' features by TP rank: the same tokens and the
    same accepted / proposed counts as one process."""
    from loadplan.engine.speculative import speculative_generate
    from loadplan.engine.worker import WorkerSpec, generate_distributed

    target_dir, draft_dir = wrapped
    prompt_ids = [5, 17, 42]
    want, stats = speculative_generate(load_local(target_dir), load_local(draft_dir, role="speculative"),
                                       prompt_ids, 10, 2)
    spec = WorkerSpec(model=str(target_dir), draft=str(draft_dir), num_draft_tokens=2, prompt_ids=tuple(prompt_ids),
                      max_new_tokens=10, registry=registry_address, **parallel)
    run = generate_distributed(spec, nproc=2, timeout_s=240)
    assert (run["tokens"], run["accepted"], run["proposed"]) == (want, stats["accepted"], stats["proposed"])
    assert stats["proposed"] > 0


def test_what_it_cannot_run_is_refused_by_field_before_any_plan(ckpt, wrapped, tmp_path):
    _, _, draft_dir = ckpt
    check_refused_before_any_plan(with_config(draft_dir, tmp_path / "two", mtp_num_hidden_layers=2), ConfigError,
                                  r"config\.mtp_num_hidden_layers: 2 MTP layers: SGLang builds one",
                                  role="speculative")
    _, wrapped_draft = wrapped
    text = json.loads((wrapped_draft / "config.json").read_text())["text_config"]
    check_refused_before_any_plan(with_config(wrapped_draft, tmp_path / "own_embedding",
                                              text_config=dict(text, mtp_use_dedicated_embeddings=True)),
                                  ConfigError, r"config\.text_config\.mtp_use_dedicated_embeddings: true not supported",
                                  role="speculative")
