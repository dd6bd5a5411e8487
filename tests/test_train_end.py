"""A trainer start at or past MAX_STEPS trains nothing (train_lora.finish_trained_run), and a final adapter at the
repo root is never replaced by another.

transformers' DefaultFlowCallback stops training only in on_step_end, after an optimizer step: resumed from
checkpoint-MAX_STEPS, the trainer would train step MAX_STEPS+1, push checkpoint-(MAX_STEPS+1) and rewrite the root
adapter. That start is a relaunch after a failed final push or a crashed final eval, and must go on to the eval.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import adapter_repo
import recipe
import train_lora
from tests.hub_double import LocalHub

REPO = "me/LFM2.5-2.6B-opencode-lora-RL"
CHECKPOINT_FILES = ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md",
                    "trainer_state.json", "rollout_state.json", "optimizer.pt", "rng_state.pth", "training_args.bin")


def never_build(*_: object, **__: object) -> None:
    """The session factory: building the trainer (it asks for the tasks first) means a start trained."""
    raise AssertionError("a start at MAX_STEPS built the trainer")


def settings(tmp: Path, max_steps: int, **env: str) -> train_lora.Settings:
    return train_lora.settings_from_env({
        "ADAPTER_REPO": REPO, "HF_TOKEN": "hf_test", "DEVICE": "cpu", "MAX_STEPS": str(max_steps), "SAVE_STEPS": "1",
        "OUTPUT_DIR": str(tmp / "out"), "HEARTBEAT_FILE": str(tmp / "heartbeat"), "DASHBOARD_SPACE": "dash", **env})


def push_checkpoint(hub: LocalHub, tmp: Path, step: int) -> None:
    folder = tmp / "pushed" / adapter_repo.checkpoint_name(step)
    folder.mkdir(parents=True)
    for name in CHECKPOINT_FILES:
        (folder / name).write_text(f"{name} of step {step}")
    adapter_repo.push_folder(hub, REPO, folder, folder.name, marker=True)


@pytest.fixture
def finished(tmp_path) -> LocalHub:
    """A run that pushed checkpoint-1 and checkpoint-2 (MAX_STEPS=2) and died before its final push."""
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    for step in (1, 2):
        push_checkpoint(hub, tmp_path, step)
    return hub


def test_a_start_at_max_steps_trains_nothing_and_pushes_the_final_adapter_from_that_checkpoint(finished, tmp_path):
    before = len(finished.commits)
    train_lora.train(settings(tmp_path / "relaunch", 2, MAX_STALENESS="3"), factory=never_build, api=finished)
    assert [message for _, message, _ in finished.commits[before:]] == ["Upload final adapter"]
    files = set(finished.list_repo_files(REPO))
    assert adapter_repo.complete_checkpoints(files) == [1, 2]  # no checkpoint-3
    assert adapter_repo.checkpoint_complete(files, adapter_repo.FINAL)
    root = tmp_path / "hub" / REPO
    assert (root / "adapter_model.safetensors").read_text() == "adapter_model.safetensors of step 2"
    assert (root / "tokenizer.json").read_text() == "tokenizer.json of step 2"
    assert not {"optimizer.pt", "rng_state.pth", "training_args.bin", "trainer_state.json", "rollout_state.json",
                adapter_repo.COMPLETE_MARKER} & files  # training state stays in the checkpoints, as at a normal end
    card = (root / "README.md").read_text()
    assert "2 optimizer steps" in card and "https://huggingface.co/spaces/" in card
    assert "| Max staleness | 3 optimizer steps |" in card  # the run's own --max-staleness, not the recipe's


def test_a_relaunch_after_the_final_push_pushes_nothing_and_goes_on(finished, tmp_path):
    """A crashed final eval's relaunch: the root adapter stays the one pushed; train() returns for the eval."""
    train_lora.train(settings(tmp_path / "first", 2), factory=never_build, api=finished)
    pushed = (tmp_path / "hub" / REPO / "adapter_model.safetensors").read_bytes()
    before = len(finished.commits)
    train_lora.train(settings(tmp_path / "again", 2), factory=never_build, api=finished)
    assert finished.commits[before:] == []
    assert (tmp_path / "hub" / REPO / "adapter_model.safetensors").read_bytes() == pushed


