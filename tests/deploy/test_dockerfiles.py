"""The Dockerfiles build what the compose file runs, checked without a Docker engine.

The build is replayed on this machine: the files each Dockerfile COPYs (filtered by
.dockerignore) go into a scratch context, the protobuf code is generated there with
scripts/gen_proto.py, and a wheel is built from it offline; the wheel must hold every
package, the generated code included. A COPY that misses a package folder, or a build
that relied on a gen/ folder of the developer's, fails here.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile.registry", "Dockerfile.worker", "Dockerfile.vllm"]


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    text = (ROOT / dockerfile).read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _copies(dockerfile: str) -> list[tuple[str, str]]:
    return [tuple(rest.split()[:2]) for word, rest in _instructions(dockerfile) if word == "COPY"]


def _ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    for pat in patterns:
        pat = pat.rstrip("/")
        if fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel, pat.replace("**/", "")) or \
                any(fnmatch.fnmatch(p, pat.replace("**/", "")) for p in parts):
            return True
    return False


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_dockerignore_keeps_generated_code_and_local_state_out():
    patterns = _dockerignore()
    for path in ("gen", ".venv", "loadplan.db", "demo-out", ".git", "engine/__pycache__"):
        assert _ignored(path, patterns), f".dockerignore lets {path} into the build context"


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_image_generates_the_protobuf_code_and_never_copies_it(dockerfile):
    sources = [src for src, _ in _copies(dockerfile)]
    assert not any(src.rstrip("/") in ("gen", ".") or src.startswith("gen/") for src in sources), sources
    runs = " ".join(rest for word, rest in _instructions(dockerfile) if word == "RUN")
    assert "scripts/gen_proto.py" in runs
    assert runs.index("scripts/gen_proto.py") < runs.index("pip install --no-cache-dir '.[")


def test_the_worker_image_pins_the_projects_torch_from_the_cpu_index():
    text = (ROOT / "Dockerfile.worker").read_text()
    makefile = (ROOT / "Makefile").read_text()
    pinned = re.search(r"torch==([\d.]+)", makefile).group(1)
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(pinned)}$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_a_build_from_the_copied_context_has_every_package(dockerfile, tmp_path):
    patterns = _dockerignore()
    ctx = tmp_path / "src"
    ctx.mkdir()
    for src, dest in _copies(dockerfile):
        source = ROOT / src
        assert source.exists(), f"{dockerfile} copies {src}, which does not exist"
        target = ctx / (src if dest.endswith("/") or dest in ("./", ".") else dest.removeprefix("./"))
        if source.is_dir():
            shutil.copytree(source, target, ignore=lambda d, names: [
                n for n in names if _ignored(str((Path(d) / n).relative_to(ROOT)), patterns)])
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    assert not (ctx / "gen").exists()
    subprocess.run([sys.executable, "scripts/gen_proto.py"], cwd=ctx, check=True, capture_output=True)
    dist = tmp_path / "dist"
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-q", "-w", str(dist), str(ctx)], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    wheel = next(dist.glob("loadplan-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    for pkg in packages:
        assert f"{pkg.replace('.', '/')}/__init__.py" in names, f"{dockerfile}: the wheel lacks package {pkg}"
    assert "loadplan/v1/registry_pb2.py" in names and "loadplan/v1/registry_pb2_grpc.py" in names
    assert "loadplan/migrations/alembic.ini" in names
