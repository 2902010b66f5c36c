"""ListBackends answers each engine's own table: for every profiled release, the names are exactly the members of
the engine's own backend enum, in its order (SGLang: layers/moe/utils.py MoeA2ABackend; vLLM: config/parallel.py
All2AllBackend), read from that release's installed source; loadplan's is this project's table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from loadplan.service.rules import vllm as vllm_rules
from loadplan.service.rules.backends import BACKENDS
from loadplan.service.rules.capabilities import backends_of
from loadplan.service.rules.sglang_releases import RELEASES as SGLANG_RELEASES

from .test_sglang_conformance import environment

ROOT = Path(__file__).resolve().parents[2]


def _site(env: Path, package: str) -> Path:
    found = sorted(env.glob(f"lib/python3*/site-packages/{package}"))
    assert found, f"no {package} in {env}: `make sglang-env vllm-env` builds it (`make test` does)"
    return found[0]


def _vllm_env(release: str) -> Path:
    # tests/integrations/vllm/vllm_env.py's environment(), which this folder cannot import
    return ROOT / (".venv-vllm" if release == vllm_rules.NEWEST else f".venv-vllm-{release}")


def sglang_enum(release: str) -> list[str]:
    tree = ast.parse((_site(environment(release), "sglang") / "srt" / "layers" / "moe" / "utils.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MoeA2ABackend"]
    return [n.value.value for n in cls.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)]


def vllm_literal(release: str) -> list[str]:
    tree = ast.parse((_site(_vllm_env(release), "vllm") / "config" / "parallel.py").read_text())
    [node] = [n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "All2AllBackend"]
    return [e.value for e in node.value.slice.elts]


@pytest.mark.parametrize("release", sorted(SGLANG_RELEASES))
def test_sglang_lists_exactly_its_moe_a2a_backends(release):
    engine, version, rows = backends_of("sglang", release)
    assert (engine, version) == ("sglang", release)
    assert [r.name for r in rows] == sglang_enum(release)
    assert [r.name for r in rows if not r.accepted] == ["customized"]
    # the accepted ones are what the profile plans on (a request naming another is NOT_FOUND)
    assert [r.name for r in rows if r.accepted] == list(SGLANG_RELEASES[release].a2a_backends)


@pytest.mark.parametrize("release", sorted(vllm_rules.RELEASES))
def test_vllm_lists_exactly_its_all2all_backends(release):
    engine, version, rows = backends_of("vllm", release)
    assert (engine, version) == ("vllm", release)
    assert [r.name for r in rows] == vllm_literal(release)
    assert {r.name for r in rows if r.accepted} == set(vllm_rules.RELEASES[release])
    by_name = {r.name: r for r in rows}
    for name in vllm_rules.RELEASES[release]:
        assert by_name[name].combine_reduces == vllm_rules.ALL2ALL[name].output_is_reduced


def test_loadplan_lists_its_own_table():
    engine, _, rows = backends_of()
    assert engine == "loadplan" and [r.name for r in rows] == list(BACKENDS)
    assert all(r.accepted for r in rows)
    assert [(r.forward_path, r.combine_reduces) for r in rows] == \
        [(b.forward_path, b.combine_reduces) for b in BACKENDS.values()]
