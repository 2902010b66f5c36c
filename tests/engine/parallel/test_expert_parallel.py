"""Expert parallelism on 2 gloo ranks: every backend of the registry's table gives the single-process
logits and greedy tokens (Qwen3-MoE, Mixtral, OLMoE, gpt-oss, MiniMax-M2, Llama 4, Qwen3-Next, Qwen3.5-MoE,
DeepSeek-V2/V3/V3.2 and V3's NextN draft, GLM-4-MoE, GLM-5), fused and
unfused where the plan allows; a forced post-experts all-reduce on the a2a path (the double-reduction
bug of DESIGN 1) is visible in the logits.

One launch per model: the ranks loop over the backends (a launch costs seconds, a load a fraction)."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.parallel.launch import launch
from loadplan.plan import Keys, Runtime
from loadplan.service.rules.backends import BACKENDS

from families import (AFMOE, AXK1, BAILING_HYBRID, COHERE2_MOE, DBRX, DEEPSEEK, DEEPSEEK_V2, DEEPSEEK_V32, DOTS1,
                      ERNIE4_5_MOE, EXAONE_MOE, FLEX_OLMO, FLINT, GLM4, GLM4V_MOE, GLM_MOE_DSA, GPT_OSS, GRANITEMOE,
                      GRANITEMOE_HYBRID, GRANITEMOE_SHARED, GRANITEMOE_SWA, HUNYUAN, HY_V3, JAMBA, KIMI_LINEAR,
                      KOLIBRI1, LAGUNA, LFM2_MOE, LLAMA4, LONGCAT_FLASH, MELLUM, MIMO_V2_FLASH, MINIMAX, MINIMAX_M2,
                      MISTRAL4, MIXTRAL, NEMOTRON_H, OLMOE, PHIMOE, QWEN3, QWEN3_5_MOE, QWEN3_NEXT, SARVAM_MLA,
                      SARVAM_MOE, SOLAR_OPEN, STEP3P7, make_model)
from parallel_helpers import single_process

pytestmark = pytest.mark.heavy(90)

EP = 2
N_NEW = 4
# Families whose MoE output is RMS-normalised before anything else reads it (FlexOlmo's post_feedforward_layernorm,
# no shared expert beside it): scaling it cannot change their logits.
SCALE_FREE_MOE_OUTPUT = {FLEX_OLMO}
TOL = 1e-4
INTENTS = {"enforce": {"enforce_shared_experts_fusion": True}, "disable": {"disable_shared_experts_fusion": True}}
# The backends where a gate that lets the torch runner fuse under EP does fuse at ep_size 2 (enforced where the
# gate asks): where a fused slot can live on every rank (DESIGN 5.1/5.2).
FUSED_UNDER_EP = {b for b, row in BACKENDS.items()
                  if not row.fusion_force_disabled and (row.forward_path == "normal" or row.per_rank_fused_slots)}


def _ep_ranks(rank, world_size, path, ids, intents, double_reduce_backend):
    """Each backend (x intent): load this rank's experts from its own plan, logits and greedy tokens."""
    from loadplan.engine.generate import generate
    from loadplan.engine.moe import RoutedExperts
    from loadplan.engine.worker import WorkerSpec, init_rank, load_runner

    from engine_helpers import LocalRegistry

    grid = None
    out = []
    for backend in BACKENDS:
        for intent in intents:
            spec = WorkerSpec(model=path, prompt_ids=(), max_new_tokens=0, ep_size=world_size,
                              runtime=Runtime(a2a_backend=backend, **(INTENTS[intent] if intent else {})))
            grid = grid or init_rank(spec)
            model = load_runner(spec, grid, registry=LocalRegistry())
            d = model.plan.decisions
            fused = bool(d[Keys.SHARED_EXPERTS_FUSION].value)
            with torch.no_grad():
                logits = model(ids)
            case = dict(backend=backend, intent=intent, fused=fused, path=d[Keys.FORWARD_PATH].value,
                        all_reduce=d[Keys.POST_EXPERTS_ALL_REDUCE].value,
                        scale=d[Keys.FUSED_SHARED_EXPERT_SCALE].value, logits=logits,
                        tokens=generate(model, ids[0], N_NEW)[0].tolist())
            if backend == double_reduce_backend and intent == intents[0]:
                # The seed bug: an all-reduce after a combine that already summed. Forced after build.
                for m in model.modules():
                    if isinstance(m, RoutedExperts):
                        m.post_experts_all_reduce = True
                with torch.no_grad():
                    case["double_reduced"] = model(ids)
            out.append(case)
            if intent == "enforce" and not fused:
                break          # the plan cannot fuse here: the disable case would be the same model
    return out


