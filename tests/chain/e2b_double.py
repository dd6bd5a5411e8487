"""A double of the E2B SDK's async sandbox and template API for Harbor 0.25's real `E2BEnvironment`, its sandboxes run
by bubblewrap (chain.sandbox.Box).

Registered in the env server's process in place of the names Harbor imports (`harbor.environments.e2b.AsyncSandbox`
and `AsyncTemplate`, tests/chain/serve.py; Harbor's `Template` builder stays the real one), so Harbor's own code
drives it: the template check and build, the create (its timeout, metadata and retries), background commands and
their handles, file reads and writes, the kill. Typed against the installed e2b SDK: each method has the real one's
parameters (tests/test_sdk_doubles.py checks them with inspect.signature) and returns the SDK's own types; a command's
handle is the SDK's real `AsyncCommandHandle`, fed the envd process events (`process_pb`) a sandbox streams, so its
`wait()` (result or `CommandExitException`) is the SDK's code. Errors are made by the SDK's own mappings
(`handle_api_exception` for the API's HTTP answers, `handle_rpc_exception` for envd's).

Templates behave as openenv's own measurement says E2B's do (openenv/harbor/shared_template.py): an alias exists as
soon as its build starts, and a sandbox created from a template whose build has not finished fails ("tag 'default'
does not exist"). A build takes BUILD_S. Each build and create is recorded (chain.sandbox.record).
"""

from __future__ import annotations

import asyncio
import json
import stat
import uuid
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from http import HTTPStatus
from logging import Logger
from pathlib import Path
from typing import IO, Any, ClassVar, Literal, Unpack

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b import Template
from e2b.api import handle_api_exception
from e2b.api.client.types import Response
from e2b.connection_config import ApiParams
from e2b.envd.process import process_pb
from e2b.envd.rpc import handle_rpc_exception
from e2b.sandbox.filesystem.filesystem import AsyncWriteEntry, EntryInfo, FileType, WriteEntry, WriteInfo
from e2b.sandbox.mcp import McpServer
from e2b.sandbox.sandbox_api import SandboxIamOpts, SandboxLifecycle, SandboxNetworkOpts
from e2b.sandbox_async.commands.command_handle import AsyncCommandHandle
from e2b.template.logger import LogEntry
from e2b.template.main import TemplateBuilder, TemplateFinal
from e2b.template.types import BuildInfo
from e2b.volume.volume_async import AsyncVolume
from protobuf import Oneof

from chain.sandbox import Box, kill, record, refused_create

BUILD_S = 3.0  # long enough that a group's rollouts overlap a build, as they do a real one


def api_error(status: int, message: str) -> Exception:
    """What the SDK raises for this answer of E2B's API."""
    return handle_api_exception(Response(status_code=HTTPStatus(status), content=json.dumps(
        {"code": status, "message": message}).encode(), headers={}, parsed=None))


def event(kind: str, value: Any) -> process_pb.StartResponse:
    """One envd process event as a started command's stream carries it."""
    return process_pb.StartResponse(event=process_pb.ProcessEvent(event=Oneof(kind, value)))


def missing(path: str) -> Exception:
    return handle_rpc_exception(ConnectError(Code.NOT_FOUND, f"path '{path}' does not exist"))


class AsyncTemplate:
    """Stands in for `e2b.AsyncTemplate`: alias -> {"image", "ready"} for this env server's life."""

    templates: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    async def alias_exists(cls, alias: str, **opts: Unpack[ApiParams]) -> bool:
        return alias in cls.templates

    @classmethod
    async def build(cls, template: TemplateFinal | TemplateBuilder, name: str | None = None, *,
                    alias: str | None = None, tags: list[str] | None = None, cpu_count: int | None = None,
                    memory_mb: int | None = None, min_free_disk_mb: int | None = None, skip_cache: bool = False,
                    on_build_logs: Callable[[LogEntry], None] | None = None, **opts: Unpack[ApiParams]) -> BuildInfo:
        image = Template.to_dockerfile(template).split("\n", 1)[0].removeprefix("FROM ").strip()
        record("e2b", event="build", alias=alias, image=image, cpu_count=cpu_count, memory_mb=memory_mb)
        built = cls.templates[alias] = {"image": image, "ready": False}
        await asyncio.sleep(BUILD_S)
        built["ready"] = True
        return BuildInfo(template_id=str(uuid.uuid4()), build_id=str(uuid.uuid4()), name=alias, alias=alias)


