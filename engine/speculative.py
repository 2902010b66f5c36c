"""Greedy speculative decoding: a draft runner proposes, the target runner verifies (gpt-fast style).

Each round, with `cur` the last accepted token (not yet fed to the target) at position L-1:
1. the draft feeds what its cache lacks (normally just `cur`; after a round where every
   proposal was accepted also the last proposal) and then proposes d1..dk one token at a time;
2. the target runs [cur, d1..dk] at positions L-1..L-1+k in ONE forward and takes its greedy
   tokens g0..gk (g_i follows d1..d_i);
3. the longest prefix with d_{i+1} == g_i is accepted, then the target's own g_n: every token
   appended is a target greedy token, so the output is exactly `generate(target, ...)`'s.

Rolling back costs nothing. Both runners use static KV caches indexed by absolute position,
and a query at position p attends only keys at positions <= p (layers/attention.py, mla.py):
entries a rejected proposal left beyond the accepted length are never seen, and the next
forward overwrites them (test_speculative.py proves both attention kinds mask them). A
linear-attention layer (layers/gated_delta_net.py) cannot undo a state, so its cache keeps the
state after each position a round wrote and the next round continues from the accepted one's.

The runners only need the model conventions (engine/models/__init__.py): `model(input_ids
[1, T], input_pos [T]) -> logits [1, T, V]`, `setup_caches(batch, max_len, lookahead)`, `clear_caches`.

A Multi-Token-Prediction draft (`drafts_from_target_hidden`, e.g. models/deepseek_nextn.py)
proposes from the target's final hidden states instead of from tokens alone: at position i
it takes (h_i, t_{i+1}) and predicts t_{i+2}. Step 1 then feeds it, at positions
[draft_len, L-1), the tokens seq[draft_len+1 : L] with the target's hidden states of those
positions (from the prefill or the last verification, its accepted part only), so its
first proposal follows `cur`; each further proposal feeds the previous one with the draft's
own output at the previous position. Its cache is right only up to L-1: the next round
starts feeding there, overwriting what the recursive steps wrote. The target must expose
its hidden states (`logits_and_hidden`: models/causal_lm.py; with pipeline stages only the last
stage has them, and the draft runs there: parallel/pipeline.py `PipelineDraft`).

On a worker with several ranks every rank runs this loop; `sync_tokens` (e.g. a broadcast
from rank 0) makes all of them take the same tokens, so they run the same forwards with the
same shapes.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from .generate import eos_set


class VocabMismatch(ValueError):
    """Target and draft must share the vocabulary: the draft's token ids are fed to the target."""


def vocab_size(model: nn.Module) -> int | None:
    """The model's vocabulary size, as its config says (None if it does not say)."""
    size = getattr(model, "vocab_size", None)
    if size is None:
        size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if size is not None else None


def _device(model: nn.Module) -> torch.device:
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


@torch.no_grad()
def speculative_generate(target: nn.Module, draft: nn.Module, prompt_ids: Sequence[int] | torch.Tensor,
                         max_new_tokens: int, num_draft_tokens: int, *,
                         eos_token_id: int | Sequence[int] | None = None,
                         sync_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         on_tokens: Callable[[int], None] | None = None) -> tuple[list[int], dict]:
    """prompt_ids [T] (or [1, T]) -> (the target's greedy new tokens, stats).

    Stops after `max_new_tokens` tokens or at the first EOS (included), like `engine.generate.generate`.
    stats: proposed (draft tokens the target verified), accepted (those it agreed with),
    acceptance_rate (accepted / proposed; 0.0 when nothing was proposed), target_forwards,
    draft_forwards, rounds. `on_tokens(n)` is told each time n tokens are added (a progress bar).
    """
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"speculative decoding runs batch size 1, got a batch of {ids.shape[0]}")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError("prompt_ids must be a non-empty sequence of token ids")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    vt, vd = vocab_size(target), vocab_size(draft)
    if vt is None or vd is None or vt != vd:
        raise VocabMismatch(f"target and draft must share the vocabulary: target vocab_size={vt}, draft "
                            f"vocab_size={vd}; pick a draft checkpoint trained with the target's tokenizer")
    eos = eos_set(eos_token_id)
    stats = {"proposed": 0, "accepted": 0, "acceptance_rate": 0.0, "target_forwards": 0, "draft_forwards": 0,
             "rounds": 0}
    if max_new_tokens == 0:
        return [], stats
    if getattr(target, "drafts_from_target_hidden", False):
        raise ValueError(f"{type(target).__name__} is a draft that predicts from a target's hidden states; it "
                         f"cannot be the target")
    if getattr(draft, "drafts_from_target_hidden", False) and not hasattr(target, "logits_and_hidden"):
        raise ValueError(f"the draft ({type(draft).__name__}) drafts from the target's hidden states, which the "
                         f"target ({type(target).__name__}) does not expose (no logits_and_hidden)")
    device = _device(target)
    sync = sync_tokens or (lambda t: t)
    told = on_tokens or (lambda n: None)
    if getattr(draft, "drafts_from_target_hidden", False):
        return _hidden_state_rounds(target, draft, ids, max_new_tokens, num_draft_tokens, eos, stats, device,
                                    sync, told)
    T = ids.numel()
    seq = ids.tolist()                     # prompt + accepted tokens
    # The deepest write: the target verifies k <= remaining - 1 proposals after a token at T + n_out - 1.
    max_len = T + max_new_tokens
    # A round writes up to k + 1 positions past those it keeps (the draft its proposals, the target their
    # verification): a sliding-window layer's ring must still hold its window after a rollback.
    target.setup_caches(1, max_len, num_draft_tokens + 1)
    draft.setup_caches(1, max_len, num_draft_tokens + 1)
    try:
        logits = target(ids[None].to(device), torch.arange(T, device=device))
        stats["target_forwards"] += 1
        out = [int(sync(logits[0, -1].argmax(dim=-1, keepdim=True))[0])]
        seq.append(out[0])
        told(1)
        draft_len = 0                      # positions [0, draft_len) of the draft's cache hold `seq`
        while len(out) < max_new_tokens and out[-1] not in eos:
            L = len(seq)                   # seq[L-1] is `cur`: the target's cache holds [0, L-1)
            k = min(num_draft_tokens, max_new_tokens - len(out) - 1)
            proposals: list[int] = []
            if k > 0:
                feed, pos = seq[draft_len:], draft_len
                while len(proposals) < k:
                    dl = draft(torch.tensor([feed], device=device),
                               torch.arange(pos, pos + len(feed), device=device))
                    stats["draft_forwards"] += 1
                    tok = int(sync(dl[0, -1].argmax(dim=-1, keepdim=True))[0])
                    proposals.append(tok)
                    pos += len(feed)
                    feed = [tok]
                    if tok in eos:         # the target will stop here if it agrees: propose no further
                        break
                draft_len = pos            # the draft fed seq[:L] then proposals[:-1]
            verify = [seq[-1]] + proposals
            vl = target(torch.tensor([verify], device=device), torch.arange(L - 1, L + len(proposals),
                                                                               device=device))
            stats["target_forwards"] += 1
            greedy = sync(vl[0].argmax(dim=-1)).tolist()                       # g0..gk
            n = _accepted(proposals, greedy, stats)
            # The draft's cache is right only up to the first rejected proposal it fed.
            draft_len = min(draft_len, L + n)
            told(_extend(out, seq, proposals[:n] + [greedy[n]], eos, max_new_tokens))
        return out, _with_rate(stats)
    finally:
        target.clear_caches()
        draft.clear_caches()


