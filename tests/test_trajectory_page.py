"""What the agent did (issue 43, items 10 and 11): the records and a trajectory sample pushed with each checkpoint, and
the page that shows the sample beside the learning curve, opened in a real headless Chromium (tests/browser.py).

The trajectories are made by `trajectories.trajectory` from OpenEnv's own HarborRolloutResult, in the shape the capture
proxy records OpenCode's chat-completions calls (tests/test_rehearsal_chain.py checks it on the real chain's)."""

from __future__ import annotations

import json
from pathlib import Path

import browser
import pytest
from hub_double import LocalHub
from openenv.harbor.models import HarborConversation, HarborRolloutResult, HarborTurn

import adapter_repo
import recipe
import train_rollouts
import trajectories

REPO = "alice/LFM2.5-2.6B-opencode-lora-RL"
SYSTEM = "You are opencode, an interactive CLI agent. " * 300  # OpenCode's system prompt runs to ~10k characters
TABLE = "\n".join(f"{i},{i * 0.5}" for i in range(4000))  # a tool result far past what a reader wants


def result(answer: str, reward: float | None) -> HarborRolloutResult:
    """A rollout as the env server returns it: the agent conversation the capture proxy recorded, OpenCode's title call
    (auxiliary), one agent turn per model call, the verifier's reward."""
    call = {"id": "call_0", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": "python3 -c 'import pandas'"})}}
    agent = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": [{"type": "text", "text": "What is the mean of column x in table.csv?"}]},
             {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_0", "content": TABLE},
             {"role": "assistant", "content": f"The mean is {answer}."}]
    return HarborRolloutResult(task_name="user__mean-x", reward=reward, turns=[HarborTurn(turn=0), HarborTurn(turn=1)],
                               conversations=[HarborConversation(role="agent", messages=agent),
                                              HarborConversation(role="auxiliary", messages=[
                                                  {"role": "user", "content": "Generate a title"}])])


def test_a_trajectory_is_the_captured_agent_conversation_clipped_with_harbors_verdict():
    t = trajectories.trajectory(result("4.2", 1.0), task="mean-x", reward=1.0, tool_calls=1)
    assert (t["task"], t["verdict"], t["reward"], t["tool_calls"]) == ("mean-x", "correct", 1.0, 1)
    assert [m["role"] for m in t["messages"]] == ["system", "user", "assistant", "tool", "assistant"]  # no title call
    system, user, call, tool, answer = t["messages"]
    assert len(system["text"]) < len(SYSTEM) and "characters cut" in system["text"]
    assert user["text"] == "What is the mean of column x in table.csv?"
    assert call["tool_calls"] == [{"name": "bash", "arguments": '{"command": "python3 -c \'import pandas\'"}'}]
    assert tool["text"].startswith("0,0.0\n1,0.5") and tool["text"].endswith("3999,1999.5") and len(tool["text"]) < 1600
    assert answer["text"] == "The mean is 4.2."
    assert trajectories.trajectory(result("?", None), task="t", reward=None, tool_calls=0)["verdict"] == "no grade"


def test_the_ledger_keeps_the_last_rollouts_with_their_outcome_class(tmp_path):
    ledger = train_rollouts.Ledger(tmp_path / recipe.LEDGER_NAME)
    for i in range(recipe.TRAJECTORY_SAMPLE + 3):
        ledger.record(None if i % 3 else "capture", "boom" if i % 3 == 0 else "", task=f"t{i}",
                      trajectory=trajectories.trajectory(result("4.2", 1.0), task=f"t{i}", reward=1.0, tool_calls=1))
    kept = json.loads((tmp_path / recipe.TRAJECTORIES_NAME).read_text())
    assert [t["task"] for t in kept] == [f"t{i}" for i in range(3, recipe.TRAJECTORY_SAMPLE + 3)]
    assert [t["outcome"] for t in kept][:3] == ["capture", "scored", "scored"]


def train_log(steps: range) -> dict:
    return {"schema": 1, "starts": [{"at": 0, "resumed_from": None, "global_step": 0, "max_steps": 1000}],
            "logs": [{"start": 0, "step": s, "reward": 0.2 + s / 1000, "loss": 0.1} for s in steps]}


def work_folder(folder: Path, answers: list[str]) -> Path:
    """What a trainer's work folder holds at a checkpoint (run_job.sh's WORK_DIR)."""
    folder.mkdir(parents=True, exist_ok=True)
    recipe.write_json(folder / recipe.TRAIN_LOG_NAME, train_log(range(1, 101)))
    recipe.write_json(folder / recipe.LEDGER_NAME, {"rollouts": len(answers), "scored": len(answers)})
    (folder / recipe.ROLLOUT_LOG_NAME).write_text("".join(json.dumps({"task": "mean-x", "outcome": "scored"}) + "\n"
                                                          for _ in answers))
    recipe.write_json(folder / recipe.TRAJECTORIES_NAME, [
        {**trajectories.trajectory(result(a, float(a == "4.2")), task="mean-x", reward=float(a == "4.2"),
                                   tool_calls=1), "outcome": "scored"} for a in answers])
    return folder


def push_checkpoint(hub: LocalHub, tmp_path: Path, step: int, work: Path) -> None:
    """train_callbacks.CheckpointPusher.on_save, as the trainer calls it after saving checkpoint-`step`."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    import train_callbacks

    out = tmp_path / "output"
    folder = out / adapter_repo.checkpoint_name(step)
    folder.mkdir(parents=True)
    for name in adapter_repo.ADAPTER_FILES:
        (folder / name).write_bytes(b"{}")
    pusher = train_callbacks.CheckpointPusher(hub, REPO, work, "68a0job")
    pusher.on_save(TrainingArguments(output_dir=str(out), report_to=[]), TrainerState(global_step=step),
                   TrainerControl())


def test_each_checkpoint_push_carries_the_runs_records_and_its_trajectories(tmp_path):
    """Item 10: train_log.json, rollouts.json and rollout_log.jsonl lived only in the job's WORK_DIR and died with it;
    now they go with each checkpoint, in its commit, so a crashed run can still be read."""
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    push_checkpoint(hub, tmp_path, 100, work_folder(tmp_path / "work", ["4.2", "7.5"]))
    [(_, _, paths)] = [c for c in hub.commits if c[0] == REPO]
    logs = f"{adapter_repo.LOGS_DIR}/68a0job"
    assert {f"{logs}/{recipe.TRAIN_LOG_NAME}", f"{logs}/{recipe.LEDGER_NAME}", f"{logs}/{recipe.ROLLOUT_LOG_NAME}",
            f"{logs}/trajectories/checkpoint-100.json", trajectories.PAGE_PATH} <= set(paths)
    assert paths[-1] == f"checkpoint-100/{adapter_repo.COMPLETE_MARKER}"  # still the commit's last file
    assert adapter_repo.complete_checkpoints(hub.list_repo_files(REPO)) == [100]
    assert adapter_repo.read_json(hub, REPO, f"{logs}/{recipe.TRAIN_LOG_NAME}")["logs"][-1]["step"] == 100
    sample = adapter_repo.read_json(hub, REPO, f"{logs}/trajectories/checkpoint-100.json")
    assert [t["verdict"] for t in sample] == ["correct", "wrong"]


@pytest.fixture()
def page_file(tmp_path) -> Path:
    """The page as the pushes and the watcher leave it: two checkpoints pushed, the first one evaluated."""
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    push_checkpoint(hub, tmp_path / "one", 100, work_folder(tmp_path / "w1", ["4.2", "7.5"]))
    summary = {"checkpoints": [{"checkpoint": "checkpoint-100", "step": 100, "complete": True, "pass_at_1": 0.31,
                                "scored": 100}], "base": {"pass_at_1": 0.2}}
    hub.upload_file(path_or_fileobj=json.dumps(summary).encode(), path_in_repo=adapter_repo.SUMMARY_PATH, repo_id=REPO)
    work = work_folder(tmp_path / "w2", ["4.2", "4.2", "nothing"])
    recipe.write_json(work / recipe.TRAIN_LOG_NAME, train_log(range(1, 201)))
    push_checkpoint(hub, tmp_path / "two", 200, work)
    return Path(hub.hf_hub_download(REPO, trajectories.PAGE_PATH, local_dir=tmp_path / "page"))


def test_the_page_shows_the_learning_curve_and_each_checkpoints_trajectories_in_a_browser(page_file):
    """Item 11, read as a person reads it in Chromium: the curve drawn, a heading per checkpoint with its pass@1, one
    line per trajectory (task, verdict, reward, tool calls, outcome), each opening to its conversation."""
    with browser.open_file(page_file) as page:
        assert page.evaluate("document.title") == f"{REPO}: what the agent did"
        curve = page.evaluate("(() => { const r = document.querySelector('#curve').getBoundingClientRect();"
                              "return [r.width, r.height, document.querySelector('#curve polyline')"
                              ".points.numberOfItems, document.querySelectorAll('#curve circle.pass').length,"
                              "document.querySelector('#curve line.base').getBoundingClientRect().width]; })()")
        assert curve == [760, 260, 200, 1, 680]  # a point a logged step, a dot an evaluated checkpoint, the base line
        text = page.evaluate("document.body.innerText")
        assert text.index("checkpoint-200: not evaluated by the watcher yet") < text.index(
            "checkpoint-100: pass@1 0.31 on 100 scored tasks")  # newest first
        assert "mean-x: correct, reward 1, 1 tool calls, scored" in text
        assert "mean-x: wrong, reward 0, 1 tool calls, scored" in text
        assert "The mean is 4.2." not in text  # folded until opened
        page.evaluate("document.querySelector('details.trajectory').open = true")
        opened = page.evaluate("document.querySelector('details.trajectory').innerText")
        assert 'bash({"command": "python3 -c \'import pandas\'"})' in opened and "The mean is 4.2." in opened
        assert "characters cut" in opened and "3999,1999.5" in opened
        width = page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        assert width, "the page scrolls sideways"
