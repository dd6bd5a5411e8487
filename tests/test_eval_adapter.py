"""eval_adapter: summarize() on hand-made cases, resumable cells, the LoRA client against vLLM's shapes,
and a whole base-vs-adapter eval against the local Hub and vLLM doubles."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from hub_double import LocalHub
from run_job_harness import assert_no_leftovers
from stubs.procs import free_port_knobs, free_ports, wait_http
from vllm_lora_double import EvalFactoryDouble, Killed, VllmLoraDouble, save_tiny_adapter

import adapter_repo
import dashboard
import eval_adapter as ea
import recipe
from adapter_repo import push_folder
from tests import offline

REPO = "you/LFM2.5-2.6B-opencode-lora-RL"


# --- summarize ------------------------------------------------------------------------------------
def test_summarize_all_agree():
    cells = {"a": 1.0, "b": 0.0, "c": 1.0, "d": 1.0}
    s = ea.summarize(cells, dict(cells))
    for side in ("base", "adapter"):
        assert s[side] | {"ci95": None} == {"tasks": 4, "scored": 4, "correct": 3, "unscorable": 0,
                                             "pass_at_1": 0.75, "ci95": None}
        lo, hi = s[side]["ci95"]
        assert lo < 0.75 < hi
    p = s["paired"]
    assert (p["tasks"], p["both"], p["only_base"], p["only_adapter"], p["neither"]) == (4, 3, 0, 0, 1)
    assert p["difference"] == 0.0 and p["ci95"] == [0.0, 0.0] and p["mcnemar_p"] == 1.0


def test_summarize_disjoint_wins():
    base = {f"t{i}": float(i < 5) for i in range(10)}
    adapter = {f"t{i}": float(i >= 5) for i in range(10)}
    p = ea.summarize(base, adapter)["paired"]
    assert (p["both"], p["only_base"], p["only_adapter"], p["neither"]) == (0, 5, 5, 0)
    assert p["difference"] == 0.0 and p["mcnemar_p"] == 1.0
    lo, hi = p["ci95"]
    assert lo < 0 < hi


def test_summarize_one_sided_wins_are_significant_and_interval_excludes_zero():
    base = {f"t{i}": 0.0 for i in range(40)}
    adapter = {f"t{i}": float(i < 9) for i in range(40)}
    p = ea.summarize(base, adapter)["paired"]
    assert (p["only_adapter"], p["only_base"], p["neither"]) == (9, 0, 31)
    assert p["difference"] == pytest.approx(9 / 40)
    assert p["mcnemar_p"] == pytest.approx(2 / 2**9)  # exact sign test: 2 * P(X=0), X ~ Bin(9, 1/2)
    assert 0 < p["ci95"][0] < 9 / 40 < p["ci95"][1]


def test_mcnemar_exact_matches_binomial_tail():
    # 1 vs 9 discordant: two-sided p = 2 * (C(10,0) + C(10,1)) / 2^10
    assert ea.mcnemar_exact_p(1, 9) == pytest.approx(22 / 1024)
    assert ea.mcnemar_exact_p(9, 1) == ea.mcnemar_exact_p(1, 9)
    assert ea.mcnemar_exact_p(0, 0) == 1.0


def test_summarize_excludes_unscorable_from_denominators_and_reports_them():
    base = {"a": 1.0, "b": None, "c": 0.0, "d": 1.0}
    adapter = {"a": 1.0, "b": 1.0, "c": None, "d": 0.0}
    s = ea.summarize(base, adapter)
    assert s["base"] | {"ci95": None} == {"tasks": 4, "scored": 3, "correct": 2, "unscorable": 1,
                                          "pass_at_1": 2 / 3, "ci95": None}
    assert s["adapter"]["scored"] == 3 and s["adapter"]["unscorable"] == 1 and s["adapter"]["pass_at_1"] == 2 / 3
    p = s["paired"]  # only a and d are scored on both sides
    assert (p["tasks"], p["both"], p["only_base"], p["only_adapter"]) == (2, 1, 1, 0)
    assert p["difference"] == -0.5


def test_summarize_is_deterministic_and_seeded():
    base = {f"t{i}": float(i % 3 == 0) for i in range(250)}
    adapter = {f"t{i}": float(i % 2 == 0) for i in range(250)}
    first, second = ea.summarize(base, adapter), ea.summarize(base, adapter)
    assert first == second
    other = ea.bootstrap_ci([int(adapter[t]) - int(base[t]) for t in sorted(base)], seed=recipe.EVAL_SEED + 1)
    assert other != tuple(first["paired"]["ci95"])


# --- eval contract --------------------------------------------------------------------------------
def test_eval_sampling_is_explicit_and_accepted_by_openenv():
    policy = ea.eval_sampling()
    assert policy == {"temperature": recipe.TEMPERATURE, "top_p": recipe.TOP_P, "top_k": recipe.EVAL_TOP_K}
    from openenv.core.harness.capture.sessions import SessionRegistry

    session = SessionRegistry().create(purpose="eval", eval_sampling=policy)  # OpenEnv's own check
    assert session.eval_sampling == policy


def test_eval_sampling_top_k_zero_is_refused_before_any_rollout(monkeypatch):
    monkeypatch.setattr(recipe, "EVAL_TOP_K", 0)
    with pytest.raises(ValueError, match="top_k"):  # OpenEnv's own validator
        ea.eval_sampling()


def test_choose_split():
    from harbor_sessions import choose_split

    splits = ["/data/datasets/train", "/data/datasets/test"]
    assert choose_split(splits[:1], "") == "/data/datasets/train"
    assert choose_split(splits, "/data/datasets/test") == "/data/datasets/test"
    with pytest.raises(recipe.ConfigError, match="has no split 'nope'.*EVAL_SPLIT"):
        choose_split(splits, "nope")
    with pytest.raises(recipe.ConfigError, match="serves several splits.*EVAL_SPLIT"):
        choose_split(splits, "")  # never a guess: a training factory would train on the test tasks


# --- cells: retries, resume, output cap -----------------------------------------------------------
@pytest.fixture()
def vllm():
    with VllmLoraDouble(recipe.SERVED_MODEL_NAME) as server:
        yield server


def _tasks(n):
    return [{"index": i, "task_name": f"task_{i}"} for i in range(n)]


def test_unscorable_cells_are_retried_a_bounded_number_of_times(tmp_path, vllm):
    failures = {1: 1, 2: 99}  # task 1 fails once then works; task 2 never runs

    def outcome(task, model):
        if failures.get(task, 0) > 0:
            failures[task] -= 1
            return None
        return 1.0

    factory = EvalFactoryDouble(vllm.url, outcome)
    results = ea.ResultsFile(tmp_path / "r.json", {})
    jobs = [("base", recipe.SERVED_MODEL_NAME, t) for t in _tasks(3)]
    ea.run_cells(factory, jobs, results, concurrency=2)
    cells = {c["task_index"]: c for c in results.doc["cells"]}
    assert cells[0] | {"duration_s": 0} == {"side": "base", "task_index": 0, "task_name": "task_0", "weights": "",
                                            "attempts": 1, "reward": 1.0, "correct": True, "unscorable": False,
                                            "tool_calls": 1, "model_calls": 2, "error": None, "rollout_error": None,
                                            "duration_s": 0}
    assert cells[1]["attempts"] == 2 and not cells[1]["unscorable"]
    assert cells[2]["attempts"] == recipe.EVAL_CELL_ATTEMPTS and cells[2]["unscorable"]
    assert cells[2]["correct"] is None and "sandbox failed" in cells[2]["error"]
    assert [t for t, _ in factory.calls].count(2) == recipe.EVAL_CELL_ATTEMPTS
    assert json.loads((tmp_path / "r.json").read_text()) == results.doc  # written through to disk


class _Finished:
    """A rollout that already ended with `result` (a real HarborRolloutResult), as HarborEvalSession leaves it."""

    def __init__(self, result):
        self.result = result

    def wait_for_completion(self):
        return 0 if self.result.ok else 1

    def close(self):
        pass


def _timed_out(reward):
    """What openenv 0.10.0's run_rollout returns when Harbor grades a rollout whose agent timed out (rollout.py:
    Harbor's exception_info makes it ok=False, the verifier's reward is kept). The agent made model calls."""
    from openenv.harbor.models import HarborRolloutResult, HarborTurn

    return HarborRolloutResult(ok=False, reward=reward, rollout_type="eval", capture_level="text",
                               exception_type="AgentTimeoutError", n_turns=3,
                               error="Agent execution timed out after 600.0 seconds", turns=[HarborTurn(turn=0)])


def test_a_graded_rollout_counts_with_its_grade_though_its_agent_timed_out(tmp_path):
    """Issue 29 defect 6: 3 solved, 5 timed out (graded 0), 2 wrong of 10 is pass@1 0.3, each cell run once."""
    from openenv.harbor.models import HarborRolloutResult, HarborTurn

    def done(reward):
        return HarborRolloutResult(ok=True, reward=reward, rollout_type="eval", capture_level="text", n_turns=2,
                                   turns=[HarborTurn(turn=0)])

    outcomes = [done(1.0)] * 3 + [_timed_out(0.0)] * 5 + [done(0.0)] * 2
    calls: list[int] = []

    def factory(task, model):
        calls.append(task)
        return _Finished(outcomes[task])

    results = ea.ResultsFile(tmp_path / "r.json", {})
    ea.run_cells(factory, [("base", recipe.SERVED_MODEL_NAME, t) for t in _tasks(10)], results, concurrency=2)
    stats = ea.side_stats(ea.rewards(results.doc["cells"], "base"))
    assert (stats["pass_at_1"], stats["scored"], stats["unscorable"]) == (0.3, 10, 0)
    assert sorted(calls) == list(range(10))  # a graded cell is final: no retry
    timed_out = [c for c in results.doc["cells"] if 3 <= c["task_index"] < 8]
    assert all(c["correct"] is False and c["error"] is None for c in timed_out)
    assert all(c["rollout_error"] == "Agent execution timed out after 600.0 seconds" for c in timed_out)


def test_the_session_clients_timed_out_rollout_counts_with_its_grade_in_the_eval(monkeypatch):
    """harbor_sessions' session raises TimeoutError for an agent that ran out of time (TRL's contract, for training),
    after Harbor graded it: the eval cell takes the grade from the session's result, not from the exception."""
    from openenv.harbor import client

    import harbor_sessions

    class OneRollout:  # openenv's HarborEnv as the session calls it; answers what openenv 0.10.0 returns for a timeout
        def __init__(self, base_url: str, message_timeout_s: float, websocket_ping_timeout_s: float) -> None:
            pass

        def run_rollout(self, **call):
            return _timed_out(1.0)

        def close(self) -> None:
            pass

    monkeypatch.setattr(client, "HarborEnv", OneRollout)

    def factory(task, model):
        return harbor_sessions.HarborRolloutSession("http://127.0.0.1:9", split="test", task_index=task,
                                                    purpose="eval", eval_sampling=ea.eval_sampling())

    cell = ea.run_cell(factory, 0, recipe.SERVED_MODEL_NAME)
    assert (cell["reward"], cell["correct"], cell["unscorable"], cell["error"]) == (1.0, True, False, None)


