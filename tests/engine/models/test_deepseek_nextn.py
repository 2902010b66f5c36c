"""DeepSeek-V3's Multi-Token-Prediction layer as a NextN draft (engine/models/deepseek_nextn.py), and the
speculative loop that drafts from the target's hidden states (engine/speculative.py).

transformers has no MTP module. The reference is transformers' own pieces composed as the DeepSeek-V3
report defines the module: its DeepseekV3DecoderLayer (layer L of the same checkpoint read as a model of
L + 1 layers), its RMSNorm and rotary embedding, and the target's `last_hidden_state`.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loadplan.engine.generate import generate
from loadplan.engine.models.config import ConfigError
from loadplan.engine.speculative import speculative_generate
from loadplan.engine.weights import MissingTensor
from loadplan.plan import Runtime

import engine_helpers
from engine_helpers import DEEPSEEK_TINY as TINY
from engine_helpers import (check_speculative_gives_the_targets_greedy_tokens, load_local,
                            make_deepseek_mtp_checkpoint, prompt, target_hidden_states)

pytestmark = pytest.mark.heavy(27)

transformers = pytest.importorskip("transformers")

ARCH = "DeepseekV3ForCausalLM"
L = TINY["num_hidden_layers"]
ATOL = 1e-3
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    target, draft = make_deepseek_mtp_checkpoint(root, **dict(TINY, rope_parameters=dict(YARN)))
    return root, target, draft


@pytest.fixture(scope="module")
def ids():
    return prompt(B=1, T=10)


def hf_mtp(root, target, ids, w=None):
    return engine_helpers.hf_mtp(root, target, ids, ARCH, w)


@pytest.fixture(scope="module")
def reference(ckpt, ids):
    h, logits, out = hf_mtp(*ckpt[:2], ids)
    assert 0.5 < logits.abs().max() < 50, logits.abs().max()   # O(1): the tolerance means something
    return h, logits, out


def test_fused_and_unfused_match_transformers_composed_as_the_mtp_module(ckpt, ids, reference):
    _, target_dir, draft_dir = ckpt
    h_ref, logits_ref, out_ref = reference
    h = target_hidden_states(target_dir, ids, ARCH, h_ref, ATOL)
    got = {}
    for fused in (True, False):
        draft = load_local(draft_dir, role="speculative", disable_shared_experts_fusion=not fused)
        d = draft.plan.decisions
        assert draft.plan.entry_class == "DeepseekV3ForCausalLMNextN"
        assert d["moe.shared_experts_fusion"].value is fused and d["pp.layer_range"].value == [L, L + 1]
        assert draft.mtp.mlp.experts.gate_up_proj.shape[0] == (257 if fused else 256)
        assert list(draft.routed_experts_weights_of_layer) == [L]
        with torch.no_grad():
            logits, out = draft.logits_and_hidden(ids[:, 1:], hidden_states=h[:, :-1])
        assert (logits - logits_ref).abs().max().item() <= ATOL
        assert (out - out_ref).abs().max().item() <= ATOL
        got[fused] = logits
    assert (got[True] - got[False]).abs().max().item() <= 1e-4


def test_without_its_own_embedding_and_head_copies_the_mtp_layer_reads_the_targets(ckpt, ids, tmp_path):
    """DeepSeek describes the MTP layer's embedding and head as shared with the target's; a checkpoint that
    keeps them once is read that way."""
    root, target_dir, draft_dir = ckpt
    w = load_file(target_dir / "model.safetensors")
    p = f"model.layers.{L}."
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "config.json").write_text((draft_dir / "config.json").read_text())
    save_file({k: v for k, v in w.items() if k not in (p + "embed_tokens.weight", p + "shared_head.head.weight")},
              shared / "model.safetensors")
    h, want, _ = hf_mtp(root, target_dir, ids, dict(w, **{p + "embed_tokens.weight": w["model.embed_tokens.weight"],
                                                          p + "shared_head.head.weight": w["lm_head.weight"]}))
    assert not torch.equal(w[p + "shared_head.head.weight"], w["lm_head.weight"])   # the test can tell them apart
    draft = load_local(shared, role="speculative")
    with torch.no_grad():
        got = draft(ids[:, 1:], hidden_states=h[:, :-1])
    assert (got - want).abs().max().item() <= ATOL


def test_cached_steps_equal_one_pass(ckpt, ids, reference):
    """The draft's static cache: a prefill of 5 positions, then one position at a time, as one full pass."""
    h_ref, logits_ref, _ = reference
    draft = load_local(ckpt[2], role="speculative")
    tokens, h = ids[:, 1:], h_ref[:, :-1]
    draft.setup_caches(1, 16)
    try:
        with torch.no_grad():
            steps = [draft(tokens[:, :5], torch.arange(5), hidden_states=h[:, :5])]
            steps += [draft(tokens[:, i:i + 1], torch.tensor([i]), hidden_states=h[:, i:i + 1])
                      for i in range(5, tokens.shape[1])]
    finally:
        draft.clear_caches()
    assert (torch.cat(steps, dim=1) - logits_ref).abs().max().item() <= ATOL


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_decoding_with_the_nextn_draft_gives_the_targets_greedy_tokens(ckpt, ids, k):
    _, target_dir, draft_dir = ckpt
    check_speculative_gives_the_targets_greedy_tokens(target_dir, draft_dir, ids, k)


