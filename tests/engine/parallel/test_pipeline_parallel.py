"""Pipeline parallelism on 2 gloo ranks (DESIGN 5.5): PP=2 gives PP=1's logits and greedy tokens for
Qwen3-MoE, DeepSeek-V3, Qwen3-Next (linear-attention layers on both stages) and GLM-5 (its second stage's one
layer reuses the top-k its first stage's last layer picked, handed on with the hidden states); each stage holds only its
layers (placeholders without mlp elsewhere), its EPLB descriptors hold only its MoE layers keyed by global id,
and a rebalance on a stage moves only its own experts and leaves the logits unchanged (that it evens the load
over EP ranks: test_worker.py).
One launch for everything."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.parallel.launch import launch
from loadplan.plan import Keys, Runtime

from families import (DEEPSEEK, GLM_MOE_DSA, GRANITEMOE_HYBRID, JAMBA, KIMI_LINEAR, KOLIBRI1, LONGCAT_FLASH, MISTRAL4,
                      NEMOTRON_H, PHIMOE, QWEN3, QWEN3_NEXT, STEP3P7, make_model)
from parallel_helpers import single_process

PP = 2
N_NEW = 4


def _stages(rank, world_size, paths, ids):
    from loadplan.engine.generate import generate
    from loadplan.engine.models import PPMissingLayer
    from loadplan.engine.rebalance import rebalance
    from loadplan.engine.worker import WorkerSpec, init_rank, load_runner

    from engine_helpers import LocalRegistry

    from loadplan.engine.parallel.launch import collective_timeout

    grid = None
    out = {"timeout_s": collective_timeout().total_seconds()}   # what make_grid gives the EP/PP groups
    for arch, path in paths.items():
        spec = WorkerSpec(model=path, prompt_ids=(), max_new_tokens=0, pp_size=world_size,
                          runtime=Runtime(enable_eplb=True, ep_num_redundant_experts=2))
        grid = grid or init_rank(spec)
        model = load_runner(spec, grid, registry=LocalRegistry())
        stage = model.stage
        inner = getattr(stage, "language_model", stage)      # a wrapper's text model: the stage's layers and head
        lo, hi = (int(v) for v in model.plan.decisions[Keys.PP_LAYER_RANGE].value)
        layers = inner.model.layers
        with torch.no_grad():
            logits = model(ids)
            skewed = torch.full((1, 12), 5)             # one token repeated: every position routes alike
            model(skewed)
        report = rebalance(model)
        with torch.no_grad():
            after = model(ids)
        out[arch] = dict(
            layer_range=(lo, hi), eplb_layers=list(model.plan.decisions[Keys.EPLB_LAYERS].value),
            descriptor=list(model.routed_experts_weights_of_layer), moe_layer_ids=list(inner.moe_layer_ids),
            placeholders=[i for i, layer in enumerate(layers) if isinstance(layer, PPMissingLayer)],
            placeholder_has_mlp=any(hasattr(layer, "mlp") for layer in layers if isinstance(layer, PPMissingLayer)),
            reusing_top_k=[i for i, layer in enumerate(layers) if getattr(getattr(layer, "self_attn", None),
                                                                          "reuses_selection", False)],
            has_embed=inner.model.embed_tokens is not None, has_head=inner.lm_head is not None, logits=logits,
            logits_after_rebalance=after,
            rebalanced_layers=list(report.layer_ids), before=report.max_over_mean_before,
            after=report.max_over_mean_after, tokens=generate(model, ids[0], N_NEW)[0].tolist())
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {QWEN3: make_model(tmp_path_factory.mktemp("q3"), QWEN3),
            DEEPSEEK: make_model(tmp_path_factory.mktemp("ds"), DEEPSEEK),
            QWEN3_NEXT: make_model(tmp_path_factory.mktemp("q3n"), QWEN3_NEXT),
            GLM_MOE_DSA: make_model(tmp_path_factory.mktemp("glm5"), GLM_MOE_DSA),
            # its final norm and head have biases, which only the last stage reads
            PHIMOE: make_model(tmp_path_factory.mktemp("phimoe"), PHIMOE),
            # Mamba2 and attention layers on the first stage, a Mamba2 layer on the second
            GRANITEMOE_HYBRID: make_model(tmp_path_factory.mktemp("granite_hybrid"), GRANITEMOE_HYBRID),
            # Mamba2, MoE and attention blocks on the first stage; MLP and MoE blocks on the second
            NEMOTRON_H: make_model(tmp_path_factory.mktemp("nemotron_h"), NEMOTRON_H),
            # Mamba layers on both stages, attention on the second
            JAMBA: make_model(tmp_path_factory.mktemp("jamba"), JAMBA),
            # KDA and NoPE MLA layers on the first stage, KDA on the second
            KIMI_LINEAR: make_model(tmp_path_factory.mktemp("kimi_linear"), KIMI_LINEAR),
            # a layer of two sublayers and its MoE block a stage
            LONGCAT_FLASH: make_model(tmp_path_factory.mktemp("longcat_flash"), LONGCAT_FLASH),
            # behind its wrapper: a global and a windowed layer (each its kind's rotary, clamps) a stage
            STEP3P7: make_model(tmp_path_factory.mktemp("step3p7"), STEP3P7),
            # the second stage scales its queries by their positions past the original context
            MISTRAL4: make_model(tmp_path_factory.mktemp("mistral4"), MISTRAL4),
            # sandwich norms, a windowed layer on each stage
            KOLIBRI1: make_model(tmp_path_factory.mktemp("kolibri1"), KOLIBRI1)}


def test_two_stages_give_one_stage_logits_and_tokens_and_keep_eplb_to_their_own_layers(paths):
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    refs = {arch: single_process(path, ids, N_NEW) for arch, path in paths.items()}
    results = launch(PP, _stages, paths, ids, timeout_s=180)
    assert results[0]["timeout_s"] == results[1]["timeout_s"] == 180
    moe_layers = {QWEN3: [0, 1, 2], DEEPSEEK: [1, 2],      # DeepSeek's layer 0 is dense (first_k_dense_replace)
                  QWEN3_NEXT: [0, 1, 2, 3], GLM_MOE_DSA: [1, 2], PHIMOE: [0, 1, 2], GRANITEMOE_HYBRID: [0, 1, 2],
                  NEMOTRON_H: [1, 4], JAMBA: [1, 3], KIMI_LINEAR: [1, 2, 3], LONGCAT_FLASH: [0, 1], STEP3P7: [1, 2, 3],
                  MISTRAL4: [1, 2], KOLIBRI1: [0, 1, 2]}
    for arch, (ref_logits, ref_tokens) in refs.items():
        s0, s1 = results[0][arch], results[1][arch]
        n_layers = moe_layers[arch][-1] + 1
        cut = (n_layers + 1) // 2                                      # the first stage takes the odd layer
        assert s0["layer_range"] == (0, cut) and s1["layer_range"] == (cut, n_layers)
        for s in (s0, s1):
            assert (s["logits"] - ref_logits).abs().max().item() <= 1e-4
            assert s["tokens"] == ref_tokens
            lo, hi = s["layer_range"]
            own = [i for i in moe_layers[arch] if lo <= i < hi]
            assert s["descriptor"] == s["eplb_layers"] == s["moe_layer_ids"] == s["rebalanced_layers"] == own
            assert s["placeholders"] == [i for i in range(n_layers) if not lo <= i < hi]
            assert not s["placeholder_has_mlp"]
            # The replicas are copies: routing to any of them leaves the logits as they were.
            assert (s["logits_after_rebalance"] - s["logits"]).abs().max().item() <= 1e-5
            assert all(s["after"][i] <= s["before"][i] + 1e-9 for i in own)   # (one EP rank: trivially even)
        assert (s0["has_embed"], s0["has_head"], s1["has_embed"], s1["has_head"]) == (True, False, False, True)
    assert (results[0][GLM_MOE_DSA]["reusing_top_k"], results[1][GLM_MOE_DSA]["reusing_top_k"]) == ([], [2])
