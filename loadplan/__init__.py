"""loadplan: load-time decisions for MoE inference workers.

Components (DESIGN section 3), each an optional part of one distribution:
- loadplan.client   typed gRPC client (grpcio + protobuf only)
- loadplan.service  registry: rules, store, transport   (extra "service")
- loadplan.engine   torch MoE engine                     (extra "engine")
- loadplan.plan     the load-plan vocabulary every part shares (pure Python)
"""

__version__ = "0.1.0"
