"""The adapter repo on the Hub: its layout (docs/training.md, Hub writes), the one way every script writes to it,
and one line per failure. Imports only recipe and huggingface_hub (1.x in the jobs, 2.x in launch.py's)."""

from __future__ import annotations

import importlib
import json
import logging
import re
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import recipe
from recipe import CHECKPOINT_PATTERN, CHECKPOINT_PREFIX, FINAL

logger = logging.getLogger("adapter_repo")

# --- Layout ----------------------------------------------------------------------------------------------------------
# The last file of a checkpoint's one commit, listing its files' sizes: readers load only a folder holding it.
COMPLETE_MARKER = "checkpoint_complete.json"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
# Training state stays in the checkpoints, out of the final adapter at the root.
FINAL_ADAPTER_IGNORE = ("training_args.bin", "*.pt", "*.pth", "trainer_state.json", recipe.ROLLOUT_STATE)
EVAL_DIR = "eval"
LOGS_DIR = "logs"
WATCH_DIR = f"{EVAL_DIR}/watch"
WATCH_BASE_PATH = f"{WATCH_DIR}/base.json"
SUMMARY_PATH = f"{EVAL_DIR}/summary.json"
# A smoke run pushes to <ADAPTER_REPO>-smoke; its clear records the run in SMOKE_RUN_PATH (smoke_report.clear).
SMOKE_SUFFIX = "-smoke"
SMOKE_RUN_PATH = "smoke_run.json"
_WATCH_RESULTS = re.compile(rf"^{WATCH_DIR}/({CHECKPOINT_PATTERN})\.json$")
_MARKER = re.compile(rf"^({CHECKPOINT_PREFIX}\d+)/{re.escape(COMPLETE_MARKER)}$")


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step}"


def adapter_folder(checkpoint: str) -> str:
    """Folder in the repo holding `checkpoint`'s adapter: the root for the final adapter."""
    return "" if checkpoint == FINAL else checkpoint


def complete_checkpoints(files: Iterable[str]) -> list[int]:
    """Steps N whose checkpoint-N/ holds the completion marker and the adapter, oldest first."""
    present = set(files)
    folders = [m.group(1) for m in map(_MARKER.match, present) if m]
    return sorted(int(folder.removeprefix(CHECKPOINT_PREFIX)) for folder in folders
                  if all(f"{folder}/{name}" in present for name in ADAPTER_FILES))


def refuse_fresh_start(repo_id: str, files: Iterable[str]) -> None:
    """RESUME=0 only into a repo without complete checkpoints: a later resume or watcher would take the newest."""
    steps = complete_checkpoints(files)
    if steps:
        raise recipe.ConfigError(
            f"{repo_id} holds checkpoints of an earlier run (newest {checkpoint_name(steps[-1])}): RESUME=0 would "
            "train from step 0 among them, and a later resume would continue the newest: resume it (RESUME=1) or "
            "train into a new ADAPTER_REPO")


def checkpoint_complete(files: Iterable[str], checkpoint: str) -> bool:
    """Whether `checkpoint` ("final" or checkpoint-N) has finished uploading: the one rule every reader uses."""
    present = set(files)
    if checkpoint == FINAL:
        return set(ADAPTER_FILES) <= present
    return checkpoint in map(checkpoint_name, complete_checkpoints(present))


def full_results_path(checkpoint: str) -> str:
    """eval_adapter.py's base-vs-adapter eval of `checkpoint` on every test task."""
    name = "final_results.json" if checkpoint == FINAL else f"{checkpoint}_full_results.json"
    return f"{EVAL_DIR}/{name}"


def watch_results_path(checkpoint: str) -> str:
    """eval_watch.py's cells of `checkpoint` on its fixed subset (never a full eval's file)."""
    return f"{WATCH_DIR}/{checkpoint}.json"


def watched_checkpoints(files: Iterable[str]) -> dict[str, str]:
    """{checkpoint: path} of the watcher's per-checkpoint results among `files`."""
    return {m.group(1): path for path in files if (m := _WATCH_RESULTS.match(path))}


# --- The jobs that write a repo ---------------------------------------------------------------------------------------
TRAIN_SCRIPT = "run_job.sh"  # the job that trains and pushes checkpoints (the train and smoke launches)


