"""A python step module that takes IMPORT_SECONDS to import (a heavy dependency, a loaded host)."""

import os
import time

from tests.unit.worker_callables import spawn_and_hang

time.sleep(float(os.environ.get("IMPORT_SECONDS", "0")))

__all__ = ["spawn_and_hang"]
