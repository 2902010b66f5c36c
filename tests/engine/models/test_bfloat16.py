"""Every family in bfloat16, the dtype checkpoints are served in: the engine runs its whole-prompt forward and its
cached decode (a prefill, then one token a forward) in bfloat16, and its logits are about as close to transformers'
float32 ones as transformers' own bfloat16 model's are.

What this catches: a dtype mix only bfloat16 meets (LFM2's short-conv cache wrote its bfloat16 states into the
float32 buffer every recurrent layer keeps: a crash at the first cached decode), and a bfloat16 path that computes
something else. What it does not: the finer precision choices (a router or a norm in float32 rather than bfloat16,
a recurrent state kept in float32). At these sizes they change the error by less than its spread between families
and seeds (measured by making each of them bfloat16: all within the bound); the code keeps them as the reference
does, and the float32 tests pin the arithmetic itself.

How close: per position, the largest logit error against transformers' float32 logits; the engine's median over
the positions at most twice transformers' bfloat16 median (measured 0.7-1.6 of it over seeds 1 and 2). A median,
because a near-tie in a router resolves differently under different rounding (in either model) and the flipped
expert shifts that position's logits by O(1): a few such positions are rounding, not a wrong computation. The
prompts' seed is one with no such tie early in any family's first layer, whose flip would reach every later
position through attention (seed 0's checkpoints have one in EXAONE-MoE's first layer)."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import _transformers, hf_logits, load_local, prompt
from families import MAKERS, QWEN2, QWEN3, REFERENCE_CLASS, make_model

SEED = 2
MAX_RATIO = 2.0     # the engine's median error over transformers' bfloat16 one
PREFILL = 4


def per_position_error(logits: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """[B, T, V] -> [B * T]: each position's largest absolute logit error."""
    return (logits.float() - truth).abs().amax(-1).flatten()


@pytest.fixture(scope="module")
def ids():
    return prompt(T=11)


@pytest.mark.parametrize("arch", [QWEN3, QWEN2, *MAKERS])
def test_bfloat16_logits_are_as_close_to_float32_as_transformers_own(tmp_path, ids, arch):
    make_model(tmp_path, arch, seed=SEED)
    truth = hf_logits(tmp_path, REFERENCE_CLASS.get(arch, arch), ids)
    reference = getattr(_transformers(), REFERENCE_CLASS.get(arch, arch)).from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager").eval()
    model = load_local(tmp_path, dtype=torch.bfloat16)
    sizes = {dtype: sum(p.numel() for p in model.parameters() if p.dtype == dtype)
             for dtype in (torch.bfloat16, torch.float32)}
    assert sizes[torch.bfloat16] > 10 * sizes[torch.float32], sizes   # bfloat16 but routers and the like
    with torch.no_grad():
        reference_error = per_position_error(reference(ids).logits, truth).median()
        whole = model(ids)
        model.setup_caches(ids.shape[0], 32)
        steps = [model(ids[:, :PREFILL], input_pos=torch.arange(PREFILL))]
        steps += [model(ids[:, t:t + 1], input_pos=torch.tensor([t])) for t in range(PREFILL, ids.shape[1])]
    assert whole.dtype in (torch.bfloat16, torch.float32)
    for what, logits in (("whole prompt", whole), ("cached decode", torch.cat(steps, dim=1))):
        error = per_position_error(logits, truth).median()
        assert error <= MAX_RATIO * reference_error, (what, float(error), float(reference_error))
