"""Harbor's real OpenCode agent, with its install skipped where the task image already has the pinned release.

Harbor's `OpenCode.install()` always fetches nvm from GitHub and Node from nodejs.org on a glibc image; the suite's
machine reaches neither. The image setup.sh builds carries the pinned OpenCode, so the install is skipped when
`opencode --version` prints exactly the pinned version (OPENENV_HARBOR_AGENT_VERSIONS -> the agent's version);
anything else runs Harbor's own install. Registered for `opencode` in the env server's process (tests/chain/serve.py).
"""

from __future__ import annotations

from harbor.agents.installed.opencode import OpenCode
from harbor.environments.base import BaseEnvironment


class PinnedOpenCode(OpenCode):
    async def install(self, environment: BaseEnvironment) -> None:
        found = await environment.exec("opencode --version", timeout_sec=60)
        if found.return_code == 0 and (found.stdout or "").strip() == self._version:
            return
        await super().install(environment)
