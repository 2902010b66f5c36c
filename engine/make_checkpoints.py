"""Tiny random HuggingFace checkpoints for the demo and the compose `checkpoints` job.

    python -m loadplan.engine.make_checkpoints OUT_DIR [--force]

writes OUT_DIR/target (a DeepSeek-V3-style `DeepseekV3ForCausalLM`, 256 routed
experts and one shared expert, so the registry's fusion gate passes: DESIGN 5.2)
and OUT_DIR/draft (a `Qwen3MoeForCausalLM`: another family, no shared experts,
the same vocabulary: what speculative decoding needs). Both are saved by
transformers' `save_pretrained`, so the engine reads them exactly as it reads a
checkpoint from the Hub. The target also holds a Multi-Token-Prediction layer in
DeepSeek's layout (`model.layers.{num_hidden_layers}.*`, which transformers does not
save), and OUT_DIR/nextn is its draft `DeepseekV3ForCausalLMNextN`: the target's
tensors (a link) under that entry class (engine/models/deepseek_nextn.py).
OUT_DIR/vllm is a Qwen3-MoE whose head size vLLM's CPU attention takes (the compose
`vllm-worker` serves it).

Random weights would make the draft guess the target's tokens by chance alone
(1 in the vocabulary), so speculative decoding would show nothing. Both models are
therefore given the same small "skill": the head reads the token embedding back as
the token's successor in one fixed permutation of the vocabulary, and each block's
output projections are damped so that the residual stream still carries the input
token. Both then mostly predict that successor; where their random blocks push
them elsewhere they disagree, and the acceptance rate shows it. The MTP layer has the
same skill one token further: it reads t_{i+1}'s embedding (eh_proj passes the
embedding half through) and its head is the target's, so it predicts t_{i+1}'s
successor, the target's t_{i+2}.

transformers is needed only here (it is a dev dependency; the worker image
installs it for the `checkpoints` job).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

VOCAB = 128
SEED = 0
# Output projections of every block are multiplied by this: small enough that the
# successor skill dominates, large enough that the blocks still matter.
BLOCK_DAMPING = 0.8

TARGET = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=256,
              n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=1,
              q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
              max_position_embeddings=256, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                               "mscale": 1.0, "mscale_all_dim": 1.0})

DRAFT = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=8,
             num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6,
             tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)

# What the compose `vllm-worker` serves: the draft's family with vLLM's CPU attention in mind,
# which takes head sizes 32, 64, 80, 96, 112, 128... only.
VLLM = dict(DRAFT, hidden_size=64, head_dim=32)

# name -> (transformers config class, model class, config kwargs, seed)
CHECKPOINTS = {
    "target": ("DeepseekV3Config", "DeepseekV3ForCausalLM", TARGET, SEED),
    "draft": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", DRAFT, SEED + 1),
    "vllm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", VLLM, SEED + 3),
}


def successor(vocab: int = VOCAB, seed: int = SEED) -> torch.Tensor:
    """The permutation both models learn: next token = successor[token]."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 1000))


def _initialize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations: fan-in scaled matrices, unit-norm embeddings, norms near 1; then the successor skill."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                e = torch.randn(p.shape, generator=g)
                p.copy_(e * (math.sqrt(p.shape[-1]) / e.norm(dim=-1, keepdim=True)))   # RMS 1, like a normed block input
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
                if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                    p.mul_(BLOCK_DAMPING)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):    # DeepSeek's routing bias is a buffer
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
        # logits[v] = <h, embed[successor^-1[v]]> * gain: largest for v = successor[current token]
        emb = model.get_input_embeddings().weight
        inverse = torch.argsort(successor(emb.shape[0]))
        model.get_output_embeddings().weight.copy_(emb[inverse] / math.sqrt(emb.shape[1]))


