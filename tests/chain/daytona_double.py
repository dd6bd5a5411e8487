"""A double of the Daytona SDK's async client for Harbor 0.25's real `DaytonaEnvironment`, its sandboxes run by
bubblewrap (chain.sandbox.Box).

Registered in the env server's process in place of the name Harbor imports
(`harbor.environments.daytona.environment.AsyncDaytona`, tests/chain/serve.py), so Harbor's own code drives it: the
shared client, the create (with Harbor's labels, lifetimes and retries), commands as process-session commands polled
every second, file transfer as tar archives through the sandbox's file system, and the delete. Typed against the
installed daytona SDK: each method has the real one's parameters (tests/test_sdk_doubles.py checks them with
inspect.signature), takes the SDK's request models and returns its response models (`SessionExecuteResponse`,
`Command`, `SessionCommandLogsResponse`, `FileInfo`); a create is turned into the API's own request model
(`CreateSandbox`), which is what is recorded (chain.sandbox.record). Its errors are the SDK's, made by the SDK's own
status-code mapping (`create_daytona_error`): a fault table's 429 is the `DaytonaRateLimitError` Harbor retries.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from http import HTTPStatus
from pathlib import Path

from daytona import CreateSandboxFromImageParams, CreateSandboxFromSnapshotParams, DaytonaConfig
from daytona.common.errors import DaytonaError, create_daytona_error
from daytona.common.process import SessionCommandLogsResponse, SessionExecuteRequest, SessionExecuteResponse
from daytona_api_client_async import CreateSandbox
from daytona_toolbox_api_client_async import Command, FileInfo

from chain.sandbox import Box, record, refused_create


class AsyncDaytona:
    """Stands in for `daytona.AsyncDaytona`: Harbor's DaytonaClientManager makes one per env server."""

    def __init__(self, config: DaytonaConfig | None = None) -> None:
        keyed = (config is not None and config.api_key) or os.environ.get("DAYTONA_API_KEY") or (
            os.environ.get("DAYTONA_JWT_TOKEN") and os.environ.get("DAYTONA_ORGANIZATION_ID"))
        if not keyed:  # the real client refuses to be made without credentials too
            raise DaytonaError("API key or JWT token is required")

    async def create(self, params: CreateSandboxFromSnapshotParams | CreateSandboxFromImageParams | None = None, *,
                     timeout: float = 60, on_snapshot_create_logs: Callable[[str], None] | None = None
                     ) -> AsyncSandbox:
        if not isinstance(params, CreateSandboxFromImageParams) or isinstance(params.image, str):
            raise NotImplementedError("the double makes sandboxes from Image objects only (Harbor's prebuilt path)")
        resources = params.resources
        request = CreateSandbox(env=params.env_vars or {}, labels=params.labels or {},
                                auto_stop_interval=params.auto_stop_interval,
                                auto_delete_interval=params.auto_delete_interval,
                                network_block_all=params.network_block_all, cpu=resources and resources.cpu,
                                memory=resources and resources.memory, disk=resources and resources.disk)
        trial = f"{request.labels.get('harbor.environment_name')} {request.labels.get('harbor.session_id')}"
        status = refused_create(trial)
        record("daytona", event="create", trial=trial, request=request.to_dict(), refused=status)
        if status:
            raise create_daytona_error(f"Failed to create sandbox: {HTTPStatus(status).phrase} (test double)",
                                       status_code=status)
        image = params.image.dockerfile().split("\n", 1)[0].removeprefix("FROM ").strip()
        return AsyncSandbox(await Box.open(image, trial, request.env))

    async def close(self) -> None:
        return None