class AsyncSandbox:
    """Stands in for `e2b.AsyncSandbox`: `create`, `commands`, `files`, `kill`."""

    def __init__(self, box: Box) -> None:
        self.sandbox_id = str(uuid.uuid4())
        self.commands = Commands(box)
        self.files = Filesystem(box)
        self._box: Box | None = box

    @classmethod
    async def create(cls, template: str | None = None, timeout: int | None = None,
                     metadata: dict[str, str] | None = None, envs: dict[str, str] | None = None,
                     secure: bool | None = None, allow_internet_access: bool | None = None,
                     mcp: McpServer | dict[str, Any] | None = None, network: SandboxNetworkOpts | None = None,
                     iam: SandboxIamOpts | None = None, lifecycle: SandboxLifecycle | None = None,
                     volume_mounts: dict[str, AsyncVolume | str] | None = None, logger: Logger | None = None,
                     idempotency_key: str | None = None, **opts: Unpack[ApiParams]) -> AsyncSandbox:
        trial = f"{(metadata or {}).get('environment_name')} {(metadata or {}).get('session_id')}"
        status = refused_create(trial)
        record("e2b", event="create", trial=trial, template=template, timeout=timeout, refused=status)
        if status:
            raise api_error(status, f"{HTTPStatus(status).phrase} (test double)")
        built = AsyncTemplate.templates.get(template or "")
        if built is None or not built["ready"]:
            raise api_error(404, f"template '{template}': tag 'default' does not exist")
        return cls(await Box.open(built["image"], trial, envs))

    async def kill(self, **opts: Unpack[ApiParams]) -> bool:
        if self._box is None:
            return False
        await self._box.close()
        self._box = None
        record("e2b", event="kill", id=self.sandbox_id)
        return True


class Commands:
    """Stands in for the sandbox's `commands`: background commands, each a `bash -c` in the sandbox."""

    def __init__(self, box: Box) -> None:
        self._box = box

    async def run(self, cmd: str, background: bool | None = None, envs: dict[str, str] | None = None,
                  user: str | None = None, cwd: str | None = None,
                  on_stdout: Callable[[str], None] | Callable[[str], Awaitable[None]] | None = None,
                  on_stderr: Callable[[str], None] | Callable[[str], Awaitable[None]] | None = None,
                  stdin: bool | None = None, timeout: float | None = 60, request_timeout: float | None = None, *,
                  retain_output: bool = True) -> AsyncCommandHandle:
        if not background or user not in (None, "root"):
            raise NotImplementedError("the double runs background commands as root only (Harbor's way)")
        proc = await self._box.spawn(cmd, cwd, envs)

        async def events() -> Any:
            yield event("start", process_pb.ProcessEvent.StartEvent(pid=proc.pid))
            try:
                out, err = await asyncio.wait_for(proc.communicate(), timeout or None)
            except TimeoutError:  # envd ends the stream at the command's timeout
                kill(proc)
                raise ConnectError(Code.DEADLINE_EXCEEDED, "context deadline exceeded") from None
            for field, chunk in (("stdout", out), ("stderr", err)):
                if chunk:
                    yield event("data", process_pb.ProcessEvent.DataEvent(output=Oneof(field, chunk)))
            yield event("end", process_pb.ProcessEvent.EndEvent(exit_code=proc.returncode, exited=True,
                                                                 status=f"exit status {proc.returncode}"))

        async def handle_kill() -> bool:
            kill(proc)
            return True

        return AsyncCommandHandle(pid=proc.pid, handle_kill=handle_kill, events=events(), on_stdout=on_stdout,
                                  on_stderr=on_stderr, retain_output=retain_output)


class Filesystem:
    """Stands in for the sandbox's `files`: reads and writes go straight to the sandbox's root."""

    def __init__(self, box: Box) -> None:
        self._box = box

    async def write(self, path: str, data: str | bytes | IO | AsyncIterable[bytes], user: str | None = None,
                    request_timeout: float | None = None, gzip: bool = False, use_octet_stream: bool | None = None,
                    metadata: dict[str, str] | None = None) -> WriteInfo:
        target = self._box.path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)
        return WriteInfo(name=target.name, type=FileType.FILE, path=path)

    async def write_files(self, files: Sequence[WriteEntry | AsyncWriteEntry], user: str | None = None,
                          request_timeout: float | None = None, gzip: bool = False,
                          use_octet_stream: bool | None = None, metadata: dict[str, str] | None = None
                          ) -> list[WriteInfo]:
        return [await self.write(entry["path"], entry["data"]) for entry in files]  # the SDK's entries: TypedDicts

    async def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text", user: str | None = None,
                   request_timeout: float | None = None, gzip: bool = False,
                   stream_idle_timeout: float | None = None) -> str | bytearray:
        data = self._existing(path).read_bytes()
        if format == "stream":
            raise NotImplementedError("the double reads text or bytes")
        return bytearray(data) if format == "bytes" else data.decode()

    async def list(self, path: str, depth: int | None = 1, user: str | None = None,
                   request_timeout: float | None = None) -> list[EntryInfo]:
        if depth != 1:
            raise NotImplementedError("the double lists one level")
        folder = self._existing(path)
        return [self._entry(f"{path.rstrip('/')}/{child.name}", child) for child in sorted(folder.iterdir())]

    async def get_info(self, path: str, user: str | None = None, request_timeout: float | None = None) -> EntryInfo:
        return self._entry(path, self._existing(path))

    def _existing(self, path: str) -> Path:
        if not (found := self._box.path(path)).exists():
            raise missing(path)
        return found

    @staticmethod
    def _entry(path: str, found: Path) -> EntryInfo:
        info = found.lstat()
        kind = FileType.DIR if stat.S_ISDIR(info.st_mode) else FileType.FILE
        return EntryInfo(name=found.name, type=kind, path=path, size=info.st_size, mode=info.st_mode,
                         permissions=stat.filemode(info.st_mode), owner="root", group="root",
                         modified_time=datetime.fromtimestamp(info.st_mtime, UTC))
