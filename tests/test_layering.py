"""Boundaries the design depends on, checked on the source itself.

- The rules import neither grpc nor sqlalchemy (they are pure functions).
- The client installs with grpcio and protobuf alone: importing it pulls in no
  sqlalchemy, torch or service code.
- Model code never names an a2a backend: it reads the plan (the mori
  double-reduction bug came from a model file checking backend names).
- Every package folder is listed in pyproject.toml, so a wheel install has it.
- One shared vocabulary below both sides (`loadplan/`'s plan, entry-class table, layout readers, config view,
  errors: standard library only); the engine imports nothing of the service nor of the CLI above both (what runs
  a registry beside a worker lives there), and the service nothing of the engine.
- No two modules import each other, directly or around a circle.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


# The import names of the folders (pyproject.toml's package-dir): `engine/` is `loadplan.engine`, ...
PACKAGE_DIRS = {folder: name for name, folder in
                tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items()}
SHARED_VOCABULARY = ("plan", "entry_classes", "layouts", "config_view", "errors")


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    folder = next(f for f in sorted(PACKAGE_DIRS, key=len, reverse=True) if rel.as_posix().startswith(f + "/"))
    parts = [*PACKAGE_DIRS[folder].split("."), *rel.relative_to(folder).parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: pathlib.Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function, by its absolute name (`from . import x`:
    the package's module x where there is one)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            # `from X import y`: X's module y where there is one, else X itself
            found.update(f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names)
    return found


def _is_module(name: str) -> bool:
    folder = next((f for f, n in sorted(PACKAGE_DIRS.items(), key=lambda fn: -len(fn[1]))
                   if name == n or name.startswith(n + ".")), None)
    if folder is None:
        return False
    rest = name[len(PACKAGE_DIRS[folder]):].lstrip(".").replace(".", "/")
    path = ROOT / folder / rest if rest else ROOT / folder
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _sources(*folders: str) -> list[pathlib.Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]


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


def test_the_engine_imports_nothing_of_the_service_nor_of_the_cli():
    found = sorted(f"{p.relative_to(ROOT)}: {m}" for p in _sources("engine") for m in _imported(p)
                   if _within(m, "loadplan.service", "loadplan.cli"))
    assert found == []


def test_the_service_imports_nothing_of_the_engine_nor_of_the_cli():
    found = sorted(f"{p.relative_to(ROOT)}: {m}" for p in _sources("service") for m in _imported(p)
                   if _within(m, "loadplan.engine", "loadplan.cli"))
    assert found == []


def test_the_shared_vocabulary_needs_the_standard_library_alone():
    shared = {f"loadplan.{name}" for name in SHARED_VOCABULARY}
    found = []
    for name in SHARED_VOCABULARY:
        path = ROOT / "loadplan" / f"{name}.py"
        for m in _imported(path):
            top = m.split(".")[0]
            if top != "loadplan" and top not in sys.stdlib_module_names and top != "__future__":
                found.append(f"{name}.py: {m}")
            if top == "loadplan" and not _within(m, *shared):
                found.append(f"{name}.py: {m}")
    assert found == []


def test_no_import_circles():
    """Modules that import each other (a circle, however long) cannot be read, tested or moved one at a time."""
    sources = _sources("engine", "service", "client", "loadplan")
    names = {_module_name(p): p for p in sources}
    graph = {m: {i for i in _imported(p) if i in names and i != m} for m, p in names.items()}
    circles, index, low, stack, on = [], {}, {}, [], set()

    def visit(v):   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []
