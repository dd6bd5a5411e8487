"""The suite's start-up rules for every Python it starts (tests/conftest.py puts this folder on PYTHONPATH).

1. Gradio is hidden, but for the env server, so OpenEnv takes its own fallback for a missing gradio. OpenEnv 0.10.0
   imports gradio at the import of its env-server package, for an optional web interface (`openenv.core.env_server`
   wraps that import in `try: ... except ModuleNotFoundError`) that no process of the job uses but the env server.
   Every other process that imports any of OpenEnv (the capture proxy, the trainer and TRL's rollout child, the eval)
   paid about 3 CPU-seconds for it: about a tenth of the suite's CPU on 2 cores. The env
   server (`harbor serve`) serves OpenEnv's gradio UI at /web (openenv.harbor.ui) and keeps gradio.
2. `importlib.metadata.packages_distributions()` is read from a file made by its first call for the same path
   folders that hold distributions (a `*.dist-info` or `*.egg-info`, or a zip on the path) and their mtimes: an
   install or removal changes its folder's mtime, and a first install puts the folder in the key, so either makes a
   new file. transformers and TRL each call it at import, about a CPU-second each, in each of the suite's Pythons
   that import them; a folder without distributions (a script's own, the run_job tests' bundle folder, new in every
   test) changes nothing importlib reads, so it does not make the map again.

tests/test_foundation.py checks each rule against what OpenEnv and importlib do without it.
"""

import os  # loaded by site before this file: free here
import sys


def env_server(argv: list[str]) -> bool:
    """`... harbor serve ...`: the env server, as serve_env.sh and tests/chain/serve.py start it."""
    return any(a == "harbor" and b == "serve" for a, b in zip(argv, argv[1:], strict=False))


def _stamp(entry: str) -> tuple[str, int] | None:
    """(entry, mtime) for a path entry importlib.metadata finds distributions in; None for one it finds none in."""
    try:
        names = os.listdir(entry or ".")
    except NotADirectoryError:  # a zip or egg on the path
        return entry, os.stat(entry).st_mtime_ns
    except OSError:
        return None
    if not any(name.lower().endswith((".dist-info", ".egg-info")) for name in names):
        return None
    return entry, os.stat(entry or ".").st_mtime_ns


def packages_distributions() -> dict[str, list[str]]:
    """importlib's mapping of import names to distributions, kept in a file per sys.path and its folders' mtimes."""
    import hashlib
    import json
    import tempfile

    stamp = json.dumps([sys.version, [s for s in map(_stamp, sys.path) if s]])
    path = os.path.join(tempfile.gettempdir(),
                        f"suite-package-map-{hashlib.sha256(stamp.encode()).hexdigest()[:20]}.json")
    packages_distributions.cache_file = path  # the file this call read or wrote (tests/test_foundation.py)
    try:
        with open(path) as cached:
            return json.load(cached)
    except (OSError, ValueError):
        pass
    mapping = packages_distributions.uncached()
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as out:
        json.dump(mapping, out)
    os.replace(partial, path)  # whole or not at all, as concurrent starts write it
    return mapping


def patch(metadata: object) -> None:
    packages_distributions.uncached = metadata.packages_distributions
    metadata.packages_distributions = packages_distributions


class PatchOnImport:
    """Patches importlib.metadata when something first imports it: importing it here would cost every one of the
    suite's ~1,300 short Pythons about 60 ms."""

    @classmethod
    def find_spec(cls, name: str, path: object = None, target: object = None) -> object:
        if name != "importlib.metadata":
            return None
        sys.meta_path.remove(cls)
        import importlib.util

        spec = importlib.util.find_spec(name)
        spec.loader = PatchingLoader(spec.loader)
        return spec


class PatchingLoader:
    """importlib.metadata's own loader, then the patch."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def create_module(self, spec: object) -> object:
        return self.inner.create_module(spec)

    def exec_module(self, module: object) -> None:
        self.inner.exec_module(module)
        patch(module)


if not env_server(sys.argv):
    sys.modules.setdefault("gradio", None)  # `import gradio` now raises ModuleNotFoundError
if "importlib.metadata" in sys.modules:  # pytest's own process (tests/conftest.py runs this file too)
    patch(sys.modules["importlib.metadata"])
else:
    sys.meta_path.insert(0, PatchOnImport)
