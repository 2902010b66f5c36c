"""The rules that make load-time decisions. Pure Python: no grpc, no sqlalchemy.

`resolve_decisions(request)` is the whole function from a runner's request to
its decisions; everything else here is a table or a small helper of it.
"""

RULESET_VERSION = "2026.12.7"   # sglang profiles of 0.5.20-0.5.23, refusals in SGLang's own words, the MoE runner on every plan