def _nextn_ranks(rank, world_size, target_path, draft_path, ids, intents):
    """Each backend x intent: this rank's target and NextN draft, the draft's logits from the target's hidden
    states, and speculative decoding with it."""
    from loadplan.engine.speculative import speculative_generate
    from loadplan.engine.worker import WorkerSpec, init_rank, load_runner

    from engine_helpers import LocalRegistry

    grid = None
    out = []
    for backend in BACKENDS:
        for intent in intents:
            spec = WorkerSpec(model=target_path, prompt_ids=(), max_new_tokens=0, ep_size=world_size,
                              runtime=Runtime(a2a_backend=backend), draft=draft_path,
                              draft_runtime=Runtime(a2a_backend=backend, **INTENTS[intent]))
            grid = grid or init_rank(spec)
            registry = LocalRegistry()
            target = load_runner(spec, grid, registry=registry)
            draft = load_runner(spec, grid, "speculative", registry=registry)
            d = draft.plan.decisions
            with torch.no_grad():
                _, hidden = target.logits_and_hidden(ids)
                logits, _ = draft.logits_and_hidden(ids[:, 1:], hidden_states=hidden[:, :-1])
            tokens, stats = speculative_generate(target, draft, ids[0], N_NEW + 2, 2)
            fused = bool(d[Keys.SHARED_EXPERTS_FUSION].value)
            out.append(dict(backend=backend, intent=intent, fused=fused, path=d[Keys.FORWARD_PATH].value,
                            all_reduce=d[Keys.POST_EXPERTS_ALL_REDUCE].value,
                            scale=d[Keys.FUSED_SHARED_EXPERT_SCALE].value, logits=logits, tokens=tokens,
                            proposed=stats["proposed"]))
            if intent == "enforce" and not fused:
                break
    return out


def _check(results, ref_logits, ref_tokens, expect_fused):
    by_rank = [{(c["backend"], c["intent"]): c for c in r} for r in results]
    assert set(by_rank[0]) == set(by_rank[1])
    seen_backends = {b for b, _ in by_rank[0]}
    assert seen_backends == set(BACKENDS)                # every row of the capability table ran
    for key, case in by_rank[0].items():
        backend, intent = key
        assert case["path"] == BACKENDS[backend].forward_path
        assert case["all_reduce"] == (BACKENDS[backend].forward_path == "normal")   # EP 2: partial sums
        for r in (0, 1):
            c = by_rank[r][key]
            diff = (c["logits"] - ref_logits).abs().max().item()
            assert diff <= TOL, f"{key} rank {r}: logits differ by {diff}"
            assert c["tokens"] == ref_tokens, key
    if expect_fused is not None:
        fused = {b for (b, i), c in by_rank[0].items() if c["fused"]}
        assert fused == expect_fused
        assert all(by_rank[0][(b, "enforce")]["scale"] == (0.5 if b == "none" else 1.0) for b in fused)
        assert all(not by_rank[0][(b, "disable")]["fused"] for b in fused)   # and the unfused twin ran
    return by_rank


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("ds"), DEEPSEEK)


@pytest.fixture(scope="module")
def deepseek_v2(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("dsv2"), DEEPSEEK_V2)


@pytest.fixture(scope="module")
def glm4(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("glm4"), GLM4)


# (arch, the a2a backend its test forces a second reduction after): every family without a fused shared expert.
DOUBLE_REDUCTION_CASES = [(QWEN3, "mori"), (MIXTRAL, "nixl"), (OLMOE, "mooncake"), (GPT_OSS, "deepep"),
                          (MINIMAX_M2, "flashinfer"), (LLAMA4, "megamoe"), (DEEPSEEK_V32, "nixl"), (DOTS1, "mooncake"),
                          (ERNIE4_5_MOE, "deepep"), (GRANITEMOE, "mori"), (GRANITEMOE_SHARED, "nixl"),
                          (HUNYUAN, "megamoe"), (PHIMOE, "deepep"), (EXAONE_MOE, "flashinfer"), (AFMOE, "mooncake"),
                          (FLEX_OLMO, "nixl"), (LFM2_MOE, "deepep"), (DBRX, "mori"), (MIMO_V2_FLASH, "mooncake"),
                          (GRANITEMOE_SWA, "megamoe"), (GRANITEMOE_HYBRID, "flashinfer"), (NEMOTRON_H, "mori"),
                          (JAMBA, "nixl"), (MINIMAX, "deepep"), (KIMI_LINEAR, "mooncake"),
                          (LONGCAT_FLASH, "nixl"), (SOLAR_OPEN, "megamoe"),
                          (BAILING_HYBRID, "flashinfer"), (COHERE2_MOE, "deepep"),
                          (STEP3P7, "mooncake"), (SARVAM_MLA, "nixl"), (SARVAM_MOE, "megamoe"),
                          (HY_V3, "deepep"), (MISTRAL4, "mori"), (LAGUNA, "flashinfer"),
                          (AXK1, "nixl"), (MELLUM, "megamoe"),
                          (FLINT, "deepep"), (KOLIBRI1, "mooncake")]


