"""Every environment variable the engine reads, in one module."""
from __future__ import annotations

import os

# Kill switch: forces the synchronous token path everywhere, whatever the config says.
FORCE_SYNC_ENV = "BACKEND_LIB_FORCE_SYNC"
# Log level of the backend_lib logger (DEBUG, INFO, ...).
LOG_LEVEL_ENV = "BACKEND_LIB_LOG_LEVEL"


def force_sync() -> bool:
    return os.environ.get(FORCE_SYNC_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def log_level() -> str:
    return os.environ.get(LOG_LEVEL_ENV, "WARNING").upper()
