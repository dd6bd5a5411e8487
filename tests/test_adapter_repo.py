"""adapter_repo.py: the layout's names, and the retry policy against the errors the real Hub client raises."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from hub_double import COMMIT_IN_PROGRESS, LocalHub, raise_hub_error
from huggingface_hub import CommitOperationAdd
from huggingface_hub.errors import HfHubHTTPError

import adapter_repo as ar
import recipe

REPO = "alice/LFM2.5-2.6B-opencode-lora-RL"
TRANSIENT = [408, 429, 500, 502, 503, 504]
PERMANENT = [400, 401, 403, 404, 422]


@pytest.fixture()
def hub(tmp_path):
    api = LocalHub(tmp_path / "hub")
    api.create_repo(REPO)
    return api


@pytest.fixture()
def waits(monkeypatch) -> list[float]:
    """The retry waits, recorded instead of slept."""
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    return slept


def failing(errors: list[BaseException]):
    """An action that raises each of `errors` in turn, then returns "done"; counts its calls."""
    calls = []

    def action() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return "done"

    return action, calls


def hub_error(status: int) -> Exception:
    try:
        raise_hub_error(status, f"https://huggingface.co/api/models/{REPO}/commit/main", "x", method="POST")
    except Exception as error:  # noqa: BLE001 - the real client's exception for `status`, kept to raise later
        return error
    raise AssertionError(f"hf_raise_for_status did not raise for {status}")


@pytest.mark.parametrize("error", [hub_error(s) for s in TRANSIENT] + [
    httpx.ConnectError("connection refused"), httpx.ReadTimeout("timed out"), httpx.RemoteProtocolError("eof")],
    ids=[str(s) for s in TRANSIENT] + ["connect", "read-timeout", "protocol"])
def test_transient_failures_are_retried_with_doubling_waits(error, waits):
    action, calls = failing([error, error])
    assert ar.with_retries("push", action) == "done"
    assert len(calls) == 3 and waits == [recipe.PUSH_BACKOFF_S, 2 * recipe.PUSH_BACKOFF_S]


@pytest.mark.parametrize("error", [hub_error(s) for s in PERMANENT] + [AttributeError("no attribute 'sha'")],
                         ids=[str(s) for s in PERMANENT] + ["bug"])
def test_anything_else_stops_at_once_with_one_line(error, waits):
    action, calls = failing([error])
    with pytest.raises(ar.PushError) as caught:
        ar.with_retries("commit 'x' to you/repo", action)
    assert len(calls) == 1 and waits == []
    message = str(caught.value)
    assert message.startswith("commit 'x' to you/repo failed (") and "\n" not in message
    assert type(error).__name__ in message or f"HTTP {ar.http_status(error)}" in message


def test_a_transient_failure_that_outlives_every_retry_is_reported(waits):
    action, calls = failing([hub_error(503)] * recipe.PUSH_RETRIES)
    with pytest.raises(ar.PushError, match=f"failed {recipe.PUSH_RETRIES} times, last error: HTTP 503"):
        ar.with_retries("push", action)
    assert len(calls) == recipe.PUSH_RETRIES


@pytest.mark.parametrize("status", [409, 412])
def test_another_writer_first_is_waited_out_with_the_shorter_conflict_wait(status, waits):
    """409: another commit is in progress; 412: a compare-and-swap lost (another writer committed first)."""
    action, calls = failing([hub_error(status), hub_error(status)])
    assert ar.with_retries("cas", action) == "done"
    assert waits == [recipe.CONFLICT_BACKOFF_S, 2 * recipe.CONFLICT_BACKOFF_S] and len(calls) == 3


def test_compare_and_swap_rebuilds_on_the_new_head_and_returns_its_commit(hub, waits):
    heads = []

    def build(head: str) -> dict[str, bytes]:
        heads.append(head)
        if len(heads) == 1:  # another writer commits between this read and this commit
            hub.upload_file(path_or_fileobj=b"theirs", path_in_repo="eval/other.json", repo_id=REPO)
        return {"eval/mine.json": json.dumps({"seen": head}).encode()}

    oid = ar.commit_cas(hub, REPO, build, "eval: mine")
    assert oid == hub.repo_info(REPO).sha and heads[0] != heads[1]
    assert json.loads((hub.root / REPO / "eval/mine.json").read_text()) == {"seen": heads[1]}
    assert (hub.root / REPO / "eval/other.json").read_bytes() == b"theirs"


class BusyHub(LocalHub):
    """LocalHub where another writer's commit of `slow.bin` stays in progress until `release` is set."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.applying, self.release = threading.Event(), threading.Event()

    def _apply(self, repo: Path, op: CommitOperationAdd) -> str:
        if op.path_in_repo == "slow.bin":
            self.applying.set()
            self.release.wait(timeout=30)
        return LocalHub._apply(repo, op)


