"""Puts the suite's stand-ins (tests/chain/serve.py) into the env server serve_env.sh starts, its command unchanged.

serve_env.sh runs `$PYTHON seam_patch.py serve -- harbor serve ...`; with this folder on PYTHONPATH, Python imports
this module at start-up, and in that one process (no other: recipe.py and the gateway start Python too) it
registers the bubblewrap sandbox for `hf-sandbox` and the pinned OpenCode before seam_patch.py runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

if Path(sys.argv[0]).name == "seam_patch.py" and sys.argv[1:2] == ["serve"]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the chain package
    from chain.serve import register

    register()
