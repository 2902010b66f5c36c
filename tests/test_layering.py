"""Boundaries the design depends on, checked on the source itself.

- The rules import neither grpc nor sqlalchemy (they are pure functions).
- The client installs with grpcio and protobuf alone: importing it pulls in no
  sqlalchemy, torch or service code.
- Model code never names an a2a backend: it reads the plan (the mori
  double-reduction bug came from a model file checking backend names).
- Every package folder is listed in pyproject.toml, so a wheel install has it.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_rules_are_pure():
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imports(p) & {"grpc", "sqlalchemy", "alembic", "torch", "psycopg"})
        for p in (ROOT / "service" / "rules").rglob("*.py")
    }
    offenders.update({"service/registry.py": sorted(_imports(ROOT / "service" / "registry.py")
                                                    & {"grpc", "sqlalchemy", "torch"})})
    assert {k: v for k, v in offenders.items() if v} == {}


def test_client_imports_only_grpc_and_protobuf():
    code = (
        "import sys, loadplan.client\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'sqlalchemy','torch','alembic','psycopg'}"
        " or m.startswith('loadplan.service') or m.startswith('loadplan.engine'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_model_code_names_no_backend():
    from loadplan.service.rules.backends import BACKENDS

    names = set(BACKENDS) - {"none"}
    found = []
    for p in (ROOT / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in names:
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
            if isinstance(node, (ast.Name, ast.Attribute)):
                ident = node.id if isinstance(node, ast.Name) else node.attr
                if any(f"is_{n}" == ident.lower() for n in names):
                    found.append(f"{p.relative_to(ROOT)}:{node.lineno}: {ident}")
    assert found == []


def test_every_package_is_listed_in_pyproject():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    mapping = conf["package-dir"]
    found = set()
    for pkg, folder in mapping.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - found == set(), "listed but missing on disk"