def test_a_rollout_whose_agent_never_reached_the_model_is_unscorable_though_graded(tmp_path, monkeypatch):
    """OpenEnv's own run_rollout (only Harbor's trial is a stand-in: no sandbox here): the agent exits non-zero before
    any model call (e.g. the proxy refused its key) and the verifier grades the untouched workspace 0. The policy did
    nothing: unscorable, retried, never a wrong answer."""
    import asyncio
    from types import SimpleNamespace

    import harbor.trial.trial as harbor_trial
    from harbor.agents.installed.base import NonZeroAgentExitCodeError
    from harbor.models.trial.result import ExceptionInfo
    from harbor_fixture import materialized
    from openenv.core.harness.capture.sessions import SessionRegistry
    from openenv.harbor.rollout import run_rollout

    class Trial:
        async def run(self):
            try:
                raise NonZeroAgentExitCodeError("opencode exited with code 1")
            except NonZeroAgentExitCodeError as exc:
                info = ExceptionInfo.from_exception(exc)
            return SimpleNamespace(verifier_result=SimpleNamespace(rewards={"reward": 0.0}), exception_info=info,
                                   step_results=None, trial_uri=None)

    async def create(config):
        return Trial()

    monkeypatch.setattr(harbor_trial.Trial, "create", staticmethod(create))
    task_dir = next((materialized(tmp_path / "tasks") / "test" / "tasks").iterdir())
    result = asyncio.run(run_rollout(
        task_dir=task_dir, harness="opencode", sandbox=recipe.SANDBOX, registry=SessionRegistry(),
        intercept_url="http://127.0.0.1:9/capture", model=recipe.SERVED_MODEL_NAME, trials_dir=tmp_path / "trials",
        purpose="eval", eval_sampling=ea.eval_sampling(), capture_level="text"))
    assert (result.ok, result.reward, result.exception_type) == (False, 0.0, "NonZeroAgentExitCodeError")
    cell = ea.run_cell(lambda task, model: _Finished(result), 0, recipe.SERVED_MODEL_NAME)
    assert cell["unscorable"] and cell["reward"] is None and cell["correct"] is None
    assert cell["error"].startswith("rollout: opencode exited with code 1")


