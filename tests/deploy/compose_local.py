"""Run docker-compose.yml's services as local processes on loopback (no Docker engine).

Everything comes from the file: each service's `command`, `environment`,
`deploy.replicas`, `ports`, `volumes`, `healthcheck` and `depends_on` (with its
conditions, in dependency order). What a container would have is mapped to this
machine, and only that:

- `${VAR:-default}` interpolation from the variables the caller passes (as the
  shell or `.env` would), not from this process's environment;
- a service's host name with a container port (`registry:50051`) -> 127.0.0.1 and
  the local port of that service's first replica; an "external" service (the
  caller's PostgreSQL instead of the `postgres` container) -> the given address;
- a replica's own `0.0.0.0:PORT` / `127.0.0.1:PORT` -> 127.0.0.1 and a free port;
- a named volume's mount point -> a folder under the work directory;
- `loadplan` / `python` -> this virtual environment's;
- what an image does not install is made unimportable for the services built from
  it (`absent`: Dockerfile -> module names), so a registry that imported torch, or a
  worker that imported SQLAlchemy, fails here as it would in its container.

A service whose condition is not met (a one-shot job that exits non-zero, a health
check that never passes) raises ComposeError with the tail of its log.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
BIN = Path(sys.executable).parent

_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?])?(?P<arg>[^}]*)\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


class ComposeError(AssertionError):
    pass


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution: ${VAR}, $VAR, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("braced") or m.group("bare")
        op, arg = m.group("op"), m.group("arg") or ""
        have = env.get(name)
        if op == ":-":
            return have if have else arg
        if op == "-":
            return arg if have is None else have
        if op in (":?", "?") and not (have if op == ":?" else have is not None):
            raise ComposeError(f"variable {name} is required: {arg}")
        return have or ""

    return _VAR.sub(sub, value)


def load(env: dict[str, str], path: Path = COMPOSE_FILE) -> dict[str, Any]:
    return interpolate(yaml.safe_load(path.read_text()), env)


def duration_s(text: str | None, default: float) -> float:
    """Compose durations: 1m30s, 2s, 500ms."""
    if not text:
        return default
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(text))
    return sum(float(n) * units[u] for n, u in parts)


def dependency_order(services: dict[str, Any]) -> list[str]:
    """Services sorted so each comes after what it depends on (as compose starts them)."""
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ComposeError(f"depends_on cycle: {' -> '.join(path + (name,))}")
        state[name] = "visiting"
        for dep in depends_on(services[name]):
            if dep not in services:
                raise ComposeError(f"{name} depends on unknown service {dep}")
            visit(dep, path + (name,))
        state[name] = "done"
        order.append(name)

    for name in services:
        visit(name, ())
    return order


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: (v or {}).get("condition", "service_started") for d, v in deps.items()}


def container_ports(service: dict[str, Any]) -> list[int]:
    """The container side of `ports` ("HOST:CONTAINER", "A-B:CONTAINER", long form) and `expose`."""
    out = []
    for p in service.get("ports") or []:
        target = p.get("target") if isinstance(p, dict) else str(p).rsplit(":", 1)[-1].split("/")[0]
        out.append(int(target))
    out += [int(str(p).split("/")[0]) for p in service.get("expose") or []]
    return out


def dockerfile_of(services: dict[str, Any], name: str) -> str | None:
    """The Dockerfile of a service's image: its own build, or the build of the service that makes its image."""
    build = services[name].get("build")
    if build is None:
        image = services[name].get("image")
        build = next((s["build"] for s in services.values() if s.get("image") == image and s.get("build")), None)
    if build is None:
        return None
    return "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Replica:
    service: str
    index: int
    argv: list[str]
    env: dict[str, str]
    log: Path
    ports: dict[int, int]                      # container port -> local port
    proc: subprocess.Popen | None = None

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class LocalCompose:
    workdir: Path
    variables: dict[str, str]
    external: dict[str, tuple[str, int]]       # service -> (host, port) that stands in for its container
    path: Path = COMPOSE_FILE
    absent: dict[str, tuple[str, ...]] = field(default_factory=dict)   # Dockerfile -> modules it lacks
    spec: dict[str, Any] = field(init=False)
    replicas: dict[str, list[Replica]] = field(init=False, default_factory=dict)
    started: list[Replica] = field(init=False, default_factory=list)   # every replica ever started, for `down`

    def __post_init__(self):
        self.spec = load(self.variables, self.path)
        self.services: dict[str, Any] = self.spec["services"]
        self.local_ports = {name: [{p: free_port() for p in container_ports(svc)}
                                   for _ in range(self.replica_count(name))]
                            for name, svc in self.services.items() if name not in self.external}

    # --- the mapping of container facts to this machine --------------------------------

    def replica_count(self, name: str) -> int:
        return int((self.services[name].get("deploy") or {}).get("replicas", 1))

    def volume_dir(self, volume: str) -> Path:
        d = self.workdir / "volumes" / volume
        d.mkdir(parents=True, exist_ok=True)
        return d

    def localize(self, text: str, name: str, index: int) -> str:
        for other, svc in self.services.items():       # other services by name
            for cport in container_ports(svc) or []:
                text = re.sub(rf"(?<![\w.-]){re.escape(other)}:{cport}\b", self._address(other, cport), text)
        for other, (host, port) in self.external.items():
            text = re.sub(rf"(?<![\w.-]){re.escape(other)}:\d+\b", f"{host}:{port}", text)
        for cport, lport in self.local_ports.get(name, [{}])[index].items():   # this replica's own ports
            text = re.sub(rf"\b(?:0\.0\.0\.0|127\.0\.0\.1|localhost):{cport}\b", f"127.0.0.1:{lport}", text)
        for vol in self.services[name].get("volumes") or []:
            source, target = str(vol).split(":")[:2]
            if text == target or text.startswith(target + "/"):
                text = str(self.volume_dir(source)) + text[len(target):]
        return text

    def _address(self, service: str, cport: int) -> str:
        if service in self.external:
            host, port = self.external[service]
            return f"{host}:{port}"
        return f"127.0.0.1:{self.local_ports[service][0][cport]}"

    def argv(self, name: str, index: int, command: Any) -> list[str]:
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        argv = [self.localize(a, name, index) for a in argv]
        if argv[0] in ("loadplan", "check-jsonschema"):
            argv[0] = str(BIN / argv[0])
        elif argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        return argv

    def environment(self, name: str, index: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOADPLAN_")}
        given = self.services[name].get("environment") or {}
        if isinstance(given, list):
            given = dict(item.split("=", 1) for item in given)
        env.update({k: self.localize(str(v), name, index) for k, v in given.items() if v is not None})
        blocked = self._absent_modules_dir(name)
        if blocked is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocked), env.get("PYTHONPATH")]))
        return env

    def _absent_modules_dir(self, name: str) -> Path | None:
        dockerfile = dockerfile_of(self.services, name)
        modules = self.absent.get(dockerfile or "", ())
        if not modules:
            return None
        d = self.workdir / "absent" / str(dockerfile)
        for mod in modules:
            pkg = d / mod
            pkg.mkdir(parents=True, exist_ok=True)
            (pkg / "__init__.py").write_text(
                f"raise ImportError({mod!r} + ' is not installed in the image of {dockerfile}')\n")
        return d

    # --- running ----------------------------------------------------------------------

    def start(self, name: str) -> list[Replica]:
        svc = self.services[name]
        if "command" not in svc:
            raise ComposeError(f"service {name} has no command to run locally")
        out = []
        for i in range(self.replica_count(name)):
            rep = Replica(name, i, self.argv(name, i, svc["command"]), self.environment(name, i),
                          self.workdir / f"{name}-{i}.log", self.local_ports[name][i])
            with rep.log.open("wb") as log:
                rep.proc = subprocess.Popen(rep.argv, env=rep.env, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=self.workdir, start_new_session=True)
            out.append(rep)
            self.started.append(rep)
        self.replicas[name] = out
        return out

    def running(self, name: str) -> bool:
        """Every replica of `name` was started and has not exited."""
        reps = self.replicas.get(name)
        return bool(reps) and all(rep.proc is not None and rep.proc.poll() is None for rep in reps)

    def healthcheck(self, rep: Replica) -> subprocess.CompletedProcess:
        """The service's healthcheck `test`, run once for this replica."""
        hc = self.services[rep.service]["healthcheck"]
        test = hc["test"]
        timeout = duration_s(hc.get("timeout"), 30)
        if isinstance(test, str):
            test = ["CMD-SHELL", test]
        if test[0] == "CMD-SHELL":
            argv = ["sh", "-c", self.localize(test[1], rep.service, rep.index)]
        elif test[0] == "CMD":
            argv = self.argv(rep.service, rep.index, test[1:])
        else:
            raise ComposeError(f"{rep.service}: healthcheck test {test!r} not supported")
        try:
            return subprocess.run(argv, env=rep.env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(argv, 124, "", f"timed out after {timeout}s")

    def wait_healthy(self, name: str) -> None:
        hc = self.services[name].get("healthcheck")
        if not hc:
            raise ComposeError(f"something waits for {name} to be healthy, but it has no healthcheck")
        interval = duration_s(hc.get("interval"), 30)
        budget = duration_s(hc.get("start_period"), 0) + interval * int(hc.get("retries", 3))
        for rep in self.replicas[name]:
            deadline = time.monotonic() + budget
            while True:
                if rep.proc.poll() is not None:
                    raise ComposeError(f"{name}[{rep.index}] exited with {rep.proc.returncode} before it was "
                                       f"healthy:\n{rep.tail()}")
                res = self.healthcheck(rep)
                if res.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise ComposeError(f"{name}[{rep.index}] not healthy after {budget:.0f}s "
                                       f"({res.stdout}{res.stderr}):\n{rep.tail()}")
                time.sleep(min(interval, 0.5))      # poll faster than compose would: same verdict, sooner

    def wait_completed(self, name: str, timeout: float = 120.0) -> None:
        for rep in self.replicas[name]:
            try:
                rc = rep.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise ComposeError(f"{name}[{rep.index}] did not finish within {timeout:.0f}s:\n{rep.tail()}") from None
            if rc != 0:
                raise ComposeError(f"{name}[{rep.index}] exited with {rc}:\n{rep.tail()}")

    def up(self, until: str | None = None, job_timeout: float = 120.0) -> list[str]:
        """Start the services in dependency order (up to and including `until`), each once its
        dependencies meet their conditions; returns the names started. As `docker compose up`, a
        service that is running already is left alone (a finished job runs again)."""
        order = dependency_order(self.services)
        if until is not None:
            needed = self._closure(until)
            order = [n for n in order if n in needed]
        started = []
        for name in order:
            if name in self.external:
                continue                    # stands in for the container; the caller checked it is up
            if self.running(name):
                continue
            for dep, condition in depends_on(self.services[name]).items():
                if dep in self.external:
                    continue
                if condition == "service_healthy":
                    self.wait_healthy(dep)
                elif condition == "service_completed_successfully":
                    self.wait_completed(dep, job_timeout)
                elif condition != "service_started":
                    raise ComposeError(f"{name}: depends_on condition {condition!r} not supported")
            self.start(name)
            started.append(name)
        return started

    def _closure(self, name: str) -> set[str]:
        out, todo = set(), [name]
        while todo:
            n = todo.pop()
            if n not in out:
                out.add(n)
                todo += list(depends_on(self.services[n]))
        return out

    def down(self) -> None:
        """Stop every replica ever started (not only the latest of each service)."""
        for rep in self.started:
            if rep.proc and rep.proc.poll() is None:
                rep.proc.terminate()
        for rep in self.started:
            if rep.proc:
                try:
                    rep.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(rep.proc.pid, 9)     # its own session: the ranks it launched go too
                    rep.proc.wait()
