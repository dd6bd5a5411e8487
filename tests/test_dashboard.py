"""dashboard.py: a dashboard Space that cannot be reached means local Trackio logs and one line, never a failure."""

from __future__ import annotations

import huggingface_hub
import pytest
from huggingface_hub import CommitInfo

import dashboard
import recipe
from tests.hub_double import ENDPOINT, raise_hub_error

CANARY = "hf_" + "CanaryTokenValue0123456789abcdefXYZ"  # never in any output; assembled so scanners skip it


def test_unreachable_space_falls_back_to_local_logs_with_one_line(monkeypatch, capsys, tmp_path):
    """Offline (the Hub refuses every call), Trackio cannot resolve or create the Space: the run logs locally."""
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    run = f"train-{tmp_path.name}"
    assert dashboard.init_run("dashboard-test", run, recipe.DASHBOARD_SPACE, {"HF_TOKEN": CANARY}) is None
    trackio.log({"train/loss": 0.5})
    trackio.finish()
    out, err = capsys.readouterr()
    [line] = [line for line in out.splitlines() if line.startswith("dashboard:")]
    assert f"Space {recipe.DASHBOARD_SPACE} unavailable" in line and "metrics are logged locally" in line
    assert CANARY not in out + err
    assert [row["train/loss"] for row in SQLiteStorage.get_logs("dashboard-test", run)] == [0.5]


def test_eval_dashboard_failure_is_said_once_and_the_eval_goes_on(monkeypatch, capsys):
    import trackio

    def refuse(*_: object, **__: object) -> None:
        raise OSError(f"disk full ({CANARY})")

    monkeypatch.setattr(trackio, "init", refuse)
    board = dashboard.EvalDashboard("you/repo", "eval", {"DASHBOARD_SPACE": "local", "HF_TOKEN": CANARY})
    board.log({"eval/pass_at_1": 0.5}, step=100)
    board.log({"eval/pass_at_1": 0.6}, step=200)
    board.finish()
    out = capsys.readouterr().out
    assert out.count("dashboard: eval logging stopped (OSError: disk full (<redacted>))") == 1 and CANARY not in out


def test_an_eval_logs_to_no_dashboard_unless_the_reporter_is_trackio(monkeypatch):
    import trackio

    monkeypatch.setattr(trackio, "init", lambda *_, **__: pytest.fail("REPORT_TO=none started a Trackio run"))
    board = dashboard.EvalDashboard("you/repo", "eval", {"REPORT_TO": "none", "DASHBOARD_SPACE": "local"})
    board.log({"eval/pass_at_1": 0.5}, step=100)
    board.finish()
    assert board.state == "off"


@pytest.mark.parametrize(("env", "name"), [
    ({"JOB_ID": "68abc"}, "train-68abc"),
    ({"HF_JOB_ID": "68def"}, "train-68def"),
    ({"SPACE_HOST": "https://68aaa--8000.hf.jobs/"}, "train-68aaa"),
])
def test_run_is_named_after_the_job(env, name):
    assert dashboard.run_name("train", env) == name
    assert dashboard.project("you/LFM2.5-2.6B-opencode-lora-RL-smoke") == "LFM2.5-2.6B-opencode-lora-RL-smoke"


