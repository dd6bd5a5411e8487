"""Sandbox lifecycle against the real Harbor 0.25, OpenEnv 0.10.0 and huggingface_hub 1.33: the env server's HF Sandbox
idle timeout reaches `Sandbox.create`, each rollout's setup parts are read off Harbor's own trial result, and trial
folders are removed or kept within the recipe's disk budget."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import shlex
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from harbor.environments import hf_sandbox
from harbor.environments.base import HealthcheckError
from harbor.environments.factory import EnvironmentFactory
from harbor.models.task.config import EnvironmentConfig as TaskEnvironmentConfig
from harbor.models.task.id import LocalTaskId
from harbor.models.trial.config import EnvironmentConfig as TrialEnvironmentConfig
from harbor.models.trial.config import TaskConfig, TrialConfig
from harbor.models.trial.paths import TrialPaths
from harbor.models.trial.result import AgentInfo, ExceptionInfo, TimingInfo, TrialResult
from harbor_fixture import materialized
from hf_sandbox_double import RefusingSandbox
from huggingface_hub import Sandbox
from openenv.core.harness.capture.sessions import SessionRegistry
from openenv.harbor import rollout, seams
from openenv.harbor.client import HarborEnv
from stubs import upstream_double
from stubs.procs import free_ports, start, stop, wait_http

import harbor_sessions
import recipe
import sandbox_lifecycle
import seam_patch
import train_rollouts

ROOT = Path(__file__).resolve().parents[1]
# Harbor's trial imports LiteLLM, which otherwise fetches its model cost map from GitHub (no network here).
NO_COST_MAP_FETCH = ("LITELLM_LOCAL_MODEL_COST_MAP", "True")
T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


@pytest.fixture
def env_server_process(monkeypatch):
    """This process patched as the env server's is (`seam_patch.py serve` runs `check`'s steps, then wraps the rollout
    export these tests do not reach, then OpenEnv), with OpenEnv's pristine tables put back afterwards."""
    monkeypatch.setitem(seams.SEAMS, "opencode", seams.SEAMS["opencode"])
    keep_factory(monkeypatch)
    seam_patch.main(["check"])


def keep_factory(monkeypatch) -> None:
    """Put Harbor's own environment factory back after the test (monkeypatch keeps the classmethod itself)."""
    monkeypatch.setattr(EnvironmentFactory, "create_environment_from_config",
                        EnvironmentFactory.__dict__["create_environment_from_config"])


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """One prepared train task (docker_image, 1 CPU / 4 GB), as prepare_tasks.py writes it for the env server."""
    tasks = materialized(tmp_path_factory.mktemp("prepared"), n_medium=1, n_hard=1, n_test=1)
    return sorted((tasks / "train" / "tasks").iterdir())[0]


def hf_sandbox_rollout(task_dir: Path, trials: Path, monkeypatch) -> object:
    """One training rollout through OpenEnv's real run_rollout and Harbor's real Trial and HFSandboxEnvironment,
    with huggingface_hub's Sandbox replaced by the refusing double."""
    monkeypatch.setattr(hf_sandbox, "Sandbox", RefusingSandbox)
    monkeypatch.setattr(RefusingSandbox, "calls", [])
    monkeypatch.setenv(*NO_COST_MAP_FETCH)
    return asyncio.run(rollout.run_rollout(
        task_dir=task_dir, harness="opencode", sandbox=recipe.SANDBOX, registry=SessionRegistry(),
        intercept_url="https://job--8000.hf.jobs/capture", model=recipe.SERVED_MODEL_NAME, trials_dir=trials,
        agent_timeout_sec=float(recipe.AGENT_TIMEOUT_SEC)))


