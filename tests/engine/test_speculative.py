"""Speculative decoding gives exactly the target's greedy tokens, whatever the draft proposes.

Real drafts: a random other-family checkpoint (disagrees almost always) and the target
checkpoint itself (agrees always: acceptance 1.0). A fake draft that knows the answer and
errs at chosen positions exercises every partial acceptance and proves the draft's cache
rolls back. The static caches keep stale entries after a rejection: a test per attention
kind (GQA, MLA) shows a query never attends an entry beyond its own position.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from loadplan.engine.generate import generate
from loadplan.engine.loader import load_model
from loadplan.engine.registry import model_class
from loadplan.engine.speculative import VocabMismatch, speculative_generate

from engine_helpers import COMMON, LocalRegistry, hf_reference, make_checkpoint, make_plan

PROMPT = [5, 17, 99, 3, 42, 8]
N = 12


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target"), "Qwen3MoeForCausalLM", num_hidden_layers=2, seed=0)


@pytest.fixture(scope="module")
def target(target_path):
    return load_model(target_path, registry=LocalRegistry())


@pytest.fixture(scope="module")
def greedy(target):
    return generate(target, PROMPT, N)[0].tolist()


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("draft"), "Qwen2MoeForCausalLM", num_hidden_layers=1, seed=7)
    return load_model(path, registry=LocalRegistry(), role="speculative")


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_disagreeing_draft_still_gives_the_targets_greedy_tokens(target, random_draft, greedy, k):
    tokens, stats = speculative_generate(target, random_draft, PROMPT, N, k)
    assert tokens == greedy
    assert stats["proposed"] > 0 and stats["accepted"] < stats["proposed"]
    assert stats["acceptance_rate"] == stats["accepted"] / stats["proposed"]
    # every round yields accepted + 1 tokens; the prefill yields the first
    assert stats["target_forwards"] == 1 + stats["rounds"]
    assert N == 1 + stats["accepted"] + stats["rounds"]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_target_as_its_own_draft_is_always_accepted(target, target_path, greedy, k):
    draft = load_model(target_path, registry=LocalRegistry(), role="speculative")
    tokens, stats = speculative_generate(target, draft, PROMPT, N, k)
    assert tokens == greedy
    assert stats["acceptance_rate"] == 1.0
    # k + 1 tokens per verification: far fewer target forwards than greedy's N
    assert stats["target_forwards"] == 1 + math.ceil((N - 1) / (k + 1))


def test_equals_transformers_greedy_generate(target, target_path, random_draft):
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = hf_reference(target_path, "Qwen3MoeForCausalLM").generate(
            ids, max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert speculative_generate(target, random_draft, PROMPT, N, 3)[0] == want


class OracleDraft(nn.Module):
    """A fake draft: proposes the target's next greedy token, except after the positions in `wrong`.

    It keeps its own 'cache' of the tokens fed at each position and predicts right only while that
    cache holds the accepted sequence: a draft whose cache were not rolled back after a rejection
    (or not caught up after a full acceptance) would keep proposing garbage."""

    def __init__(self, sequence: list[int], wrong: set[int], vocab: int):
        super().__init__()
        self.sequence, self.wrong, self.vocab_size = sequence, wrong, vocab
        self.cache: list[int | None] | None = None
        self.fed_positions: list[list[int]] = []

    def setup_caches(self, batch: int, max_len: int, lookahead: int = 0) -> None:
        self.cache = [None] * max_len

    def clear_caches(self) -> None:
        self.cache = None

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.fed_positions.append(pos.tolist())
        for tok, p in zip(ids[0].tolist(), pos.tolist()):
            self.cache[p] = tok
        last = int(pos[-1])
        nxt = self.sequence[last + 1]
        if self.cache[:last + 1] != self.sequence[:last + 1] or last + 1 in self.wrong:
            nxt = (nxt + 1) % self.vocab_size
        logits = torch.zeros(1, ids.shape[1], self.vocab_size)
        logits[0, -1, nxt] = 1.0
        return logits


@pytest.mark.parametrize("k", [1, 2, 4])
def test_partial_acceptance_rolls_the_draft_back(target, greedy, k):
    seq = PROMPT + greedy
    wrong = {len(PROMPT) + i for i in (2, 3, 7)}     # the draft errs on new tokens 2, 3 and 7
    draft = OracleDraft(seq, wrong, 128)
    tokens, stats = speculative_generate(target, draft, PROMPT, N, k)
    assert tokens == greedy
    # each wrong position costs at most one round's proposals; a draft left with a stale cache would
    # have kept erring after the first one
    assert 0 < stats["accepted"] and stats["proposed"] - stats["accepted"] <= len(wrong) * k
    assert draft.cache is None    # caches released


def test_an_oracle_draft_is_fed_every_accepted_token_once_per_round(target, greedy):
    """After a round that accepted everything the draft catches up with its last proposal and the
    target's bonus token in one forward (two positions), never re-reading the prompt."""
    draft = OracleDraft(PROMPT + greedy, set(), 128)
    tokens, stats = speculative_generate(target, draft, PROMPT, N, 3)
    assert tokens == greedy and stats["acceptance_rate"] == 1.0
    assert draft.fed_positions[0] == list(range(len(PROMPT) + 1))
    assert all(len(p) <= 2 for p in draft.fed_positions[1:])