def test_a_commit_that_overlaps_another_on_the_same_repo_waits_and_then_lands(tmp_path, monkeypatch):
    """Issue 26 (1): the Hub's 409 "another commit operation is in progress" is retried, not fatal."""
    hub = BusyHub(tmp_path / "hub")
    hub.create_repo(REPO)
    other = threading.Thread(target=hub.create_commit, args=(REPO, [CommitOperationAdd("slow.bin", b"x")]),
                             kwargs={"commit_message": "trainer: checkpoint"})
    other.start()
    assert hub.applying.wait(timeout=10)
    with pytest.raises(HfHubHTTPError) as refused:  # what the real client raises for the Hub's answer
        hub.create_commit(REPO, [CommitOperationAdd("eval/x.json", b"{}")], commit_message="probe")
    assert refused.value.response.status_code == 409 and refused.value.server_message == COMMIT_IN_PROGRESS
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        hub.release.set()  # the other commit finishes while this writer waits
        other.join(timeout=10)

    monkeypatch.setattr(time, "sleep", sleep)
    oid = ar.commit(hub, REPO, [CommitOperationAdd("eval/x.json", b"{}")], "eval: x")
    assert waits == [recipe.CONFLICT_BACKOFF_S]
    assert [m for _, m, _ in hub.commits] == ["trainer: checkpoint", "eval: x"] and oid == hub.head(REPO)


def test_a_writer_builds_on_its_own_last_commit_while_the_head_read_still_lags(hub, waits):
    """Issue 26 (2): right after a commit repo_info may still answer the old head; the writer's own CommitInfo.oid
    is the head, so its next compare-and-swap lands at once instead of losing to itself."""
    hub.stale_reads = recipe.PUSH_RETRIES + 1  # the read lags for longer than every attempt
    first = ar.commit_cas(hub, REPO, lambda head: {"eval/a.json": b"1"}, "eval: a")
    assert hub.repo_info(REPO).sha != first  # the double answers the stale head
    heads: list[str] = []
    second = ar.commit_cas(hub, REPO, lambda head: heads.append(head) or {"eval/b.json": b"2"}, "eval: b")
    assert heads == [first] and waits == [] and second == hub.head(REPO) != first


def test_a_lost_compare_and_swap_waits_and_rebuilds_on_the_head_once_the_read_catches_up(hub, waits):
    """Issue 26 (2): after a 412 the loser backs off, reads the head again and rebuilds on it: while the read still
    answers the refused head, that costs one more 412 and wait, never a commit on a stale view."""
    hub.stale_reads = 1
    built: list[str] = []

    def build(head: str) -> dict[str, bytes]:
        built.append(head)
        if len(built) == 1:  # another writer commits between this read and this commit
            hub.upload_file(path_or_fileobj=b"theirs", path_in_repo="eval/other.json", repo_id=REPO)
        return {"eval/mine.json": head.encode()}

    oid = ar.commit_cas(hub, REPO, build, "eval: mine")
    assert waits == [recipe.CONFLICT_BACKOFF_S, 2 * recipe.CONFLICT_BACKOFF_S]  # the 412, then the stale read's 412
    assert built[:2] == [built[0]] * 2 and built[2] != built[0] and oid == hub.head(REPO)
    assert (hub.root / REPO / "eval/mine.json").read_text() == built[2]


@pytest.mark.parametrize(("role", "writable"), [("read", set()), ("fineGrained", {"alice/another-repo"})],
                         ids=["read-only", "fine-grained-other-repo"])
def test_a_token_that_cannot_write_to_an_existing_repo_is_refused_in_one_line(hub, role, writable):
    """Issue 26 (8): create_repo(exist_ok=True) succeeds for such a token; the Hub's write auth-check does not."""
    hub.token_role, hub.writable = role, writable
    hub.create_repo(REPO, private=True, exist_ok=True)  # the check train() had: it passes for this token
    with pytest.raises(ar.Failure) as refused:
        ar.require_write_access(hub, REPO)
    line = str(refused.value)
    assert line.startswith(f"HF_TOKEN cannot write to {REPO} (HTTP 403: ") and "\n" not in line
    assert line.endswith(f"use a write token, or a fine-grained token with write access to {REPO}")