def live_jobs(api: Any, repo_id: str, script: str) -> list[Any]:
    """The token owner's jobs, not ended, running the bundle's `script` on `repo_id` (their ADAPTER_REPO)."""
    return [job for job in api.list_jobs(status=["SCHEDULING", "RUNNING"])  # huggingface_hub's JobStage values
            if (job.environment or {}).get("ADAPTER_REPO") == repo_id and f"/{script}" in " ".join(job.command or [])]


# --- Retry policy ----------------------------------------------------------------------------------------------------
class Failure(RuntimeError):
    """A failure whose message already says what failed, the likely cause and the fix: printed as it is."""


class PushError(Failure):
    """A write to the Hub failed for good: a permanent error, or a transient one that outlived every retry."""


class StaleHead(RuntimeError):
    """The Hub's head read still lags a commit it should show: read again after a wait."""


def http_status(error: BaseException) -> int | None:
    from huggingface_hub.errors import HfHubHTTPError

    return error.response.status_code if isinstance(error, HfHubHTTPError) else None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection failures and timeouts of the installed client (huggingface_hub 1.x: httpx; 2.x: httpx2)."""
    from huggingface_hub.errors import HTTPError

    transport = importlib.import_module(HTTPError.__module__)
    return (transport.TimeoutException, transport.NetworkError, transport.RemoteProtocolError, ConnectionError,
            TimeoutError)


def describe(error: BaseException) -> str:
    """One line: the HTTP status and the Hub's message, or the error's type and first line."""
    status = http_status(error)
    message = getattr(error, "server_message", None) or next(
        (line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"HTTP {status}: {message}" if status is not None else f"{type(error).__name__}: {message}"


_HINTS = {401: "check HF_TOKEN (is it valid?)", 403: "check that HF_TOKEN can write to the repo (a write token)",
          404: "check the repo id, and that HF_TOKEN can see it"}


def with_retries[T](what: str, action: Callable[[], T]) -> T:
    """`action()`, tried up to recipe.PUSH_RETRIES times with doubling waits on what is transient: HTTP 408, 429, 5xx
    or a transport error (first wait PUSH_BACKOFF_S); another writer first (409, a lost compare-and-swap's 412) or a
    lagging head read (CONFLICT_BACKOFF_S). Anything else raises PushError at once: a retried 403 only hides it."""
    for attempt in range(1, recipe.PUSH_RETRIES + 1):
        try:
            return action()
        except Exception as error:  # noqa: BLE001 - sorted below: retried, or reported in one line
            status = http_status(error)
            raced = status in (409, 412) or isinstance(error, StaleHead)
            blip = status in (408, 429) or (status or 0) >= 500 or isinstance(error, _transport_errors())
            if not (raced or blip):
                hint = f": {_HINTS[status]}" if status in _HINTS else ""
                raise PushError(f"{what} failed ({describe(error)}){hint}") from error
            if attempt == recipe.PUSH_RETRIES:
                raise PushError(f"{what} failed {attempt} times, last error: {describe(error)}") from error
            wait = (recipe.CONFLICT_BACKOFF_S if raced else recipe.PUSH_BACKOFF_S) * 2 ** (attempt - 1)
            logger.warning("push attempt %d/%d failed (%s); retrying in %.0fs", attempt, recipe.PUSH_RETRIES,
                           describe(error), wait)
            time.sleep(wait)
    raise AssertionError("unreachable: PUSH_RETRIES >= 1")


# --- One line per failure ---------------------------------------------------------------------------------------------
def _chain(error: BaseException) -> Iterable[BaseException]:
    """`error` and what caused it: clients wrap a connection failure (or mask it, as OpenEnv's client does)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


_HUB_HOST = re.compile(r"^https://([^/]+\.)?(hf\.co|huggingface\.co)(/|$)")  # the Hub's API and file CDNs


def failure_line(error: BaseException) -> tuple[str, int]:
    """`error` as one line (what failed, the likely cause, the fix) and the exit code: 2 for bad input, else 1."""
    from huggingface_hub import constants

    if isinstance(error, recipe.ConfigError | Failure):
        return str(error), 2 if isinstance(error, recipe.ConfigError) else 1
    cut = next((e for e in _chain(error) if isinstance(e, _transport_errors())), None)
    if cut is not None:
        try:
            url = str(cut.request.url)  # type: ignore[attr-defined]  # the HTTP client's errors carry their request
        except (AttributeError, RuntimeError):
            url = ""
        if not url or url.startswith(constants.ENDPOINT) or _HUB_HOST.match(url):
            return (f"could not reach the Hugging Face Hub at {constants.ENDPOINT} ({describe(cut)}): no network, or "
                    "HF_ENDPOINT or a proxy setting points elsewhere; check the connection and rerun"), 1
        return (f"could not reach {url} ({describe(cut)}): the server there is not running, or the URL is wrong; "
                "start it or fix the URL, and rerun"), 1
    refused = next((e for e in _chain(error) if http_status(e) is not None), None)
    if refused is not None:
        status = http_status(refused)
        hint = _HINTS.get(status, "try again later" if status and status >= 500 else "check the repo id and token")
        return f"the Hub refused a request ({describe(refused)}): {hint}", 1
    return (f"unexpected {describe(error)}: rerun with DEBUG=1 for the full traceback, and report it if the "
            "cause is not yours to fix"), 1


def run_cli(script: str, main: Callable[[], object], env: Mapping[str, str] | None = None,
            usage: str | None = None) -> int:
    """Run an entry point: 0 when it returns; when it fails, one line on stderr (a traceback buries the one fact a
    user needs; DEBUG=1 prints it first) and the exit code."""
    if usage is not None and sys.argv[1:]:  # no arguments (the environment is the interface): any prints `usage`
        print(f"usage: python3 {script}.py  (no arguments: settings come from the environment)\n\n{usage}")
        return 0 if sys.argv[1:] in (["-h"], ["--help"]) else 2
    debug = False
    try:
        debug = recipe.knob("DEBUG", env)  # a bad DEBUG is refused up front, like every knob
        main()
    except Exception as error:  # noqa: BLE001 - every failure ends in one line
        line, code = failure_line(error)
        if debug:
            traceback.print_exception(error)
        print(" ".join(f"{script}: {line}".splitlines()), file=sys.stderr)
        return code
    return 0


# --- Writes ----------------------------------------------------------------------------------------------------------
# {client: {repo: (parent, oid)}} of this writer's last compare-and-swap: a head read can still answer its parent.
_LAST_CAS: weakref.WeakKeyDictionary[Any, dict[str, tuple[str, str]]] = weakref.WeakKeyDictionary()


def commit(api: Any, repo_id: str, operations: list[Any], message: str) -> str:
    """Commit `operations` in one commit (retried as above); return the commit id."""
    return with_retries(f"commit {message!r} to {repo_id}",
                        lambda: api.create_commit(repo_id, operations, commit_message=message).oid)


def commit_cas(api: Any, repo_id: str, build: Callable[[str], dict[str, bytes]], message: str) -> str:
    """Commit the files `build(head)` returns on top of `head`; return the commit id. `parent_commit` makes the Hub
    refuse (412) it once another writer committed, so none overwrites what another wrote after it read."""
    from huggingface_hub import CommitOperationAdd

    last = _LAST_CAS.setdefault(api, {})

    def attempt() -> str:
        head = api.repo_info(repo_id).sha
        if repo_id in last and head == last[repo_id][0]:  # the read lags this writer's own last commit
            head = last[repo_id][1]
        ops = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=data) for p, data in build(head).items()]
        oid = api.create_commit(repo_id, ops, commit_message=message, parent_commit=head).oid
        last[repo_id] = head, oid
        return oid

    return with_retries(f"commit {message!r} to {repo_id}", attempt)