def test_stops_at_eos_like_greedy(target, random_draft, target_path, greedy):
    eos = greedy[4]
    want = generate(target, PROMPT, N, eos_token_id=eos)[0].tolist()
    assert want == greedy[:greedy.index(eos) + 1]
    same = load_model(target_path, registry=LocalRegistry(), role="speculative")
    for draft in (random_draft, same):
        for k in (1, 3, 5):
            assert speculative_generate(target, draft, PROMPT, N, k, eos_token_id=[eos, 999])[0] == want
    # the draft proposing EOS stops proposing: nothing after it is verified
    tokens, stats = speculative_generate(target, same, PROMPT, N, 5, eos_token_id=eos)
    assert tokens == want and stats["proposed"] == len(want) - 1


def test_budget_edges(target, random_draft, greedy):
    tokens, stats = speculative_generate(target, random_draft, PROMPT, 0, 3)
    assert tokens == [] and stats["target_forwards"] == 0
    assert speculative_generate(target, random_draft, PROMPT, 1, 3)[0] == greedy[:1]
    assert speculative_generate(target, random_draft, torch.tensor([PROMPT]), 2, 3)[0] == greedy[:2]
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(target, random_draft, PROMPT, 4, 0)
    with pytest.raises(ValueError, match="batch size 1"):
        speculative_generate(target, random_draft, [PROMPT, PROMPT], 4, 2)


def test_a_draft_with_another_vocabulary_is_refused(target, tmp_path):
    path = make_checkpoint(tmp_path, "Qwen3MoeForCausalLM", num_hidden_layers=1, vocab_size=96)
    draft = load_model(path, registry=LocalRegistry(), role="speculative")
    with pytest.raises(VocabMismatch, match=r"target vocab_size=128, draft vocab_size=96"):
        speculative_generate(target, draft, PROMPT, 4, 2)


# --- stale cache entries are never attended --------------------------------------------------------

def _random_model(config: dict, seed: int) -> nn.Module:
    model = model_class(config["architectures"][0])(config, make_plan(config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if "embed" in name else 1 / math.sqrt(p.shape[-1])
            p.copy_((1 + 0.1 * torch.randn(p.shape, generator=g)) if "norm" in name
                    else torch.randn(p.shape, generator=g) * scale)
    return model.eval()


GQA = dict(COMMON, architectures=["Qwen3MoeForCausalLM"], head_dim=24, rope_theta=10000.0, hidden_act="silu",
           num_hidden_layers=2)
MLA = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, n_shared_experts=1,
           num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256,
           rms_norm_eps=1e-6, rope_theta=10000.0, architectures=["DeepseekV3ForCausalLM"], hidden_act="silu")


@pytest.mark.parametrize("config", [GQA, MLA], ids=["gqa", "mla"])
def test_cache_entries_beyond_a_query_are_never_attended(config):
    model = _random_model(config, seed=3)
    prompt = torch.tensor([[4, 8, 15, 16, 23, 42]])
    T = prompt.shape[1]
    junk = torch.tensor([[99, 98, 97, 96, 95]])
    real = torch.tensor([[7, 11]])

    def run(writes):
        model.setup_caches(1, 32)
        try:
            with torch.no_grad():
                out = None
                for ids, start in writes:
                    out = model(ids, torch.arange(start, start + ids.shape[1]))
                return out
        finally:
            model.clear_caches()

    clean = run([(prompt, 0), (real, T)])
    # a rejected verification wrote T..T+4; the next one rewrites T..T+1 and must not see T+2..T+4
    after_junk = run([(prompt, 0), (junk, T), (real, T)])
    assert torch.equal(after_junk, clean) or (after_junk - clean).abs().max().item() < 1e-5
    one_at_a_time = run([(prompt, 0), (junk, T), (real[:, :1], T), (real[:, 1:], T + 1)])
    assert (one_at_a_time[0, -1] - clean[0, -1]).abs().max().item() < 1e-5
    # the check has power: junk at positions the query may attend does change its logits
    seen = run([(prompt, 0), (junk[:, :2], T), (real[:, 1:], T + 1)])
    assert (seen[0, -1] - clean[0, -1]).abs().max().item() > 1e-3
