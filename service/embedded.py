"""`EmbeddedRegistry`: the real server in-process on a loopback port.

The embedded default of DESIGN 3: with no registry address the CLI (and the
engine) run the whole path on one machine with a SQLite file. It is the same
server a deployment runs, only bound to 127.0.0.1:0.

    with EmbeddedRegistry("sqlite:///loadplan.db") as reg, reg.client() as client:
        plan = client.resolve_load_plan(request)
"""

from __future__ import annotations

from typing import Any

from loadplan.client import RegistryClient
from .registry import PlanStore
from .server import RegistryServer, ServerOptions

DEFAULT_DB_URL = "sqlite:///loadplan.db"


class EmbeddedRegistry:
    def __init__(self, db_url: str = DEFAULT_DB_URL, *, store: PlanStore | None = None,
                 options: ServerOptions | None = None):
        """`store` replaces the SQL store (tests); otherwise `db_url` is migrated to head first."""
        self.db_url = db_url
        self._store = store
        self._engine = None
        self.options = options or ServerOptions(listen="127.0.0.1:0", max_workers=8)
        self.server: RegistryServer | None = None

    @property
    def address(self) -> str:
        if self.server is None:
            raise RuntimeError("EmbeddedRegistry is not started; use it as a context manager")
        return self.server.address

    @property
    def store(self) -> PlanStore | None:
        return self._store

    def start(self) -> "EmbeddedRegistry":
        if self._store is None:
            from .store.db import make_engine, migrate
            from .store.repository import SqlPlanStore

            migrate(self.db_url)
            self._engine = make_engine(self.db_url)
            self._store = SqlPlanStore(self._engine)
        try:
            self.server = RegistryServer(self._store, self.options).start()
        except BaseException:
            self._dispose()
            raise
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=1.0)
            self.server = None
        self._dispose()

    def _dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def client(self, **kwargs: Any) -> RegistryClient:
        # The embedded server is plaintext and open: ignore $LOADPLAN_TOKEN / $LOADPLAN_TLS_*
        # meant for a remote registry, which would make the client fail against it.
        kwargs.setdefault("token", "")
        kwargs.setdefault("tls", False)
        return RegistryClient(self.address, **kwargs)

    def __enter__(self) -> "EmbeddedRegistry":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