def require_write_access(api: Any, repo_id: str) -> None:
    """Create `repo_id` (private) if missing, then prove the token may write to it (create_repo(exist_ok=True)
    succeeds with a read-only token)."""
    from huggingface_hub.errors import HfHubHTTPError

    api.create_repo(repo_id, private=True, exist_ok=True)
    try:
        api.auth_check(repo_id, write=True)
    except HfHubHTTPError as error:
        if http_status(error) not in (401, 403, 404):
            raise
        raise Failure(f"HF_TOKEN cannot write to {repo_id} ({describe(error)}): use a write token, or a "
                      f"fine-grained token with write access to {repo_id}") from error


def push_folder(api: Any, repo_id: str, folder: Path, path_in_repo: str, *, ignore: tuple[str, ...] = (),
                marker: bool = False, also: Mapping[str, Path | bytes] | None = None) -> list[str]:
    """Upload `folder` as one commit (whole or not at all), with `marker` ending in COMPLETE_MARKER, and `also`
    ({repo path: file or bytes}) outside the folder; return the repo paths written."""
    from huggingface_hub import CommitOperationAdd

    files = sorted(p for p in folder.rglob("*") if p.is_file() and not any(p.match(g) for g in ignore))
    prefix = f"{path_in_repo.strip('/')}/" if path_in_repo.strip("/") else ""
    ops = [CommitOperationAdd(f"{prefix}{p.relative_to(folder).as_posix()}", str(p)) for p in files]
    if marker:
        listing = {p.relative_to(folder).as_posix(): p.stat().st_size for p in files}
        ops.append(CommitOperationAdd(f"{prefix}{COMPLETE_MARKER}", json.dumps({"files": listing}).encode()))
    ops[:0] = [CommitOperationAdd(name, data if isinstance(data, bytes) else str(data))  # the marker stays last
               for name, data in (also or {}).items()]
    commit(api, repo_id, ops, f"Upload {path_in_repo.strip('/') or 'final adapter'}")
    logger.info("pushed %s to %s (%d files)", path_in_repo or "/", repo_id, len(ops))
    return [op.path_in_repo for op in ops]


