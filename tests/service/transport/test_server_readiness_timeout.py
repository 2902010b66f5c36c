"""A store whose readiness check does not answer (a stalled database) is NOT_SERVING within
ServerOptions.readiness_timeout_s, and SERVING again once it answers."""

from __future__ import annotations

import threading
import time

from fake_store import FakePlanStore

from loadplan.service.server import RegistryServer, ServerOptions


class StallingStore(FakePlanStore):
    def __init__(self):
        super().__init__()
        self.stall = threading.Event()       # set: ready() blocks until cleared
        self.released = threading.Event()
        self.calls = 0

    def ready(self) -> bool:
        self.calls += 1
        if self.stall.is_set():
            self.released.wait(30)
        return True


def test_a_readiness_check_that_hangs_is_not_serving_then_recovers():
    store = StallingStore()
    options = ServerOptions(listen="127.0.0.1:0", readiness_interval_s=3600, readiness_timeout_s=0.2)
    server = RegistryServer(store, options).start()
    try:
        assert server.serving
        store.stall.set()
        t = time.monotonic()
        assert server.check_ready() is False
        assert time.monotonic() - t < 1.0
        calls = store.calls
        assert server.check_ready() is False          # still hanging: not asked again meanwhile
        assert store.calls == calls
        store.stall.clear()
        store.released.set()
        deadline = time.monotonic() + 5
        while not server.check_ready():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert server.serving
    finally:
        store.released.set()
        server.stop(grace=0)
