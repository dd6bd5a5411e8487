"""dashboard.py: a dashboard Space that cannot be reached means local Trackio logs and one line, never a failure."""

from __future__ import annotations

import huggingface_hub
import pytest

import dashboard
import recipe

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
    assert f"Space {recipe.DASHBOARD_SPACE} unavailable" in line and "logging locally" in line
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


@pytest.mark.parametrize(("env", "name"), [
    ({"JOB_ID": "68abc"}, "train-68abc"),
    ({"HF_JOB_ID": "68def"}, "train-68def"),
    ({"SPACE_HOST": "https://68aaa--8000.hf.jobs/"}, "train-68aaa"),
])
def test_run_is_named_after_the_job(env, name):
    assert dashboard.run_name("train", env) == name
    assert dashboard.project("you/LFM2.5-2.6B-opencode-lora-RL-smoke") == "LFM2.5-2.6B-opencode-lora-RL-smoke"