# --- Reads -----------------------------------------------------------------------------------------------------------
def read_json(api: Any, repo_id: str, path: str, revision: str | None = None) -> dict[str, Any] | None:
    """A JSON file from the repo at `revision`, or None if it is not there."""
    if path not in api.list_repo_files(repo_id, revision=revision):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        local = api.hf_hub_download(repo_id=repo_id, filename=path, local_dir=tmp, revision=revision)
        return json.loads(Path(local).read_text())


def head_holding(api: Any, repo_id: str, checkpoint: str) -> str:
    """The head to download `checkpoint` at, read again while it lacks a checkpoint the latest listing holds (a head
    read can lag the push); for a checkpoint the repo lacks, the head, for download_adapter to refuse."""

    def read() -> str:
        head = api.repo_info(repo_id).sha
        if checkpoint_complete(api.list_repo_files(repo_id, revision=head), checkpoint) or not checkpoint_complete(
                api.list_repo_files(repo_id), checkpoint):
            return head
        raise StaleHead(f"the Hub still answers head {head[:12]}, which lacks the {checkpoint!r} pushed since")

    return with_retries(f"read the head of {repo_id} holding {checkpoint!r}", read)


def download_adapter(api: Any, repo_id: str, checkpoint: str, dest: Path, revision: str | None = None) -> Path:
    """Download only `checkpoint`'s adapter files into `dest`; refuse an incomplete upload."""
    folder = adapter_folder(checkpoint)
    if not checkpoint_complete(api.list_repo_files(repo_id, revision=revision), checkpoint):
        raise recipe.ConfigError(
            f"{repo_id} has no complete adapter for {checkpoint!r} ({folder or 'repo root'} lacks the adapter "
            "or its completion marker): check CHECKPOINT, or wait for the upload to finish")
    for name in ADAPTER_FILES:
        path = f"{folder}/{name}" if folder else name
        api.hf_hub_download(repo_id=repo_id, filename=path, local_dir=str(dest), revision=revision)
    return dest / folder if folder else dest


def download_checkpoint(api: Any, repo_id: str, step: int, dest: Path) -> Path:
    """Download checkpoint-`step`/ into `dest` and check every file against its marker's listing."""
    folder = checkpoint_name(step)
    api.snapshot_download(repo_id, local_dir=str(dest), allow_patterns=[f"{folder}/*"])
    local = dest / folder
    listing = json.loads((local / COMPLETE_MARKER).read_text())["files"]
    wrong = [name for name, size in listing.items()
             if not (local / name).is_file() or (local / name).stat().st_size != size]
    if wrong:
        raise PushError(f"downloaded {repo_id}/{folder} does not match its marker ({', '.join(wrong[:3])}): rerun")
    return local
