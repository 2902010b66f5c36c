"""A pipeline stage that runs like a whole model on every rank (DESIGN 5.5).

`PipelineModel(stage_model, grid)` wraps this rank's stage (its layers of the
plan's `pp.layer_range`, placeholders elsewhere) and gives it the whole model's
interface: `forward(input_ids [B, T], input_pos) -> logits [B, T, V]` on EVERY
rank. Every rank of a PP group calls it with the same ids in the same order (the
decoding loops run in lockstep):

    first stage:   embed + its layers -> send hidden states to the next stage
    middle stage:  recv hidden states -> its layers -> send
    last stage:    recv -> its layers -> norm + head = logits
    then the last stage broadcasts the logits over the PP group.
A stage may hand the next more than its hidden states (`stage_carry`: GLM-5's latest top-k
selection, which a stage starting at a layer that reuses it needs).

Broadcasting the logits (rather than only a sampled token) lets any decoding loop
(greedy `generate`, `speculative_generate`'s verification of K tokens) sample on
every rank from identical numbers, so all ranks pick the same tokens and stay in
lockstep without knowing about stages. Each stage keeps its own KV caches
(`setup_caches` reaches only its layers). With pp_size 1 it is a pass-through.

A Multi-Token-Prediction draft drafts from the target's final hidden states, which only
the last stage computes: `logits_and_hidden` keeps them there, and `PipelineDraft` runs
the draft on the last stage's ranks and broadcasts its logits the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from .p2p import recv_tensors, send_tensors


class PipelineModel(nn.Module):
    def __init__(self, stage: nn.Module, grid, vocab_size: int | None = None):
        super().__init__()
        self.stage = stage
        self.grid = grid
        self.vocab_size = int(vocab_size if vocab_size is not None else stage.config.vocab_size)
        self._last_rank = grid.pp_ranks[-1]

    # The stage model's attributes (plan, config, routed_experts_weights_of_layer, ...) read through.
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("stage"), name)

    def setup_caches(self, max_batch_size: int, max_seq_len: int, lookahead: int = 0) -> None:
        self.stage.setup_caches(max_batch_size, max_seq_len, lookahead)

    def clear_caches(self) -> None:
        self.stage.clear_caches()

    def logits_and_hidden(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None, *,
                          hidden_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole model's (logits, final hidden states): what a Multi-Token-Prediction draft drafts from.
        With stages the logits reach every rank, the hidden states [B, T, D] stay on the last stage, where
        such a draft runs (`PipelineDraft`); the other ranks get zeros of their shape."""
        if self.grid.pp_size == 1:
            return self.stage.logits_and_hidden(input_ids, input_pos, hidden_states=hidden_states)
        return self._through_stages(input_ids, input_pos, with_hidden=True)

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        if self.grid.pp_size == 1:
            return self.stage(input_ids, input_pos)
        return self._through_stages(input_ids, input_pos, with_hidden=False)

    def _through_stages(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None, *, with_hidden: bool):
        import torch.distributed as dist

        g = self.grid
        device = input_ids.device
        x = None
        if not g.is_first_stage:
            x, *carry = recv_tensors(g.prev_stage_rank, device=device)
            self.stage.take_stage_carry(carry)       # e.g. GLM-5's latest top-k, for a stage's shared layers
        ids = input_ids if x is None else None          # a later stage takes the previous one's hidden states
        if g.is_last_stage and with_hidden:
            logits, hidden = self.stage.logits_and_hidden(ids, input_pos, hidden_states=x)
        elif g.is_last_stage:
            logits, hidden = self.stage(ids, input_pos, hidden_states=x), None
        else:
            out = self.stage(ids, input_pos, hidden_states=x)
            send_tensors([out, *self.stage.stage_carry()], g.next_stage_rank)
            B, T = input_ids.shape
            logits = torch.empty(B, T, self.vocab_size, dtype=out.dtype, device=device)
            hidden = torch.zeros_like(out)
        dist.broadcast(logits, src=self._last_rank, group=g.pp_group)
        return (logits, hidden) if with_hidden else logits


class PipelineDraft(nn.Module):
    """A Multi-Token-Prediction draft next to a target in pipeline stages. It drafts from the target's final
    hidden states, which only the last stage holds, so only the last stage's ranks build it (its own runner,
    one stage: `draft`); the others hold None. Its logits are broadcast from the last stage like the target's,
    so every rank proposes the same tokens; its own outputs (the hidden states of further steps) stay there."""

    drafts_from_target_hidden = True

    def __init__(self, draft: nn.Module | None, grid, vocab_size: int):
        super().__init__()
        if (draft is not None) != grid.is_last_stage:
            raise ValueError("a PipelineDraft holds the draft on the last stage's ranks, and only there")
        self.draft = draft
        self.grid = grid
        self.vocab_size = int(vocab_size)
        self._last_rank = grid.pp_ranks[-1]

    @property
    def plan(self):
        """The draft runner's plan on the last stage; None on the other stages (they hold no draft)."""
        return None if self.draft is None else self.draft.plan

    def setup_caches(self, max_batch_size: int, max_seq_len: int, lookahead: int = 0) -> None:
        if self.draft is not None:
            self.draft.setup_caches(max_batch_size, max_seq_len, lookahead)

    def clear_caches(self) -> None:
        if self.draft is not None:
            self.draft.clear_caches()

    def logits_and_hidden(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None, *,
                          hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        if self.draft is not None:
            logits, out = self.draft.logits_and_hidden(input_ids, input_pos, hidden_states=hidden_states)
        else:
            B, T = input_ids.shape
            logits = torch.empty(B, T, self.vocab_size, dtype=hidden_states.dtype, device=input_ids.device)
            out = torch.zeros_like(hidden_states)          # [B, T, D], as a NextN draft takes them
        dist.broadcast(logits, src=self._last_rank, group=self.grid.pp_group)
        return logits, out

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None, *,
                hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_and_hidden(input_ids, input_pos, hidden_states=hidden_states)[0]