def add_mtp_layer(target: Path, seed: int = SEED + 2) -> None:
    """Append one MTP layer (DeepSeek's layout) to the target checkpoint and say so in its config.json.

    Its decoder layer is layer L of a model of L + 1 layers initialized like the others (so the target's
    own tensors stay as they were); its embedding and head are the target's, its eh_proj passes the
    embedding half through with a little of the hidden half."""
    import transformers
    from safetensors.torch import load_file, save_file

    L = TARGET["num_hidden_layers"]
    torch.manual_seed(seed)
    donor = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**dict(TARGET, num_hidden_layers=L + 1)))
    _initialize(donor, seed)
    mtp = f"model.layers.{L}."
    weights = target / "model.safetensors"
    tensors = load_file(weights)
    with tempfile.TemporaryDirectory() as tmp:
        donor.save_pretrained(tmp)          # the Hub's tensor names (one per expert), as the target's
        saved = {}
        for f in Path(tmp).glob("*.safetensors"):
            saved.update(load_file(f))
    tensors.update({k: v for k, v in saved.items() if k.startswith(mtp)})
    D = TARGET["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    tensors.update({
        mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        mtp + "enorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        mtp + "hnorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        mtp + "shared_head.norm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        mtp + "eh_proj.weight": torch.cat((torch.eye(D), 0.1 * torch.randn(D, D, generator=g) / math.sqrt(D)), dim=1),
    })
    save_file(tensors, weights, metadata={"format": "pt"})
    f = target / "config.json"
    f.write_text(json.dumps(dict(json.loads(f.read_text()), num_nextn_predict_layers=1), indent=2) + "\n")


def has_mtp_layer(target: Path) -> bool:
    from .checkpoint import Checkpoint

    return f"model.layers.{TARGET['num_hidden_layers']}.eh_proj.weight" in Checkpoint(target)


def make_nextn(out: Path) -> Path:
    """OUT/nextn: the target's tensors (a relative link, so the folder can move) as DeepseekV3ForCausalLMNextN."""
    path = out / "nextn"
    path.mkdir(parents=True, exist_ok=True)
    link = path / "model.safetensors"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path("..") / "target" / "model.safetensors")
    cfg = json.loads((out / "target" / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, architectures=["DeepseekV3ForCausalLMNextN"]),
                                                 indent=2) + "\n")
    return path


def make_checkpoint(out: Path, name: str) -> Path:
    import transformers

    cfg_name, model_name, kwargs, seed = CHECKPOINTS[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kwargs))
    _initialize(model, seed)
    path = out / name
    model.save_pretrained(path)
    # The engine reads config.json itself; keep it readable for people too.
    f = path / "config.json"
    f.write_text(json.dumps(json.loads(f.read_text()), indent=2) + "\n")
    return path


def make_checkpoints(out: str | Path, *, force: bool = False) -> dict[str, Path]:
    """OUT/target, OUT/draft and OUT/vllm; existing complete folders are kept unless `force`."""
    out = Path(out)
    paths = {}
    for name in CHECKPOINTS:
        path = out / name
        # A target made before it carried the MTP layer is made again.
        if force or not (path / "config.json").is_file() or not any(path.glob("*.safetensors")) \
                or (name == "target" and not has_mtp_layer(path)):
            make_checkpoint(out, name)
            if name == "target":
                add_mtp_layer(path)
        paths[name] = path
    paths["nextn"] = make_nextn(out)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadplan.engine.make_checkpoints",
                                     description="write tiny random checkpoints OUT_DIR/target (DeepSeek-V3 style, "
                                                 "256 experts, with an MTP layer), OUT_DIR/draft (Qwen3-MoE, same "
                                                 "vocabulary), OUT_DIR/nextn (the target's MTP draft) and OUT_DIR/vllm (a Qwen3-MoE "
                                                 "vLLM's CPU build serves)")
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("--force", action="store_true", help="rewrite checkpoints that already exist")
    args = parser.parse_args(argv)
    try:
        paths = make_checkpoints(args.out_dir, force=args.force)
    except ImportError as e:
        print(f"error: FAILED_PRECONDITION: making checkpoints needs transformers ({e}); "
              f"pip install 'transformers>=4.57'", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
