"""The SQLite session store of the agent runtime (see `store.py`).

`SessionStore` records sessions, segments, messages, tool calls, model samples (compact blobs,
see `blobs.py`), feedback and policy versions under `$APPRENTICE_HOME`; the schema evolves
through the numbered migrations in `migrations.py`.
"""

from agent_runtime.store.migrations import FEEDBACK_REASONS
from agent_runtime.store.store import STATUSES, SessionStore, default_home

__all__ = ["SessionStore", "FEEDBACK_REASONS", "STATUSES", "default_home"]