def test_speculative_decoding_with_the_nextn_draft_stops_at_the_targets_eos(ckpt, ids):
    _, target_dir, draft_dir = ckpt
    target, draft = load_local(target_dir), load_local(draft_dir, role="speculative")
    full = generate(target, ids[0], 12)[0].tolist()
    eos = full[6]                                              # a token the target produces mid-way
    want = generate(target, ids[0], 12, eos_token_id=eos)[0].tolist()
    assert want == full[:full.index(eos) + 1]
    tokens, _ = speculative_generate(target, draft, ids[0], 12, 3, eos_token_id=eos)
    assert tokens == want


class OracleDraft(torch.nn.Module):
    """A fake hidden-state draft: proposes the true next token except where `wrong(position)`, and records
    every call, so the loop's bookkeeping can be checked with proposals accepted and rejected."""

    drafts_from_target_hidden = True

    def __init__(self, truth: list[int], vocab: int, dim: int, wrong):
        super().__init__()
        self.truth, self.vocab, self.dim, self.wrong = truth, vocab, dim, wrong
        self.config = type("C", (), {"vocab_size": vocab})
        self.calls = []
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def setup_caches(self, *_):
        pass

    def clear_caches(self):
        pass

    def logits_and_hidden(self, input_ids, input_pos, *, hidden_states):
        self.calls.append((input_ids[0].tolist(), input_pos.tolist(), hidden_states.clone()))
        at = int(input_pos[-1]) + 2                  # position i predicts t_{i+2}
        tok = self.truth[at] if not self.wrong(at) else (self.truth[at] + 1) % self.vocab
        logits = torch.zeros(1, input_ids.shape[1], self.vocab)
        logits[0, -1, tok] = 1.0
        # An output a further step must be fed: recognisable by its position (i + 2 at position i).
        return logits, (input_pos.float() + 2)[None, :, None].expand(1, -1, self.dim).clone()


class MarkingTarget(torch.nn.Module):
    """The target, marking each of its forwards in the draft's call log (a round ends with the verification)."""

    def __init__(self, target, log: list):
        super().__init__()
        self.target, self.log, self.vocab_size = target, log, target.config.vocab_size

    def setup_caches(self, *a):
        self.target.setup_caches(*a)

    def clear_caches(self):
        self.target.clear_caches()

    def logits_and_hidden(self, *a, **kw):
        self.log.append(None)
        return self.target.logits_and_hidden(*a, **kw)