@pytest.mark.parametrize("role", ["write", "fineGrained"])
def test_a_token_that_may_write_passes_and_a_missing_repo_is_created_private(tmp_path, role):
    hub = LocalHub(tmp_path / "hub")
    hub.token_role, hub.writable = role, {REPO}
    ar.require_write_access(hub, REPO)
    assert hub.list_repo_files(REPO) == [] and hub.commits == []


def test_the_watcher_and_the_full_eval_never_share_a_file():
    names = [ar.FINAL, *(ar.checkpoint_name(s) for s in (1, 100, 1000))]
    full = {ar.full_results_path(n) for n in names}
    watch = {ar.watch_results_path(n) for n in names} | {ar.WATCH_BASE_PATH}
    assert len(full) == len(names) and len(watch) == len(names) + 1
    assert not full & (watch | {ar.SUMMARY_PATH})
    assert ar.watched_checkpoints([*full, *watch, ar.SUMMARY_PATH]) == {n: ar.watch_results_path(n) for n in names}


@pytest.mark.parametrize(("name", "ok"), [("final", True), ("checkpoint-300", True), ("checkpoint-0", False),
                                          ("checkpoint-", False), ("step-5", False), ("checkpoint-3/..", False)])
def test_checkpoint_names(name, ok):
    assert (re.fullmatch(recipe.CHECKPOINT_PATTERN, name) is not None) is ok
    # the CHECKPOINT knob's check is the layout's rule, with the user-facing line on a refusal
    if ok:
        assert recipe.knob("CHECKPOINT", {"CHECKPOINT": name}) == name
    else:
        with pytest.raises(recipe.ConfigError, match=r"^CHECKPOINT=.* is not a checkpoint name: use 'final' or e\.g\."):
            recipe.knob("CHECKPOINT", {"CHECKPOINT": name})


# --- one line per failure ---------------------------------------------------------------------------------------
def hub_refusal(status: int) -> Exception:
    try:
        raise_hub_error(status, f"https://huggingface.co/api/models/{REPO}",
                        "Invalid credentials in Authorization header")
    except Exception as error:  # noqa: BLE001 - the real client's error, as a value
        return error
    raise AssertionError("raise_hub_error returned")


def wrapped(error: Exception) -> Exception:
    """`error` as a library re-raises it: masked by another exception while handling it (OpenEnv, transformers)."""
    try:
        try:
            raise error
        except Exception:  # noqa: BLE001
            raise TypeError("object NoneType can't be used in 'await' expression") from None
    except TypeError as outer:
        outer.__context__ = error
        return outer


@pytest.mark.parametrize(("error", "code", "line"), [
    (recipe.ConfigError("N_TASKS=0 is out of range: use 1..250"), 2, "N_TASKS=0 is out of range: use 1..250"),
    (ar.PushError("commit 'x' to a/b failed (HTTP 403: no)"), 1, "commit 'x' to a/b failed (HTTP 403: no)"),
    (wrapped(hub_refusal(401)), 1,
     "the Hub refused a request (HTTP 401: Invalid credentials in Authorization header): check HF_TOKEN"),
    (wrapped(httpx.ConnectError("All connection attempts failed", request=httpx.Request("GET", "http://127.0.0.1:9/mcp"))),
     1, "could not reach http://127.0.0.1:9/mcp (ConnectError: All connection attempts failed): the server there is "
        "not running, or the URL is wrong; start it or fix the URL, and rerun"),
    (KeyError("global_step"), 1, "unexpected KeyError: 'global_step': rerun with DEBUG=1 for the full traceback"),
])
def test_every_failure_is_one_line_with_its_exit_code(capsys, error, code, line):
    def main() -> None:
        raise error

    assert ar.run_cli("x.py", main, {}) == code
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"x.py: {line}") and err.count("\n") == 1


def test_debug_prints_the_traceback_before_the_line_and_a_bad_debug_is_refused_up_front(capsys):
    def main() -> None:
        raise ValueError("first line\nsecond line")

    assert ar.run_cli("x.py", main, {"DEBUG": "yes"}) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "ValueError: first line" in err
    assert err.splitlines()[-1].startswith("x.py: unexpected ValueError: first line: rerun with DEBUG=1")
    ran = []
    assert ar.run_cli("x.py", lambda: ran.append(1), {"DEBUG": "2"}) == 2 and ran == []
    assert capsys.readouterr().err.startswith("x.py: DEBUG='2' is not a yes/no value")
    assert ar.run_cli("x.py", lambda: ran.append(1), {}) == 0 and ran == [1]