@pytest.mark.parametrize(("max_steps", "env"), [(3, {}), (2, {"RESUME": "0"})], ids=["more-steps", "from-scratch"])
def test_training_that_would_replace_a_final_adapter_is_refused_before_anything_loads(finished, tmp_path, max_steps,
                                                                                       env):
    train_lora.train(settings(tmp_path / "first", 2), factory=never_build, api=finished)
    before = len(finished.commits)
    with pytest.raises(recipe.ConfigError, match=r"already holds a final adapter.*`launch.py eval`"):
        train_lora.train(settings(tmp_path / "later", max_steps, **env), factory=never_build, api=finished)
    assert finished.commits[before:] == [] and not (tmp_path / "later" / "out").exists()


def test_a_fresh_start_into_a_repo_holding_another_runs_checkpoints_is_refused_before_anything_loads(finished,
                                                                                                    tmp_path):
    """RESUME=0 among an earlier run's checkpoints would overwrite some of them and leave the rest: a later resume
    (or the eval watcher) would take the newest, maybe the other run's. Refused in one line, nothing pushed."""
    before = len(finished.commits)
    with pytest.raises(recipe.ConfigError, match=r"holds checkpoints of an earlier run \(newest checkpoint-2\): "
                                                 r"RESUME=0 .* or train into a new ADAPTER_REPO"):
        train_lora.train(settings(tmp_path / "fresh", 3, RESUME="0"), factory=never_build, api=finished)
    assert finished.commits[before:] == [] and not (tmp_path / "fresh" / "out").exists()


# --- a disk that fills during a checkpoint save (issue 44, item 5) ----------------------------------------------------
# The trainer's checkpoint save, transformers' own (what TRL's AsyncGRPOTrainer calls), of the tiny LFM2's LoRA with
# its optimizer state, as `train_lora.py` runs it; `train` is the only part replaced.
SAVE_AS_THE_TRAINER = """
import sys
sys.path[:0] = sys.argv[1:3]
import torch
from peft import get_peft_model
from transformers import Trainer, TrainingArguments
import tiny_lfm2, train_lora

def train(settings, **_):
    model = get_peft_model(tiny_lfm2.tiny_model()[0], train_lora.lora_config())
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=settings.output_dir, report_to=[], use_cpu=True))
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    trainer.optimizer.step()
    trainer.state.global_step = 1
    trainer._save_checkpoint(model, trial=None)

train_lora.train = train
sys.exit(train_lora.main([]))
"""


def test_a_disk_that_fills_during_a_checkpoint_save_ends_the_trainer_saying_so_and_where(tmp_path):
    """A 1 MiB tmpfs (in a user and mount namespace: no root needed, nothing mounted outside) holds the adapter
    (0.55 MB) but not the optimizer state (1.1 MB): torch.save fails with `[enforce fail at inline_container.cc:672]
    . unexpected pos`, no ENOSPC anywhere in its exception chain. The trainer's last line says the disk is full and
    which folder, and how to go on."""
    disk = tmp_path / "disk"
    disk.mkdir()
    probe = subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=1m", "none", str(disk)],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        reason = f"needs a user and mount namespace (unshare -rm): {probe.stderr.strip()}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "ADAPTER_REPO": REPO, "HF_TOKEN": "hf_test", "DEVICE": "cpu", "DEBUG": "0",
           "OUTPUT_DIR": str(disk / "out"), "HEARTBEAT_FILE": str(tmp_path / "heartbeat")}
    mount_then_run = 'mount -t tmpfs -o size=1m none "$1" && shift && exec "$@"'
    out = subprocess.run(["unshare", "-rm", "sh", "-c", mount_then_run, "sh", str(disk), sys.executable, "-c",
                          SAVE_AS_THE_TRAINER, str(root), str(root / "tests")],
                         env=env, capture_output=True, text=True, timeout=300)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1, out.stderr[-3000:]
    assert last.startswith(f"train_lora.py: the disk holding {disk / 'out'} is full ("), last
    assert "unexpected pos" in last and "relaunch" in last