def test_the_loop_feeds_the_targets_hidden_states_of_accepted_positions(ckpt, ids):
    target = load_local(ckpt[1])
    T, n_new, k = ids.shape[1], 14, 3
    seq = ids[0].tolist() + generate(target, ids[0], n_new)[0].tolist()
    with torch.no_grad():
        _, h_all = target.logits_and_hidden(torch.tensor([seq]))            # one pass over the final sequence
    draft = OracleDraft(seq, TINY["vocab_size"], TINY["hidden_size"], wrong=lambda at: at % 4 == 0)
    tokens, stats = speculative_generate(MarkingTarget(target, draft.calls), draft, ids[0], n_new, k)
    assert tokens == seq[T:]
    assert 0 < stats["accepted"] < stats["proposed"]
    fed_upto = prev_pos = 0                    # positions fed from the target; the last position fed
    assert draft.calls[0] is None                                          # the prefill comes first
    for previous, call in zip(draft.calls, draft.calls[1:]):
        if call is None:
            continue
        tokens_in, pos, hidden = call
        if previous is None:                                               # a round's first call
            assert pos == list(range(fed_upto, pos[-1] + 1))
            assert tokens_in == seq[pos[0] + 1:pos[-1] + 2]
            assert (hidden[0] - h_all[0, pos[0]:pos[-1] + 1]).abs().max().item() <= 1e-4
            fed_upto = pos[-1] + 1
        else:                                                              # a further step: its own output
            assert len(pos) == 1 and pos[0] == prev_pos + 1
            assert torch.all(hidden == float(prev_pos + 2))
        prev_pos = pos[-1]
    assert fed_upto > T                                                    # later rounds fed accepted tokens
    # Each round accepts the proposals up to the first wrong one, then the target's own token.
    proposed = accepted = 0
    L, produced = T + 1, 1
    while produced < n_new:
        kk = min(k, n_new - produced - 1)
        n = next((j for j in range(kk) if (L + j) % 4 == 0), kk)
        proposed, accepted, L, produced = proposed + kk, accepted + n, L + n + 1, produced + n + 1
    assert (stats["proposed"], stats["accepted"]) == (proposed, accepted)
    # An EOS among the proposals: the draft proposes nothing after it, and the output ends with it.
    eos = seq[T + 5]
    draft = OracleDraft(seq, TINY["vocab_size"], TINY["hidden_size"], wrong=lambda at: False)
    tokens, stats = speculative_generate(MarkingTarget(target, draft.calls), draft, ids[0], n_new, k, eos_token_id=eos)
    assert tokens == seq[T:seq.index(eos, T) + 1]
    after_eos = [nxt for call, nxt in zip(draft.calls, draft.calls[1:])
                 if call is not None and seq[call[1][-1] + 2] == eos]
    assert after_eos and all(nxt is None for nxt in after_eos)       # the target verifies right after an EOS


class CheckedDraft(torch.nn.Module):
    """The real draft in the loop, each call checked against a cache-free pass of a second copy over every
    position fed so far (later feeds overwrite a position, as the loop overwrites what recursive steps wrote)."""

    drafts_from_target_hidden = True

    def __init__(self, draft, fresh):
        super().__init__()
        self.draft, self.fresh, self.config = draft, fresh, draft.config
        self.fed: dict[int, tuple[int, torch.Tensor]] = {}
        self.checked = 0

    def setup_caches(self, *a):
        self.draft.setup_caches(*a)

    def clear_caches(self):
        self.draft.clear_caches()

    def logits_and_hidden(self, input_ids, input_pos, *, hidden_states):
        logits, out = self.draft.logits_and_hidden(input_ids, input_pos, hidden_states=hidden_states)
        for j, p in enumerate(input_pos.tolist()):
            self.fed[p] = (int(input_ids[0, j]), hidden_states[0, j])
        end = int(input_pos[-1]) + 1
        assert sorted(self.fed)[:end] == list(range(end))            # nothing unfed below the last position
        tokens = torch.tensor([[self.fed[p][0] for p in range(end)]])
        hidden = torch.stack([self.fed[p][1] for p in range(end)])[None]
        want, want_out = self.fresh.logits_and_hidden(tokens, hidden_states=hidden)
        T = input_ids.shape[1]
        assert (logits - want[:, -T:]).abs().max().item() <= 1e-4
        assert (out - want_out[:, -T:]).abs().max().item() <= 1e-4
        self.checked += 1
        return logits, out


