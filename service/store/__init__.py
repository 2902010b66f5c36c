"""The registry's history database: SQLAlchemy 2 models, engines, migrations, the SQL `PlanStore`."""

from .db import downgrade, is_at_head, make_engine, migrate, normalize_url
from .repository import SqlPlanStore

__all__ = ["SqlPlanStore", "downgrade", "is_at_head", "make_engine", "migrate", "normalize_url"]