class FamilyFailed(RuntimeError):
    """A family of the one launch failed on this rank: the launch stops there, naming it."""


def _ep_ranks_of_families(rank, world_size, paths, ids):
    """`_ep_ranks` for every family of DOUBLE_REDUCTION_CASES in one launch (a launch costs seconds of its own):
    arch -> its cases. A family that fails on a rank ends the launch, naming the family: the ranks cannot go on to
    the next family, since the other rank may be waiting in a collective of this one (the next family's collectives
    would then pair with it, and the launch would hang until its timeout)."""
    out = {}
    for arch, backend in DOUBLE_REDUCTION_CASES:
        try:
            out[arch] = _ep_ranks(rank, world_size, paths[arch], ids, (None,), backend)
        except Exception as err:
            raise FamilyFailed(f"{arch} (double-reduction backend {backend}) failed on rank {rank}: "
                               f"{type(err).__name__}: {err}") from err
    return out


@pytest.fixture(scope="module")
def every_family_on_two_ranks(tmp_path_factory):
    """(paths, ids, each rank's results by family) of one launch over every family of DOUBLE_REDUCTION_CASES."""
    paths = {arch: make_model(tmp_path_factory.mktemp(arch), arch) for arch, _ in DOUBLE_REDUCTION_CASES}
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    return paths, ids, launch(EP, _ep_ranks_of_families, paths, ids, timeout_s=900)


@pytest.mark.parametrize("arch, double_reduce_backend", DOUBLE_REDUCTION_CASES)
def test_every_backend_on_two_ranks_matches_one_process_and_sees_a_double_reduction(every_family_on_two_ranks, arch,
                                                                                    double_reduce_backend):
    """No shared expert: Qwen3-MoE, Mixtral in the Hub's block_sparse_moe spelling, OLMoE, gpt-oss (experts with
    biases, stacked in the checkpoint), MiniMax-M2 (sigmoid routing with a correction bias); each rank reads 4 of
    the 8 experts. And Llama 4, whose shared expert is never fused (added after the reduction, replicated) and
    whose experts scale their inputs (2 of its 4 experts a rank); DeepSeek-V3.2, never fused either (its sparse
    attention whole on each rank, 8 of its 16 experts a rank); dots.llm1, whose two shared experts are never fused
    (8 of its 16 experts a rank), and ERNIE-4.5 the same with its softmax router (4 of its 8 experts a rank).
    Granite MoE: Mixtral's layer with its multipliers, its stacked experts split by rank; GraniteMoeShared's shared
    MLP never fused (replicated, added after the reduction), as Hunyuan's beside its float32 router. Phi-3.5-MoE:
    its sparsemixer's two picks a token, 4 of its 8 experts a rank. EXAONE-MoE: DeepSeek-V3's grouped router over
    windowed and NoPE layers, its shared expert never fused; AFMoE the same with gated attention and sandwich norms.
    LFM2-MoE: its short-conv layers replicated on both ranks; DBRX: its flattened experts, 4 of 8 a rank;
    MiMo-V2-Flash: its windowed and global layers (sinks, narrow values) replicated, DeepSeek's router. Granite 4.0-H:
    its Mamba2 layers replicated, its shared MLP never fused. Nemotron-H: its ungated experts, 4 of 8 a rank, under
    DeepSeek's grouped router, beside Mamba2, attention and dense MLP blocks. Jamba: its Mamba layers replicated, its
    experts on every other layer. MiniMax-Text-01: its lightning layers replicated. Kimi-Linear: its KDA and NoPE
    MLA layers replicated, DeepSeek-V3's router, its shared expert never fused. LongCat-Flash: 4 of its 8 routed
    experts a rank, its zero-computation experts' picks (the input, weighted) on each rank. Solar Open: GLM-4-MoE's
    block on every layer, its shared expert never fused. The Ling 3 hybrid: its KDA and gated MLA layers replicated.
    Cohere2-MoE: its parallel block, its shared expert averaged with the reduced routed output on each rank.
    Step-3.7 (Step-3.5's text model): its biased sigmoid router, clamped experts, its shared expert on each rank.
    Sarvam's: DeepSeek-V3's and GLM-4-MoE's blocks under their names, their shared experts never fused. HY-V3:
    DeepSeek-V3's block with one group, its shared expert never fused, summed in float32. Mistral 4: its softmax
    router in groups, its stacked experts split by rank, its position-scaled MLA replicated. Laguna: its soft-capped
    router, its shared expert on each rank. A.X K1: DeepSeek-V3's block whose reduced output is normalised on each
    rank. Mellum: Qwen3-MoE's block under windowed and global layers. Flint: its sigmoid router, its sink logits
    replicated, its ungated shared expert on each rank. Kolibri-1: its logit-biased router, its sandwich norms.
    FlexOlmo:
    OLMoE's layer with post-norms, whose RMSNorm of the experts' output normalises a uniform scale away: a
    double reduction (twice every token's output) leaves its logits as they are, and the test says so."""
    paths, ids, launched = every_family_on_two_ranks
    results = [by_family[arch] for by_family in launched]
    ref_logits, ref_tokens = single_process(paths[arch], ids, N_NEW)
    by_rank = _check(results, ref_logits, ref_tokens, None)
    for r in (0, 1):
        c = by_rank[r][(double_reduce_backend, None)]
        assert c["path"] == "a2a" and c["all_reduce"] is False
        wrong = (c["double_reduced"] - ref_logits).abs().max().item()
        if arch in SCALE_FREE_MOE_OUTPUT:
            assert wrong <= 1e-3, "RMSNorm(2 y) == RMSNorm(y): the extra all-reduce cannot show"
        else:
            assert wrong > 1e-2, "an extra all-reduce after the a2a combine must change the logits"