class TrackioHub:
    """The Hub as trackio 0.43.0's Space path calls it (trackio.init -> deploy.py), patched in at huggingface_hub.

    Spaces in `spaces` exist; any other is not found, and creating one is refused with 403 when `refuse_create`
    (a token that may not create Spaces: trackio then asks for a login, which a job without a terminal cannot give).
    Every write is recorded in `calls`. The dashboard Space itself (trackio's RemoteClient) is not reachable here.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, spaces: set[str], refuse_create: bool = False) -> None:
        import trackio

        self.spaces, self.refuse_create = set(spaces), refuse_create
        self.calls: list[tuple[str, ...]] = []
        from trackio import deploy

        for name in ("repo_info", "create_repo", "add_space_secret", "add_space_variable", "delete_space_variable",
                     "login", "create_bucket"):
            monkeypatch.setattr(huggingface_hub, name, getattr(self, name))
        monkeypatch.setattr(huggingface_hub.HfApi, "whoami", lambda api, *a, **k: {"type": "user", "name": "alice"})
        monkeypatch.setattr(deploy, "_warn_if_space_build_fails", lambda space_id: None)  # polls the Hub for 10 min
        monkeypatch.setattr(huggingface_hub.HfApi, "space_info", lambda api, repo_id, **_: self.repo_info(repo_id))
        monkeypatch.setattr(huggingface_hub.HfApi, "bucket_info", lambda api, bucket_id, **_: raise_hub_error(
            404, f"{ENDPOINT}/api/buckets/{bucket_id}", "Bucket not found", "RepoNotFound"))
        monkeypatch.setattr(huggingface_hub.HfApi, "upload_file", lambda api, **kwargs: self.upload_file(**kwargs))
        # The bucket trackio.init mounts at the Space's /data (a new Space has no volumes and no variables yet).
        new = huggingface_hub.SpaceRuntime({"stage": "BUILDING", "volumes": []})
        monkeypatch.setattr(huggingface_hub.HfApi, "get_space_runtime", lambda api, repo_id, **_: new)
        monkeypatch.setattr(huggingface_hub.HfApi, "set_space_volumes",
                            lambda api, repo_id, volumes, **_: self.calls.append(("set_space_volumes", repo_id)))
        monkeypatch.setattr(huggingface_hub.HfApi, "get_space_variables", lambda api, repo_id, **_: {})
        monkeypatch.setattr(trackio, "RemoteClient", self.remote_client)

    def repo_info(self, repo_id: str, **_: object) -> huggingface_hub.SpaceInfo:
        if repo_id not in self.spaces:
            raise_hub_error(404, f"{ENDPOINT}/api/spaces/{repo_id}", "Repository not found", "RepoNotFound")
        return huggingface_hub.SpaceInfo(id=repo_id, sdk="gradio", private=True)

    def create_repo(self, repo_id: str, **kwargs: object) -> None:
        if self.refuse_create:
            raise_hub_error(403, f"{ENDPOINT}/api/repos/create", "You don't have the rights to create a space",
                            method="POST")
        self.calls.append(("create_repo", repo_id, str(kwargs.get("repo_type"))))
        self.spaces.add(repo_id)

    def upload_file(self, *, path_or_fileobj: object, path_in_repo: str, repo_id: str,
                    **_: object) -> CommitInfo:
        self.calls.append(("upload_file", repo_id, path_in_repo))
        return CommitInfo(commit_url=f"{ENDPOINT}/spaces/{repo_id}/commit/{'0' * 40}", commit_message="",
                          commit_description="", oid="0" * 40)

    def create_bucket(self, bucket_id: str, **_: object) -> None:
        self.calls.append(("create_bucket", bucket_id))

    def add_space_secret(self, repo_id: str, key: str, value: str, **_: object) -> None:
        self.calls.append(("add_space_secret", repo_id, key, value))

    def add_space_variable(self, repo_id: str, key: str, value: str, **_: object) -> None:
        self.calls.append(("add_space_variable", repo_id, key, value))

    def delete_space_variable(self, repo_id: str, key: str, **_: object) -> None:
        self.calls.append(("delete_space_variable", repo_id, key))

    @staticmethod
    def login(**_: object) -> None:
        raise EOFError("EOF when reading a line")  # no terminal in a job

    @staticmethod
    def remote_client(space: str, **_: object) -> None:
        raise ConnectionError(f"Could not connect to Space '{space}'. Is it running?")


def test_a_space_trackio_cannot_create_gives_no_url_and_one_line_saying_so(monkeypatch, capsys, tmp_path):
    """Issue 26 (12): trackio.init warns and falls back to local storage; the run must not claim the Space."""
    import trackio

    hub = TrackioHub(monkeypatch, spaces=set(), refuse_create=True)
    space = "alice/lfm-dashboard"
    try:
        url = dashboard.init_run("dashboard-no-space", f"train-{tmp_path.name}", space, {"HF_TOKEN": CANARY})
    finally:
        # The fallback run still names the Space's bucket, which only the real Hub could take: drop it unfinished,
        # or the next trackio.init in this process finishes it against the Hub (a test hung there, unreachable).
        trackio.context_vars.current_run.set(None)
    out, err = capsys.readouterr()
    assert url is None and hub.calls == [] and CANARY not in out + err
    [line] = [line for line in out.splitlines() if line.startswith("dashboard:")]
    assert line.startswith(f"dashboard: Trackio could not create Space {space} (") and "EOF" in line
    assert "no dashboard: metrics are logged locally" in line and "lost when the job ends" in line
    assert dashboard.SPACE_URL.format(space) not in line


def test_trackio_copies_the_token_and_turns_on_mcp_only_when_it_creates_the_space(monkeypatch):
    """Issue 26 (13), the fact README states, on trackio 0.43.0's own deploy code: a Space it creates gets the
    token it runs under as the `HF_TOKEN` secret and an MCP server; a Space that exists gets neither."""
    from trackio import deploy

    monkeypatch.setenv("HF_TOKEN", CANARY)
    hub = TrackioHub(monkeypatch, spaces={"alice/existing"})
    assert deploy.create_space_if_not_exists("alice/new", private=True) is True
    assert ("add_space_secret", "alice/new", "HF_TOKEN", CANARY) in hub.calls
    assert ("add_space_variable", "alice/new", "GRADIO_MCP_SERVER", "True") in hub.calls
    hub.calls.clear()
    assert deploy.create_space_if_not_exists("alice/existing", private=True) is False and hub.calls == []


def test_the_default_dashboard_path_never_copies_the_jobs_token_into_the_space(monkeypatch, capsys, tmp_path):
    """Issue 43 (6): REPORT_TO=trackio (the default) with no Space yet: trackio 0.43.0's own deploy code creates it,
    and must not store the job's write token in it as a secret, nor turn on its MCP server. The Space needs neither:
    Trackio's server checks each writer's own token (`check_hf_token_has_write_access`)."""
    import trackio

    monkeypatch.setenv("HF_TOKEN", CANARY)
    hub = TrackioHub(monkeypatch, spaces=set())
    space = "alice/lfm-dashboard"
    try:
        dashboard.init_run("dashboard-new-space", f"train-{tmp_path.name}", space, {"HF_TOKEN": CANARY})
    finally:
        trackio.context_vars.current_run.set(None)
    out, err = capsys.readouterr()
    assert ("create_repo", space, "space") in hub.calls and ("upload_file", space, "app.py") in hub.calls
    assert [c for c in hub.calls if c[0] == "add_space_secret" or CANARY in c] == []
    assert ("add_space_variable", space, "GRADIO_MCP_SERVER", "True") not in hub.calls
    assert CANARY not in out + err