def test_a_rollout_whose_model_calls_failed_at_the_engine_is_unscorable_though_graded():
    """Issue 41, defect 3, eval side (recipe.graded_reward, the rule training shares): the agent's first call was
    answered, later ones failed at the engine (the env server's upstream finding, seam_patch.py), OpenCode exited
    non-zero and Harbor graded the workspace. An outage is not the adapter's answer: unscorable, retried."""
    from openenv.harbor.models import HarborRolloutResult, HarborTurn

    result = HarborRolloutResult(ok=False, reward=0.0, error="opencode exited with code 1",
                                 exception_type="NonZeroAgentExitCodeError", turns=[HarborTurn(turn=0)],
                                 findings=[f"{recipe.UPSTREAM_FINDING}2 model call(s) failed at the engine"])
    cell = ea.run_cell(lambda task, model: _Finished(result), 0, recipe.SERVED_MODEL_NAME)
    assert (cell["unscorable"], cell["reward"], cell["error"]) == (True, None,
                                                                   "upstream: 2 model call(s) failed at the engine")


def test_killed_eval_resumes_and_reruns_only_cells_without_a_result(tmp_path, vllm):
    jobs = [("base", recipe.SERVED_MODEL_NAME, t) for t in _tasks(6)]
    path = tmp_path / "r.json"
    killer = EvalFactoryDouble(vllm.url, lambda t, m: float(t % 2), kill_after=4)
    with pytest.raises(Killed):
        ea.run_cells(killer, jobs, ea.ResultsFile(path, {}), concurrency=1)
    survived = json.loads(path.read_text())["cells"]
    assert [c["task_index"] for c in survived] == [0, 1, 2, 3]

    again = EvalFactoryDouble(vllm.url, lambda t, m: float(t % 2))
    results = ea.ResultsFile(path, json.loads(path.read_text()))
    ea.run_cells(again, jobs, results, concurrency=1)
    assert [t for t, _ in again.calls] == [4, 5]
    assert [c["task_index"] for c in results.doc["cells"]] == list(range(6))
    assert all(c["attempts"] == 1 for c in results.doc["cells"])


def test_servers_down_stops_the_eval_loudly_and_a_rerun_recovers(tmp_path, vllm, monkeypatch):
    monkeypatch.setattr(recipe, "EVAL_ABORT_STREAK", 4)
    jobs = [("base", recipe.SERVED_MODEL_NAME, t) for t in _tasks(6)]
    results = ea.ResultsFile(tmp_path / "r.json", {})
    down = EvalFactoryDouble(vllm.url, lambda t, m: None)  # every rollout fails: an outage, not 6 wrong answers
    with pytest.raises(ea.InfrastructureDown, match="4 eval cells in a row were unscorable"):
        ea.run_cells(down, jobs, results, concurrency=1)
    assert len(results.doc["cells"]) == 4 and all(c["attempts"] == 1 for c in results.doc["cells"])
    assert len(down.calls) == 4  # no queue of rollouts keeps running after the stop
    up = EvalFactoryDouble(vllm.url, lambda t, m: 1.0)
    ea.run_cells(up, jobs, results, concurrency=1)
    assert sorted(t for t, _ in up.calls) == list(range(6))  # the 4 failed cells are retried, not kept as failures
    assert all(c["correct"] and c["attempts"] in (1, 2) for c in results.doc["cells"])


def test_at_most_concurrency_rollouts_are_in_flight(tmp_path, vllm):
    inner = EvalFactoryDouble(vllm.url, lambda t, m: 1.0)
    lock, state = threading.Lock(), {"now": 0, "peak": 0}

    class Slow:
        def __init__(self, session):
            self.session = session

        def wait_for_completion(self):
            with lock:
                state["now"] += 1
                state["peak"] = max(state["peak"], state["now"])
            time.sleep(0.05)
            try:
                return self.session.wait_for_completion()
            finally:
                with lock:
                    state["now"] -= 1

        @property
        def result(self):
            return self.session.result

        def close(self):
            self.session.close()

    results = ea.ResultsFile(tmp_path / "r.json", {})
    jobs = [("base", recipe.SERVED_MODEL_NAME, t) for t in _tasks(12)]
    ea.run_cells(lambda t, m: Slow(inner(t, m)), jobs, results, concurrency=3)
    assert state["peak"] == 3 and len(results.doc["cells"]) == 12