@pytest.mark.parametrize("arch", [DEEPSEEK, GLM_MOE_DSA])
def test_deepseek_v3_and_glm5_every_backend_fused_and_unfused_on_two_ranks_matches_one_process(deepseek, tmp_path,
                                                                                             arch):
    """GLM-5: V3.2's sparse attention (whole on each rank) over DeepSeek-V3's MoE, its own fused architecture."""
    path = deepseek if arch == DEEPSEEK else make_model(tmp_path, arch)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    ref_logits, ref_tokens = single_process(path, ids, N_NEW, disable_shared_experts_fusion=True)
    results = launch(EP, _ep_ranks, path, ids, ("enforce", "disable"), "deepep", timeout_s=240)
    # DESIGN 5.1/5.2 with ep_size=2 on the torch runner: fusion holds where a fused slot can live on every rank.
    assert FUSED_UNDER_EP == {"none", "deepep", "mooncake", "mori", "megamoe"}
    by_rank = _check(results, ref_logits, ref_tokens, FUSED_UNDER_EP)
    for r in (0, 1):   # fused on the a2a path: the slot is computed once per token, an extra reduce doubles it
        c = by_rank[r][("deepep", "enforce")]
        assert c["fused"] and (c["double_reduced"] - ref_logits).abs().max().item() > 1e-2


@pytest.mark.parametrize("arch", [QWEN3_NEXT, QWEN3_5_MOE])
def test_qwen3_next_and_3_5_every_backend_fused_and_unfused_on_two_ranks_matches_one_process(tmp_path, arch):
    """Linear-attention layers replicated on both EP ranks, experts split; the shared expert (Qwen2-MoE's gated
    one) fused where a fused slot can live on every rank, as DeepSeek's. Qwen3.5-MoE as the Hub ships it (its
    multimodal wrapper, text only)."""
    path = make_model(tmp_path, arch)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(6))
    ref_logits, ref_tokens = single_process(path, ids, N_NEW, disable_shared_experts_fusion=True)
    results = launch(EP, _ep_ranks, path, ids, ("enforce", "disable"), "mori", timeout_s=240)
    by_rank = _check(results, ref_logits, ref_tokens, FUSED_UNDER_EP)
    for r in (0, 1):   # fused on the a2a path: an extra all-reduce after the combine doubles the experts' sum
        c = by_rank[r][("mori", "enforce")]
        assert c["fused"] and (c["double_reduced"] - ref_logits).abs().max().item() > 1e-2


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory):
    from families import DEEPSEEK_TINY

    from engine_helpers import make_deepseek_mtp_checkpoint

    return tuple(str(p) for p in make_deepseek_mtp_checkpoint(tmp_path_factory.mktemp("mtp"), **DEEPSEEK_TINY))


