"""Tensor parallelism on gloo ranks: each rank holds its share of the attention heads, the dense MLP's
and every expert's intermediate features (checked on the built layers), and TP=2 gives the single
process's logits and greedy tokens for Qwen3-MoE (a dense layer and o_proj's bias included), Mixtral, OLMoE,
Qwen2-MoE, GLM-4-MoE, DeepSeek-V3, -V3.2 (sparse attention), GLM-5 and DeepSeek-V2 (Multi-head Latent
Attention), Qwen3-Next and Qwen3.5-MoE (linear attention), ERNIE-4.5 (pairwise rope), GLM-4.5V's text model,
Granite MoE and Granite 4.0-H (Mamba2 layers, their groups split or one group on every rank), Nemotron-H (ungated
experts, a dense relu^2 MLP), shared experts fused and unfused; TP=2 x PP=2 too; DeepSeek-V3's NextN draft on TP
ranks drafts as on one process. EP 2 x TP 2 on 4 ranks too. Every a2a backend on TP 2 and on EP 2 x TP 2: experts
whole on each TP rank, the single process's logits, a forced reduction after the combine seen. Refusals: a family
whose layers do not split, heads that do not divide."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.parallel.launch import launch
from loadplan.plan import Keys, Runtime
from loadplan.service.rules.backends import BACKENDS

from engine_helpers import (LocalRegistry, load_kwargs, make_checkpoint, make_granitemoe_hybrid_checkpoint,
                            make_nemotron_h_checkpoint)
from families import (AFMOE, AXK1, BAILING_HYBRID, COHERE2_MOE, DBRX, DEEPSEEK, DEEPSEEK_V2, DEEPSEEK_V32,
                      ERNIE4_5_MOE, EXAONE_MOE, FLEX_OLMO, FLINT, GLM4, GLM4V_MOE, GLM_MOE_DSA, GPT_OSS, GRANITEMOE,
                      GRANITEMOE_HYBRID, GRANITEMOE_SWA, HUNYUAN, HY_V3, JAMBA, KIMI_LINEAR, KOLIBRI1, LAGUNA, LLAMA4,
                      LONGCAT_FLASH, MELLUM, MIMO_V2_FLASH, MINIMAX, MINIMAX_M2, MISTRAL4, MIXTRAL, NEMOTRON_H, OLMOE,
                      PHIMOE, QWEN2, QWEN3, QWEN3_5_MOE, QWEN3_NEXT, SARVAM_MLA, SARVAM_MOE, SOLAR_OPEN, STEP3P7,
                      make_model)
from parallel_helpers import single_process

pytestmark = pytest.mark.heavy(70)

N_NEW = 4
TOL = 1e-4
INTENTS = {None: {}, "enforce": {"enforce_shared_experts_fusion": True},
           "disable": {"disable_shared_experts_fusion": True}}
# (name, arch, fusion intent): Qwen3-MoE has no shared expert.
CASES = [("qwen3", QWEN3, None), ("qwen2", QWEN2, "enforce"), ("qwen2", QWEN2, "disable"),
         ("glm4", GLM4, "enforce"), ("glm4", GLM4, "disable"), ("deepseek", DEEPSEEK, "enforce"),
         ("deepseek", DEEPSEEK, "disable"), ("deepseek_v2", DEEPSEEK_V2, None), ("mixtral", MIXTRAL, None),
         ("olmoe", OLMOE, None), ("gpt_oss", GPT_OSS, None), ("minimax_m2", MINIMAX_M2, None),
         ("llama4", LLAMA4, None), ("qwen3_next", QWEN3_NEXT, None), ("qwen3_5_moe", QWEN3_5_MOE, None),
         ("deepseek_v32", DEEPSEEK_V32, None), ("glm_moe_dsa", GLM_MOE_DSA, "enforce"),
         ("ernie4_5_moe", ERNIE4_5_MOE, None), ("glm4v_moe", GLM4V_MOE, "enforce"), ("granitemoe", GRANITEMOE, None),
         ("hunyuan", HUNYUAN, None), ("phimoe", PHIMOE, None), ("exaone_moe", EXAONE_MOE, None),
         ("afmoe", AFMOE, None), ("flex_olmo", FLEX_OLMO, None),
         ("dbrx", DBRX, None), ("mimo_v2_flash", MIMO_V2_FLASH, None),
         ("granitemoe_swa", GRANITEMOE_SWA, None), ("granitemoe_hybrid", GRANITEMOE_HYBRID, None),
         ("granitemoe_hybrid_g1", GRANITEMOE_HYBRID, None), ("nemotron_h", NEMOTRON_H, None),
         ("jamba", JAMBA, None), ("minimax", MINIMAX, None), ("kimi_linear", KIMI_LINEAR, None),
         ("longcat_flash", LONGCAT_FLASH, None), ("solar_open", SOLAR_OPEN, None),
         ("bailing_hybrid", BAILING_HYBRID, None), ("cohere2_moe", COHERE2_MOE, None),
         ("step3p7", STEP3P7, None), ("sarvam_mla", SARVAM_MLA, None), ("sarvam_moe", SARVAM_MOE, None),
         ("hy_v3", HY_V3, None), ("mistral4", MISTRAL4, None),
         ("laguna", LAGUNA, None), ("axk1", AXK1, None),
         ("mellum", MELLUM, None), ("flint", FLINT, None), ("kolibri1", KOLIBRI1, None)]


def _tp_ranks(rank, world_size, paths, ids, tp_size, pp_size):
    from loadplan.engine.generate import generate
    from loadplan.engine.layers.attention import GQAttention
    from loadplan.engine.layers.gated_delta_net import GatedDeltaNet
    from loadplan.engine.layers.kimi_delta_attention import KimiDeltaAttention
    from loadplan.engine.layers.lightning_attention import LightningAttention
    from loadplan.engine.layers.mamba1 import Mamba1Mixer
    from loadplan.engine.layers.mamba2 import Mamba2Mixer
    from loadplan.engine.layers.mla import MultiHeadLatentAttention
    from loadplan.engine.layers.mlp import GatedMLP, UngatedMLP
    from loadplan.engine.moe import RoutedExperts
    from loadplan.engine.worker import WorkerSpec, init_rank, load_runner

    from engine_helpers import LocalRegistry

    grid = None
    out = []
    for name, arch, intent in CASES if pp_size == 1 else CASES[:1]:
        spec = WorkerSpec(model=paths[name], prompt_ids=(), max_new_tokens=0, tp_size=tp_size, pp_size=pp_size,
                          runtime=Runtime(**INTENTS[intent]))
        grid = grid or init_rank(spec)
        model = load_runner(spec, grid, registry=LocalRegistry())
        d = model.plan.decisions
        stage = model.stage
        mods = list(stage.modules())
        with torch.no_grad():
            logits = model(ids)
        out.append(dict(
            name=name, intent=intent, fused=bool(d[Keys.SHARED_EXPERTS_FUSION].value),
            tp=(model.plan.request.parallel.tp_size, model.plan.request.parallel.tp_rank),
            all_reduce=bool(d[Keys.POST_EXPERTS_ALL_REDUCE].value),
            heads={(m.n_heads, m.n_kv_heads, m.q_proj.weight.shape[0]) for m in mods if isinstance(m, GQAttention)},
            mla_heads={(m.num_heads, m.kv_b_proj.weight.shape[0], m.kv_a_proj_with_mqa.weight.shape[0])
                       for m in mods if isinstance(m, MultiHeadLatentAttention)},
            indexer_heads={m.indexer.wq_b.weight.shape[0] // m.indexer.head_dim for m in mods
                           if isinstance(m, MultiHeadLatentAttention) and m.indexer is not None},
            reusing=sum(isinstance(m, MultiHeadLatentAttention) and m.reuses_selection for m in mods),
            expert_inter={m.gate_up_proj.shape[1] // (2 if m.gated else 1) for m in mods
                          if isinstance(m, RoutedExperts)},
            expert_width={m.hidden_size for m in mods if isinstance(m, RoutedExperts)},
            dense_inter={m.gate_proj.weight.shape[0] for m in mods if isinstance(m, GatedMLP)},
            proj_norms={(m.q_proj_norm.weight.shape[0], m.k_proj_norm.weight.shape[0]) for m in mods
                        if isinstance(m, GQAttention) and m.q_proj_norm is not None},
            sinks={m.sinks.shape[0] for m in mods if isinstance(m, GQAttention) and m.sinks is not None},
            attn_gate_rows={m.gate_proj.weight.shape[0] for m in mods
                            if isinstance(m, GQAttention) and m.gate_proj is not None},
            expert_biases={(m.gate_up_bias.shape[1], m.down_bias.shape[1]) for m in mods
                           if isinstance(m, RoutedExperts) and m.gate_up_bias is not None},
            lightning={(m.H, m.qkv_proj.weight.shape[0], m.output_gate.weight.shape[0], m.out_proj.weight.shape[1],
                        tuple(round(float(v), 6) for v in m.slope)) for m in mods if isinstance(m, LightningAttention)},
            mamba1={(m.inner, m.in_proj.weight.shape[0], m.x_proj.weight.shape[1], m.dt_proj.weight.shape[0],
                     m.A_log.shape[0], m.out_proj.weight.shape[1]) for m in mods if isinstance(m, Mamba1Mixer)},
            ungated_mlp={(m.up_proj.weight.shape[0], m.down_proj.weight.shape[1]) for m in mods
                         if isinstance(m, UngatedMLP)},
            linear={(m.n_k, m.n_v, (m.in_proj_qkvz if m.grouped else m.in_proj_qkv).weight.shape[0],
                     m.conv1d.weight.shape[0], m.A_log.shape[0], m.out_proj.weight.shape[1])
                    for m in mods if isinstance(m, GatedDeltaNet)},
            mamba={(m.H, m.G, m.in_proj.weight.shape[0], m.conv1d.weight.shape[0], m.norm.weight.shape[0],
                    m.out_proj.weight.shape[1], m.norm.reduce is not None) for m in mods if isinstance(m, Mamba2Mixer)},
            ling_kda={(m.n, m.q_proj.weight.shape[0], m.f_proj.weight.shape[0], m.g_proj.weight.shape[0],
                       m.A_log.shape[0]) for m in mods if isinstance(m, KimiDeltaAttention) and not m.low_rank},
            mla_gates={m.g_proj.weight.shape[0] for m in mods
                       if isinstance(m, MultiHeadLatentAttention) and m.g_proj is not None},
            kda={(m.n, m.q_proj.weight.shape[0], m.q_conv1d.weight.shape[0], m.f_b_proj.weight.shape[0],
                  m.dt_bias.shape[0], m.A_log.shape[0], m.b_proj.weight.shape[0], m.g_b_proj.weight.shape[0],
                  m.o_proj.weight.shape[1], m.f_a_proj.weight.shape[0])
                 for m in mods if isinstance(m, KimiDeltaAttention) and m.low_rank},
            logits=logits, tokens=generate(model, ids[0], N_NEW)[0].tolist()))
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {
        # layer 0 dense (mlp_only_layers), o_proj with a bias: both split or added once under TP
        "qwen3": str(make_checkpoint(tmp_path_factory.mktemp("q3"), QWEN3, mlp_only_layers=[0], attention_bias=True)),
        "qwen2": make_model(tmp_path_factory.mktemp("q2"), QWEN2),
        "glm4": make_model(tmp_path_factory.mktemp("glm"), GLM4),
        "deepseek": make_model(tmp_path_factory.mktemp("ds"), DEEPSEEK),
        "deepseek_v2": make_model(tmp_path_factory.mktemp("ds2"), DEEPSEEK_V2),
        "mixtral": make_model(tmp_path_factory.mktemp("mixtral"), MIXTRAL),
        "olmoe": make_model(tmp_path_factory.mktemp("olmoe"), OLMOE),
        "gpt_oss": make_model(tmp_path_factory.mktemp("gpt_oss"), GPT_OSS),
        "minimax_m2": make_model(tmp_path_factory.mktemp("minimax_m2"), MINIMAX_M2),
        "llama4": make_model(tmp_path_factory.mktemp("llama4"), LLAMA4),
        "qwen3_next": make_model(tmp_path_factory.mktemp("qwen3_next"), QWEN3_NEXT),
        "qwen3_5_moe": make_model(tmp_path_factory.mktemp("qwen3_5_moe"), QWEN3_5_MOE),
        "deepseek_v32": make_model(tmp_path_factory.mktemp("deepseek_v32"), DEEPSEEK_V32),
        "glm_moe_dsa": make_model(tmp_path_factory.mktemp("glm_moe_dsa"), GLM_MOE_DSA),
        "ernie4_5_moe": make_model(tmp_path_factory.mktemp("ernie4_5_moe"), ERNIE4_5_MOE),
        "glm4v_moe": make_model(tmp_path_factory.mktemp("glm4v_moe"), GLM4V_MOE),
        "granitemoe": make_model(tmp_path_factory.mktemp("granitemoe"), GRANITEMOE),
        "hunyuan": make_model(tmp_path_factory.mktemp("hunyuan"), HUNYUAN),
        "phimoe": make_model(tmp_path_factory.mktemp("phimoe"), PHIMOE),
        "exaone_moe": make_model(tmp_path_factory.mktemp("exaone_moe"), EXAONE_MOE),
        "afmoe": make_model(tmp_path_factory.mktemp("afmoe"), AFMOE),
        "flex_olmo": make_model(tmp_path_factory.mktemp("flex_olmo"), FLEX_OLMO),
        "dbrx": make_model(tmp_path_factory.mktemp("dbrx"), DBRX),
        "mimo_v2_flash": make_model(tmp_path_factory.mktemp("mimo_v2_flash"), MIMO_V2_FLASH),
        "granitemoe_swa": make_model(tmp_path_factory.mktemp("granitemoe_swa"), GRANITEMOE_SWA),
        "granitemoe_hybrid": make_model(tmp_path_factory.mktemp("granitemoe_hybrid"), GRANITEMOE_HYBRID),
        # one group of B and C for all 4 Mamba2 heads, as the published models have
        "granitemoe_hybrid_g1": str(make_granitemoe_hybrid_checkpoint(tmp_path_factory.mktemp("granite_g1"),
                                                                      mamba_n_groups=1)),
        # a shared MLP (40) wider than the dense MLP's rank share (24); a latent MoE (Nemotron 3 Super's): experts
        # 16 wide in and out, between replicated projections
        "jamba": make_model(tmp_path_factory.mktemp("jamba"), JAMBA),
        "minimax": make_model(tmp_path_factory.mktemp("minimax"), MINIMAX),
        "kimi_linear": make_model(tmp_path_factory.mktemp("kimi_linear"), KIMI_LINEAR),
        "longcat_flash": make_model(tmp_path_factory.mktemp("longcat_flash"), LONGCAT_FLASH),
        "solar_open": make_model(tmp_path_factory.mktemp("solar_open"), SOLAR_OPEN),
        "bailing_hybrid": make_model(tmp_path_factory.mktemp("bailing_hybrid"), BAILING_HYBRID),
        "cohere2_moe": make_model(tmp_path_factory.mktemp("cohere2_moe"), COHERE2_MOE),
        "step3p7": make_model(tmp_path_factory.mktemp("step3p7"), STEP3P7),
        "sarvam_mla": make_model(tmp_path_factory.mktemp("sarvam_mla"), SARVAM_MLA),
        "sarvam_moe": make_model(tmp_path_factory.mktemp("sarvam_moe"), SARVAM_MOE),
        "hy_v3": make_model(tmp_path_factory.mktemp("hy_v3"), HY_V3),
        "mistral4": make_model(tmp_path_factory.mktemp("mistral4"), MISTRAL4),
        "laguna": make_model(tmp_path_factory.mktemp("laguna"), LAGUNA),
        "axk1": make_model(tmp_path_factory.mktemp("axk1"), AXK1),
        "mellum": make_model(tmp_path_factory.mktemp("mellum"), MELLUM),
        "flint": make_model(tmp_path_factory.mktemp("flint"), FLINT),
        "kolibri1": make_model(tmp_path_factory.mktemp("kolibri1"), KOLIBRI1),
        "nemotron_h": str(make_nemotron_h_checkpoint(tmp_path_factory.mktemp("nemotron_h"),
                                                     moe_shared_expert_intermediate_size=40, moe_latent_size=16)),
    }


@pytest.fixture(scope="module")
def ids():
    return torch.tensor([[3, 17, 42, 9, 101, 5, 77]])


@pytest.fixture(scope="module")
def references(paths, ids):
    return {(name, intent): single_process(paths[name], ids, N_NEW, **INTENTS[intent]) for name, _, intent in CASES}


def test_two_tp_ranks_give_the_single_process_logits_and_tokens(paths, ids, references):
    ranks = launch(2, _tp_ranks, paths, ids, 2, 1, timeout_s=240)
    for tp_rank, cases in enumerate(ranks):
        assert len(cases) == len(CASES)
        for case in cases:
            want_logits, want_tokens = references[(case["name"], case["intent"])]
            where = f"{case['name']} {case['intent']} tp rank {tp_rank}"
            assert case["tp"] == (2, tp_rank), where
            assert case["all_reduce"], where              # normal path, experts split: the plan reduces
            if case["intent"]:
                assert case["fused"] == (case["intent"] == "enforce"), where
            torch.testing.assert_close(case["logits"], want_logits, atol=TOL, rtol=0, msg=where)
            assert case["tokens"] == want_tokens, where
    by_name = {c["name"]: c for c in ranks[0]}
    # Each rank holds half: 4 heads and 2 key/value heads of head_dim 24 (Qwen3) -> 2 and 1; experts' 32
    # intermediate features -> 16; the dense layer's 96 -> 48 (Qwen2's unfused shared expert stays whole).
    assert by_name["qwen3"]["heads"] == {(2, 1, 48)}
    assert by_name["qwen3"]["expert_inter"] == {16} and by_name["qwen3"]["dense_inter"] == {48}
    assert ranks[0][2]["name"] == "qwen2" and ranks[0][2]["dense_inter"] == {32}      # replicated shared expert
    assert by_name["glm4"]["expert_inter"] == {8}
    assert by_name["mixtral"]["heads"] == {(2, 1, 32)} and by_name["mixtral"]["expert_inter"] == {16}
    # OLMoE's q / k norms span the whole projection: each rank holds its heads' part, summed over the pair.
    assert by_name["olmoe"]["heads"] == {(2, 1, 32)} and by_name["olmoe"]["proj_norms"] == {(32, 16)}
    # gpt-oss: each rank its heads' sinks; the experts' gate/up biases split with their rows, and the down
    # projections' biases whole, added by the first TP rank only (both ranks adding them fails the logits).
    assert by_name["gpt_oss"]["heads"] == {(2, 1, 32)} and by_name["gpt_oss"]["sinks"] == {2}
    assert by_name["gpt_oss"]["expert_inter"] == {16} and by_name["gpt_oss"]["expert_biases"] == {(32, 64)}
    # MiniMax-M2: OLMoE's whole-projection norms, split with the heads
    assert by_name["minimax_m2"]["heads"] == {(2, 1, 32)} and by_name["minimax_m2"]["proj_norms"] == {(32, 16)}
    # Llama 4: its dense layers' 48 features split (24), its unfused shared expert (32) whole on each rank
    assert by_name["llama4"]["heads"] == {(2, 1, 32)} and by_name["llama4"]["expert_inter"] == {16}
    assert by_name["llama4"]["dense_inter"] == {24, 32}
    # Qwen3-Next: gated attention, each head's query and gate rows together (2 heads of 16: 2 * 2 * 16 rows); its
    # linear layers 1 of 2 key heads and its 2 value heads: q, k, v, z rows 8 + 8 + 2 * 8 + 2 * 8, conv channels
    # 8 + 8 + 16 (the checkpoint's regrouped by rank), decays and out_proj columns by value head.
    assert by_name["qwen3_next"]["heads"] == {(2, 1, 64)} and by_name["qwen3_next"]["expert_inter"] == {16}
    assert by_name["qwen3_next"]["linear"] == {(1, 2, 48, 32, 2, 16)} and by_name["qwen3_next"]["fused"]
    # Qwen3.5-MoE (its wrapper): in_proj_qkv's rows are the conv's channels, regrouped by rank alike (8 + 8 + 16)
    assert by_name["qwen3_5_moe"]["linear"] == {(1, 2, 32, 32, 2, 16)} and by_name["qwen3_5_moe"]["fused"]
    # DeepSeek-V3.2: MLA's heads split as V3's, its sparse attention indexer whole on each rank (8 index heads)
    assert by_name["deepseek_v32"]["mla_heads"] == by_name["deepseek"]["mla_heads"]
    assert by_name["deepseek_v32"]["indexer_heads"] == {8} and not by_name["deepseek_v32"]["fused"]
    assert by_name["glm_moe_dsa"]["indexer_heads"] == {8} and by_name["glm_moe_dsa"]["fused"]      # GLM-5 fuses
    assert by_name["glm_moe_dsa"]["reusing"] == 1    # its last layer reuses the top-k of the one before it
    # ERNIE-4.5: 2 of 4 heads and 1 of 2 key/value heads (of 8), its experts' 16 features and its dense 48 split,
    # its two shared experts (one MLP of 32) whole on each rank
    assert by_name["ernie4_5_moe"]["heads"] == {(2, 1, 16)} and by_name["ernie4_5_moe"]["expert_inter"] == {8}
    assert by_name["ernie4_5_moe"]["dense_inter"] == {24, 32} and not by_name["ernie4_5_moe"]["fused"]
    # GLM-4.5V behind its wrapper: GLM-4-MoE's split, its shared expert fused as GLM-4-MoE's
    assert by_name["glm4v_moe"]["heads"] == by_name["glm4"]["heads"] and by_name["glm4v_moe"]["fused"]
    # Granite MoE: 2 of its 4 heads of 8, its experts' 16 features split (its multipliers on every rank)
    assert by_name["granitemoe"]["heads"] == {(2, 1, 16)} and by_name["granitemoe"]["expert_inter"] == {8}
    # Hunyuan: 2 of 4 heads of 8 (their q/k norms, after the rotation, whole), its experts' 16 features split, its
    # shared MLP (16) whole on each rank
    assert by_name["hunyuan"]["heads"] == {(2, 1, 16)} and by_name["hunyuan"]["expert_inter"] == {8}
    assert by_name["hunyuan"]["dense_inter"] == {16} and not by_name["hunyuan"]["fused"]
    # Phi-3.5-MoE: 2 of 4 heads of 8 with their q/k/v biases, o_proj's bias added once; the head's bias whole
    assert by_name["phimoe"]["heads"] == {(2, 1, 16)} and by_name["phimoe"]["expert_inter"] == {8}
    # EXAONE-MoE: 2 of 4 heads of 8 (windowed and NoPE layers alike), its dense layer's 48 features split, its shared
    # expert (16) whole on each rank
    assert by_name["exaone_moe"]["heads"] == {(2, 1, 16)} and by_name["exaone_moe"]["expert_inter"] == {8}
    assert by_name["exaone_moe"]["dense_inter"] == {24, 16} and not by_name["exaone_moe"]["fused"]
    # AFMoE: 2 of 4 heads of 8 and their rows of the output gate's projection, its two shared experts (32) whole
    assert by_name["afmoe"]["heads"] == {(2, 1, 16)} and by_name["afmoe"]["attn_gate_rows"] == {16}
    assert by_name["afmoe"]["dense_inter"] == {24, 32} and not by_name["afmoe"]["fused"]
    # FlexOlmo: its projection norms split with the heads (2 of 4 heads of 6: 12 of q's 24 features, 6 of k's 12)
    assert by_name["flex_olmo"]["heads"] == {(2, 1, 12)} and by_name["flex_olmo"]["proj_norms"] == {(12, 6)}
    # DBRX: its fused q/k/v shown as three projections, each split by head (2 of 4, 1 of 2); experts' 16 features
    assert by_name["dbrx"]["heads"] == {(2, 1, 16)} and by_name["dbrx"]["expert_inter"] == {8}
    # MiMo-V2-Flash: 2 of 4 heads of 12 (q rows 24); the global layer's 1 of 2 key/value heads, the windowed ones' 2 of
    # 4 with 2 sink logits; its dense layer's 48 features split
    assert by_name["mimo_v2_flash"]["heads"] == {(2, 1, 24), (2, 2, 24)} and by_name["mimo_v2_flash"]["sinks"] == {2}
    assert by_name["mimo_v2_flash"]["dense_inter"] == {24}
    # Granite MoE SWA: each rank its heads' sink logits on every layer, its shared MLP (24) whole
    assert by_name["granitemoe_swa"]["sinks"] == {2} and by_name["granitemoe_swa"]["dense_inter"] == {24}
    # Granite 4.0-H: each Mamba2 layer 2 of its 4 heads of 16 and the group they read: in_proj rows 32 (z) + 32 (x) +
    # 8 (B) + 8 (C) + 2 (dt), conv channels 32 + 8 + 8, norm features and out_proj columns 32. With 2 groups each
    # rank has its own and normalises alone; with one, B and C are on both and the norm's mean square is summed.
    assert by_name["granitemoe_hybrid"]["mamba"] == {(2, 1, 82, 48, 32, 32, False)}
    assert by_name["granitemoe_hybrid_g1"]["mamba"] == {(2, 1, 82, 48, 32, 32, True)}
    assert by_name["granitemoe_hybrid"]["heads"] == {(2, 1, 16)} and by_name["granitemoe_hybrid"]["dense_inter"] == {24}
    # Nemotron-H: its ungated experts' 16 features split (8 up rows each), in the latent width (16); the dense relu^2
    # MLP's 48 split (24), the shared one (40) whole; its Mamba2 layer 2 of 4 heads and 1 of 2 groups; its attention
    # NoPE, 2 of 4 heads of 8
    n = by_name["nemotron_h"]
    assert n["expert_inter"] == {8} and n["expert_width"] == {16} and n["ungated_mlp"] == {(24, 24), (40, 40)}
    assert n["heads"] == {(2, 1, 16)} and n["mamba"] == {(2, 1, 82, 48, 32, 32, False)} and not n["fused"]
    # Jamba: each Mamba layer 32 of its 64 channels (x and z rows of in_proj 2 x 32, x_proj's columns, dt_proj's rows,
    # A_log's rows, out_proj's columns); its experts' and dense MLP's 48 features split (24)
    assert by_name["jamba"]["mamba1"] == {(32, 64, 32, 32, 32, 32)} and by_name["jamba"]["expert_inter"] == {24}
    assert by_name["jamba"]["heads"] == {(2, 1, 16)} and by_name["jamba"]["dense_inter"] == {24}
    # MiniMax: each lightning layer 2 of its 4 heads (q, k, v rows 2 x 24, output gate 16, out_proj columns 16) with
    # those heads' slopes (rank 0 the faster-decaying half), its norm's mean square summed over the pair
    from loadplan.engine.layers.lightning_attention import slopes
    for tp_rank, cases in enumerate(ranks):
        lightning = {c["name"]: c for c in cases}["minimax"]["lightning"]
        assert {(h, q, g, o) for h, q, g, o, _ in lightning} == {(2, 48, 16, 16)}
        assert {s for *_, s in lightning} == {tuple(round(float(v), 6) for v in slopes(4, layer, 4)[2 * tp_rank:][:2])
                                             for layer in (1, 3)}
    # Kimi-Linear: each KDA layer 2 of its 4 heads of 8 (q/k/v rows, their convs' channels, f_b_proj's and g_b_proj's
    # rows, dt_bias 16; A_log and b_proj 2; o_proj's columns 16), the low-rank f_a_proj (8) whole; its NoPE MLA 2 of 4
    # heads (kv_b_proj rows 2 x (8 + 12)); its experts' 16 features split, its dense 48 split, its shared expert whole
    k = by_name["kimi_linear"]
    assert k["kda"] == {(2, 16, 16, 16, 16, 2, 2, 16, 16, 8)} and k["mla_heads"] == {(2, 40, 24)}
    assert k["expert_inter"] == {8} and k["dense_inter"] == {24, 16} and not k["fused"]
    # LongCat-Flash: both MLA sublayers 2 of 4 heads (kv_b_proj rows 2 x (8 + 12)), both dense MLPs 24 of 48, its
    # routed experts' 16 features split (its zero-computation experts: the input, on every rank)
    c = by_name["longcat_flash"]
    assert c["mla_heads"] == {(2, 40, 24)} and c["dense_inter"] == {24} and c["expert_inter"] == {8}
    # Solar Open: 2 of 4 heads of 8 and 1 of 2 key/value heads, whole heads rotated; its experts' 16 features split,
    # its shared expert (16) whole on each rank
    s = by_name["solar_open"]
    assert s["heads"] == {(2, 1, 16)} and s["expert_inter"] == {8} and s["dense_inter"] == {16} and not s["fused"]
    # The Ling 3 hybrid: each KDA layer 2 of 4 heads of 8 (its full-rank forget and output gate projections 16 rows
    # each); its gated MLA 2 of 4 heads and their 2 gate rows
    b = by_name["bailing_hybrid"]
    assert b["ling_kda"] == {(2, 16, 16, 16, 2)} and b["mla_gates"] == {2} and b["mla_heads"] == {(2, 40, 24)}
    # Cohere2-MoE: 2 of 4 heads of 8 and 1 of 2 key/value heads (interleaved rotary, windowed and NoPE layers alike),
    # its dense prefix's 48 features and its experts' 16 split, its shared expert (16) whole on each rank
    c2 = by_name["cohere2_moe"]
    assert c2["heads"] == {(2, 1, 16)} and c2["expert_inter"] == {8} and c2["dense_inter"] == {24, 16}
    assert not c2["fused"]
    # Step-3.7 (Step-3.5's text model): its global layers 2 of 4 heads, its windowed ones 4 of 8 (1 of 2 key/value
    # heads of 8 each) with their per-head gate rows; its dense layer's 48 features split, its experts' 16, its
    # shared expert (24) whole on each rank
    s7 = by_name["step3p7"]
    assert s7["heads"] == {(2, 1, 16), (4, 1, 32)} and s7["attn_gate_rows"] == {2, 4}
    assert s7["expert_inter"] == {8} and s7["dense_inter"] == {24} and not s7["fused"]
    # Sarvam's: sarvam-105b's MLA 2 of 4 heads (kv_b_proj rows 2 x (8 + 12)); sarvam-30b's fused q/k/v shown apart
    # and split by head (2 of 4 query heads and 1 of 2 key/value heads of 8), its dense layer's 48 features split
    assert by_name["sarvam_mla"]["mla_heads"] == {(2, 40, 24)} and by_name["sarvam_mla"]["expert_inter"] == {8}
    assert by_name["sarvam_moe"]["heads"] == {(2, 1, 16)} and by_name["sarvam_moe"]["dense_inter"] == {24, 16}
    # HY-V3: 2 of 4 heads of 8 and 1 of 2 key/value heads (their q/k norms whole), its dense layer's 48 features and
    # its experts' 16 split, its shared expert (16) whole on each rank
    assert by_name["hy_v3"]["heads"] == {(2, 1, 16)} and by_name["hy_v3"]["expert_inter"] == {8}
    assert by_name["hy_v3"]["dense_inter"] == {24, 16} and not by_name["hy_v3"]["fused"]
    # Mistral 4: its MLA 2 of 4 heads (kv_b_proj rows 2 x (8 + 12)), its stacked experts' 12 features split (6)
    assert by_name["mistral4"]["mla_heads"] == {(2, 40, 24)} and by_name["mistral4"]["expert_inter"] == {6}
    # Laguna: its global layers 2 of 4 heads, its windowed ones 4 of 8 (1 of 2 key/value heads of 8 each) with their
    # per-head gate rows; its dense layer's 48 features split, its shared expert (24) whole on each rank
    lg = by_name["laguna"]
    assert lg["heads"] == {(2, 1, 16), (4, 1, 32)} and lg["attn_gate_rows"] == {2, 4}
    assert lg["expert_inter"] == {8} and lg["dense_inter"] == {24} and not lg["fused"]
    # A.X K1: its MLA 2 of 4 heads (kv_b_proj rows 2 x (8 + 12)), its experts' 16 features split, its MoE output norm
    # after the reduction (whole)
    assert by_name["axk1"]["mla_heads"] == {(2, 40, 24)} and by_name["axk1"]["expert_inter"] == {8}
    # Mellum: 2 of 4 heads of 8 and 1 of 2 key/value heads (windowed and global layers alike), its experts' 16
    # features and its dense layer's 48 split
    assert by_name["mellum"]["heads"] == {(2, 1, 16)} and by_name["mellum"]["expert_inter"] == {8}
    assert by_name["mellum"]["dense_inter"] == {24}
    # Flint: 2 of 4 heads of 8 with their 2 sink logits (NoPE and windowed layers alike), its dense layer's 48 features
    # split, its shared expert (24) whole on each rank
    assert by_name["flint"]["heads"] == {(2, 1, 16)} and by_name["flint"]["sinks"] == {2}
    assert by_name["flint"]["dense_inter"] == {24} and by_name["flint"]["expert_inter"] == {8}
    # Kolibri-1: 2 of 4 heads of 8, its experts' 16 features split, its shared expert (24) whole on each rank
    assert by_name["kolibri1"]["heads"] == {(2, 1, 16)} and by_name["kolibri1"]["expert_inter"] == {8}
    assert by_name["kolibri1"]["dense_inter"] == {24}
    # MLA: half the heads and their kv_b_proj rows; the latent projection stays whole.
    (heads, kv_b_rows, kv_a_rows), = by_name["deepseek"]["mla_heads"]
    assert (heads, kv_b_rows, kv_a_rows) == (1, 1 * (8 + 12), 16 + 8)     # of 2 heads; nope 8 + v 12; lora 16 + rope 8


def _ep_tp_ranks(rank, world_size, paths, ids):
    from loadplan.engine.moe import RoutedExperts
    from loadplan.engine.worker import WorkerSpec, init_rank, load_runner

    from engine_helpers import LocalRegistry

    grid, out = None, []
    for name, intent in (("qwen3", None), ("deepseek", "enforce"), ("deepseek", "disable"), ("mixtral", None),
                         ("gpt_oss", None)):
        spec = WorkerSpec(model=paths[name], prompt_ids=(), max_new_tokens=0, ep_size=2, tp_size=2,
                          runtime=Runtime(**INTENTS[intent]))
        grid = grid or init_rank(spec)
        model = load_runner(spec, grid, registry=LocalRegistry())
        experts = next(m for m in model.modules() if isinstance(m, RoutedExperts))
        with torch.no_grad():
            logits = model(ids)
        d = model.plan.decisions
        out.append(dict(name=name, intent=intent, logits=logits, fused=bool(d[Keys.SHARED_EXPERTS_FUSION].value),
                        scale=d[Keys.FUSED_SHARED_EXPERT_SCALE].value, ranks=(grid.ep_rank, grid.tp_rank),
                        experts=(experts.local_start, experts.num_local_experts, experts.intermediate_size)))
    return out


def test_ep_and_tp_together_give_the_single_process_logits(paths, ids, references):
    """4 ranks, EP 2 x TP 2: each holds half the experts, each of them half its features; the experts'
    all-reduce spans the stage, the attention's its TP pair; a fused slot (on every EP rank) counts once."""
    ranks = launch(4, _ep_tp_ranks, paths, ids, timeout_s=240)
    assert sorted(case["ranks"] for r in ranks for case in r[:1]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for cases in ranks:
        for case in cases:
            where = f"{case['name']} {case['intent']} ranks {case['ranks']}"
            want, _ = references[(case["name"], case["intent"] if case["name"] == "deepseek" else None)]
            torch.testing.assert_close(case["logits"], want, atol=TOL, rtol=0, msg=where)
            if case["intent"]:
                assert case["fused"] == (case["intent"] == "enforce"), where
                assert case["scale"] == (0.5 if case["fused"] else 1.0), where
        for moe in (cases[0], cases[3], cases[4]):                     # Qwen3-MoE, Mixtral and gpt-oss
            assert moe["experts"] == (4 * moe["ranks"][0], 4, 16)      # 8 experts over EP 2; 32 features over TP 2


def test_tp_within_pipeline_stages(paths, ids, references):
    ranks = launch(4, _tp_ranks, paths, ids, 2, 2, timeout_s=240)
    want_logits, want_tokens = references[("qwen3", None)]
    for rank, (case,) in enumerate(ranks):
        assert case["tp"] == (2, rank % 2)
        torch.testing.assert_close(case["logits"], want_logits, atol=TOL, rtol=0, msg=f"rank {rank}")
        assert case["tokens"] == want_tokens


def _tp_eplb_ranks(rank, world_size, path, ids, ep_size, backend):
    """EPLB on TP ranks: every rank counts the same loads (routing is replicated), so a rebalance moves
    each rank's slices of the same experts to the same slots (between EP ranks: each TP rank's slices
    over its own EP group)."""
    from loadplan.engine.rebalance import rebalance
    from loadplan.engine.worker import WorkerSpec, init_rank, load_runner

    from engine_helpers import LocalRegistry

    spec = WorkerSpec(model=path, prompt_ids=(), max_new_tokens=0, tp_size=world_size // ep_size, ep_size=ep_size,
                      runtime=Runtime(a2a_backend=backend, enable_eplb=True, ep_num_redundant_experts=2))
    model = load_runner(spec, init_rank(spec), registry=LocalRegistry())
    with torch.no_grad():
        before = model(ids)
        model(torch.full((1, 12), 5))             # one token repeated: a skewed load to even out
    report = rebalance(model)
    with torch.no_grad():
        after = model(ids)
    placements = [m.placement.phy2log.tolist() for m in model.modules() if getattr(m, "placement", None) is not None]
    return dict(before=before, after=after, moved=list(report.layer_ids), placements=placements,
                physical=model.plan.decisions[Keys.EPLB_NUM_PHYSICAL_EXPERTS].value)


@pytest.mark.parametrize("name, ep_size, world, backend", [("qwen3", 1, 2, "none"), ("qwen3", 2, 4, "none"),
                                                           ("qwen3", 2, 4, "deepep"), ("gpt_oss", 2, 4, "none")])
def test_a_rebalance_on_tp_ranks_moves_the_same_experts_and_keeps_the_logits(paths, ids, references, name, ep_size,
                                                                             world, backend):
    """deepep: whole experts on each TP rank (the a2a path), moved over its EP group and dispatched to. gpt-oss:
    its experts' biases move with their weights."""
    ranks = launch(world, _tp_eplb_ranks, paths[name], ids, ep_size, backend, timeout_s=240)
    want, _ = references[(name, None)]
    initial = [p % 8 for p in range(10)]                          # slot p holds expert p % n_routed
    moe_layers = [1, 2] if name == "qwen3" else [0, 1, 2]         # Qwen3's layer 0 is dense
    for r in ranks:
        assert r["physical"] == 10 and r["moved"] == moe_layers
        assert r["placements"] == ranks[0]["placements"] != [[initial]] * len(moe_layers), r["placements"]
        torch.testing.assert_close(r["before"], want, atol=TOL, rtol=0)
        torch.testing.assert_close(r["after"], want, atol=TOL, rtol=0)


# --- refusals (one process: they come before any collective) ----------------------------------


def _load(path, **kw):
    from loadplan.engine.loader import load_model

    registry = LocalRegistry()
    return registry, lambda: load_model(path, registry=registry, **load_kwargs(**kw))


def test_a_family_whose_layers_do_not_split_is_refused_before_any_plan(paths, monkeypatch):
    from loadplan.engine.models.qwen_moe import Qwen3MoeForCausalLM

    monkeypatch.setattr(Qwen3MoeForCausalLM, "TENSOR_PARALLEL", False)   # as a family added without TP would be
    registry, load = _load(paths["qwen3"], tp_size=2, tp_rank=1)
    refusal = (r"tensor parallelism \(tp_size=2\) is not implemented by the engine for Qwen3MoeForCausalLM; "
               r"it is for: AXK1ForCausalLM, AfmoeForCausalLM, BailingHybridForCausalLM, Cohere2MoeForCausalLM, ")
    with pytest.raises(NotImplementedError, match=refusal) as err:
        load()
    assert "Qwen3MoeForCausalLM" not in str(err.value).split("it is for:")[1]
    assert registry.requests == []


def test_the_nextn_draft_on_tp_ranks_drafts_as_on_one_process(tmp_path, registry_address):
    """DeepSeek-V3 with its own MTP draft: the same tokens and the same accepted/proposed counts."""
    from loadplan.engine.make_checkpoints import make_checkpoints
    from loadplan.engine.worker import WorkerSpec, generate_distributed

    paths = make_checkpoints(tmp_path / "ck")
    runs = {}
    for tp in (1, 2):
        spec = WorkerSpec(model=str(paths["target"]), draft=str(paths["nextn"]), num_draft_tokens=2,
                          prompt_ids=(5, 17, 42), max_new_tokens=12, tp_size=tp,
                          registry=registry_address)
        runs[tp] = generate_distributed(spec, nproc=tp, timeout_s=240)
    assert runs[2]["tokens"] == runs[1]["tokens"]
    assert (runs[2]["accepted"], runs[2]["proposed"]) == (runs[1]["accepted"], runs[1]["proposed"])
    assert runs[2]["accepted"] > 0


A2A_BACKENDS = [name for name, row in BACKENDS.items() if row.forward_path == "a2a"]


def _a2a_tp_ranks(rank, world_size, paths, ids, ep_size):
    """Every a2a backend on TP ranks: the experts whole on each (EP share only), tokens exchanged over
    the EP group of the rank's own TP rank; then the seed's double reduction forced on one of them."""
    from loadplan.engine.moe import RoutedExperts
    from loadplan.engine.worker import WorkerSpec, init_rank, load_runner

    from engine_helpers import LocalRegistry

    grid, out = None, []
    for backend in A2A_BACKENDS:
        for name, intent in (("qwen3", None), ("deepseek", "enforce")):
            spec = WorkerSpec(model=paths[name], prompt_ids=(), max_new_tokens=0, ep_size=ep_size,
                              tp_size=world_size // ep_size, runtime=Runtime(a2a_backend=backend, **INTENTS[intent]))
            grid = grid or init_rank(spec)
            model = load_runner(spec, grid, registry=LocalRegistry())
            experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
            d = model.plan.decisions
            with torch.no_grad():
                logits = model(ids)
            case = dict(backend=backend, name=name, intent=intent, logits=logits, ranks=(grid.ep_rank, grid.tp_rank),
                        path=d[Keys.FORWARD_PATH].value, all_reduce=d[Keys.POST_EXPERTS_ALL_REDUCE].value,
                        fused=bool(d[Keys.SHARED_EXPERTS_FUSION].value),
                        experts={(m.local_start, m.num_local_experts, m.intermediate_size, m.dispatch_tokens)
                                 for m in experts})
            if backend == A2A_BACKENDS[0] and name == "qwen3":
                for m in experts:           # the seed bug: an all-reduce after a combine that already summed
                    m.post_experts_all_reduce = True
                with torch.no_grad():
                    case["double_reduced"] = model(ids)
            out.append(case)
    return out


@pytest.mark.parametrize("ep_size, world", [(1, 2), (2, 4)])
def test_every_a2a_backend_on_tp_ranks_gives_the_single_process_logits(paths, ids, references, ep_size, world):
    """The a2a plan has no all-reduce after the experts (the combine sums); the engine keeps the experts
    whole on TP ranks, so nothing is left partial: TP 2, and EP 2 x TP 2, match one process."""
    ranks = launch(world, _a2a_tp_ranks, paths, ids, ep_size, timeout_s=300)
    assert len(A2A_BACKENDS) >= 7
    for cases in ranks:
        assert [(c["backend"], c["name"]) for c in cases] == [(b, n) for b in A2A_BACKENDS
                                                              for n in ("qwen3", "deepseek")]
        for case in cases:
            where = f"{case['backend']} {case['name']} ranks {case['ranks']}"
            assert (case["path"], case["all_reduce"]) == ("a2a", False), where
            want, _ = references[(case["name"], case["intent"])]
            torch.testing.assert_close(case["logits"], want, atol=TOL, rtol=0, msg=where)
            ep_rank = case["ranks"][0]
            n_local = (8 if case["name"] == "qwen3" else 256) // ep_size
            inter = 32 if case["name"] == "qwen3" else 16               # whole: not split over the TP pair
            assert {e[:3] for e in case["experts"]} == {(ep_rank * n_local, n_local, inter)}, where
            assert {e[3] for e in case["experts"]} == {ep_size > 1}, where  # tokens move only between EP ranks
        double = cases[0]
        assert double["backend"] == A2A_BACKENDS[0] and "double_reduced" in double
        gap = (double["double_reduced"] - references[("qwen3", None)][0]).abs().max().item()
        assert gap > 100 * TOL, f"a forced all-reduce after the combine went unseen ({gap:.2e})"
    deepseek = [c for c in ranks[0] if c["name"] == "deepseek"]
    assert {c["backend"] for c in deepseek if c["fused"]} == {
        b for b in A2A_BACKENDS if not BACKENDS[b].fusion_force_disabled
        and (BACKENDS[b].per_rank_fused_slots or ep_size == 1)}


def test_heads_that_do_not_divide_are_named(tmp_path):
    path = make_checkpoint(tmp_path, QWEN3, num_key_value_heads=1)
    _, load = _load(str(path), tp_size=2)
    with pytest.raises(ValueError, match="num_key_value_heads=1 does not divide over tp_size=2"):
        load()


@pytest.mark.parametrize("config, message", [
    (dict(mamba_num_heads=6, n_groups=3), "n_groups=3 does not divide over tp_size=2"),
    (dict(mamba_num_heads=3, n_groups=1), "mamba_num_heads=3 does not divide over tp_size=2"),
])
def test_mamba2_heads_and_groups_that_do_not_divide_are_named_as_the_config_does(tmp_path, config, message):
    """Nemotron-H's names for them (Granite 4.0-H's are mamba_n_heads and mamba_n_groups); one group is read by
    every rank, so only a count of groups other than 1 must divide."""
    _, load = _load(str(make_nemotron_h_checkpoint(tmp_path / "nh", **config)), tp_size=2)
    with pytest.raises(ValueError, match=message):
        load()
