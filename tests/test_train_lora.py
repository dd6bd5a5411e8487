"""train_lora.py against the real TRL 1.15 / PEFT / transformers stack on CPU, with a tiny LFM2.

Doubles stand only for what cannot exist here: the Hub (`LocalHub`), the Harbor env server
(`FakeSessionFactory`), vLLM's NCCL link (`NullWeightTransfer`) and the GPU-only bits of TRL
(`cpu_trainer_shims`).
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from transformers import Lfm2Config
from trl.experimental.async_grpo.openenv_harness import HarnessRolloutOutcome, HarnessRolloutWorker

import adapter_repo
import recipe
import train_callbacks
import train_lora
import train_metrics
from tests.fake_sessions import TASKS, FakeSessionFactory, fake_task_list
from tests.hub_double import LocalHub
from tests.tiny_lfm2 import LAYER_TYPES, lora_param_count, save_tiny_model, tiny_model
from tests.trl_cpu_shims import NullWeightTransfer, cpu_trainer_shims

ROOT = Path(__file__).resolve().parents[1]
REPO = "me/LFM2.5-2.6B-opencode-lora-RL"
TOKEN = "hf_SECRETtokenVALUE123"
BASE_ENV = {"ADAPTER_REPO": REPO, "HF_TOKEN": TOKEN}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No network here: without this, transformers' hub-kernel lookup for the conv waits out a timeout."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def run_env(model_dir: Path, tmp: Path, **extra: str) -> dict[str, str]:
    return {**BASE_ENV, "MODEL": str(model_dir), "DEVICE": "cpu", "OUTPUT_DIR": str(tmp / "out"),
            "HEARTBEAT_FILE": str(tmp / "heartbeat"), "TASK_DATA": fake_task_list(tmp / "data"), **extra}


# --- LoRA ----------------------------------------------------------------------------------------------------------
def wrapped_modules(model) -> set[str]:
    return {name.removeprefix("base_model.model.") for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def test_lora_wraps_attention_and_ffn_only_and_count_matches_formula(tmp_path):
    model, _ = tiny_model()
    peft_model = get_peft_model(model, train_lora.lora_config())
    expected = set()
    for i, kind in enumerate(LAYER_TYPES):
        expected |= {f"model.layers.{i}.feed_forward.{w}" for w in ("w1", "w2", "w3")}
        if kind == "full_attention":
            expected |= {f"model.layers.{i}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")}
    assert wrapped_modules(peft_model) == expected
    assert not any(".conv." in name for name in wrapped_modules(peft_model))

    peft_model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert sum(t.numel() for t in saved.values()) == lora_param_count(model.config)
    assert all("conv" not in key and "lm_head" not in key for key in saved)


def test_a_bare_out_proj_target_would_also_wrap_the_conv_projection():
    # The pitfall lora_config() avoids: PEFT matches by suffix.
    model, _ = tiny_model()
    config = train_lora.lora_config()
    config.target_modules = ["q_proj", "k_proj", "v_proj", "out_proj", "w1", "w2", "w3"]
    assert any(name.endswith("conv.out_proj") for name in wrapped_modules(get_peft_model(model, config)))


def test_param_count_formula_follows_auto_adjusted_ffn(tmp_path):
    model, _ = tiny_model(block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.5, block_multiple_of=16)
    get_peft_model(model, train_lora.lora_config()).save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert sum(t.numel() for t in saved.values()) == lora_param_count(model.config)


def test_param_count_of_the_real_layout_is_the_published_adapter_size():
    # LFM2-2.6B layout (FACTS.md): 30 layers, attention at 2,5,9,13,17,21,24,27; 40,271,872 params = 161 MB fp32.
    attention = {2, 5, 9, 13, 17, 21, 24, 27}
    config = Lfm2Config(vocab_size=65536, hidden_size=2048, intermediate_size=10752, num_hidden_layers=30,
                        num_attention_heads=32, num_key_value_heads=8, block_auto_adjust_ff_dim=False,
                        layer_types=["full_attention" if i in attention else "conv" for i in range(30)])
    assert lora_param_count(config) == 40_271_872


# --- Reward ----------------------------------------------------------------------------------------------------------
def outcome(env_reward: float | None, tool_calls: int) -> HarnessRolloutOutcome:
    return HarnessRolloutOutcome(env_reward=env_reward, completion=[], trace=[], tool_call_count=tool_calls,
                                 tool_failure_count=0, tool_calls_by_name={"bash": tool_calls}, timed_out=False)


@pytest.mark.parametrize(("env_reward", "tool_calls", "expected"), [
    (1.0, 0, 1.1),      # correct, no tools: full bonus
    (1.0, 8, 1.075),    # correct: 0.1 * 24/32
    (1.0, 32, 1.0),     # correct at the budget: no bonus
    (1.0, 40, 1.0),     # over the budget: the bonus floors at 0, never negative
    (0.0, 0, 0.0),      # wrong scores 0 whatever its tool count
    (0.0, 40, 0.0),
])
def test_reward(env_reward, tool_calls, expected):
    assert train_lora.reward(outcome(env_reward, tool_calls)) == pytest.approx(expected)


def test_unscorable_rollout_has_no_reward():
    assert train_lora.reward(outcome(None, 3)) is None


# --- Settings and bad input ------------------------------------------------------------------------------------------
def test_settings_defaults_come_from_the_recipe():
    settings = train_lora.settings_from_env(BASE_ENV)
    assert (settings.model, settings.max_steps, settings.save_steps) == (
        recipe.BASE_MODEL, recipe.MAX_STEPS, recipe.SAVE_STEPS)
    assert settings.vllm_url == f"http://{recipe.LOOPBACK}:{recipe.VLLM_PORT}"
    assert settings.env_url == f"http://{recipe.LOOPBACK}:{recipe.ENV_PORT}"
    assert (settings.resume, settings.weight_sync, settings.sandbox) == (True, "merge_free", "hf-sandbox")
    assert TOKEN not in repr(settings)
    assert (settings.report_to, settings.dashboard_space) == (recipe.REPORT_TO, recipe.DASHBOARD_SPACE)


def test_dashboard_names_come_from_the_adapter_repo_and_the_job():
    env = {**BASE_ENV, "SPACE_HOST": "68abc--8000.hf.jobs", "REPORT_TO": "none", "DASHBOARD_SPACE": "local",
           "DEVICE": "cpu"}
    settings = train_lora.settings_from_env(env)
    assert (settings.run_name, settings.report_to, settings.dashboard_space) == ("train-68abc", "none", None)
    assert train_lora.settings_from_env({**env, "HF_JOB_ID": "68def"}).run_name == "train-68def"
    assert train_lora.grpo_config(settings).project == REPO.split("/")[-1]


@pytest.mark.parametrize(("env", "message"), [
    ({"ADAPTER_REPO": ""}, "ADAPTER_REPO is not set"),
    ({"ADAPTER_REPO": "no-slash"}, "is not a valid repo id"),
    ({"ADAPTER_REPO": "a/b/c"}, "is not a valid repo id"),
    ({"MAX_STEPS": "0"}, "MAX_STEPS=0 is out of range: use 1..1000"),
    ({"MAX_STEPS": "-5"}, "MAX_STEPS=-5 is out of range"),
    ({"MAX_STEPS": "ten"}, "MAX_STEPS='ten' is not a whole number"),
    ({"MAX_STEPS": "1001"}, "MAX_STEPS=1001 is out of range: use 1..1000 (one training task per step)"),
    ({"SAVE_STEPS": "0"}, "SAVE_STEPS=0 is out of range"),
    ({"WEIGHT_SYNC": "lora"}, "WEIGHT_SYNC='lora' is not one of merge_free, stock"),
    ({"SANDBOX": "hf_sandbox"}, "SANDBOX='hf_sandbox' is not offered"),
    ({"SANDBOX": "modal"}, "SANDBOX='modal' is not offered (the job installs and checks only these Harbor backends"),
    ({"RESUME": "maybe"}, "RESUME='maybe' is not a yes/no value"),
    ({"DEVICE": "tpu"}, "DEVICE='tpu' is not one of cuda, cpu"),
    ({"REPORT_TO": "wandb"}, "REPORT_TO='wandb' is not offered (the job installs Trackio and no other dashboard)"),
    ({"REPORT_TO": "tensorboard"}, "REPORT_TO='tensorboard' is not offered"),
    ({"STOP_AFTER_STEP": "two"}, "STOP_AFTER_STEP='two' is not a whole number"),
    ({"LEARNING_RATE": "fast"}, "LEARNING_RATE='fast' is not a positive number"),
    ({"MAX_STALENESS": "-1"}, "MAX_STALENESS=-1 is out of range: use a whole number >= 0"),
])
def test_bad_input_is_one_clear_line_and_exit_2(env, message, monkeypatch, capsys):
    with pytest.raises(recipe.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train_lora.settings_from_env({**BASE_ENV, **env})
    monkeypatch.setattr(os, "environ", {**BASE_ENV, **env})
    assert train_lora.main(["--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err and TOKEN not in captured.err


UNEXPECTED = "rerun with DEBUG=1 for the full traceback, and report it if the cause is not yours to fix"


@pytest.mark.parametrize("debug", ["", "1"], ids=["plain", "debug"])
def test_an_early_failure_that_is_not_bad_input_ends_in_its_own_one_line(monkeypatch, capsys, tmp_path, debug):
    """Issue 26, item 11: an import error before the settings existed ended in "UnboundLocalError: ... 'settings'",
    which run_job.sh then quoted as the reason. It ends as every entry point's failure does (adapter_repo.run_cli)."""
    def missing_trl(*_: object) -> None:
        raise ModuleNotFoundError("No module named 'trl'")

    monkeypatch.setattr(recipe, "check_versions", missing_trl)
    monkeypatch.setattr(os, "environ", {**BASE_ENV, "DEBUG": debug, "HEARTBEAT_FILE": str(tmp_path / "heartbeat")})
    assert train_lora.main([]) == 1
    err = capsys.readouterr().err
    assert "UnboundLocalError" not in err and TOKEN not in err
    assert err.splitlines()[-1] == f"train_lora.py: unexpected ModuleNotFoundError: No module named 'trl': {UNEXPECTED}"
    assert err.startswith("Traceback") if debug else err.count("\n") == 1


