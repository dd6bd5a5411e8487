"""The rehearsal on the real rollout chain (issue 25 item 4): `rehearse.py --real-chain` runs train_lora.train() (TRL's
AsyncGRPOTrainer and HarnessRolloutWorker, the session factory train_lora builds from ENV_URL) with every rollout
through `openenv harbor serve` -> Harbor's Trial in the bubblewrap sandbox -> the real OpenCode -> the task's own
verifier, as tests/test_chain.py runs that chain, every model call sampled by vLLM's own engine (tests/engine), which
the trainer syncs into after every step, each sync checked. Two starts in one workdir on one engine, as a relaunched
job lives them (run_job.sh keeps vLLM up): killed right after checkpoint-1 is pushed, then resumed there for step 2.
Kept to what the claim needs (2 steps, one group in flight): a real rollout takes 10-28 s on an idle machine. Runs
where test_chain runs (envserver.require) and the engine can (engine.require).

The tiny model is random: it writes no tool call, so OpenCode leaves no answer and every reward is 0; no group has
contrast, no step moves the adapter, and each sync's check passes without the power to fail (its margins are 0:
tests/test_rehearsal.py shows the check failing a broken sync). A policy that acts (issue 40 item 3) gives it both.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import engine
import pytest
from chain import envserver
from engine.sync_check import TOLERANCE

import adapter_repo
import prepare_tasks
import train_rollouts
import trajectories

envserver.require()
engine.require()

sys.path.insert(0, str(Path(__file__).resolve().parent / "rehearsal"))
from rehearse import ADAPTER_REPO, CHAIN_GROUP, REHEARSAL_RATIO_BAND, run_apart  # noqa: E402

START_TIMEOUT_S = 420  # one start: servers, trainer, a group of CHAIN_GROUP rollouts (and the next in flight), a step


def by_start(report: dict, lines: list[dict], data: Path) -> dict[int, list[float]]:
    """The verifier rewards of the rollouts of each group's task that this start trained, by the group's position in
    the trained order (the task list's order, repeated)."""
    names = [row["name"] for row in prepare_tasks.load_list(data, "train")]
    trained = report["trained_groups"][str(max(int(step) for step in report["trained_groups"]))]
    positions = [trained["start"] + group for group in trained["groups"]]
    return {at: [line["reward"] for line in lines if line["task"] == names[at % len(names)]] for at in positions}


def check_rollouts(lines: list[dict], workdir: Path) -> None:
    """Every finished rollout is listed with its task, reward, outcome and trial folder; a scored one's is removed."""
    served = {p.name for p in (workdir / "fixture" / "tasks" / "train" / "tasks").iterdir()}
    assert lines
    for line in lines:
        assert line["task"] in served, line
        assert line["outcome"] in ("scored", "timed_out", *train_rollouts.FAILURE_CLASSES), line
        assert Path(line["trial"]).parent == workdir / "chain" / "trials", line
        assert line["trial_kept"] == Path(line["trial"]).is_dir(), line
        if line["outcome"] == "scored":
            assert line["reward"] in (0.0, 1.0) and not line["trial_kept"], line


def check_trajectories(repo: Path) -> None:
    """Issue 43 (11): checkpoint-1's trajectory sample, pushed with it, is what the real chain recorded: OpenCode's own
    system prompt, the task, the engine's reply as the capture proxy saw it, and the verdict the task's verifier gave
    (its reward). The engine's random model writes no tool call, so the sample has no `write` call or tool answer to
    check (tests/test_trajectory_page.py shows them on the page); a policy that acts brings them back here."""
    [logs] = (repo / adapter_repo.LOGS_DIR).iterdir()
    sample = json.loads((logs / "trajectories" / "checkpoint-1.json").read_text())
    scored = [t for t in sample if t["outcome"] == "scored"]
    assert scored, sample
    for t in scored:
        roles = [m["role"] for m in t["messages"]]
        assert roles[:2] == ["system", "user"] and roles[-1] == "assistant", roles
        assert "opencode" in t["messages"][0]["text"].lower(), t["messages"][0]
        assert t["verdict"] == ("correct" if t["reward"] == 1.0 else "wrong"), t
    assert "checkpoint-1" in (repo / trajectories.PAGE_PATH).read_text()


@pytest.fixture()
def vllm(tmp_path):
    """vLLM in training mode (serve_policy.sh) on the chain's tiny model, in the rehearsal's workdir; not waited for:
    the first start loads its env server and trainer meanwhile, and waits for it before training."""
    workdir = tmp_path / "rehearsal"
    runner = engine.Engine(engine.save_engine_model(workdir / "model", vocab_size=envserver.CHAIN_VOCAB),
                           workdir / "engine")
    runner.start(wait=False)
    yield runner
    runner.stop()


def assert_synced(syncs: list[dict], steps: list[int]) -> None:
    """The engine served the trainer's policy after each of these syncs (the cold one at the start, then one a step)."""
    assert [sync["step"] for sync in syncs] == steps
    assert all(sync["ok"] and sync["served_vs_policy"] <= TOLERANCE for sync in syncs), syncs


def test_real_chain_rehearsal_is_killed_after_checkpoint_1_and_resumes_for_step_2(vllm):
    workdir = vllm.model.parent
    repo = workdir / "hub" / ADAPTER_REPO
    data = workdir / "fixture" / "data"
    steps = {"MAX_STEPS": "2", "SAVE_STEPS": "1"}
    try:
        first = run_apart(workdir, "--real-chain", "--vllm-url", vllm.url, "--crash-after-checkpoint", "1",
                          env=steps, timeout=START_TIMEOUT_S)
        assert first.returncode == -signal.SIGKILL, first.stdout[-3000:] + vllm.tail()
        report = json.loads((workdir / "report.json").read_text())
        assert report["resumed_from"] is None and [row["step"] for row in report["steps"]] == [1]
        lines = report["rollout_log"]
        check_rollouts(lines, workdir)
        first_groups = by_start(report, lines, data)
        assert first_groups and all(len(r) >= CHAIN_GROUP for r in first_groups.values()), first_groups
        assert_synced(report["syncs"], [0, 1])
        position = json.loads((repo / "checkpoint-1" / "rollout_state.json").read_text())
        check_trajectories(repo)

        second = run_apart(workdir, "--real-chain", "--vllm-url", vllm.url, env=steps, timeout=START_TIMEOUT_S)
        assert second.returncode == 0, second.stdout[-3000:] + vllm.tail()
        report = json.loads((workdir / "report.json").read_text())
        assert report["resumed_from"] == 1 and [row["step"] for row in report["steps"]] == [2]
        assert report["heartbeats"] == [2]
        trained = report["trained_groups"]["2"]
        assert trained["start"] == position["prompt_index"]  # the resumed start begins at checkpoint-1's position
        assert not set(trained["groups"]) & set(position["consumed_ahead"])
        later = report["rollout_log"][len(lines):]
        check_rollouts(later, workdir)
        second_groups = by_start(report, later, data)
        assert not set(second_groups) & set(first_groups)  # nothing trained before is trained again
        assert_synced(report["syncs"], [1, 2])  # the resumed start's cold sync sends checkpoint-1's policy
        low, high = REHEARSAL_RATIO_BAND
        state = json.loads((repo / "checkpoint-2" / "trainer_state.json").read_text())
        ratios = [entry["ratio"] for entry in state["log_history"] if "ratio" in entry]
        assert len(ratios) == 2 and all(low < ratio < high for ratio in ratios), ratios  # both starts' steps
        assert (repo / "checkpoint-2" / adapter_repo.COMPLETE_MARKER).is_file()
        assert (repo / "adapter_model.safetensors").is_file()
    finally:
        envserver.unmount_leftovers(workdir / "chain" / "sandboxes")  # a failed start's overlays
