"""Harbor's real OpenCode agent, with its install skipped where the task image already has the pinned release.

Harbor's `OpenCode.install()` always fetches nvm from GitHub and Node from nodejs.org on a glibc image, then runs
`npm i -g opencode-ai@VERSION`; the suite's machine reaches neither. The image setup.sh builds carries the pinned
OpenCode where that npm install puts it, so the install is skipped when `opencode` on PATH resolves into the global
`opencode-ai` package and its package.json names the pinned version (OPENENV_HARBOR_AGENT_VERSIONS -> the agent's
version); anything else runs Harbor's own install. Read, not run: `opencode --version` starts Bun, 0.6 CPU-s in every
trial (image_root.sh runs it once, when it builds the image). Registered for `opencode` in the env server's process
(tests/chain/serve.py).
"""

from __future__ import annotations

import json

from harbor.agents.installed.opencode import OpenCode
from harbor.environments.base import BaseEnvironment

PACKAGE = "/usr/local/lib/node_modules/opencode-ai"  # npm's global prefix /usr/local, as image_root.sh lays it out
INSTALLED = f'[ "$(readlink -f "$(command -v opencode)")" = {PACKAGE}/bin/opencode.exe ] && cat {PACKAGE}/package.json'


def installed_version(stdout: str | None) -> str | None:
    try:
        return json.loads(stdout or "").get("version")
    except (ValueError, AttributeError):
        return None


class PinnedOpenCode(OpenCode):
    async def install(self, environment: BaseEnvironment) -> None:
        found = await environment.exec(INSTALLED, timeout_sec=60)
        if found.return_code == 0 and installed_version(found.stdout) == self._version:
            return
        await super().install(environment)
