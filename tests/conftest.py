"""Session-wide settings: Trackio logs into a throw-away folder and never to a Space or server.

Trackio reads TRACKIO_DIR once, when first imported (TRL imports it with its async GRPO trainer), so it is set
here, before any test module is collected; the rehearsal subprocesses inherit it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="trackio-tests-")
atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], ignore_errors=True)
for name in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
    os.environ.pop(name, None)
