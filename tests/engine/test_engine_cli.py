"""`loadplan generate`, in-process through the console script's main(), with an embedded registry on --db."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from loadplan.cli.main import main

from engine_helpers import hf_reference, make_checkpoint

pytestmark = pytest.mark.heavy(20)

ARCH = "Qwen3MoeForCausalLM"
PROMPT = [5, 17, 99, 3]
N = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), ARCH, num_hidden_layers=2)


@pytest.fixture(scope="module")
def want(ckpt):
    with torch.no_grad():
        out = hf_reference(ckpt, ARCH).generate(torch.tensor([PROMPT]), max_new_tokens=N, min_new_tokens=N,
                                                do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture
def db(tmp_path):
    return f"sqlite:///{tmp_path / 'plans.db'}"


def generate(capsys, *args):
    rc = main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_tokens_equal_transformers_and_the_plan_is_recorded(ckpt, want, db, capsys):
    rc, out, err = generate(capsys, "--model", ckpt, "--prompt-ids", ",".join(map(str, PROMPT)),
                            "--max-new-tokens", N, "--db", db, "--json")
    assert rc == 0, err
    doc = json.loads(out)                       # stdout is exactly one JSON document
    assert doc["tokens"] == want
    assert "draft_plan_id" not in doc and "acceptance_rate" not in doc
    assert main(["plans", "show", doc["plan_id"], "--db", db, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["plan_id"] == doc["plan_id"] and shown["role"] == "target"
    assert shown["runtime"]["a2a_backend"] == "none"


def test_runtime_flags_reach_the_plan(ckpt, db, capsys):
    rc, out, err = generate(capsys, "--model", ckpt, "--prompt-ids", "1,2", "--max-new-tokens", 2, "--db", db,
                            "--json", "--a2a-backend", "deepep", "--deployment", "dep-flags")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["deployment_id"] == "dep-flags"
    assert main(["plans", "show", doc["plan_id"], "--db", db, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["runtime"]["a2a_backend"] == "deepep" and shown["deployment_id"] == "dep-flags"


def test_a_running_registry_by_address(ckpt, want, tmp_path, capsys):
    from loadplan.service.embedded import EmbeddedRegistry

    with EmbeddedRegistry(f"sqlite:///{tmp_path / 'remote.db'}") as reg, reg.client() as client:
        rc, out, err = generate(capsys, "--model", ckpt, "--prompt-ids", ",".join(map(str, PROMPT)),
                                "--max-new-tokens", 3, "--registry", reg.address, "--json")
        assert rc == 0, err
        doc = json.loads(out)
        assert doc["tokens"] == want[:3]
        assert client.get_plan(doc["plan_id"]).request.deployment_id == doc["deployment_id"]


def test_with_a_draft_the_tokens_stay_the_targets(ckpt, want, db, capsys):
    # the target's own checkpoint as its draft: every proposal is accepted
    rc, out, err = generate(capsys, "--model", ckpt, "--prompt-ids", ",".join(map(str, PROMPT)),
                            "--max-new-tokens", N, "--db", db, "--draft", ckpt, "--num-draft-tokens", 3, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["tokens"] == want
    assert doc["acceptance_rate"] == 1.0
    assert doc["draft_plan_id"] != doc["plan_id"]
    assert main(["plans", "list", "--deployment", doc["deployment_id"], "--db", db, "--json"]) == 0
    roles = {p["plan_id"]: p["role"] for p in json.loads(capsys.readouterr().out)}
    assert roles == {doc["plan_id"]: "target", doc["draft_plan_id"]: "speculative"}


def test_readable_output_with_a_disagreeing_draft(ckpt, want, db, tmp_path, capsys):
    draft = make_checkpoint(tmp_path / "draft", "Qwen2MoeForCausalLM", num_hidden_layers=1, seed=5)
    rc, out, err = generate(capsys, "--model", ckpt, "--prompt-ids", " ".join(map(str, PROMPT)),
                            "--max-new-tokens", N, "--db", db, "--draft", draft)
    assert rc == 0, err
    (line,) = out.splitlines()
    assert line.startswith("tokens: " + " ".join(map(str, want)) + "  (plan ")
    assert "draft plan" in line and "acceptance" in line


def test_stops_at_the_checkpoints_eos(ckpt, want, db, tmp_path, capsys):
    import shutil

    path = tmp_path / "eos"
    shutil.copytree(ckpt, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = want[3]
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").unlink(missing_ok=True)
    stop = want[:want.index(want[3]) + 1]
    for extra in ([], ["--draft", path]):
        rc, out, err = generate(capsys, "--model", path, "--prompt-ids", ",".join(map(str, PROMPT)),
                                "--max-new-tokens", N, "--db", db, "--json", *extra)
        assert rc == 0, err
        assert json.loads(out)["tokens"] == stop


@pytest.mark.parametrize("args, status", [
    (["--model", "{missing}", "--prompt-ids", "1,2"], "INVALID_ARGUMENT"),
    (["--model", "{ckpt}", "--prompt-ids", "1,two"], "INVALID_ARGUMENT"),
    (["--model", "{ckpt}", "--prompt-ids", ""], "INVALID_ARGUMENT"),
    (["--model", "{ckpt}", "--prompt-ids", "1,-2"], "INVALID_ARGUMENT"),
    (["--model", "{ckpt}", "--prompt-ids", "1,128"], "INVALID_ARGUMENT"),          # vocab_size is 128
    (["--model", "{ckpt}", "--prompt-ids", "1", "--max-new-tokens", "-1"], "INVALID_ARGUMENT"),
    (["--model", "{ckpt}", "--prompt-ids", "1", "--a2a-backend", "bogus"], "NOT_FOUND"),
    (["--model", "{ckpt}", "--prompt-ids", "1", "--ep-size", "2"], "INVALID_ARGUMENT"),   # needs --nproc 2
    (["--model", "{ckpt}", "--prompt-ids", "1", "--tp-size", "2"], "INVALID_ARGUMENT"),   # needs --nproc 2
    (["--model", "{ckpt}", "--prompt-ids", "1", "--draft", "{ckpt}", "--num-draft-tokens", "0"], "INVALID_ARGUMENT"),
    (["--model", "{ckpt}", "--prompt-ids", "1", "--draft", "{small_vocab}"], "INVALID_ARGUMENT"),
    (["--model", "{ckpt}", "--prompt-ids", "1", "--draft", "{missing}"], "INVALID_ARGUMENT"),
    (["--model", "{no_weights}", "--prompt-ids", "1"], "INVALID_ARGUMENT"),
    (["--model", "{ckpt}", "--prompt-ids", "1", "--device", "tpu"], "INVALID_ARGUMENT"),
    (["--model", "{ckpt}", "--prompt-ids", "1", "--tp-rank", "1"], "INVALID_ARGUMENT"),
])
def test_errors_are_one_line_without_traceback(args, status, ckpt, db, tmp_path, capsys):
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((ckpt / "config.json").read_text())
    small_vocab = tmp_path / "small_vocab"
    small_vocab.mkdir()
    cfg = json.loads((ckpt / "config.json").read_text())
    (small_vocab / "config.json").write_text(json.dumps(dict(cfg, vocab_size=64)))
    paths = dict(ckpt=ckpt, missing=tmp_path / "missing", no_weights=no_weights, small_vocab=small_vocab)
    rc, out, err = generate(capsys, *[a.format(**paths) for a in args], "--db", db, "--json")
    assert rc == 2
    assert out == ""
    assert err.startswith(f"error: {status}: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize("axis, backend", [("ep", "none"), ("tp", "none"), ("tp", "deepep")])
def test_two_ranks_with_a_draft(axis, backend, ckpt, want, db, capsys):
    """--nproc 2 with --ep-size 2 or --tp-size 2 (with an a2a backend too): each rank resolves its own target
    and draft plans under one deployment, and the tokens are transformers' greedy ones."""
    rc, out, err = generate(capsys, "--model", ckpt, "--prompt-ids", ",".join(map(str, PROMPT)),
                            "--max-new-tokens", N, "--db", db, "--nproc", 2, f"--{axis}-size", 2, "--draft", ckpt,
                            "--num-draft-tokens", 3, "--a2a-backend", backend, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["tokens"] == want and doc["acceptance_rate"] == 1.0
    assert doc["accepted"] == doc["proposed"] > 0          # the draft is the target: every proposal accepted
    assert len(set(doc["plan_ids"])) == 2 and len(set(doc["draft_plan_ids"])) == 2
    assert doc["plan_id"] == doc["plan_ids"][0] and doc["draft_plan_id"] == doc["draft_plan_ids"][0]
    assert main(["plans", "list", "--deployment", doc["deployment_id"], "--db", db, "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert sorted((p["role"], p["parallel"][f"{axis}_size"], p["parallel"][f"{axis}_rank"]) for p in plans) == [
        ("speculative", 2, 0), ("speculative", 2, 1), ("target", 2, 0), ("target", 2, 1)]


def test_a_failing_rank_is_one_line_with_its_status(ckpt, db, capsys):
    rc, out, err = generate(capsys, "--model", ckpt, "--prompt-ids", "1,2", "--db", db, "--nproc", 2,
                            "--ep-size", 2, "--a2a-backend", "bogus", "--json")
    assert rc == 2 and out == ""
    assert err.startswith("error: NOT_FOUND: rank 0 of 2 failed: a2a backend 'bogus'") and err.count("\n") == 1


def test_without_the_worker_module_nproc_is_a_clear_error(ckpt, db, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "loadplan.engine.worker", None)     # import fails as if absent
    rc, out, err = generate(capsys, "--model", ckpt, "--prompt-ids", "1,2", "--max-new-tokens", 2, "--db", db,
                            "--nproc", 2, "--ep-size", 2, "--json")
    assert rc == 1 and out == ""
    assert err.startswith("error: FAILED_PRECONDITION: --nproc 2: multi-rank generation is not available")


TRACEBACK = """Traceback (most recent call last):
  File "x.py", line 1, in <module>
    raise X
{last}
"""


@pytest.mark.parametrize("text, status, message", [
    (TRACEBACK.format(last="loadplan.client.errors.NotFoundError: NOT_FOUND: a2a backend 'x' is not supported"),
     "NOT_FOUND", "a2a backend 'x' is not supported"),
    (TRACEBACK.format(last="loadplan.engine.weights.MissingTensor: 2 tensor(s) missing"), "INVALID_ARGUMENT",
     "MissingTensor: 2 tensor(s) missing"),
    (TRACEBACK.format(last="NotImplementedError: tensor parallelism"), "UNIMPLEMENTED", "tensor parallelism"),
    (TRACEBACK.format(last="RuntimeError: boom"), "INTERNAL", "RuntimeError: boom"),
    ("no result within timeout_s=5s (ranks without a result: [1])\nstack...", "DEADLINE_EXCEEDED",
     "no result within timeout_s=5s (ranks without a result: [1])"),
    ("exited with code -9 without reporting", "INTERNAL", "exited with code -9 without reporting"),
])
def test_rank_errors_map_to_statuses(text, status, message):
    from loadplan.cli.generate import rank_error

    assert rank_error(text) == (status, message)


def test_dtype_builds_the_runner_in_it(ckpt, db, capsys):
    """--dtype bfloat16: the tokens of the engine's bfloat16 model (not the float32 ones, where they differ)."""
    from loadplan.engine.generate import generate as engine_generate

    from engine_helpers import load_local

    model, fp32 = load_local(ckpt, dtype=torch.bfloat16), load_local(ckpt)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(0)
    for _ in range(20):                       # a prompt whose bfloat16 tokens part from the float32 ones
        prompt = torch.randint(0, 128, (6,), generator=g).tolist()
        want = engine_generate(model, prompt, 16)[0].tolist()
        if want != engine_generate(fp32, prompt, 16)[0].tolist():
            break
    else:
        pytest.fail("no prompt of 20 tells bfloat16 from float32 here")
    rc, out, err = generate(capsys, "--model", ckpt, "--prompt-ids", ",".join(map(str, prompt)),
                            "--max-new-tokens", 16, "--db", db, "--dtype", "bfloat16", "--json")
    assert rc == 0, err
    assert json.loads(out)["tokens"] == want


def test_dtype_reaches_every_rank(ckpt, db, capsys):
    """Two ranks in bfloat16 sum partial expert outputs in bfloat16, so their tokens are those of the same ranks
    launched with WorkerSpec(dtype="bfloat16"), not necessarily one process's."""
    from loadplan.engine.worker import WorkerSpec, generate_distributed
    from loadplan.service.embedded import EmbeddedRegistry

    prompt = [58, 65, 102, 39, 87, 46]
    rc, out, err = generate(capsys, "--model", ckpt, "--prompt-ids", ",".join(map(str, prompt)),
                            "--max-new-tokens", 16, "--db", db, "--dtype", "bfloat16", "--json", "--nproc", 2,
                            "--ep-size", 2)
    assert rc == 0, err
    with EmbeddedRegistry(db) as reg:
        spec = WorkerSpec(model=str(ckpt), prompt_ids=prompt, max_new_tokens=16, ep_size=2, registry=reg.address,
                          dtype="bfloat16")
        assert json.loads(out)["tokens"] == generate_distributed(spec, 2)["tokens"]


def test_an_unknown_dtype_is_refused_by_the_parser(ckpt, db, capsys):
    rc, out, err = generate(capsys, "--model", ckpt, "--prompt-ids", "1", "--db", db, "--dtype", "float64")
    assert rc == 2 and out == ""
    assert err.startswith("error: INVALID_ARGUMENT: loadplan generate: argument --dtype: invalid choice: 'float64'")

