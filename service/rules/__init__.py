"""The rules that make load-time decisions. Pure Python: no grpc, no sqlalchemy.

`resolve_decisions(request)` is the whole function from a runner's request to
its decisions; everything else here is a table or a small helper of it.
"""

RULESET_VERSION = "2026.12.1"   # engine profiles: runtime.engine decides