def _hidden_state_rounds(target, draft, ids, max_new_tokens, num_draft_tokens, eos, stats, device, sync, told):
    """`speculative_generate`'s loop for a draft that takes the target's hidden states (module docstring)."""
    T = ids.numel()
    seq = ids.tolist()
    max_len = T + max_new_tokens
    # A round writes up to k + 1 positions past those it keeps (the draft its proposals, the target their
    # verification): a sliding-window layer's ring must still hold its window after a rollback.
    target.setup_caches(1, max_len, num_draft_tokens + 1)
    draft.setup_caches(1, max_len, num_draft_tokens + 1)
    try:
        logits, hidden = target.logits_and_hidden(ids[None].to(device), torch.arange(T, device=device))
        stats["target_forwards"] += 1
        out = [int(sync(logits[0, -1].argmax(dim=-1, keepdim=True))[0])]
        seq.append(out[0])
        told(1)
        draft_len = 0                  # the draft's cache holds positions [0, draft_len) as the target saw them
        pending = hidden               # [1, L-1-draft_len, D]: the target's h of positions [draft_len, L-1)
        while len(out) < max_new_tokens and out[-1] not in eos:
            L = len(seq)               # seq[L-1] is `cur`: the target's cache holds [0, L-1)
            k = min(num_draft_tokens, max_new_tokens - len(out) - 1)
            proposals: list[int] = []
            if k > 0:
                feed = seq[draft_len + 1:L]                                   # t_{i+1} for i in [draft_len, L-1)
                pos, h = draft_len, pending
                while len(proposals) < k:
                    dl, dh = draft.logits_and_hidden(torch.tensor([feed], device=device),
                                                     torch.arange(pos, pos + len(feed), device=device),
                                                     hidden_states=h)
                    stats["draft_forwards"] += 1
                    tok = int(sync(dl[0, -1].argmax(dim=-1, keepdim=True))[0])
                    proposals.append(tok)
                    pos += len(feed)
                    feed, h = [tok], dh[:, -1:]
                    if tok in eos:
                        break
                draft_len, pending = L - 1, pending[:, :0]
            verify = [seq[-1]] + proposals
            vl, vh = target.logits_and_hidden(torch.tensor([verify], device=device),
                                              torch.arange(L - 1, L + len(proposals), device=device))
            stats["target_forwards"] += 1
            greedy = sync(vl[0].argmax(dim=-1)).tolist()                       # g0..gk
            n = _accepted(proposals, greedy, stats)
            # Positions L-1 .. L-1+n saw accepted inputs: their hidden states are the draft's next feed.
            pending = torch.cat((pending, vh[:, :n + 1]), dim=1)
            told(_extend(out, seq, proposals[:n] + [greedy[n]], eos, max_new_tokens))
        return out, _with_rate(stats)
    finally:
        target.clear_caches()
        draft.clear_caches()


def _accepted(proposals: list[int], greedy: list[int], stats: dict) -> int:
    """How many proposals the target agrees with (the longest prefix with d_{i+1} == g_i), counted in stats."""
    n = 0
    while n < len(proposals) and proposals[n] == greedy[n]:
        n += 1
    stats["proposed"] += len(proposals)
    stats["accepted"] += n
    stats["rounds"] += 1
    return n


def _extend(out: list[int], seq: list[int], new: list[int], eos: frozenset[int], max_new_tokens: int) -> int:
    """Append `new` to the output and the sequence, up to an EOS (included) or the token budget; how many."""
    before = len(out)
    for tok in new:
        out.append(tok)
        seq.append(tok)
        if tok in eos or len(out) >= max_new_tokens:
            break
    return len(out) - before


def _with_rate(stats: dict) -> dict:
    if stats["proposed"]:
        stats["acceptance_rate"] = stats["accepted"] / stats["proposed"]
    return stats


__all__ = ["speculative_generate", "VocabMismatch", "vocab_size"]
