"""bench/registry.py's CPU accounting: what each call costs the server, the load generator and the database;
its targets."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import time

import pytest

from loadplan.service.embedded import EmbeddedRegistry

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "registry.py"
linux_only = pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="CPU times are read from /proc")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("loadplan_bench_registry", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@linux_only
def test_process_cpu_is_what_the_process_spent(bench):
    before, own = bench._process_cpu_s([os.getpid()]), time.process_time()
    _spin(0.3)
    spent, own = bench._process_cpu_s([os.getpid()]) - before, time.process_time() - own
    assert spent == pytest.approx(own, abs=0.05)
    assert bench._process_cpu_s([os.getpid(), 2 ** 22 + 12345]) >= 0     # a process that ended is skipped


@linux_only
def test_the_server_is_charged_what_its_process_spent(bench):
    # The child says when it starts and stops spinning, so its interpreter's start-up is not in the window.
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nprint('ready', flush=True)\n"
                              "end = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"
                              "print('spun', flush=True)\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        meter = bench.CpuMeter(child.pid, "in-server")
        mark = meter.start()
        assert child.stdout.readline() == "spun\n"        # 0.4 s of the child's CPU; this process waits
        meter.stop(mark)
    finally:
        child.communicate("")
    per_call = meter.per_call_ms(100)
    assert 3.7 <= per_call["server"] <= 4.5            # 0.4 s over 100 calls, give or take clock ticks
    assert per_call["client"] < 1.0
    assert per_call["db"] == 0.0                         # SQLite: inside the server's process
    assert 0.3 <= meter.busy_cores() <= os.cpu_count()


def _meter(bench, database, server, client, db):
    meter = bench.CpuMeter(0, database)
    meter.spent = {"server": server, "client": client, "db": db}
    return meter


def test_the_bounds_follow_from_the_cpu_per_call(bench):
    row = bench.cpu_figures({"echo": _meter(bench, "local", 0.5, 0.3, 0.0),
                             "resolve": _meter(bench, "local", 0.7, 0.3, 0.2)}, calls=1000)
    assert row["echo_server_cpu_ms"] == 0.5 and row["resolve_db_cpu_ms"] == 0.2
    assert row["server_cpu_bound"] == round(0.5 / 0.7, 3)
    assert row["cpu_bound"] == round(0.8 / 1.2, 3)
    remote = bench.cpu_figures({"echo": _meter(bench, "remote", 0.5, 0.3, None),
                                "resolve": _meter(bench, "remote", 0.7, 0.3, None)}, calls=1000)
    assert remote["resolve_db_cpu_ms"] is None and "cpu_bound" not in remote       # not the whole machine
    assert remote["server_cpu_bound"] == round(0.5 / 0.7, 3)


def test_only_a_postgresql_on_this_machine_is_measured(bench):
    assert bench._local_postgres("postgresql+psycopg://postgres@127.0.0.1:5432/x")
    assert bench._local_postgres("postgresql:///x")                                  # the local socket
    assert not bench._local_postgres("postgresql+psycopg://u@db.example:5432/x")
    assert not bench._local_postgres("sqlite:///x.db")


N_CALLS = 400


@linux_only
def test_measure_reports_cpu_per_call_for_both_methods(bench, sqlite_url):
    with EmbeddedRegistry(sqlite_url) as reg:        # in this process: server and client are one process
        meters = {m: bench.CpuMeter(os.getpid(), "in-server") for m in ("echo", "resolve")}
        # Enough calls that each window spans several clock ticks (/proc counts in ticks of 10 ms): 40 echo calls
        # took less than one on a fast machine, and read as no CPU at all.
        row = bench.measure(reg.address, inflight=4, n=N_CALLS, rounds=1, meters=meters)
    for method in ("echo", "resolve"):
        assert row[f"{method}_server_cpu_ms"] > 0 and row[f"{method}_busy_cores"] > 0
        # one process measured twice: /proc in clock ticks, process_time() finer
        tick_ms = 1e3 / os.sysconf("SC_CLK_TCK") / N_CALLS
        assert row[f"{method}_client_cpu_ms"] == pytest.approx(row[f"{method}_server_cpu_ms"], abs=2 * tick_ms)
    assert row["server_cpu_bound"] > 0 and row["cpu_bound"] > 0
    assert row["resolve_vs_echo_qps_rounds"] == [row["resolve_vs_echo_qps"]]      # one round: its ratio is the median


def test_each_row_says_its_target_and_whether_it_is_met(bench):
    seq = {"inflight": 1, "echo_p50_ms": 0.7, "commit_p50_ms": 0.5, "resolve_p50_ms": 1.45}
    assert bench.target_figures(seq) == {"target": "p50<=1.450", "target_met": True}
    assert bench.target_figures({**seq, "resolve_p50_ms": 1.451})["target_met"] is False
    loaded = {"inflight": 64, "resolve_vs_echo_qps": 0.5}
    assert bench.target_figures(loaded) == {"target": "qps>=0.5x", "target_met": True}
    assert bench.target_figures({**loaded, "resolve_vs_echo_qps": 0.499})["target_met"] is False
    assert bench.target_figures({**loaded, "inflight": 8}) == {"target": "-", "target_met": None}   # no target there
