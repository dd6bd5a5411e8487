"""A double of huggingface_hub's `Sandbox` for Harbor's real HF-sandbox environment, where no HF Job can start.

`RefusingSandbox.create` has the real `Sandbox.create` signature (tests/test_sandbox_lifecycle.py checks it against
the installed huggingface_hub with inspect.signature), records what it was asked for, and then refuses with the
library's own `SandboxError`, as the Hub does when a sandbox cannot start. So a trial driven through Harbor's
`HFSandboxEnvironment.start` shows exactly which arguments reach `Sandbox.create`, then ends as a failed sandbox start.
"""

from __future__ import annotations

from typing import Any, ClassVar

from huggingface_hub._sandbox import DEFAULT_IDLE_TIMEOUT, DEFAULT_IMAGE, Volume
from huggingface_hub.errors import SandboxError


class RefusingSandbox:
    """Stands in for `huggingface_hub.Sandbox` in `harbor.environments.hf_sandbox`; reset `calls` per test."""

    calls: ClassVar[list[dict[str, Any]]] = []

    @classmethod
    def create(
        cls,
        image: str = DEFAULT_IMAGE,
        *,
        flavor: str = "cpu-basic",
        idle_timeout: int | float | str | None = DEFAULT_IDLE_TIMEOUT,
        env: dict[str, Any] | None = None,
        secrets: dict[str, Any] | None = None,
        volumes: list[Volume] | None = None,
        namespace: str | None = None,
        forward_hf_token: bool = False,
        labels: dict[str, str] | None = None,
        start_timeout: float = 120.0,
        token: str | None = None,
    ) -> Any:
        cls.calls.append({"image": image, "flavor": flavor, "idle_timeout": idle_timeout, "env": env,
                          "secrets": secrets, "volumes": volumes, "namespace": namespace,
                          "forward_hf_token": forward_hf_token, "labels": labels, "start_timeout": start_timeout,
                          "token": token})
        raise SandboxError("test double: no HF Job can start a sandbox here")