def test_the_sandbox_double_takes_exactly_the_installed_sandbox_create_signature():
    def shape(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    assert shape(RefusingSandbox.create) == shape(Sandbox.create)


def test_the_idle_timeout_covers_the_agent_timeout_setup_and_a_margin():
    assert recipe.SANDBOX_IDLE_TIMEOUT_S == (recipe.AGENT_TIMEOUT_SEC + recipe.ROLLOUT_SETUP_BUDGET_S
                                             + recipe.SANDBOX_IDLE_MARGIN_S)
    assert recipe.SANDBOX_IDLE_TIMEOUT_S > recipe.ROLLOUT_CALL_LIMIT_S > recipe.AGENT_TIMEOUT_SEC
    assert recipe.SANDBOX_IDLE_TIMEOUT_S > hf_sandbox._DEFAULT_IDLE_TIMEOUT


def test_without_the_env_server_patch_harbor_asks_for_an_idle_timeout_shorter_than_the_agent_timeout(
        task_dir, tmp_path, monkeypatch):
    """What the patch is for: Harbor's own default reaches Sandbox.create and is below AGENT_TIMEOUT_SEC."""
    keep_factory(monkeypatch)
    if getattr(EnvironmentFactory.create_environment_from_config, sandbox_lifecycle._PATCHED, False):
        pytest.skip("Harbor's environment factory already patched in this process")
    hf_sandbox_rollout(task_dir, tmp_path / "trials", monkeypatch)
    assert [call["idle_timeout"] for call in RefusingSandbox.calls] == [hf_sandbox._DEFAULT_IDLE_TIMEOUT]
    assert hf_sandbox._DEFAULT_IDLE_TIMEOUT < recipe.AGENT_TIMEOUT_SEC


def test_an_env_server_rollout_asks_sandbox_create_for_the_recipe_idle_timeout(
        env_server_process, task_dir, tmp_path, monkeypatch):
    result = hf_sandbox_rollout(task_dir, tmp_path / "trials", monkeypatch)
    assert len(RefusingSandbox.calls) == 1
    call = RefusingSandbox.calls[0]
    assert call["idle_timeout"] == recipe.SANDBOX_IDLE_TIMEOUT_S
    assert call["image"] == recipe.TASK_IMAGE and call["forward_hf_token"] is False
    # The refused start is a failed rollout, and the trial's own config records what was asked for.
    assert result.ok is False and result.exception_type == "SandboxError", result
    config = json.loads(TrialPaths(tmp_path / "trials" / result.trial_name).config_path.read_text())
    assert config["environment"]["kwargs"] == {sandbox_lifecycle.IDLE_KWARG: recipe.SANDBOX_IDLE_TIMEOUT_S}


def environment_through_harbor(tmp_path: Path, type: str, **kwargs) -> tuple[object, TrialEnvironmentConfig]:
    """An environment built by Harbor's factory from a trial's environment config, as Trial does (nothing starts)."""
    (tmp_path / "Dockerfile").write_text(f"FROM {recipe.TASK_IMAGE}\n")
    config = TrialEnvironmentConfig(type=type, kwargs=kwargs)
    environment = EnvironmentFactory.create_environment_from_config(
        config=config, environment_dir=tmp_path, environment_name="t", session_id="t__env",
        trial_paths=TrialPaths(tmp_path), task_env_config=TaskEnvironmentConfig(docker_image=recipe.TASK_IMAGE))
    return environment, config


def test_the_patch_keeps_an_explicit_idle_timeout_leaves_other_backends_alone_and_applies_once(
        env_server_process, tmp_path):
    assert sandbox_lifecycle.apply_idle_timeout() is False
    explicit, _ = environment_through_harbor(tmp_path, recipe.SANDBOX, job_timeout="1h")
    assert explicit._idle_timeout == 3600
    docker, config = environment_through_harbor(tmp_path, "docker")
    assert type(docker).__name__ == "DockerEnvironment" and config.kwargs == {}


@pytest.mark.parametrize(("sandbox", "harbors_own"), [
    ("daytona", {"_auto_stop_interval": 0, "_auto_delete_interval": 0}),  # 0: never stops (a crashed server's bill)
    ("e2b", {"_sandbox_timeout": 86400})])
def test_each_backends_lifetime_reaches_its_environment_only_through_the_patch(sandbox, harbors_own, tmp_path,
                                                                              monkeypatch):
    """Harbor's own defaults without the env server's patch; the recipe's bound with it (the SDK calls that carry them
    are checked in tests/test_chain_backends.py)."""
    keep_factory(monkeypatch)
    for folder in ("bare", "patched"):
        (tmp_path / folder).mkdir()
    if not getattr(EnvironmentFactory.create_environment_from_config, sandbox_lifecycle._PATCHED, False):
        bare, _ = environment_through_harbor(tmp_path / "bare", sandbox)
        assert {name: getattr(bare, name) for name in harbors_own} == harbors_own
        sandbox_lifecycle.apply_idle_timeout()
    patched, config = environment_through_harbor(tmp_path / "patched", sandbox)
    assert config.kwargs == sandbox_lifecycle.lifetime_kwargs(sandbox)
    if sandbox == "daytona":
        assert patched._auto_stop_interval * 60 >= recipe.SANDBOX_IDLE_TIMEOUT_S and patched._auto_delete_interval == 0
    else:
        assert patched._sandbox_timeout == recipe.SANDBOX_IDLE_TIMEOUT_S


def test_every_e2b_task_of_one_image_and_size_shares_one_template(env_server_process, tmp_path):
    """Harbor names a template per task ({task}__{hash}); the patch names it by what it is built from."""
    names = set()
    for task in ("task-a", "task-b"):
        (tmp_path / task).mkdir()
        environment, _ = environment_through_harbor(tmp_path / task, "e2b")
        names.add(environment._template_name)
    assert names == {sandbox_lifecycle.template_name(recipe.TASK_IMAGE, None, None)}  # no cpus/memory in this config
    image = recipe.TASK_IMAGE
    builds = [(image, 1, 4096), (image, 2, 4096), (image, 1, 8192), ("o:1", 1, 4096)]
    assert len({sandbox_lifecycle.template_name(*build) for build in builds}) == len(builds)  # unlike ones: their own


@pytest.mark.parametrize(("sandbox", "keys", "said"), [
    ("daytona", {}, "seam_patch: Harbor's daytona preflight: Daytona requires either DAYTONA_API_KEY, or both"),
    ("daytona", {"DAYTONA_JWT_TOKEN": "jwt"}, "seam_patch: Harbor's daytona preflight: Daytona requires"),
    ("e2b", {}, "seam_patch: Harbor's e2b preflight: E2B requires E2B_API_KEY to be set"),
    ("daytona", {"DAYTONA_API_KEY": "k"}, "daytona trials ask for auto_stop_interval=35 min and auto_delete_inter"),
    ("e2b", {"E2B_API_KEY": "k"}, "e2b trials ask for timeout=2100 s; every task of "
                                  f"{recipe.TASK_IMAGE} uses template env-data-agent-train-base-1cpu-4096mb-")])
def test_the_env_server_runs_harbors_own_preflight_for_its_backend(sandbox, keys, said):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAYTONA_", "E2B_"))} | keys | {"SANDBOX": sandbox}
    out = subprocess.run([sys.executable, str(ROOT / "seam_patch.py"), "check"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == (0 if "trials ask" in said else 1), out.stderr
    assert said in (out.stdout if out.returncode == 0 else out.stderr.strip()) and out.stderr.count("\n") <= 1


@pytest.mark.parametrize(("drift", "said"), [
    ("ignores", f"a hf-sandbox trial would ask for {{'job_timeout': {hf_sandbox._DEFAULT_IDLE_TIMEOUT}}}, not "
                f"{{'job_timeout': {recipe.SANDBOX_IDLE_TIMEOUT_S}}}: the lifetime patch is not in effect"),
    ("renames", "harbor's hf-sandbox environment changed shape ('HFSandboxEnvironment' object has no attribute "
                "'_idle_timeout')")])
def test_a_harbor_that_drops_the_lifetime_stops_the_env_server_in_one_line(env_server_process, monkeypatch, drift,
                                                                           said):
    """A Harbor whose environment ignores the lifetime kwarg (it takes **kwargs) or keeps it elsewhere: the check the
    env server runs at start (seam_patch.py) names it, rather than a sandbox idling out under a running agent."""
    harbors_init = hf_sandbox.HFSandboxEnvironment.__init__

    def drifted(self, *args, job_timeout=None, **kwargs):
        harbors_init(self, *args, job_timeout=None if drift == "ignores" else job_timeout, **kwargs)
        if drift == "renames":
            del self._idle_timeout

    monkeypatch.setattr(hf_sandbox.HFSandboxEnvironment, "__init__", drifted)
    with pytest.raises(sandbox_lifecycle.ShapeError) as error:
        sandbox_lifecycle.verify_lifetime("hf-sandbox")
    assert said in str(error.value) and "\n" not in str(error.value)


def test_seam_patch_check_says_the_idle_timeout_it_set(env_server_process, capsys):
    seam_patch.main(["check"])  # again: a second check changes nothing and says the same
    assert f"{recipe.SANDBOX} trials ask for idle_timeout={recipe.SANDBOX_IDLE_TIMEOUT_S} s" in capsys.readouterr().out


def test_the_env_server_as_serve_env_sh_starts_it_sends_the_idle_timeout_to_sandbox_create(task_dir, tmp_path):
    """serve_env.sh's own plan (DRY_RUN), run with the Sandbox double in the server process; one rollout through
    OpenEnv's client: what reaches Sandbox.create in the job's env server process."""
    upstream = upstream_double.start(model=recipe.SERVED_MODEL_NAME)
    env_port, public_port = free_ports(2)
    env = {k: v for k, v in os.environ.items() if k not in {"SANDBOX", "DAYTONA_API_KEY", "E2B_API_KEY"}}
    env.update(DRY_RUN="1", PYTHON=sys.executable, HF_TOKEN="hf_dummy", DATASETS=str(task_dir.parents[1]),
               SPACE_HOST=f"job--{public_port}.hf.jobs", ENV_PORT=str(env_port), PUBLIC_PORT=str(public_port),
               POLICY_URL=f"http://127.0.0.1:{upstream.server_address[1]}")
    plan = subprocess.run(["bash", str(ROOT / "serve_env.sh")], env=env, capture_output=True, text=True, timeout=60)
    server = shlex.split(next(line for line in plan.stdout.splitlines() if "seam_patch.py" in line)[4:])
    at = server.index(str(ROOT / "seam_patch.py"))
    assert server[0] == "env" and server[at - 1] == sys.executable, server
    calls = tmp_path / "calls.jsonl"
    server_env = dict(pair.split("=", 1) for pair in server[1:at - 1])
    server_env.update([NO_COST_MAP_FETCH], HF_TOKEN="hf_dummy", OPENENV_HARBOR_TRIALS_DIR=str(tmp_path / "trials"))
    log = open(tmp_path / "env_server.log", "w")  # closed in the finally below
    proc = start([sys.executable, str(ROOT / "tests" / "stubs" / "env_server_sandbox_double.py"), str(calls),
                  *server[at + 1:]], env=server_env, log=log)
    try:
        wait_http(f"http://127.0.0.1:{env_port}/health", proc, timeout=90)
        client = HarborEnv(f"http://127.0.0.1:{env_port}")
        try:
            result = client.run_rollout(sandbox=recipe.SANDBOX, agent_timeout_sec=float(recipe.AGENT_TIMEOUT_SEC))
        finally:
            client.close()
    finally:
        stop(proc)
        log.close()
        upstream.shutdown()
    assert result.ok is False and result.exception_type == "SandboxError", result
    made = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [call["idle_timeout"] for call in made] == [recipe.SANDBOX_IDLE_TIMEOUT_S]
    assert f"idle_timeout={recipe.SANDBOX_IDLE_TIMEOUT_S} s" in (tmp_path / "env_server.log").read_text()


# --- per-rollout timing, from Harbor's own result file ---------------------------------------------------------------
def write_result(trial_dir: Path, **fields) -> Path:
    """A TrialResult built with Harbor's models and written the way Harbor's Trial._finalize writes it."""
    config = TrialConfig(task=TaskConfig(path=Path("tasks/t")), trial_name=trial_dir.name, trials_dir=trial_dir.parent)
    result = TrialResult(task_name="t", trial_name=trial_dir.name, trial_uri=trial_dir.resolve().as_uri(),
                         task_id=LocalTaskId(path=Path("tasks/t")), task_checksum="0" * 16, config=config,
                         agent_info=AgentInfo(name="opencode", version=recipe.OPENCODE_VERSION), started_at=T0,
                         **fields)
    paths = TrialPaths(trial_dir)
    trial_dir.mkdir(parents=True, exist_ok=True)
    paths.result_path.write_text(result.model_dump_json(indent=4))
    return trial_dir


def span(start: float, end: float | None) -> TimingInfo:
    return TimingInfo(started_at=T0 + timedelta(seconds=start),
                      finished_at=None if end is None else T0 + timedelta(seconds=end))


def test_a_full_trial_reports_every_part_in_seconds(tmp_path, capsys):
    trial = write_result(tmp_path / "trial-a", environment_setup=span(0, 7.5), agent_setup=span(19.25, 40),
                         agent_execution=span(40, 340.125), verifier=span(341, 353))
    timing = sandbox_lifecycle.trial_timing(trial)
    assert timing == {"sandbox_start_s": 7.5, "healthcheck_s": 11.75, "agent_setup_s": 20.75,
                      "agent_run_s": 300.125, "verifier_s": 12.0}
    assert sandbox_lifecycle.setup_seconds(timing) == 7.5 + 11.75 + 20.75 + 12.0
    assert "trial-a: sandbox_start_s=7.5 healthcheck_s=11.75" in capsys.readouterr().err


def test_a_failed_healthcheck_is_timed_to_its_failure_and_nothing_after_it_is_reported(tmp_path):
    failure = ExceptionInfo(exception_type=HealthcheckError.__name__, exception_message="retries", occurred_at=T0
                            + timedelta(seconds=70), exception_traceback="")
    trial = write_result(tmp_path / "trial-b", environment_setup=span(0, 10), exception_info=failure)
    assert sandbox_lifecycle.trial_timing(trial) == {"sandbox_start_s": 10.0, "healthcheck_s": 60.0}


def test_an_agent_that_never_finished_reports_no_run_time(tmp_path):
    trial = write_result(tmp_path / "trial-c", environment_setup=span(0, 5), agent_setup=span(5, 9),
                         agent_execution=span(9, None))
    assert sandbox_lifecycle.trial_timing(trial) == {"sandbox_start_s": 5.0, "healthcheck_s": 0.0,
                                                     "agent_setup_s": 4.0}


def test_a_sandbox_that_failed_to_start_reports_only_its_start_as_harbor_wrote_it(
        env_server_process, task_dir, tmp_path, monkeypatch):
    result = hf_sandbox_rollout(task_dir, tmp_path / "trials", monkeypatch)
    timing = sandbox_lifecycle.trial_timing(tmp_path / "trials" / result.trial_name)
    assert list(timing) == ["sandbox_start_s"] and 0 <= timing["sandbox_start_s"] < 60


def test_a_trial_without_a_result_file_has_no_timing(tmp_path, capsys):
    (tmp_path / "running").mkdir()
    assert sandbox_lifecycle.trial_timing(tmp_path / "running") == {}
    (tmp_path / "running" / "result.json").write_text("{}")
    assert sandbox_lifecycle.trial_timing(tmp_path / "running") == {}
    assert "no timing from" in capsys.readouterr().err


# --- trial folders ---------------------------------------------------------------------------------------------------
def finished_trial(trials: Path, name: str, size: int, age_s: float) -> Path:
    trial = write_result(trials / name, environment_setup=span(0, 1))
    TrialPaths(trial).config_path.write_text("{}")  # Harbor writes it when the trial starts
    (trial / "agent").mkdir()
    (trial / "agent" / "opencode.txt").write_bytes(b"x" * size)
    when = datetime.now().timestamp() - age_s
    os.utime(TrialPaths(trial).result_path, (when, when))
    return trial


def test_a_scored_rollouts_trial_folder_is_removed(tmp_path):
    trial = finished_trial(tmp_path, "ok-1", 10, 0)
    sandbox_lifecycle.finish_trial(trial, failed=False)
    assert not trial.exists()
    sandbox_lifecycle.finish_trial(trial, failed=False)  # already gone: fine


def test_a_folder_that_is_not_one_trial_is_never_removed(tmp_path):
    """An empty trial name makes the trials folder itself out of `trials_dir / name`: nothing is removed."""
    trial = finished_trial(tmp_path, "ok-2", 10, 0)
    for failed in (False, True):
        sandbox_lifecycle.finish_trial(tmp_path / "", failed=failed)
    assert trial.exists()


def test_failed_trials_are_kept_newest_first_within_the_disk_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(recipe, "FAILED_TRIALS_KEEP_MB", 1)
    old = [finished_trial(tmp_path, f"failed-{i}", 400_000, 100 - i) for i in range(3)]
    running = tmp_path / "running"  # no result file yet: Harbor is still on it
    (running / "agent").mkdir(parents=True)
    (running / "agent" / "big.txt").write_bytes(b"x" * 3_000_000)
    newest = finished_trial(tmp_path, "failed-new", 400_000, 0)
    sandbox_lifecycle.finish_trial(newest, failed=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["failed-2", "failed-new", "running"]
    assert not old[0].exists() and not old[1].exists()



def test_a_kept_trial_folder_holds_no_session_key(env_server_process, task_dir, tmp_path, monkeypatch):
    """Issue 44, item 6: Harbor writes the rollout's capture session key (OpenCode's apiKey and, seam-patched,
    x-api-key) into the trial's config.json, result.json and lock.json. A failed rollout's folder is kept to be shared
    for debugging: when the trainer's session closes it (harbor_sessions, as in the job), the key is gone from every
    file, and the files still parse."""
    result = hf_sandbox_rollout(task_dir, tmp_path / "trials", monkeypatch)
    trial, key = tmp_path / "trials" / result.trial_name, result.session_id.encode()
    written = sorted(path.name for path in trial.rglob("*") if path.is_file() and key in path.read_bytes())
    assert {"config.json", "result.json", "lock.json"} <= set(written), written
    monkeypatch.setenv("OPENENV_HARBOR_TRIALS_DIR", str(tmp_path / "trials"))
    session = harbor_sessions.HarborRolloutSession("http://127.0.0.1:9", split="train", task_index=0, sampling={})
    session.result = result
    session.close()
    assert trial.is_dir()  # failed: kept
    assert [path for path in trial.rglob("*") if path.is_file() and key in path.read_bytes()] == []
    for name in written:
        if name.endswith(".json"):
            assert sandbox_lifecycle.REDACTED in json.dumps(json.loads((trial / name).read_text()))

# --- the ledger's timing, for the smoke report --------------------------------------------------------------------
def test_the_ledger_keeps_the_count_and_the_slowest_of_each_part_and_of_setup(tmp_path):
    fast = sandbox_lifecycle.trial_timing(write_result(
        tmp_path / "fast", environment_setup=span(0, 5), agent_setup=span(8, 20), agent_execution=span(20, 900),
        verifier=span(900, 910)))
    slow_start = sandbox_lifecycle.trial_timing(write_result(
        tmp_path / "slow", environment_setup=span(0, 90), agent_setup=span(91, 95), agent_execution=span(95, 100),
        verifier=span(100, 101)))
    ledger = train_rollouts.Ledger(tmp_path / "rollouts.json")
    assert ledger.state["timing"] == {"count": 0, "max": {}}
    ledger.record(None, timing=fast)
    ledger.record("rollout", "exit code 1", timing=slow_start)
    ledger.record("create", "env server down")  # no trial, no timing
    on_disk = json.loads((tmp_path / "rollouts.json").read_text())["timing"]
    # setup_s is the slowest rollout's setup (90 + 1 + 4 + 1), not the sum of each part's slowest (115).
    assert on_disk == {"count": 2, "max": {"sandbox_start_s": 90.0, "healthcheck_s": 3.0, "agent_setup_s": 12.0,
                                           "agent_run_s": 880.0, "verifier_s": 10.0, "setup_s": 96.0}}
