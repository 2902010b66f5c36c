"""The registry's history database: SQLAlchemy 2 models, engines, migrations, the SQL `PlanStore`."""

from .db import downgrade, is_at_head, make_engine, migrate, normalize_url
from .repository import SqlPlanStore, UnitOfWork

__all__ = ["SqlPlanStore", "UnitOfWork", "downgrade", "is_at_head", "make_engine", "migrate", "normalize_url"]
