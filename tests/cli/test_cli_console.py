"""The installed `loadplan` console script as a user runs it: a few subprocess round trips."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import real_model, run

from loadplan.cli import main as cli_main

SCRIPT = pathlib.Path(sys.executable).with_name("loadplan")


def loadplan(*argv: str, **kw) -> subprocess.CompletedProcess:
    exe = [str(SCRIPT)] if SCRIPT.exists() else [shutil.which("loadplan") or "loadplan"]
    return subprocess.run(exe + list(argv), capture_output=True, text=True, timeout=60, **kw)


def test_console_script_resolve_and_bad_input(tmp_path):
    db = f"sqlite:///{tmp_path / 'c.db'}"
    done = loadplan("resolve", "--model", real_model("deepseek-v3"), "--db", db, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["decisions"]["moe.shared_experts_fusion"]["value"] is True

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"')
    bad = loadplan("resolve", "--model", str(tmp_path / "m"), "--db", db)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: INVALID_ARGUMENT: config_json")
    assert "Traceback" not in bad.stderr


def test_migrate_then_serve_until_sigterm(tmp_path):
    from loadplan.service.healthcheck import check

    db = f"sqlite:///{tmp_path / 's.db'}"
    assert loadplan("migrate", "--db", db).returncode == 0
    exe = str(SCRIPT) if SCRIPT.exists() else "loadplan"
    proc = subprocess.Popen([exe, "serve", "--db", db, "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, line + proc.stderr.read()
        address = line.split("listening on ")[1].split()[0]
        deadline = time.monotonic() + 10
        while not check(address) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert check(address)
        done = loadplan("resolve", "--model", real_model("qwen3-30b-a3b"), "--registry", address, "--json")
        assert done.returncode == 0, done.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_missing_engine_command_is_one_line(capsys, monkeypatch):
    monkeypatch.setitem(cli_main.COMMANDS, "generate",
                        cli_main.Command("loadplan.engine.no_such_cli_module", "generate", extra="engine"))
    code, _, err = run(capsys, "generate", "--model", "x")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: FAILED_PRECONDITION: the 'generate' command is not available")
    assert "loadplan[engine]" in err


def test_help_lists_commands_without_importing_them(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli_main.COMMANDS)


def test_closed_stdout_pipe_is_not_a_traceback(tmp_path):
    # `loadplan backends | head -c 1`: the reader leaves early; the command ends quietly.
    exe = [sys.executable, "-c", "import sys, loadplan.cli.main as m; sys.exit(m.main(sys.argv[1:]))"]
    proc = subprocess.Popen(exe + ["backends"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))   # its embedded default DB lands in tmp
    proc.stdout.close()                      # nobody reads: the first write breaks the pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err
