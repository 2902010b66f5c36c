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

Broadcasting the logits (rather than only a sampled token) lets any decoding loop
(greedy `generate`, `speculative_generate`'s verification of K tokens) sample on
every rank from identical numbers, so all ranks pick the same tokens and stay in
lockstep without knowing about stages. Each stage keeps its own KV caches
(`setup_caches` reaches only its layers). With pp_size 1 it is a pass-through.
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

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        self.stage.setup_caches(max_batch_size, max_seq_len)

    def clear_caches(self) -> None:
        self.stage.clear_caches()

    def logits_and_hidden(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None, *,
                          hidden_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage's `logits_and_hidden` (what a Multi-Token-Prediction draft drafts from): pp_size 1 only."""
        if self.grid.pp_size != 1:
            raise NotImplementedError(f"speculative decoding with a Multi-Token-Prediction draft takes the target's "
                                      f"final hidden states on every rank; with pp_size {self.grid.pp_size} only the "
                                      f"last stage holds them (run it with pp_size 1)")
        return self.stage.logits_and_hidden(input_ids, input_pos, hidden_states=hidden_states)

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        g = self.grid
        if g.pp_size == 1:
            return self.stage(input_ids, input_pos)
        import torch.distributed as dist

        device = input_ids.device
        if g.is_first_stage:
            out = self.stage(input_ids, input_pos)
        else:
            (h,) = recv_tensors(g.prev_stage_rank, device=device)
            out = self.stage(None, input_pos, hidden_states=h)
        if not g.is_last_stage:
            send_tensors([out], g.next_stage_rank)
            B, T = input_ids.shape
            out = torch.empty(B, T, self.vocab_size, dtype=out.dtype, device=device)
        dist.broadcast(out, src=self._last_rank, group=g.pp_group)
        return out