class AsyncSandbox:
    """Stands in for `daytona.AsyncSandbox`: `id`, `process`, `fs`, `delete`, `stop`."""

    def __init__(self, box: Box) -> None:
        self.id = str(uuid.uuid4())
        self.process = AsyncProcess(box)
        self.fs = AsyncFileSystem(box)
        self._box: Box | None = box

    async def delete(self, timeout: float | None = 60, wait: bool = False) -> None:
        await self.stop()
        record("daytona", event="delete", id=self.id)

    async def stop(self, timeout: float | None = 60, force: bool = False) -> None:
        if self._box is not None:
            await self._box.close()
            self._box = None


class AsyncProcess:
    """Stands in for the sandbox's `process`: session commands, each a `bash -c` in the sandbox."""

    def __init__(self, box: Box) -> None:
        self._box = box
        self._sessions: dict[str, dict[str, tuple[str, asyncio.subprocess.Process, asyncio.Future]]] = {}

    async def create_session(self, session_id: str, request_timeout: float | None = None) -> None:
        if session_id in self._sessions:
            raise create_daytona_error("session already exists", status_code=409)
        self._sessions[session_id] = {}

    async def execute_session_command(self, session_id: str, req: SessionExecuteRequest, timeout: int | None = None
                                      ) -> SessionExecuteResponse:
        commands = self._session(session_id)
        proc = await self._box.spawn(req.command)
        cmd_id = str(uuid.uuid4())
        commands[cmd_id] = (req.command, proc, asyncio.ensure_future(proc.communicate()))
        if req.run_async:
            return SessionExecuteResponse(cmd_id=cmd_id)
        out, err = await commands[cmd_id][2]
        return SessionExecuteResponse(cmd_id=cmd_id, stdout=out.decode(), stderr=err.decode(),
                                      output=(out + err).decode(), exit_code=proc.returncode)

    async def get_session_command(self, session_id: str, command_id: str, request_timeout: float | None = None
                                  ) -> Command:
        command, proc, done = self._command(session_id, command_id)
        return Command(id=command_id, command=command, exit_code=proc.returncode if done.done() else None)

    async def get_session_command_logs(self, session_id: str, command_id: str, request_timeout: float | None = None
                                       ) -> SessionCommandLogsResponse:
        _, _, done = self._command(session_id, command_id)
        out, err = (part.decode(errors="replace") for part in (done.result() if done.done() else (b"", b"")))
        return SessionCommandLogsResponse(output=out + err, stdout=out, stderr=err)

    def _session(self, session_id: str) -> dict:
        if session_id not in self._sessions:
            raise create_daytona_error(f"session {session_id} not found", status_code=404)
        return self._sessions[session_id]

    def _command(self, session_id: str, command_id: str) -> tuple[str, asyncio.subprocess.Process, asyncio.Future]:
        if command_id not in (commands := self._session(session_id)):
            raise create_daytona_error(f"command {command_id} not found", status_code=404)
        return commands[command_id]


class AsyncFileSystem:
    """Stands in for the sandbox's `fs`: files go straight into the sandbox's root."""

    def __init__(self, box: Box) -> None:
        self._box = box

    async def upload_file(self, src: str | bytes, dst: str, timeout: int = 1800) -> None:
        target = self._box.path(dst)
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, bytes):
            target.write_bytes(src)
        else:
            await asyncio.to_thread(shutil.copyfile, src, target)

    async def download_file(self, *args: str) -> bytes | None:
        source = self._existing(args[0])
        if len(args) == 1:
            return source.read_bytes()
        await asyncio.to_thread(shutil.copyfile, source, args[1])
        return None

    async def get_file_info(self, path: str, request_timeout: float | None = None) -> FileInfo:
        found = self._existing(path)
        info = found.stat()
        return FileInfo(name=found.name, is_dir=found.is_dir(), size=info.st_size, mode=oct(info.st_mode),
                        mod_time=datetime.fromtimestamp(info.st_mtime, UTC).isoformat(), permissions=oct(info.st_mode),
                        owner="root", group="root")

    def _existing(self, path: str) -> Path:
        found = self._box.path(path)
        if not found.exists():
            raise create_daytona_error(f"file {path} not found", status_code=404)
        return found
