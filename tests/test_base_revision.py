"""Every load of the base model, its tokenizer or its config uses recipe.BASE_MODEL_REVISION, never `main`.

The Hub here is a real huggingface_hub cache in offline mode that holds a tiny LFM2 under the pinned commit
only, with no `refs/main`: a load at the pin finds it, and any load that falls back to the default branch
(no revision, or `main`) fails the test with transformers' own OSError. vLLM cannot run here, so its
command line is read off the DRY_RUN plan of every script that starts it.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants
from peft import get_peft_model

import export_adapter
import recipe
import train_lora
from tests.fake_sessions import FakeSessionFactory, fake_task_list
from tests.hub_double import LocalHub
from tests.tiny_lfm2 import save_tiny_model, tiny_model
from tests.trl_cpu_shims import NullWeightTransfer, cpu_trainer_shims

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "hf_SECRETtokenVALUE123"


@pytest.fixture
def pinned_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline Hub cache holding the base model at BASE_MODEL_REVISION and nowhere else."""
    cache = tmp_path / "hf-cache"
    snapshot = cache / f"models--{recipe.BASE_MODEL.replace('/', '--')}" / "snapshots" / recipe.BASE_MODEL_REVISION
    save_tiny_model(snapshot)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the kernels hub lookup reads the variable
    return snapshot


def test_the_base_model_is_pinned_to_a_commit():
    assert re.fullmatch(r"[0-9a-f]{40}", recipe.BASE_MODEL_REVISION), recipe.BASE_MODEL_REVISION


def test_trainer_loads_model_config_and_tokenizer_at_the_pin(pinned_hub, tmp_path):
    """The production builder with the default MODEL: TRL's model creation, the tokenizer, the generation config."""
    settings = train_lora.settings_from_env({
        "ADAPTER_REPO": "you/lfm-test", "HF_TOKEN": TOKEN, "DEVICE": "cpu",
        "OUTPUT_DIR": str(tmp_path / "out"), "HEARTBEAT_FILE": str(tmp_path / "heartbeat"),
        "TASK_DATA": fake_task_list(tmp_path / "data")})
    assert (settings.model, settings.model_revision) == (recipe.BASE_MODEL, recipe.BASE_MODEL_REVISION)
    with cpu_trainer_shims():
        trainer = train_lora.build_trainer(settings, factory=functools.partial(FakeSessionFactory, "http://env"),
                                           weight_transfer=NullWeightTransfer(), api=LocalHub(tmp_path / "hub"))
    assert trainer.model.base_model.model.config._commit_hash == recipe.BASE_MODEL_REVISION


def test_export_merges_into_the_base_at_the_pin(pinned_hub, tmp_path):
    """export_adapter.py --merged with the default --base-model loads the base model and tokenizer at the pin."""
    adapter = tmp_path / "adapter"
    get_peft_model(tiny_model()[0], train_lora.lora_config()).save_pretrained(adapter)
    args = export_adapter.parse_args(["--source", "you/lfm-test", "--target", "you/out", "--merged"], env={})
    assert args.base_model == recipe.BASE_MODEL
    export_adapter.write_merged(args.base_model, adapter, tmp_path / "merged", "card", args.merged_dtype)
    assert (tmp_path / "merged" / "config.json").is_file() and (tmp_path / "merged" / "tokenizer.json").is_file()


def vllm_commands(script: str, tmp_path: Path, **extra: str) -> list[list[str]]:
    """The argv of every `vllm serve` a script's DRY_RUN plan prints (environment assignments dropped)."""
    env = {"PATH": os.environ["PATH"], "PYTHON": sys.executable, "DRY_RUN": "1", "LOG_DIR": str(tmp_path / "logs"),
           "ADAPTER_REPO": "you/lfm-test", "HF_TOKEN": TOKEN, "JOB_ID": "abc", **extra}
    out = subprocess.run(["bash", str(ROOT / script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    argvs = [shlex.split(line.strip()[2:]) for line in out.stdout.splitlines() if line.strip().startswith("$ ")]
    return [argv[argv.index("serve") - 1:] for argv in argvs if "serve" in argv and "vllm" in argv]


@pytest.mark.parametrize(("script", "extra", "count"), [
    ("serve_policy.sh", {}, 1),                 # training mode
    ("serve_policy.sh", {"LORA": "1"}, 1),      # eval mode
    ("run_eval.sh", {}, 1),
    ("run_eval.sh", {"EVAL_MODE": "watch"}, 1),
    ("run_job.sh", {}, 1),                      # training; its final eval runs run_eval.sh
])
def test_every_vllm_start_pins_model_and_tokenizer_revision(tmp_path, script, extra, count):
    commands = vllm_commands(script, tmp_path, **extra)
    assert len(commands) == count, commands
    for argv in commands:
        assert argv[2] == recipe.BASE_MODEL
        assert argv[argv.index("--revision") + 1] == recipe.BASE_MODEL_REVISION
        assert argv[argv.index("--tokenizer-revision") + 1] == recipe.BASE_MODEL_REVISION