def test_the_drafts_cache_after_rounds_equals_a_pass_over_what_it_was_fed(ckpt, ids):
    _, target_dir, draft_dir = ckpt
    target = load_local(target_dir)
    draft = CheckedDraft(load_local(draft_dir, role="speculative"), load_local(draft_dir, role="speculative"))
    tokens, stats = speculative_generate(target, draft, ids[0], 12, 3)
    assert tokens == generate(target, ids[0], 12)[0].tolist()
    assert draft.checked == stats["draft_forwards"] > stats["rounds"]   # recursive steps were checked too


def test_config_and_checkpoint_refusals_name_what_is_wrong(ckpt, tmp_path):
    _, target_dir, draft_dir = ckpt
    bad = tmp_path / "two"
    shutil.copytree(draft_dir, bad, symlinks=True)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=2)))
    with pytest.raises(ConfigError, match="num_nextn_predict_layers: 2"):
        load_local(bad, role="speculative")
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text((draft_dir / "config.json").read_text())
    w = load_file(target_dir / "model.safetensors")
    del w[f"model.layers.{L}.eh_proj.weight"]
    save_file(w, missing / "model.safetensors")
    with pytest.raises(MissingTensor, match=rf"model\.layers\.{L}\.eh_proj\.weight"):
        load_local(missing, role="speculative")


def test_a_target_without_hidden_states_is_refused_before_anything_runs(ckpt, ids):
    class LogitsOnly(torch.nn.Module):
        vocab_size = TINY["vocab_size"]

        def forward(self, *_):
            raise AssertionError("must not run")

    draft = load_local(ckpt[2], role="speculative")
    with pytest.raises(ValueError, match="hidden states"):
        speculative_generate(LogitsOnly(), draft, ids[0], 4, 2)


def _generate(capsys, *args):
    from loadplan.cli.main import main

    rc = main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("ranks", [[], ["--nproc", 2, "--ep-size", 2]], ids=["one process", "two ranks"])