def test_merge_cells_keeps_one_record_per_cell_preferring_scored():
    unscorable = {"side": "adapter", "task_index": 3, "unscorable": True, "attempts": 2, "reward": None}
    scored = {"side": "adapter", "task_index": 3, "unscorable": False, "attempts": 1, "reward": 1.0}
    other = {"side": "base", "task_index": 3, "unscorable": False, "attempts": 1, "reward": 0.0}
    assert ea.merge_cells([unscorable, other], [scored]) == [scored, other]
    assert ea.merge_cells([scored], [unscorable]) == [scored]


# --- vLLM LoRA client -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return save_tiny_adapter(tmp_path_factory.mktemp("adapter"))


def test_lora_server_uses_vllm_request_shapes(vllm, adapter_dir):
    lora = ea.LoraServer(vllm.url)
    with lora.serving("opencode-lora-checkpoint-100", adapter_dir):
        assert vllm.requests[-1] == ("POST", "/v1/load_lora_adapter",
                                     {"lora_name": "opencode-lora-checkpoint-100", "lora_path": str(adapter_dir)})
        assert vllm.loras == {"opencode-lora-checkpoint-100": str(adapter_dir)}
        with lora.serving("opencode-lora-checkpoint-100", adapter_dir):  # vLLM answers 400 "already been loaded"
            pass
        assert vllm.requests[-1] == ("POST", "/v1/unload_lora_adapter", {"lora_name": "opencode-lora-checkpoint-100"})
    assert vllm.loras == {}  # the outer unload: vLLM answers 404 "cannot be found", already gone
    assert [p for _, p, _ in vllm.requests[-4:]] == ["/v1/load_lora_adapter", "/v1/load_lora_adapter",
                                                     "/v1/unload_lora_adapter", "/v1/unload_lora_adapter"]


def test_lora_server_errors_are_explained(tmp_path, adapter_dir):
    def load(url, name, path):
        with ea.LoraServer(url).serving(name, path):
            pass

    with VllmLoraDouble(recipe.SERVED_MODEL_NAME, runtime_lora_updating=False) as server:
        with pytest.raises(RuntimeError, match="/v1/load_lora_adapter .*HTTP 404: .*Not Found"):
            load(server.url, "x", adapter_dir)
    with VllmLoraDouble(recipe.SERVED_MODEL_NAME, max_lora_rank=16) as server:
        with pytest.raises(RuntimeError, match="HTTP 500: .*LoRA rank 32 is greater than max_lora_rank 16"):
            load(server.url, "x", adapter_dir)
        with pytest.raises(RuntimeError, match="HTTP 404: .*Loading lora y failed: No adapter found"):
            load(server.url, "y", tmp_path)