def test_a_training_crash_ends_in_one_line_naming_it(monkeypatch, capsys, tmp_path):
    def crash(settings: object, **_: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")

    monkeypatch.setattr(train_lora, "train", crash)
    monkeypatch.setattr(os, "environ", {**BASE_ENV, "HEARTBEAT_FILE": str(tmp_path / "heartbeat")})
    assert train_lora.main([]) == 1
    assert capsys.readouterr().err == ("train_lora.py: unexpected RuntimeError: CUDA error: an illegal memory access "
                                       f"was encountered: {UNEXPECTED}\n")


def test_dry_run_needs_no_token_but_a_real_run_does(monkeypatch, capsys):
    """The README's `train_lora.py --dry-run` reads no secret; only training refuses a missing HF_TOKEN."""
    monkeypatch.setattr(os, "environ", {"ADAPTER_REPO": REPO, "RESUME": "off"})
    assert train_lora.main(["--dry-run"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["adapter_repo"] == REPO and config["resume"] is False and "hf_token" not in config
    with pytest.raises(recipe.ConfigError, match="HF_TOKEN is not set"):
        train_lora.settings_from_env({"ADAPTER_REPO": REPO, "HF_TOKEN": ""})


@pytest.mark.parametrize(("package", "installed"), [("trl", "1.16.0"), ("transformers", "5.18.0")])
def test_wrong_library_version_stops_before_anything_loads(package, installed, monkeypatch, capsys):
    from importlib import metadata

    real_version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: installed if name == package else real_version(name))
    monkeypatch.setattr(os, "environ", dict(BASE_ENV))
    assert train_lora.main(["--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{package} {installed} is installed" in err
    assert f"{package}=={recipe.pinned_versions()[package].removeprefix('==')}" in err


def test_no_cuda_device_is_refused_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    settings = train_lora.settings_from_env({**run_env(model_dir, tmp_path), "DEVICE": "cuda"})
    hub = LocalHub(tmp_path / "hub")
    with pytest.raises(recipe.ConfigError, match="no CUDA device is visible"):
        train_lora.train(settings, factory=functools.partial(FakeSessionFactory), api=hub)
    assert hub.commits == [] and not (tmp_path / "hub" / REPO).exists()


def test_a_token_that_cannot_write_to_the_existing_repo_is_refused_before_the_model_loads(model_dir, tmp_path,
                                                                                       monkeypatch):
    """Issue 26 (8): a read-only HF_TOKEN fails before step 1, not at the first checkpoint push."""
    settings = train_lora.settings_from_env(run_env(model_dir, tmp_path))
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    hub.token_role = "read"
    monkeypatch.setattr(train_lora, "build_trainer",
                        lambda *a, **k: pytest.fail("the trainer was built with a token that cannot write"))
    with pytest.raises(adapter_repo.Failure, match=f"^HF_TOKEN cannot write to {REPO} "):
        train_lora.train(settings, factory=functools.partial(FakeSessionFactory), api=hub)


def test_dry_run_prints_the_resolved_config_without_secrets_side_effects_or_downloads(tmp_path):
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(ROOT), **BASE_ENV, "MAX_STEPS": "20", "LEARNING_RATE": "1e-5"}
    # The dry run imports none of the training stack (about 10 s of CPU), and loads or writes nothing.
    code = ("import sys, train_lora; code = train_lora.main(['--dry-run']); loaded = [m for m in ('openenv', "
            "'torch', 'transformers', 'peft', 'trl', 'train_weight_sync', 'train_callbacks') if m in sys.modules]; "
            "print('LOADED', loaded, file=sys.stderr); sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "LOADED []" in result.stderr
    assert TOKEN not in result.stdout + result.stderr
    config = json.loads(result.stdout)
    assert config["model"] == recipe.BASE_MODEL and config["adapter_repo"] == REPO and config["max_steps"] == 20
    assert (config["learning_rate"], config["max_staleness"]) == (1e-5, recipe.MAX_STALENESS)  # the knob; the default
    numbers = config["recipe"]
    assert (numbers["LORA_R"], numbers["LORA_ALPHA"], numbers["LORA_DROPOUT"]) == (
        recipe.LORA_R, recipe.LORA_ALPHA, recipe.LORA_DROPOUT)
    assert numbers["LORA_TARGET_MODULES"] == list(recipe.LORA_TARGET_MODULES)
    assert (numbers["TEMPERATURE"], numbers["TOP_P"], numbers["TOP_K"], numbers["MAX_TOKENS"]) == (
        recipe.TEMPERATURE, recipe.TOP_P, recipe.TOP_K, recipe.MAX_TOKENS)
    assert numbers["MAX_TOOL_CALLING_ITERATIONS"] == recipe.MAX_TOOL_CALLING_ITERATIONS
    assert config["vllm_url"] == f"http://{recipe.LOOPBACK}:{recipe.VLLM_PORT}"
    assert config["batching"] == train_lora.conv_safe_batching()
    assert list(cwd.iterdir()) == [] and not list(tmp_path.rglob("*.safetensors"))


# --- Trainer and rollout worker ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("built")
    settings = train_lora.settings_from_env(run_env(model_dir, tmp))
    with cpu_trainer_shims():
        trainer = train_lora.build_trainer(settings, factory=functools.partial(FakeSessionFactory, "http://env"),
                                           weight_transfer=NullWeightTransfer(), api=LocalHub(tmp / "hub"))
    return settings, trainer


def test_real_trainer_and_config_from_the_builders(built):
    settings, trainer = built
    args = trainer.args
    assert type(trainer).__name__ == "MergeFreeAsyncGRPOTrainer"  # WEIGHT_SYNC=merge_free via train_weight_sync.py
    assert trainer.model.base_model.model.dtype == torch.float32  # Frozen base kept in fp32 (no merge drift).
    assert (args.learning_rate, args.max_steps, args.save_steps) == (
        recipe.LEARNING_RATE, recipe.MAX_STEPS, recipe.SAVE_STEPS)
    assert (args.num_generations, args.max_completion_length, args.max_staleness, args.max_inflight_tasks) == (
        recipe.NUM_GENERATIONS, recipe.MAX_TOKENS, recipe.MAX_STALENESS, recipe.MAX_INFLIGHT_ROLLOUTS)
    assert (args.temperature, args.top_p, args.top_k) == (recipe.TEMPERATURE, recipe.TOP_P, recipe.TOP_K)
    assert args.vllm_server_base_url == settings.vllm_url
    assert wrapped_modules(trainer.model) == wrapped_modules(get_peft_model(tiny_model()[0], train_lora.lora_config()))
    assert trainer.processing_class.response_template is not None
    ours = [type(c).__name__ for c in trainer.callback_handler.callbacks if type(c).__module__ == "train_callbacks"]
    assert ours == ["Heartbeat", "CheckpointPusher", "RunLog"]  # StopAfterStep only with STOP_AFTER_STEP
    # Dashboard: Trackio by default, one project per adapter repo, one run per job, a private live Space.
    assert args.report_to == ["trackio"] and args.project == REPO.split("/")[-1] and args.run_name.startswith("train-")
    assert (args.trackio_space_id, args.hub_private_repo, args.trackio_static_space_id) == (
        recipe.DASHBOARD_SPACE, True, False)
    callbacks = {type(c).__name__ for c in trainer.callback_handler.callbacks}
    assert "SafeTrackioCallback" in callbacks and "TrackioCallback" not in callbacks
    # The step's objective and metrics (train_metrics), counting this start's rollout ledger.
    assert isinstance(trainer, train_metrics.StepObjective) and trainer._growth.path.name == recipe.LEDGER_NAME


def test_worker_gets_every_knob_the_recipe_requires(built):
    settings, trainer = built
    worker = trainer.rollout_worker
    kwargs = worker._loop_kwargs
    assert isinstance(worker, HarnessRolloutWorker)
    assert kwargs["max_tool_calling_iterations"] == recipe.MAX_TOOL_CALLING_ITERATIONS == 32
    assert kwargs["max_tokens"] == recipe.MAX_TOKENS == 4096
    assert kwargs["num_generations"] == recipe.NUM_GENERATIONS == 8
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (1.0, 1.0, 0)
    assert kwargs["repetition_penalty"] == 1.0 and kwargs["min_p"] is None
    assert kwargs["eos_token_ids"] == trainer.eos_token_ids  # What TRL would have given its own worker.
    assert kwargs["max_inflight_tasks"] == trainer.args.max_inflight_tasks
    assert kwargs["vllm_server_url"] == settings.vllm_url
    assert kwargs["rollout_reward_fn"] is train_lora.reward and kwargs["reward_funcs"] == []
    assert [row["prompt"][0]["content"] for row in kwargs["dataset"]] == list(TASKS)
    from trl.chat_template_utils import lfm2_2_5_template

    assert kwargs["processing_class"].response_template == lfm2_2_5_template


def test_worker_kwargs_and_factory_survive_pickle(built):
    _, trainer = built
    kwargs = pickle.loads(pickle.dumps(trainer.rollout_worker._loop_kwargs))  # What the spawned child receives.
    factory = kwargs["harness_session_factory"](sampling={"temperature": recipe.TEMPERATURE})
    session = factory.create(kwargs["dataset"][0]["prompt"])
    assert session.sampling["temperature"] == recipe.TEMPERATURE


def test_session_factory_builds_harbor_sessions_that_trl_can_train_after_pickle():
    from openenv.core.harness import TrainableSession

    import harbor_sessions

    settings = train_lora.settings_from_env({**BASE_ENV, "ENV_URL": "http://127.0.0.1:9001", "SANDBOX": "hf-sandbox"})
    factory = pickle.loads(pickle.dumps(train_lora.session_factory(settings)))
    built = factory(sampling={"temperature": 1.0})  # what TRL's spawned rollout child does
    assert isinstance(built, harbor_sessions.HarborSessionFactory) and built.env_url == "http://127.0.0.1:9001"
    assert TOKEN not in pickle.dumps(factory).decode("latin-1")
    built._tasks = [{"index": 3, "task_name": "t3", "instruction": "Say 4.2."}]  # as tasks() fills it
    session = pickle.loads(pickle.dumps(built)).create([{"role": "user", "content": "Say 4.2.\n"}])
    assert isinstance(session, TrainableSession)  # TRL's loop-owning path refuses anything else
    call = session.call  # what the env server's run_rollout gets
    assert call["harness"] == "opencode" and call["sandbox"] == "hf-sandbox" and call["purpose"] == "train"
    assert call["llm_url"] == settings.vllm_url and call["model"] == recipe.SERVED_MODEL_NAME
    # The proxy counts OpenCode's title call too: the agent itself still gets the recipe's 32 calls.
    assert call["agent_step_limit"] == recipe.MAX_TOOL_CALLING_ITERATIONS + 1
    assert call["agent_timeout_sec"] == recipe.AGENT_TIMEOUT_SEC
    assert (session.task_index, session.call["purpose"], session.call["sampling"]) == (3, "train", {"temperature": 1.0})


def test_empty_task_list_is_a_config_error(tmp_path):
    with pytest.raises(recipe.ConfigError, match="listed but not served"):
        train_lora.train_dataset(functools.partial(FakeSessionFactory, tasks=()), fake_task_list(tmp_path))


# --- Checkpoint push, resume, heartbeat -------------------------------------------------------------------------------
def fake_checkpoint(folder: Path, step: int) -> Path:
    folder.mkdir(parents=True)
    for name in ("adapter_model.safetensors", "adapter_config.json", "trainer_state.json", "tokenizer.json"):
        (folder / name).write_text(f"{name} of step {step}")
    return folder


def test_push_uploads_the_checkpoint_in_one_commit_with_its_marker_last(tmp_path):
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    folder = fake_checkpoint(tmp_path / "out" / "checkpoint-100", 100)
    paths = adapter_repo.push_folder(hub, REPO, folder, "checkpoint-100", marker=True)
    assert len(hub.commits) == 1 and paths[-1] == f"checkpoint-100/{adapter_repo.COMPLETE_MARKER}"
    marker = json.loads((tmp_path / "hub" / REPO / "checkpoint-100" / adapter_repo.COMPLETE_MARKER).read_text())
    assert marker["files"] == {p.name: p.stat().st_size for p in folder.iterdir()}
    assert adapter_repo.complete_checkpoints(hub.list_repo_files(REPO)) == [100]


def test_push_retries_with_backoff_then_succeeds(tmp_path, monkeypatch):
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    hub.fail_uploads = recipe.PUSH_RETRIES - 1
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    folder = fake_checkpoint(tmp_path / "checkpoint-5", 5)
    adapter_repo.push_folder(hub, REPO, folder, "checkpoint-5", marker=True)
    assert waits == [recipe.PUSH_BACKOFF_S * 2**k for k in range(recipe.PUSH_RETRIES - 1)]
    assert adapter_repo.complete_checkpoints(hub.list_repo_files(REPO)) == [5]


def test_push_that_keeps_failing_raises_loudly(tmp_path, caplog, monkeypatch):
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    hub.fail_uploads = recipe.PUSH_RETRIES
    folder = fake_checkpoint(tmp_path / "checkpoint-5", 5)
    monkeypatch.setattr(time, "sleep", lambda s: None)
    with pytest.raises(adapter_repo.PushError, match=f"failed {recipe.PUSH_RETRIES} times.*503"):
        adapter_repo.push_folder(hub, REPO, folder, "checkpoint-5", marker=True)
    assert hub.commits == [] and hub.list_repo_files(REPO) == []
    assert caplog.text.count("push attempt") == recipe.PUSH_RETRIES - 1


def test_resume_picks_the_newest_complete_checkpoint_and_skips_a_half_written_one(tmp_path):
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    for step in (100, 200):
        adapter_repo.push_folder(hub, REPO, fake_checkpoint(tmp_path / f"c{step}", step), f"checkpoint-{step}",
                               marker=True)
    # checkpoint-300: files uploaded one by one and the job died before the marker.
    for path in fake_checkpoint(tmp_path / "c300", 300).iterdir():
        hub.upload_file(path_or_fileobj=str(path), path_in_repo=f"checkpoint-300/{path.name}", repo_id=REPO)
    assert adapter_repo.complete_checkpoints(hub.list_repo_files(REPO)) == [100, 200]
    local = adapter_repo.download_checkpoint(hub, REPO, 200, tmp_path / "out")
    assert local == tmp_path / "out" / "checkpoint-200"
    assert (local / "adapter_model.safetensors").read_text() == "adapter_model.safetensors of step 200"
    assert not (tmp_path / "out" / "checkpoint-300").exists()


def test_resume_refuses_a_download_that_does_not_match_its_marker(tmp_path):
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    adapter_repo.push_folder(hub, REPO, fake_checkpoint(tmp_path / "c1", 1), "checkpoint-1", marker=True)
    (tmp_path / "hub" / REPO / "checkpoint-1" / "trainer_state.json").write_text("truncated")
    with pytest.raises(adapter_repo.PushError, match="does not match its marker"):
        adapter_repo.download_checkpoint(hub, REPO, 1, tmp_path / "out")


def test_on_save_pushes_the_saved_folder_and_a_failed_push_stops_training(tmp_path, monkeypatch):
    from transformers import TrainerState

    monkeypatch.setattr(time, "sleep", lambda s: None)
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    fake_checkpoint(tmp_path / "out" / "checkpoint-7", 7)
    args = SimpleNamespace(output_dir=str(tmp_path / "out"))
    pusher = train_callbacks.CheckpointPusher(hub, REPO, tmp_path / "work", "job")
    pusher.on_save(args, TrainerState(global_step=7, is_world_process_zero=False), None)
    assert hub.commits == []  # Only the main process pushes.
    hub.fail_uploads = recipe.PUSH_RETRIES
    with pytest.raises(adapter_repo.PushError):
        pusher.on_save(args, TrainerState(global_step=7), None)
    pusher.on_save(args, TrainerState(global_step=7), None)
    assert adapter_repo.complete_checkpoints(hub.list_repo_files(REPO)) == [7]


@pytest.mark.parametrize("status", [401, 403, 404, 400])
def test_a_permanent_push_error_stops_at_once_with_one_line(tmp_path, status, monkeypatch):
    """Defect 6: a refused push (bad token, no write access, no repo) is not retried for minutes."""
    from transformers import TrainerState

    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    fake_checkpoint(tmp_path / "out" / "checkpoint-7", 7)
    hub.fail_uploads, hub.fail_status = 1, status
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    pusher = train_callbacks.CheckpointPusher(hub, REPO, tmp_path / "work", "job")
    with pytest.raises(RuntimeError) as caught:
        pusher.on_save(SimpleNamespace(output_dir=str(tmp_path / "out")), TrainerState(global_step=7), None)
    message = str(caught.value)
    assert waits == [] and hub.commits == []
    assert f"HTTP {status}" in message and "checkpoint-7" in message and "\n" not in message


def test_heartbeat_rewrites_its_file_every_step(tmp_path):
    from transformers import TrainerState

    beat = train_callbacks.Heartbeat(str(tmp_path / "deep" / "heartbeat"))
    beat.on_train_begin(None, TrainerState(global_step=0), None)
    assert (tmp_path / "deep" / "heartbeat").read_text().split()[0] == "0"
    os.utime(tmp_path / "deep" / "heartbeat", (0, 0))
    beat.on_step_end(None, TrainerState(global_step=1), None)
    assert (tmp_path / "deep" / "heartbeat").read_text().split()[0] == "1"
    assert (tmp_path / "deep" / "heartbeat").stat().st_mtime > 0


def test_stop_after_step_saves_that_step_and_ends_training():
    from transformers import TrainerControl, TrainerState

    stop, control = train_callbacks.StopAfterStep(2), TrainerControl()
    stop.on_step_end(None, TrainerState(global_step=1), control)
    assert not control.should_save and not control.should_training_stop
    stop.on_step_end(None, TrainerState(global_step=2), control)
    assert control.should_save and control.should_training_stop
    assert train_lora.settings_from_env({**BASE_ENV, "STOP_AFTER_STEP": "2", "MAX_STEPS": "6"}).stop_after_step == 2
    assert train_lora.settings_from_env(BASE_ENV).stop_after_step == 0


def test_run_log_keeps_every_start_and_logged_step_across_a_resume(tmp_path):
    """train_log.json is what the smoke report reads: the second start must add to it, not replace it."""
    from transformers import TrainerState

    path = recipe.work_file(tmp_path / recipe.HEARTBEAT_NAME, recipe.TRAIN_LOG_NAME)  # where build_trainer puts it
    first = train_callbacks.RunLog(path, resumed_from=None)
    first.on_train_begin(None, TrainerState(global_step=0, max_steps=6), None)
    first.on_log(None, TrainerState(global_step=1), None, logs={"loss": 0.1, "ratio": 0.999})
    second = train_callbacks.RunLog(path, resumed_from=2)
    second.on_train_begin(None, TrainerState(global_step=2, max_steps=6), None)
    second.on_log(None, TrainerState(global_step=3), None, logs={"loss": 0.2, "perf/step_s": None})
    doc = json.loads(path.read_text())
    assert [(s["resumed_from"], s["global_step"], s["max_steps"]) for s in doc["starts"]] == [(None, 0, 6), (2, 2, 6)]
    assert doc["logs"] == [{"start": 0, "step": 1, "loss": 0.1, "ratio": 0.999},
                           {"start": 1, "step": 3, "loss": 0.2, "perf/step_s": None}]


def test_train_pushes_every_checkpoint_beats_every_step_and_resumes(tmp_path):
    """Real optimizer steps through TRL's spawned rollout worker: push, heartbeat, a run stopped after step 2 (the
    smoke run's first start: checkpoints pushed, no final adapter), then a resume that ends with the final adapter."""
    model_dir = save_tiny_model(tmp_path / "model")
    # Like the real checkpoint's, the template is not byte-equal to TRL's copy, so TRL's add_response_schema
    # would raise "Unrecognized chat template" in the rollout child unless train_lora sets the response template.
    template = model_dir / "chat_template.jinja"
    template.write_text("{#- LFM2.5 chat template -#}\n" + template.read_text())
    hub = LocalHub(tmp_path / "hub")
    # 4 groups finish per run: enough for 2 steps of 8 samples plus the dataloader's one-batch lookahead.
    factory = functools.partial(FakeSessionFactory, "http://env", rollout_budget=4 * recipe.NUM_GENERATIONS)
    transfer = NullWeightTransfer()
    first = train_lora.settings_from_env(run_env(model_dir, tmp_path / "run1", MAX_STEPS="3", SAVE_STEPS="1",
                                                 STOP_AFTER_STEP="2"))
    with cpu_trainer_shims():
        train_lora.train(first, factory=factory, weight_transfer=transfer, api=hub)
    files = hub.list_repo_files(REPO)
    assert adapter_repo.complete_checkpoints(files) == [1, 2]
    for name in ("adapter_model.safetensors", "adapter_config.json", "trainer_state.json", "tokenizer.json",
                 "optimizer.pt", "rollout_state.json"):
        assert f"checkpoint-2/{name}" in files
    assert "adapter_model.safetensors" not in files  # stopped before MAX_STEPS: no final adapter at the root
    assert Path(first.heartbeat_file).read_text().split()[0] == "2"
    assert len(transfer.syncs) == 3  # Cold sync plus one per optimizer step.

    # The job dies while checkpoint-2 is half uploaded; the relaunch must resume from checkpoint-1.
    (tmp_path / "hub" / REPO / "checkpoint-2" / adapter_repo.COMPLETE_MARKER).unlink()
    commits_before = len(hub.commits)
    second = train_lora.settings_from_env(run_env(model_dir, tmp_path / "run2", MAX_STEPS="3", SAVE_STEPS="1"))
    with cpu_trainer_shims():
        train_lora.train(second, factory=factory, weight_transfer=NullWeightTransfer(), api=hub)
    assert [message for _, message, _ in hub.commits[commits_before:]] == [
        "Upload checkpoint-2", "Upload checkpoint-3", "Upload final adapter"]  # Steps 2 and 3 only: it resumed at 1.
    state = json.loads((tmp_path / "hub" / REPO / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    files = hub.list_repo_files(REPO)
    assert adapter_repo.complete_checkpoints(files) == [1, 2, 3]
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(files)  # Final at the root.
    assert "training_args.bin" not in files and "optimizer.pt" not in files
    final = load_file(tmp_path / "hub" / REPO / "adapter_model.safetensors")
    assert sum(t.numel() for t in final.values()) == lora_param_count(tiny_model()[0].config)