def test_deepseek_nextn_draft_every_backend_fused_and_unfused_on_two_ranks_matches_one_process(deepseek_mtp):
    """The MTP draft's own plan on every backend: its logits from the target's hidden states, and speculative
    decoding (the target's greedy tokens), as in one process."""
    from loadplan.engine.speculative import speculative_generate

    from engine_helpers import load_local

    target_path, draft_path = deepseek_mtp
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(7))
    target = load_local(target_path)
    draft = load_local(draft_path, role="speculative", disable_shared_experts_fusion=True)
    with torch.no_grad():
        _, hidden = target.logits_and_hidden(ids)
        ref_logits = draft(ids[:, 1:], hidden_states=hidden[:, :-1])
    ref_tokens, _ = speculative_generate(target, draft, ids[0], N_NEW + 2, 2)
    assert ref_tokens == single_process(target_path, ids, N_NEW + 2)[1]
    results = launch(EP, _nextn_ranks, target_path, draft_path, ids, ("enforce", "disable"), timeout_s=240)
    by_rank = _check(results, ref_logits, ref_tokens, FUSED_UNDER_EP)
    assert all(c["proposed"] > 0 for c in by_rank[0].values())


@pytest.fixture(scope="module")
def deepseek_fp8(deepseek, tmp_path_factory):
    from pathlib import Path

    from engine_helpers import make_fp8_copies

    return str(make_fp8_copies(Path(deepseek), tmp_path_factory.mktemp("fp8"), [16, 8])[0])


def test_deepseek_v3_fp8_checkpoint_every_backend_fused_and_unfused_on_two_ranks_matches_one_process(deepseek_fp8):
    """Block-FP8 weights dequantized per rank: each rank's experts and the fused shared slot (its scales with it)."""
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(8))
    ref_logits, ref_tokens = single_process(deepseek_fp8, ids, N_NEW, disable_shared_experts_fusion=True)
    results = launch(EP, _ep_ranks, deepseek_fp8, ids, ("enforce", "disable"), "deepep", timeout_s=240)
    _check(results, ref_logits, ref_tokens, FUSED_UNDER_EP)


def test_glm4_moe_lite_every_backend_fused_and_unfused_on_two_ranks_matches_one_process(tmp_path):
    """GLM-4.7-Flash's shape: DeepSeek's MLA with GLM's MoE block and gate (fused under EP on the torch runner)."""
    from engine_helpers import make_glm4_lite_checkpoint

    path = str(make_glm4_lite_checkpoint(tmp_path / "glm4_lite"))
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(6))
    ref_logits, ref_tokens = single_process(path, ids, N_NEW, disable_shared_experts_fusion=True)
    results = launch(EP, _ep_ranks, path, ids, ("enforce", "disable"), "nixl", timeout_s=240)
    _check(results, ref_logits, ref_tokens, FUSED_UNDER_EP)


@pytest.mark.parametrize("arch", [GLM4, GLM4V_MOE])
def test_glm4_moe_every_backend_fused_and_unfused_on_two_ranks_matches_one_process(glm4, tmp_path, arch):
    """GLM-4.5V too: GLM-4-MoE's text model behind its multimodal wrapper, run text-only."""
    path = glm4 if arch == GLM4 else make_model(tmp_path, arch)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    ref_logits, ref_tokens = single_process(path, ids, N_NEW, disable_shared_experts_fusion=True)
    results = launch(EP, _ep_ranks, path, ids, ("enforce", "disable"), "mooncake", timeout_s=240)
    # The GLM gate (DESIGN 5.2) lets the torch runner fuse under EP; where a slot lives is the table's.
    by_rank = _check(results, ref_logits, ref_tokens, FUSED_UNDER_EP)
    for r in (0, 1):
        c = by_rank[r][("mooncake", "enforce")]
        assert c["fused"] and (c["double_reduced"] - ref_logits).abs().max().item() > 1e-2


def test_deepseek_v2_every_backend_on_two_ranks_matches_one_process_and_sees_a_double_reduction(deepseek_v2):
    """Softmax routing, two shared experts (never fused: replicated and added after the reduction)."""
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(6))
    ref_logits, ref_tokens = single_process(deepseek_v2, ids, N_NEW)
    results = launch(EP, _ep_ranks, deepseek_v2, ids, (None,), "nixl", timeout_s=180)
    by_rank = _check(results, ref_logits, ref_tokens, set())
    for r in (0, 1):
        c = by_rank[r][("nixl", None)]
        assert c["path"] == "a2a" and (c["double_reduced"] - ref_logits).abs().max().item() > 1e-2
