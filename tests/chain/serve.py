"""The env server as the job starts it (seam_patch.py serve -- harbor serve ...), with the suite's stand-ins
registered first, in its own process: the bubblewrap sandbox for `hf-sandbox`, OpenCode with its install skipped, and
the Daytona and E2B SDK doubles in place of the SDK names Harbor's real DaytonaEnvironment and E2BEnvironment use.

    python tests/chain/serve.py serve -- harbor serve --llm-url ... --dataset ...

Both go through Harbor 0.25's private tables (`harbor.environments.factory._ENVIRONMENT_REGISTRY`,
`AgentFactory._AGENT_MAP`); their shape is asserted before anything is replaced, as seam_patch.py asserts its seam,
so a Harbor that moved them fails here with one line instead of running the real hf-sandbox. Each SDK name is checked
to be the installed SDK's own before its double replaces it.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent)]  # the bundle (seam_patch) and tests/ (chain.*)

SANDBOX = ("harbor.environments.hf_sandbox", "HFSandboxEnvironment")
STAND_IN = ("chain.sandbox", "BubblewrapEnvironment")
OPENCODE = "harbor.agents.installed.opencode:OpenCode"
PINNED = "chain.agent:PinnedOpenCode"
# Harbor module -> {name it imported from the SDK: (the SDK module it came from, the double's module)}
SDK_DOUBLES = {"harbor.environments.daytona.environment": {"AsyncDaytona": ("daytona", "chain.daytona_double")},
               "harbor.environments.e2b": {"AsyncSandbox": ("e2b", "chain.e2b_double"),
                                           "AsyncTemplate": ("e2b", "chain.e2b_double")}}


def register() -> None:
    """Swap the stand-ins in, or exit with one line saying which table no longer has the expected shape."""
    from harbor.agents.factory import AgentFactory
    from harbor.environments import factory
    from harbor.models.agent.name import AgentName
    from harbor.models.environment_type import EnvironmentType

    entry = getattr(factory, "_ENVIRONMENT_REGISTRY", {}).get(EnvironmentType.HF_SANDBOX)
    if entry is None or (entry.module, entry.class_name) != SANDBOX:
        sys.exit(f"chain serve: Harbor's environment registry maps hf-sandbox to {entry}, not {SANDBOX}: "
                 "the sandbox stand-in needs updating for this Harbor")
    agents = getattr(AgentFactory, "_AGENT_MAP", {})
    if agents.get(AgentName.OPENCODE) != OPENCODE:
        sys.exit(f"chain serve: Harbor's agent map has opencode -> {agents.get(AgentName.OPENCODE)}, not {OPENCODE}")
    import importlib

    swaps = []
    for harbor_module, names in SDK_DOUBLES.items():
        module = importlib.import_module(harbor_module)
        for name, (sdk, double) in names.items():
            if getattr(module, name, None) is not getattr(importlib.import_module(sdk), name):
                sys.exit(f"chain serve: {harbor_module}.{name} is not {sdk}.{name}: the SDK doubles need updating")
            swaps.append((module, name, getattr(importlib.import_module(double), name)))
    factory._ENVIRONMENT_REGISTRY[EnvironmentType.HF_SANDBOX] = entry._replace(
        module=STAND_IN[0], class_name=STAND_IN[1], pip_extra=None)
    agents[AgentName.OPENCODE] = PINNED
    for module, name, double in swaps:
        setattr(module, name, double)
    print(f"chain serve: hf-sandbox -> {':'.join(STAND_IN)}, opencode -> {PINNED}, the daytona and e2b SDKs -> "
          "chain.daytona_double, chain.e2b_double", flush=True)


if __name__ == "__main__":
    register()
    import seam_patch

    seam_patch.main(sys.argv[1:])
