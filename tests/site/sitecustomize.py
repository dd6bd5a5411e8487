"""The suite's start-up rule for every Python it starts (tests/conftest.py puts this folder on PYTHONPATH): gradio is
hidden, but for the env server, so OpenEnv takes its own fallback for a missing gradio.

OpenEnv 0.10.0 imports gradio at the import of its env-server package, for an optional web interface
(`openenv.core.env_server` wraps that import in `try: ... except ModuleNotFoundError`) that no process of the job uses
but the env server. Every other process that imports any of OpenEnv (the capture proxy, the trainer and TRL's rollout
child, the eval, `seam_patch.py check`) paid about 3 CPU-seconds for it: about a tenth of the suite's CPU on 2 cores.
The env server (`harbor serve`) serves OpenEnv's gradio UI at /web (openenv.harbor.ui) and keeps gradio.
tests/test_foundation.py checks both sides.
"""

import sys


def env_server(argv: list[str]) -> bool:
    """`... harbor serve ...`: the env server, as serve_env.sh and tests/chain/serve.py start it."""
    return any(a == "harbor" and b == "serve" for a, b in zip(argv, argv[1:], strict=False))


if not env_server(sys.argv):
    sys.modules.setdefault("gradio", None)  # `import gradio` now raises ModuleNotFoundError
