"""The rules that make load-time decisions. Pure Python: no grpc, no sqlalchemy.

`resolve_decisions(request)` is the whole function from a runner's request to
its decisions; everything else here is a table or a small helper of it.
"""

RULESET_VERSION = "2026.12.3"   # the vllm 0.32.0 profile agrees with vLLM's own decision code (DP flattening, a2a, get_pp_indices)