def test_loadplan_generate_with_the_nextn_draft(ckpt, tmp_path, capsys, ranks):
    """The CLI: the target's tokens with or without the draft; the draft is its own runner, planned as
    DeepseekV3ForCausalLMNextN with role speculative (and on two ranks, each rank its own)."""
    from loadplan.cli.main import main

    _, target_dir, draft_dir = ckpt
    db = f"sqlite:///{tmp_path / 'plans.db'}"
    common = ["--model", target_dir, "--prompt-ids", "5,17,99,3,8", "--max-new-tokens", 10, "--db", db, "--json",
              *ranks]
    rc, out, err = _generate(capsys, *common)
    assert rc == 0, err
    want = json.loads(out)["tokens"]
    rc, out, err = _generate(capsys, *common, "--draft", draft_dir, "--num-draft-tokens", 3)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["tokens"] == want and doc["proposed"] > 0
    assert main(["plans", "list", "--deployment", doc["deployment_id"], "--db", db, "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert {(p["role"], p["entry_class"]) for p in plans} == {("target", "DeepseekV3ForCausalLM"),
                                                             ("speculative", "DeepseekV3ForCausalLMNextN")}
    assert len(plans) == (4 if ranks else 2)


def test_loadplan_generate_with_the_nextn_draft_behind_pipeline_stages(ckpt, tmp_path, capsys):
    """A target in 2 stages: the draft drafts from the final hidden states, which only the last stage holds,
    so it runs there, as a runner of one stage (its plan: pp 0/1, one per last-stage rank), its logits
    broadcast to the first stage. The tokens and acceptance are the single process's."""
    from loadplan.cli.main import main

    _, target_dir, draft_dir = ckpt
    db = f"sqlite:///{tmp_path / 'plans.db'}"
    common = ["--model", target_dir, "--prompt-ids", "5,17,99,3,8", "--max-new-tokens", 10, "--db", db, "--json",
              "--draft", draft_dir, "--num-draft-tokens", 3]
    rc, out, err = _generate(capsys, *common)
    assert rc == 0, err
    want = json.loads(out)
    rc, out, err = _generate(capsys, *common, "--nproc", 2, "--pp-size", 2)
    assert rc == 0, err
    doc = json.loads(out)
    assert (doc["tokens"], doc["accepted"], doc["proposed"]) == (want["tokens"], want["accepted"], want["proposed"])
    assert doc["proposed"] > 0 and len(doc["draft_plan_ids"]) == 1
    assert main(["plans", "list", "--deployment", doc["deployment_id"], "--db", db, "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert sorted((p["role"], p["parallel"]["pp_size"], p["parallel"]["pp_rank"]) for p in plans) == [
        ("speculative", 1, 0), ("target", 2, 0), ("target", 2, 1)]
    draft_plan = next(p for p in plans if p["role"] == "speculative")
    assert draft_plan["plan_id"] == doc["draft_plan_id"]


def test_the_nextn_draft_behind_two_stages_of_two_ep_ranks_drafts_as_one_process(ckpt, registry_address):
    """PP 2 x EP 2 with DeepEP: the draft on the last stage's two EP ranks dispatches over that stage's EP group."""
    from loadplan.engine.worker import WorkerSpec, generate_distributed

    _, target_dir, draft_dir = ckpt
    prompt_ids = [5, 17, 42]
    want, stats = speculative_generate(load_local(target_dir, a2a_backend="deepep"),
                                       load_local(draft_dir, role="speculative", a2a_backend="deepep"),
                                       prompt_ids, 10, 2)
    spec = WorkerSpec(model=str(target_dir), draft=str(draft_dir), num_draft_tokens=2, prompt_ids=tuple(prompt_ids),
                      max_new_tokens=10, pp_size=2, ep_size=2, runtime=Runtime(a2a_backend="deepep"),
                      registry=registry_address)
    run = generate_distributed(spec, nproc=4, timeout_s=240)
    assert (run["tokens"], run["accepted"], run["proposed"]) == (want, stats["accepted"], stats["proposed"])
    assert [r["draft_plan_id"] is not None for r in run["ranks"]] == [False, False, True, True]


def test_the_nextn_draft_is_refused_as_a_target_before_any_plan_is_recorded(ckpt, ids, tmp_path, capsys):
    from loadplan.cli.main import main

    _, target_dir, draft_dir = ckpt
    db = f"sqlite:///{tmp_path / 'plans.db'}"
    rc, out, err = _generate(capsys, "--model", draft_dir, "--prompt-ids", "5,17", "--max-new-tokens", 2,
                             "--db", db)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: INVALID_ARGUMENT: DeepseekV3ForCausalLMNextN is a speculative draft")
    assert main(["plans", "list", "--db", db, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    draft = load_local(draft_dir, role="speculative")
    with pytest.raises(ValueError, match="predicts from a target's hidden states"):
        generate(draft, ids[0], 2)
    with pytest.raises(ValueError, match="cannot be the target"):
        speculative_generate(draft, load_local(draft_dir, role="speculative"), ids[0], 2, 1)


@pytest.fixture(scope="module")
def demo_checkpoints(tmp_path_factory):
    from loadplan.engine.make_checkpoints import make_checkpoints

    return make_checkpoints(tmp_path_factory.mktemp("demo"))


def test_the_demo_targets_mtp_layer_drafts_well_and_its_cache_stays_right(demo_checkpoints, ids):
    """make_checkpoints gives the demo target an MTP layer with the target's skill one token ahead: the real
    draft is accepted often, and its cache, refed after every partly accepted round, equals a cache-free pass."""
    target = load_local(demo_checkpoints["target"])
    draft = CheckedDraft(load_local(demo_checkpoints["nextn"], role="speculative"),
                         load_local(demo_checkpoints["nextn"], role="speculative"))
    assert draft.draft.plan.entry_class == "DeepseekV3ForCausalLMNextN"
    prompt_ids = [5, 17, 42]
    tokens, stats = speculative_generate(target, draft, prompt_ids, 24, 3)
    assert tokens == generate(target, prompt_ids, 24)[0].tolist()
    assert stats["acceptance_rate"] > 0.3 and stats["accepted"] < stats["proposed"], stats   # some of each
    assert draft.checked == stats["draft_forwards"]
