"""The loadplan registry service: rules (pure), store (SQLAlchemy), transport (gRPC)."""