def test_vllm_double_refuses_non_json_like_vllm(vllm):
    response = httpx.post(f"{vllm.url}/v1/load_lora_adapter", content=b"lora_name=x",
                          headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert response.status_code == 400 and "application/json" in response.json()["error"]["message"]


# --- checkpoints and a whole eval -----------------------------------------------------------------
@pytest.fixture()
def hub(tmp_path):
    api = LocalHub(tmp_path / "hub")
    api.create_repo(REPO)
    return api


def test_incomplete_checkpoint_is_refused(hub, adapter_dir, tmp_path):
    hub.upload_folder(repo_id=REPO, folder_path=adapter_dir, path_in_repo="checkpoint-100")  # no marker yet
    with pytest.raises(recipe.ConfigError, match="no complete adapter for 'checkpoint-100'"):
        adapter_repo.download_adapter(hub, REPO, "checkpoint-100", tmp_path / "dl")
    push_folder(hub, REPO, adapter_dir, "checkpoint-100", marker=True)  # the trainer's own push
    local = adapter_repo.download_adapter(hub, REPO, "checkpoint-100", tmp_path / "dl")
    name = "adapter_model.safetensors"
    assert (local / name).read_bytes() == (adapter_dir / name).read_bytes()


CELL = {"side": "adapter", "task_index": 3, "task_name": "task_3", "reward": 1.0, "correct": True,
        "unscorable": False, "attempts": 1}


def test_results_push_lands_at_once_on_the_commit_the_real_client_returns(hub, tmp_path, monkeypatch):
    """Defect 1: create_commit returns a CommitInfo (its id is .oid, there is no .sha): one commit, no retry."""
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    results = ea.ResultsFile(tmp_path / "r.json", {"cells": [CELL]})
    ea.push_results(hub, REPO, "eval/final_results.json", results)
    assert sleeps == [] and len(hub.commits) == 1
    assert json.loads((hub.root / REPO / "eval/final_results.json").read_text())["cells"] == [CELL]


@pytest.mark.parametrize("status", [401, 403, 404])
def test_results_push_refused_by_the_hub_stops_at_once_with_one_line(hub, tmp_path, monkeypatch, status):
    """Defect 6: only transient errors are retried; a 401/403/404 is reported at once."""
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    hub.fail_uploads, hub.fail_status = 1, status
    with pytest.raises(RuntimeError) as caught:
        ea.push_results(hub, REPO, "eval/final_results.json", ea.ResultsFile(tmp_path / "r.json", {"cells": [CELL]}))
    assert sleeps == [] and hub.commits == []
    assert f"HTTP {status}" in str(caught.value) and "\n" not in str(caught.value)


def test_an_eval_stopped_by_a_server_outage_pushes_every_cell_it_recorded(hub, vllm, adapter_dir, tmp_path,
                                                                         monkeypatch):
    """Nothing is lost: the cells recorded since the last periodic push reach the Hub before the outage stops the
    job, so a relaunch on a fresh machine reruns only what never ran (or failed)."""
    monkeypatch.setattr(recipe, "EVAL_PUSH_EVERY", 3)
    monkeypatch.setattr(recipe, "EVAL_ABORT_STREAK", 4)
    push_folder(hub, REPO, adapter_dir, "")
    down = EvalFactoryDouble(vllm.url, lambda t, m: None)  # every rollout fails: the servers are down
    with pytest.raises(ea.InfrastructureDown):
        ea.evaluate(hub, REPO, adapter_repo.FINAL, down, _tasks(8), ea.LoraServer(vllm.url), tmp_path / "work",
                    concurrency=1)
    path = adapter_repo.full_results_path(adapter_repo.FINAL)
    pushed = json.loads((hub.root / REPO / path).read_text())
    assert len(pushed["cells"]) == recipe.EVAL_ABORT_STREAK and not pushed["complete"]
    assert pushed["cells"] == json.loads((tmp_path / "work" / path).read_text())["cells"]


def test_full_eval_base_vs_final_adapter_resumes_and_pushes(hub, vllm, adapter_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(recipe, "EVAL_PUSH_EVERY", 3)
    push_folder(hub, REPO, adapter_dir, "")  # the final adapter at the repo root
    tasks = _tasks(8)

    def outcome(task, model):
        if model == recipe.SERVED_MODEL_NAME:
            return float(task < 3)
        return None if task == 7 else float(task < 5)

    lora = ea.LoraServer(vllm.url)
    killer = EvalFactoryDouble(vllm.url, outcome, kill_after=7)
    with pytest.raises(Killed):
        ea.evaluate(hub, REPO, adapter_repo.FINAL, killer, tasks, lora, tmp_path / "work1", concurrency=1)
    pushed = json.loads((hub.root / REPO / "eval/final_results.json").read_text())
    assert len(pushed["cells"]) == 6 and not pushed["complete"]  # pushed every 3 cells
    assert vllm.loras == {}  # unloaded even though the eval died

    # A fresh machine (new work dir) resumes from the pushed cells only.
    factory = EvalFactoryDouble(vllm.url, outcome)
    board = dashboard.EvalDashboard(REPO, "eval", {"DASHBOARD_SPACE": "local", "JOB_ID": tmp_path.name})
    doc = ea.evaluate(hub, REPO, adapter_repo.FINAL, factory, tasks, lora, tmp_path / "work2", concurrency=1,
                      board=board)
    board.finish()
    assert len(factory.calls) == 16 - 6 + (recipe.EVAL_CELL_ATTEMPTS - 1)  # task 7 on the adapter is retried
    assert {m for _, m in factory.calls} == {recipe.SERVED_MODEL_NAME, "opencode-lora-final"}
    remote = json.loads((hub.root / REPO / "eval/final_results.json").read_text())
    assert remote == doc and doc["complete"]
    s = doc["summary"]
    assert s["base"] | {"ci95": None} == {"tasks": 8, "scored": 8, "correct": 3, "unscorable": 0,
                                          "pass_at_1": 3 / 8, "ci95": None}
    assert (s["adapter"]["scored"], s["adapter"]["correct"], s["adapter"]["unscorable"]) == (7, 5, 1)
    assert (s["paired"]["tasks"], s["paired"]["both"], s["paired"]["only_adapter"]) == (7, 3, 2)
    assert doc["sampling"] == {**ea.eval_sampling(), "max_tokens": recipe.MAX_TOKENS,
                               "max_tool_calling_iterations": recipe.MAX_TOOL_CALLING_ITERATIONS}
    assert doc["adapter_revision"] and doc["checkpoint"] == "final"
    assert vllm.loras == {}
    # The summary, read back from Trackio's local storage (TRACKIO_DIR, set in conftest.py).
    from trackio.sqlite_storage import SQLiteStorage

    [logged] = SQLiteStorage.get_logs(dashboard.project(REPO), f"eval-{tmp_path.name}")
    assert (logged["final_eval/base_pass_at_1"], logged["final_eval/adapter_pass_at_1"]) == (3 / 8, 5 / 7)
    assert (logged["final_eval/adapter_scored"], logged["final_eval/adapter_unscorable"]) == (7, 1)
    assert logged["final_eval/difference"] == s["paired"]["difference"]
    assert [logged["final_eval/difference_ci95_low"], logged["final_eval/difference_ci95_high"]] == s["paired"]["ci95"]
    assert [logged["final_eval/adapter_ci95_low"], logged["final_eval/adapter_ci95_high"]] == s["adapter"]["ci95"]


def test_a_rerun_eval_reuses_only_cells_of_the_same_adapter_and_keeps_the_others(hub, vllm, adapter_dir, tmp_path):
    """Issue 29 defect 3: the final adapter was rewritten (a relaunch trained one step more) after an eval. A re-run
    evaluates the new weights on every task, reuses the base cells, and keeps the old adapter's cells apart."""
    tasks = _tasks(4)
    lora = ea.LoraServer(vllm.url)
    push_folder(hub, REPO, adapter_dir, "")
    first = ea.evaluate(hub, REPO, adapter_repo.FINAL, EvalFactoryDouble(vllm.url, lambda t, m: 0.0), tasks, lora,
                        tmp_path / "work", concurrency=1)
    assert first["summary"]["adapter"]["pass_at_1"] == 0.0
    push_folder(hub, REPO, save_tiny_adapter(tmp_path / "rewritten", seed=1), "")  # other weights, same name

    again = EvalFactoryDouble(vllm.url, lambda t, m: 1.0)
    doc = ea.evaluate(hub, REPO, adapter_repo.FINAL, again, tasks, lora, tmp_path / "work", concurrency=1)
    assert sorted(again.calls) == [(t, "opencode-lora-final") for t in range(4)]  # base cells reused, adapter redone
    assert doc["summary"]["adapter"] | {"ci95": None} == {"tasks": 4, "scored": 4, "correct": 4, "unscorable": 0,
                                                         "pass_at_1": 1.0, "ci95": None}
    assert doc["summary"]["base"]["pass_at_1"] == 0.0
    remote = json.loads((hub.root / REPO / "eval/final_results.json").read_text())
    adapter_cells = [c for c in remote["cells"] if c["side"] == "adapter"]
    assert len(adapter_cells) == 8 and sorted(c["reward"] for c in adapter_cells) == [0.0] * 4 + [1.0] * 4
    assert len({c["weights"] for c in adapter_cells}) == 2 and doc["weights"]["adapter"].startswith("sha256:")

    same = EvalFactoryDouble(vllm.url, lambda t, m: 1.0)  # the same weights once more: nothing to run
    assert ea.evaluate(hub, REPO, adapter_repo.FINAL, same, tasks, lora, tmp_path / "fresh", concurrency=1)[
        "summary"] == doc["summary"] and same.calls == []


def lora_posts(vllm) -> list[str]:
    return [p for m, p, _ in vllm.requests if m == "POST" and "lora_adapter" in p]


def test_a_full_eval_of_weights_already_evaluated_loads_no_adapter_and_commits_nothing(hub, vllm, adapter_dir,
                                                                                       tmp_path):
    """The watcher's rule, now the full eval's too (one loop): a results file already complete for these weights on
    every task is left as it is; no adapter is hot-loaded into vLLM and no commit is made for nothing new."""
    tasks = _tasks(3)
    lora = ea.LoraServer(vllm.url)
    push_folder(hub, REPO, adapter_dir, "")
    first = ea.evaluate(hub, REPO, adapter_repo.FINAL, EvalFactoryDouble(vllm.url, lambda t, m: float(t == 1)), tasks,
                        lora, tmp_path / "work", concurrency=1)
    commits, posts = len(hub.commits), len(lora_posts(vllm))
    again = EvalFactoryDouble(vllm.url, lambda t, m: 0.0)
    doc = ea.evaluate(hub, REPO, adapter_repo.FINAL, again, tasks, lora, tmp_path / "fresh", concurrency=1)
    assert again.calls == [] and doc["summary"] == first["summary"] and doc["complete"]
    assert lora_posts(vllm)[posts:] == []
    assert len(hub.commits) == commits



def test_a_full_eval_started_while_the_head_read_lags_the_final_push_evaluates_that_push(hub, vllm, adapter_dir,
                                                                                         tmp_path, monkeypatch):
    """FACTS "Hub commits": right after the trainer's final push, repo_info can still answer the head before it. The
    eval reads the head again after a wait until it holds the adapter, instead of refusing one that is there; a
    checkpoint the repo does not hold at all is still refused at once."""
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    hub.stale_reads = 2
    push_folder(hub, REPO, adapter_dir, "")  # the trainer's final push; the next 2 head reads answer the one before
    lora = ea.LoraServer(vllm.url)
    doc = ea.evaluate(hub, REPO, adapter_repo.FINAL, EvalFactoryDouble(vllm.url, lambda t, m: 1.0), _tasks(2), lora,
                      tmp_path / "work", concurrency=1)
    assert waits == [recipe.CONFLICT_BACKOFF_S, 2 * recipe.CONFLICT_BACKOFF_S]
    assert adapter_repo.checkpoint_complete(hub.list_repo_files(REPO, revision=doc["adapter_revision"]),
                                            adapter_repo.FINAL)
    assert doc["weights"]["adapter"] == ea.adapter_weights(adapter_dir) and doc["summary"]["adapter"]["correct"] == 2

    waits.clear()
    with pytest.raises(recipe.ConfigError, match="no complete adapter for 'checkpoint-7'"):
        ea.evaluate(hub, REPO, "checkpoint-7", EvalFactoryDouble(vllm.url, lambda t, m: 1.0), _tasks(2), lora,
                    tmp_path / "work", concurrency=1)
    assert waits == []


# --- run_eval.sh ---------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent


def run_script(script, **env):
    base = {"PATH": os.environ["PATH"], "PYTHON": sys.executable, "DRY_RUN": "1", "LOG_DIR": "/tmp/lfm-test-logs"}
    return subprocess.run(["bash", str(ROOT / script)], env={**base, **env}, capture_output=True, text=True,
                          timeout=60)


def test_run_eval_dry_run_prints_the_plan_without_secrets():
    result = run_script("run_eval.sh", ADAPTER_REPO=REPO, HF_TOKEN="hf_SECRETSECRET", JOB_ID="abc123",
                        CHECKPOINT="checkpoint-300")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "prepare_tasks.py --out /tmp/lfm-eval/tasks --split test" in out
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in out and f"--max-lora-rank {recipe.LORA_R}" in out
    assert f"--max-output-tokens {recipe.MAX_TOKENS}" in out and "--dataset /tmp/lfm-eval/tasks/test" in out
    assert "SPACE_HOST=abc123--8000.hf.jobs" in out
    assert f"CHECKPOINT=checkpoint-300 {sys.executable} {ROOT}/eval_adapter.py" in out
    assert "hf_SECRETSECRET" not in out + result.stderr


@pytest.mark.parametrize(("env", "message"), [
    ({"HF_TOKEN": "x", "JOB_ID": "a"}, "ADAPTER_REPO is not set"),
    ({"ADAPTER_REPO": REPO, "JOB_ID": "a"}, "HF_TOKEN is not set"),
    ({"ADAPTER_REPO": REPO, "HF_TOKEN": "x", "JOB_ID": "a", "CHECKPOINT": "step-5"},
     "CHECKPOINT='step-5' is not a checkpoint name: use 'final' or e.g. 'checkpoint-300'"),
    ({"ADAPTER_REPO": REPO, "HF_TOKEN": "x", "JOB_ID": "a", "CHECKPOINT": "checkpoint-0"},
     "CHECKPOINT='checkpoint-0' is not a checkpoint name"),
    ({"ADAPTER_REPO": REPO, "HF_TOKEN": "x", "JOB_ID": "a", "N_TASKS": "500"},
     "N_TASKS=500 is out of range: use 1..250"),
    ({"ADAPTER_REPO": REPO, "HF_TOKEN": "x", "JOB_ID": "a", "EVAL_CONCURRENCY": "x"},
     "EVAL_CONCURRENCY='x' is not a whole number"),
    ({"ADAPTER_REPO": REPO, "HF_TOKEN": "x", "JOB_ID": "a", "READY_TIMEOUT": "soon"},
     "READY_TIMEOUT='soon' is not a whole number"),
    ({"ADAPTER_REPO": REPO, "HF_TOKEN": "x", "JOB_ID": "a", "EVAL_MODE": "fast"}, "EVAL_MODE='fast' is not one of"),
    ({"ADAPTER_REPO": REPO, "HF_TOKEN": "x"}, "cannot derive the job's public host"),
])
def test_run_eval_refuses_bad_input_with_one_line(env, message):
    result = run_script("run_eval.sh", **env)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "step 1/5" not in result.stdout  # nothing installed or started


# --- against the real OpenEnv Harbor env server ------------------------------------------------------------------
@pytest.fixture(scope="module")
def env_server(tmp_path_factory):
    """`openenv harbor serve` (the real server) on prepared test tasks, with a vLLM stand-in upstream.

    No HF token reaches it, so the hf-sandbox backend refuses at once: every eval call runs the server's
    whole request validation (purpose, eval_sampling, budget) and then fails at the sandbox, offline.
    """
    from harbor_fixture import materialized

    root = tmp_path_factory.mktemp("harbor")
    tasks = materialized(root)
    llm_port, env_port = free_ports(2)
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"} | {
        "SPACE_HOST": "test--8000.hf.jobs", "ENABLE_WEB_INTERFACE": "false", "HOME": str(root),
        "OPENENV_HARBOR_TRIALS_DIR": str(root / "trials")}
    upstream = subprocess.Popen([sys.executable, str(ROOT / "tests/stubs/upstream_double.py"), "--host", "127.0.0.1",
                                 "--port", str(llm_port), "--model", recipe.SERVED_MODEL_NAME],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = subprocess.Popen([str(Path(sys.executable).with_name("openenv")), "harbor", "serve",
                               "--llm-url", f"http://127.0.0.1:{llm_port}", "--model", recipe.SERVED_MODEL_NAME,
                               "--host", "127.0.0.1", "--port", str(env_port),
                               "--max-output-tokens", str(recipe.MAX_TOKENS), "--dataset", str(tasks / "test")],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{llm_port}/health", upstream, timeout=90)
        wait_http(f"http://127.0.0.1:{env_port}/health", server, timeout=90)
        yield f"http://127.0.0.1:{env_port}", f"http://127.0.0.1:{llm_port}", tasks
    finally:
        for proc in (server, upstream):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_eval_rollouts_pass_the_real_servers_eval_contract(env_server, monkeypatch):
    env_url, llm_url, tasks = env_server
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("ENV_URL", env_url)
    monkeypatch.setenv("VLLM_URL", llm_url)
    factory, listed, _ = ea.servers(recipe.SANDBOX)
    names = sorted(p.name for p in (tasks / "test" / "tasks").iterdir())
    assert sorted(t["task_name"] for t in listed) == names

    session = factory(listed[0]["index"], recipe.SERVED_MODEL_NAME)
    assert session.wait_for_completion() == 1
    result = session.result
    # Accepted as an eval rollout (a wrong purpose, sampling or top_k is refused before this point, with
    # "eval_sampling requires explicit eval purpose" / "eval top_k must be -1 ..."); it then stops at the
    # sandbox, which is an infrastructure failure: unscorable, never a wrong answer.
    assert result.rollout_type == "eval" and "Hugging Face token" in result.error
    from openenv.harbor.client import HarborEnv

    with HarborEnv(base_url=env_url) as env:  # control: the same call without purpose="eval" is refused
        refused = env.run_rollout(split=str(tasks / "test"), task_index=0, sandbox=recipe.SANDBOX, llm_url=llm_url,
                                  model=recipe.SERVED_MODEL_NAME, eval_sampling=ea.eval_sampling())
    assert "eval_sampling requires explicit eval purpose" in refused.error
    cell = ea.run_cell(factory, listed[1]["index"], recipe.SERVED_MODEL_NAME)
    assert cell["unscorable"] and cell["reward"] is None and cell["correct"] is None
    assert "Hugging Face token" in cell["error"]


@pytest.mark.parametrize("script", ["eval_adapter", "eval_watch"])
def test_both_entry_points_refuse_a_split_that_is_not_the_test_splits(env_server, tmp_path, script):
    """Both start in eval_adapter.job(): an env server serving other tasks than the test split's is refused in one
    line before the Hub is asked (the watcher ran on any split)."""
    env_url, llm_url, tasks = env_server
    served = len(list((tasks / "test" / "tasks").iterdir()))
    proc = offline.run([f"{script}.py"], offline.offline_env(tmp_path, ADAPTER_REPO=REPO, ENV_URL=env_url,
                                                             VLLM_URL=llm_url, N_TASKS="1", EVAL_TASKS="1"))
    assert proc.returncode == 2 and offline.one_line(proc, script) == (
        f"{script}: the env server's split has {served} tasks, the test split {recipe.TEST_TASKS}: serve the test "
        "tasks (run_eval.sh does) or set EVAL_SPLIT")


# --- run_eval.sh for real, with stub vllm / nvidia-smi / pip and the fake env server (tests/stubs) ---------------
FAKE_EVAL = '''"""Stands in for eval_adapter.py / eval_watch.py: records what it was started with and what answered."""
import os, sys, urllib.request
def up(url):
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False
keys = ("ADAPTER_REPO", "CHECKPOINT", "N_TASKS", "ENV_URL", "VLLM_URL", "SANDBOX")
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(f"eval {os.path.basename(sys.argv[0])} " + " ".join(f"{k}={os.environ.get(k, '')}" for k in keys)
              + f" vllm_up={up(os.environ['VLLM_URL'] + '/health')} env_up={up(os.environ['ENV_URL'] + '/health')}\\n")
sys.exit(int(os.environ.get("STUB_EVAL_RC", "0")))
'''


@pytest.fixture()
def eval_job(tmp_path):
    return make_eval_job(tmp_path)


def make_eval_job(tmp_path):
    """A bundle folder with the real run_eval.sh and servers' scripts, fake task prep and eval, and its env."""
    stubs = ROOT / "tests" / "stubs"
    app = tmp_path / "app"
    app.mkdir()
    for name in ("run_eval.sh", "run_eval_watch.sh", "common.sh", "image_check.py", "recipe.py", "adapter_repo.py",
                 "serve_policy.sh", "chat_template.py", "serve_env.sh", "seam_patch.py",
                 "capture_gateway.py"):
        shutil.copy(ROOT / name, app / name)
    shutil.copy(stubs / "fake_prepare_tasks.py", app / "prepare_tasks.py")
    for name in ("eval_adapter.py", "eval_watch.py"):
        (app / name).write_text(FAKE_EVAL)
    token = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in {"HF_TOKEN", "SANDBOX", "SPACE_HOST", "JOB_ID"}}
    env.update(PATH=f"{stubs / 'bin'}:{env['PATH']}", PYTHON=str(stubs / "bin" / "python3"),
               REAL_PYTHON=sys.executable, STUB_LOG=str(tmp_path / "stub.log"), LOG_DIR=str(tmp_path / "logs"),
               WORK_DIR=str(tmp_path / "work"), ADAPTER_REPO=REPO, HF_TOKEN="hf_SECRETSECRET", JOB_ID="job9",
               PUBLIC_HOST="127.0.0.1", READY_TIMEOUT="60", RUN_JOB_TEST_TOKEN=token,  # how its processes are found
               **{name: str(port) for name, port in free_port_knobs().items()})
    return {"app": app, "env": env, "log": tmp_path / "stub.log", "token": token}


def _run_eval_job(job, script="run_eval.sh", **extra):
    result = subprocess.run(["bash", str(job["app"] / script)], env={**job["env"], **extra}, capture_output=True,
                            text=True, timeout=120)
    assert "hf_SECRETSECRET" not in result.stdout + result.stderr
    assert_no_leftovers(job["token"], wait_s=10)  # vLLM, env server and gateway are all stopped
    return result, job["log"].read_text().splitlines() if job["log"].exists() else []


def test_run_eval_starts_lora_vllm_and_env_server_then_evaluates(eval_job):
    result, log = _run_eval_job(eval_job, CHECKPOINT="checkpoint-200")
    assert result.returncode == 0, result.stderr
    assert not any(line.startswith("pip ") for line in log)  # the pinned stack is already installed here
    order = [next(i for i, line in enumerate(log) if line.startswith(p)) for p in ("prepare_tasks", "vllm", "eval")]
    assert order == sorted(order) and "--split test" in log[order[0]]
    vllm = log[order[1]]
    assert "CUDA_VISIBLE_DEVICES=0 " in vllm and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in vllm
    assert f"--enable-lora --max-lora-rank {recipe.LORA_R}" in vllm and "--host 127.0.0.1" in vllm
    env = eval_job["env"]
    assert log[order[2]] == (f"eval eval_adapter.py ADAPTER_REPO={REPO} CHECKPOINT=checkpoint-200 N_TASKS= "
                             f"ENV_URL=http://127.0.0.1:{env['ENV_PORT']} VLLM_URL=http://127.0.0.1:"
                             f"{env['POLICY_PORT']} SANDBOX={recipe.SANDBOX} vllm_up=True env_up=True")


def test_eval_job_without_a_gpu_names_its_own_flavor(eval_job):
    result, log = _run_eval_job(eval_job, STUB_GPUS="none")
    assert result.returncode != 0 and log == []
    [line] = result.stderr.strip().splitlines()
    assert f"GPU 0 not found (nvidia-smi lists: none): run on an {recipe.EVAL_FLAVOR} job" in line
    assert recipe.TRAIN_FLAVOR not in line


def test_run_eval_fails_fast_when_vllm_dies(eval_job):
    result, log = _run_eval_job(eval_job, STUB_VLLM="crash")
    assert result.returncode != 0 and "eval_vllm exited before it was ready" in result.stderr
    assert not any(line.startswith("eval ") for line in log)


# --- one line, not a traceback -----------------------------------------------------------------------------------
def test_eval_without_an_env_server_is_one_line_not_a_type_error(tmp_path):
    """OpenEnv's client, refused a connection, ends in `TypeError: object NoneType can't be used in 'await'`."""
    env_url, vllm_url = offline.closed_url(), offline.closed_url()
    proc = offline.run(["eval_adapter.py"],
                       offline.offline_env(tmp_path, ADAPTER_REPO=REPO, ENV_URL=env_url, VLLM_URL=vllm_url))
    line = offline.one_line(proc, "eval_adapter")
    assert proc.returncode == 1 and "TypeError" not in line
    assert line == (f"eval_adapter: could not reach {env_url}/health (ConnectError: [Errno 111] Connection refused): "
                    "the server there is not running, or the URL is wrong; start it or fix the URL, and rerun")


def test_a_vllm_that_does_not_answer_is_named():
    url = offline.closed_url()
    with pytest.raises(httpx.ConnectError) as caught:
        with ea.LoraServer(url).serving("x", Path("/nonexistent")):
            pass
    line, code = adapter_repo.failure_line(caught.value)  # the entry points' one line (run_cli)
    assert line.startswith(f"could not reach {url}/v1/") and "start it or fix the URL" in line and code == 1
