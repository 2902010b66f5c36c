"""Every command the README shows works as written.

- Concrete commands in ```sh blocks (`.venv/bin/loadplan ...`, `.venv/bin/python ...`)
  run for real, in README order, through the shell, in a scratch directory that has
  `.venv`, `tests/` and `bench/` as the repository root has them. The ones that talk
  to the compose stack's registry on the host (127.0.0.1:50051) get a registry of
  this test on a free port instead.
- Reference lines (with [options] or METAVARS) and `loadplan ...` code spans in the
  prose: `--help` works and names every flag the line uses.
- `make` targets exist; `docker compose` lines name services the compose file has;
  the compose variables and services tables match docker-compose.yml.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy_helpers import clean_env

pytestmark = [pytest.mark.heavy(55), pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
VENV = Path(sys.executable).parent.parent
HOST_REGISTRY = "127.0.0.1:50051"        # the compose stack's first replica, as the README says


def sh_lines() -> list[str]:
    lines = []
    for block in re.findall(r"^```sh\n(.*?)^```", README, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def prose_commands() -> list[str]:
    """`loadplan ...` code spans outside the fenced blocks."""
    prose = re.sub(r"^```.*?^```", "", README, flags=re.M | re.S)
    return [c for c in re.findall(r"`([^`\n]+)`", prose) if c.startswith(("loadplan ", "python -m loadplan"))]


def is_reference(line: str) -> bool:
    """A synopsis rather than a command: optional parts or METAVARS (DIR, URL, HOST:PORT, PLAN_ID...)."""
    words = shlex.split(line)
    return "[" in line or "..." in line or any(re.fullmatch(r"[A-Z][A-Z_]*(:[A-Z]+)?", w) for w in words[1:])


def help_argv(line: str) -> list[str]:
    """The --help invocation of the (sub)command a line uses."""
    words = shlex.split(line.replace("[", " ").replace("]", " ").replace("|", " "))
    prog = words[0].rsplit("/", 1)[-1]
    if prog == "loadplan":
        sub = words[1:3] if words[1] == "plans" else words[1:2]
        return [str(VENV / "bin" / "loadplan"), *sub, "--help"]
    if prog.startswith("python"):
        if words[1] == "-m":
            return [sys.executable, "-m", words[2], "--help"]
        return [sys.executable, str(ROOT / words[1]), "--help"]
    raise AssertionError(f"no --help for {line!r}")


@functools.lru_cache(maxsize=None)
def _help(argv: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, env=_env())


def check_help(line: str) -> None:
    argv = help_argv(line)
    res = _help(tuple(argv))
    assert res.returncode == 0, f"{' '.join(argv)}: {res.stderr}"
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line)) - {"--help"}
    missing = [f for f in sorted(flags) if f not in res.stdout]
    assert not missing, f"README line {line!r} uses {missing}, which `{' '.join(argv[-3:])}` does not know"


def _env() -> dict[str, str]:
    return clean_env()


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


# --- the tests ------------------------------------------------------------------------------

REFERENCES = [line for line in sh_lines() if line.startswith(("loadplan ", "python ", ".venv/")) and
              is_reference(line)] + prose_commands()


@pytest.mark.parametrize("line", REFERENCES)
def test_reference_lines_name_real_flags(line):
    check_help(line)


def test_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    for line in sh_lines():
        if line.startswith("make "):
            target = line.split()[1]
            assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"Makefile has no target {target}"


def test_docker_compose_lines_name_real_services():
    services = set(_compose()["services"])
    compose_lines = [c for c in sh_lines() + re.findall(r"`(docker compose [^`]+)`", README)
                     if c.startswith("docker compose")]
    assert compose_lines
    for line in compose_lines:
        words = line.split()
        if words[2] in ("logs", "exec", "run", "restart", "stop", "start"):
            named = next(w for w in words[3:] if not w.startswith("-"))
            assert named in services, f"{line!r}: no service {named!r} in docker-compose.yml"


def test_compose_tables_match_the_file():
    text = (ROOT / "docker-compose.yml").read_text()
    variables = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", text))
    section = README[README.index("## Deploying with docker compose"):README.index("## Operations")]
    documented = set(re.findall(r"`((?:LOADPLAN|POSTGRES)_[A-Z0-9_]+)`", section))
    assert variables - documented == set(), f"compose variables the README does not document: {variables - documented}"
    assert documented - variables == set(), f"README documents variables compose does not use: {documented - variables}"
    for name in _compose()["services"]:
        assert f"| `{name}` |" in section, f"service {name} is missing from the README's table"


@pytest.fixture(scope="module")
def sandbox(repo_like, demo_run):
    """The repository root after `make demo`, as the README's commands expect it."""
    return repo_like


@pytest.fixture(scope="module")
def host_registry(tmp_path_factory):
    from loadplan.service.embedded import EmbeddedRegistry

    db = tmp_path_factory.mktemp("host-registry") / "registry.db"
    with EmbeddedRegistry(f"sqlite:///{db}") as reg:
        yield reg.address


def test_concrete_commands_run_as_written(sandbox, host_registry):
    concrete = [line for line in sh_lines() if line.startswith(".venv/") and not is_reference(line)]
    assert any("--nproc 2" in c for c in concrete), "the README must show a multi-rank run"
    for line in concrete:
        cmd = line.replace(HOST_REGISTRY, host_registry)
        res = subprocess.run(["bash", "-c", cmd], cwd=sandbox, capture_output=True, text=True, timeout=200,
                             env=_env())
        assert res.returncode == 0, f"README command failed ({res.returncode}): {line}\n{res.stderr[-2000:]}"
        assert res.stdout.strip(), f"README command printed nothing: {line}"
