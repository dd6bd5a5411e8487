"""Async GRPO with LoRA on LFM2.5-2.6B inside the OpenCode harness (TRL 1.15 AsyncGRPOTrainer), run by run_job.sh.
In the recipe's order: trainer, rollout worker, reward, LoRA, callbacks; then settings and the run (docs/training.md).

    ADAPTER_REPO=you/LFM2.5-2.6B-opencode-lora-RL HF_TOKEN=hf_... CUDA_VISIBLE_DEVICES=0 python3 train_lora.py
    ADAPTER_REPO=you/x .venv/bin/python train_lora.py --dry-run   # the resolved configuration; loads nothing
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import adapter_repo
import dashboard
import prepare_tasks
import recipe

if TYPE_CHECKING:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PreTrainedTokenizerBase, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.openenv_harness import HarnessRolloutOutcome, HarnessRolloutWorker

logger = logging.getLogger("train_lora")


# --- 1. Trainer -------------------------------------------------------------------------------------------------------
def grpo_config(settings: Settings) -> AsyncGRPOConfig:
    """The trainer's config; the base loads at its pinned revision (without `architecture`, its config from main)."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo import AsyncGRPOConfig

    pinned = {"revision": settings.revision, "architecture": AutoModelForCausalLM} if settings.revision else None
    return AsyncGRPOConfig(
        output_dir=settings.output_dir, dtype=recipe.TRAINER_DTYPE, model_init_kwargs=pinned,
        use_cpu=settings.device == "cpu", bf16=settings.device == "cuda", hub_private_repo=True,
        learning_rate=settings.learning_rate, max_steps=settings.max_steps, save_steps=settings.save_steps,
        # the GRPO group and its sampling: full vocabulary, one output cap and call budget (training and eval alike)
        num_generations=recipe.NUM_GENERATIONS, temperature=recipe.TEMPERATURE, top_p=recipe.TOP_P, top_k=recipe.TOP_K,
        max_completion_length=recipe.MAX_TOKENS, max_tool_calling_iterations=recipe.MAX_TOOL_CALLING_ITERATIONS,
        # async rollouts: in flight not -1 (auto), since the injected worker must read the same number
        max_staleness=settings.max_staleness, max_inflight_tasks=recipe.MAX_INFLIGHT_ROLLOUTS,
        vllm_server_base_url=settings.vllm_url,
        # Trackio: a project per adapter repo, a run per job
        report_to=settings.report_to, project=dashboard.project(settings.adapter_repo), run_name=settings.run_name,
        trackio_space_id=settings.dashboard_space, trackio_static_space_id=False, **conv_safe_batching())


@functools.cache
def trainer_class(weight_sync: str) -> type[AsyncGRPOTrainer]:
    """TRL's trainer with the weight sync (train_weight_sync), the token-level step and its metrics (train_metrics)
    and the resume position (train_resume) mixed in; one class per mode."""
    import train_metrics
    import train_resume
    import train_weight_sync

    base = train_weight_sync.TRAINERS[weight_sync]
    return type(base.__name__, (train_resume.ResumePosition, train_metrics.StepObjective, base),
                {"__module__": base.__module__, "__doc__": base.__doc__})


def build_trainer(settings: Settings, *, factory: Callable[..., Any] | None = None, weight_transfer: Any = None,
                  api: Any = None, resumed_from: int | None = None) -> AsyncGRPOTrainer:
    """The trainer with its worker, LoRA and callbacks, counting the rollout ledger's growth per step."""
    from huggingface_hub import HfApi

    import train_metrics

    factory = factory if factory is not None else session_factory(settings)
    dataset = train_dataset(factory, settings.task_data)
    tokenizer = load_tokenizer(settings)
    trainer = trainer_class(settings.weight_sync)(
        model=settings.model, args=grpo_config(settings), train_dataset=dataset, processing_class=tokenizer,
        rollout_worker=rollout_worker(settings, tokenizer, dataset, factory), peft_config=lora_config(),
        callbacks=callbacks(settings, api if api is not None else HfApi(token=settings.hf_token), resumed_from),
        weight_transfer=weight_transfer)
    trainer.rollout_worker._loop_kwargs["eos_token_ids"] = trainer.eos_token_ids  # read at the child's start
    train_metrics.attach(trainer, recipe.work_file(settings.heartbeat_file, recipe.LEDGER_NAME))
    return trainer


# --- 2. Rollout worker: tasks, tokenizer, sessions --------------------------------------------------------------------
def session_factory(settings: Settings) -> functools.partial:
    """A picklable factory of OpenEnv Harbor sessions (harbor_sessions.py: OpenCode, the recipe's agent timeout and
    call budget, which the capture proxy enforces; TRL's never reaches a loop-owning agent), rebuilt in TRL's child."""
    from harbor_sessions import HarborSessionFactory

    return functools.partial(HarborSessionFactory, settings.env_url, split=settings.train_split,
                             llm_url=settings.vllm_url, model=settings.served_model_name, sandbox=settings.sandbox)


def train_dataset(factory: Callable[..., Any], task_data: str | Path) -> Dataset:
    """The env server's tasks as prompts (`create()` only accepts prompts built by `prompt_rows()`), in the task
    list's fixed order: TRL iterates this dataset unshuffled from a resume position, on every start."""
    from datasets import Dataset

    rows = factory().prompt_rows()  # in_list_order refuses tasks other than the list's, none included
    return Dataset.from_list(prepare_tasks.in_list_order(rows, Path(task_data), "train"))


def load_tokenizer(settings: Settings) -> PreTrainedTokenizerBase:
    """The tokenizer with the chat template vLLM serves (chat_template.py) and TRL's LFM2.5 response template, which
    add_response_schema does not find for the model repo's own template."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import lfm2_2_5_template

    from chat_template import chat_template

    tokenizer = AutoTokenizer.from_pretrained(settings.model, revision=settings.revision)
    tokenizer.chat_template = chat_template()
    tokenizer.response_template = copy.deepcopy(lfm2_2_5_template)
    return tokenizer


def rollout_worker(settings: Settings, tokenizer: PreTrainedTokenizerBase, dataset: Dataset,
                   factory: Callable[..., Any]) -> HarnessRolloutWorker:
    """TRL's HarnessRolloutWorker in loop-owning mode, given every knob itself (the trainer forwards none); sessions go
    through the rollout guard (train_rollouts), and a finished rollout dates the heartbeat while the trainer waits."""
    from trl.experimental.async_grpo.openenv_harness import HarnessRolloutWorker

    import train_resume
    import train_rollouts

    ledger = recipe.work_file(settings.heartbeat_file, recipe.LEDGER_NAME)

    class ProgressWorker(HarnessRolloutWorker):
        _loop_cls = train_resume.PositionedRolloutLoop  # the child's: resumes at the position, stamps row metrics

        def check_health(self, stale_after_s: float) -> None:
            """TRL calls this every few seconds while the trainer waits for samples (and nowhere else)."""
            super().check_health(stale_after_s)
            train_rollouts.refresh_heartbeat(settings.heartbeat_file, ledger)

    args = grpo_config(settings)
    same_names = ("num_generations", "max_inflight_tasks", "queue_maxsize", "temperature", "top_p", "top_k", "min_p",
                  "repetition_penalty", "request_timeout", "max_tool_calling_iterations")
    return ProgressWorker(
        model_name=settings.served_model_name, dataset=dataset, processing_class=tokenizer,
        eos_token_ids=[],  # build_trainer sets TRL's own once the model is loaded
        vllm_server_url=args.vllm_server_base_url, max_tokens=args.max_completion_length,
        harness_session_factory=train_rollouts.guarded(factory, ledger), reward_funcs=[], rollout_reward_fn=reward,
        **{name: getattr(args, name) for name in same_names})


# --- 3. Reward --------------------------------------------------------------------------------------------------------
def reward(outcome: HarnessRolloutOutcome) -> float | None:
    """Correctness plus a tool-efficiency bonus only a correct answer earns (recipe.py's Reward note weighs it); None
    when the verifier did not run, so TRL leaves the rollout out of the group baseline instead of scoring it wrong."""
    if outcome.env_reward is None:
        return None
    score = recipe.CORRECT_REWARD * outcome.env_reward
    if outcome.env_reward >= 1.0:
        unused = (recipe.TOOL_BUDGET - outcome.tool_call_count) / recipe.TOOL_BUDGET
        score += recipe.TOOL_BONUS * max(0.0, unused)
    return score


# --- 4. LoRA and batching ---------------------------------------------------------------------------------------------
def lora_config() -> LoraConfig:
    """LoRA on attention q/k/v/out and FFN w1/w2/w3, never on the short-conv projections."""
    from peft import LoraConfig

    return LoraConfig(
        r=recipe.LORA_R, lora_alpha=recipe.LORA_ALPHA, lora_dropout=recipe.LORA_DROPOUT, bias="none",
        target_modules=list(recipe.LORA_TARGET_MODULES), task_type="CAUSAL_LM",
        revision=recipe.BASE_MODEL_REVISION)  # saved in adapter_config.json: AutoPeftModel loads the base there


def conv_safe_batching() -> dict[str, int]:
    """AsyncGRPOConfig fields that give every row one sample: in a packed row LFM2's short conv reads the previous
    sample's tail (docs/pitfalls.md). One GRPO group a step; train_metrics.StepObjective keeps the loss token-level."""
    return {"token_budget": 0, "per_device_train_batch_size": 1, "gradient_accumulation_steps": recipe.NUM_GENERATIONS}


# --- 5. Callbacks -----------------------------------------------------------------------------------------------------
def callbacks(settings: Settings, api: Any, resumed_from: int | None) -> list[TrainerCallback]:
    """The heartbeat, the checkpoint push (with the work folder's logs), train_log.json, and the smoke's early stop."""
    import train_callbacks

    return [train_callbacks.Heartbeat(settings.heartbeat_file),
            train_callbacks.CheckpointPusher(api, settings.adapter_repo, Path(settings.heartbeat_file).parent,
                                             dashboard.job_id(os.environ)),
            train_callbacks.RunLog(recipe.work_file(settings.heartbeat_file, recipe.TRAIN_LOG_NAME), resumed_from),
            *([train_callbacks.StopAfterStep(settings.stop_after_step)] if settings.stop_after_step else [])]


# --- Settings ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """Where things are for this run; the numbers stay in recipe.py."""

    adapter_repo: str
    hf_token: str = field(repr=False)
    model: str = recipe.BASE_MODEL
    model_revision: str = recipe.BASE_MODEL_REVISION
    served_model_name: str = recipe.SERVED_MODEL_NAME
    max_steps: int = recipe.MAX_STEPS
    save_steps: int = recipe.SAVE_STEPS
    learning_rate: float = recipe.LEARNING_RATE
    max_staleness: int = recipe.MAX_STALENESS
    vllm_url: str = f"http://{recipe.LOOPBACK}:{recipe.VLLM_PORT}"
    env_url: str = f"http://{recipe.LOOPBACK}:{recipe.ENV_PORT}"
    train_split: str = ""
    task_data: str = str(prepare_tasks.DATA_DIR)  # folder of train.json, whose order is the trained order
    output_dir: str = "outputs"
    heartbeat_file: str = f"outputs/{recipe.HEARTBEAT_NAME}"
    resume: bool = True
    stop_after_step: int = 0
    weight_sync: str = "merge_free"
    sandbox: str = "hf-sandbox"
    device: str = "cuda"
    report_to: str = recipe.REPORT_TO
    dashboard_space: str | None = recipe.DASHBOARD_SPACE
    run_name: str = "train"

    @property
    def revision(self) -> str | None:
        """The model's pinned revision; None for a local model folder."""
        return None if Path(self.model).is_dir() else self.model_revision


# Environment knobs (recipe.knob reads and checks each), then where things are (read as given).
KNOBS = ("MAX_STEPS", "SAVE_STEPS", "LEARNING_RATE", "MAX_STALENESS", "RESUME", "STOP_AFTER_STEP", "WEIGHT_SYNC",
         "SANDBOX", "REPORT_TO")
PLACES = ("MODEL", "MODEL_REVISION", "SERVED_MODEL_NAME", "VLLM_URL", "ENV_URL", "TRAIN_SPLIT", "TASK_DATA",
          "OUTPUT_DIR", "HEARTBEAT_FILE", "DEVICE")


def settings_from_env(env: Mapping[str, str] = os.environ, *, need_token: bool = True) -> Settings:
    """The run's settings, checked as run_job.sh's preflight checks them (recipe.knob); a real run needs the token."""
    given = {name.lower(): env[name].strip() for name in PLACES if env.get(name, "").strip()}
    if given.get("device", Settings.device) not in ("cuda", "cpu"):
        raise recipe.ConfigError(f"DEVICE={given['device']!r} is not one of cuda, cpu")
    given.setdefault("heartbeat_file", str(Path(given.get("output_dir", Settings.output_dir)) / recipe.HEARTBEAT_NAME))
    return Settings(
        adapter_repo=recipe.require_repo_id(env.get("ADAPTER_REPO", "").strip(), "ADAPTER_REPO"),
        hf_token=recipe.require_token(dict(env)) if need_token else env.get("HF_TOKEN", "").strip(),
        dashboard_space=dashboard.space(env), run_name=dashboard.run_name("train", env),
        **{name.lower(): recipe.knob(name, env) for name in KNOBS}, **given)


def resolved_config(settings: Settings) -> dict[str, Any]:
    """What --dry-run prints: the settings (no token) and the recipe numbers the run uses, read from recipe.py as the
    builders pass them (importing PEFT and TRL would cost the dry run 10 s)."""
    numbers = ("TRAINER_DTYPE", "NUM_GENERATIONS", "TEMPERATURE", "TOP_P", "TOP_K", "MAX_TOKENS",
               "MAX_TOOL_CALLING_ITERATIONS", "LORA_R", "LORA_ALPHA", "LORA_DROPOUT", "LORA_TARGET_MODULES",
               "CORRECT_REWARD", "TOOL_BONUS", "TOOL_BUDGET")
    return {**{k: v for k, v in asdict(settings).items() if k != "hf_token"}, "batching": conv_safe_batching(),
            "recipe": {name: getattr(recipe, name) for name in numbers}}


# --- The run: resume, train, push the final adapter; the command line -------------------------------------------------
def train(settings: Settings, *, factory: Callable[..., Any] | None = None, weight_transfer: Any = None,
          api: Any = None) -> None:
    """Resume from the newest complete checkpoint, train, then push the final adapter with its model card to the repo
    root (not after STOP_AFTER_STEP); a final adapter already at the root is never replaced."""
    import torch
    from huggingface_hub import HfApi

    import train_metrics

    if settings.device == "cuda" and not torch.cuda.is_available():
        raise recipe.ConfigError("DEVICE=cuda but no CUDA device is visible: check CUDA_VISIBLE_DEVICES, or DEVICE=cpu")
    api = api if api is not None else HfApi(token=settings.hf_token)
    adapter_repo.require_write_access(api, settings.adapter_repo)  # before any model loads, not at step 100
    files = api.list_repo_files(settings.adapter_repo)
    has_final = adapter_repo.checkpoint_complete(files, adapter_repo.FINAL)
    resumed_from = (adapter_repo.complete_checkpoints(files) or [None])[-1] if settings.resume else None
    if has_final and (resumed_from or 0) < settings.max_steps:
        raise recipe.ConfigError(
            f"{settings.adapter_repo} already holds a final adapter, which training from step {resumed_from or 0} to "
            f"MAX_STEPS={settings.max_steps} would replace: evaluate it with `launch.py eval`, or train into a new "
            "ADAPTER_REPO")
    if not settings.resume:
        adapter_repo.refuse_fresh_start(settings.adapter_repo, files)
    resume_dir = None
    if resumed_from is not None:  # the newest complete checkpoint; a half-pushed one has no marker
        resume_dir = adapter_repo.download_checkpoint(api, settings.adapter_repo, resumed_from,
                                                      Path(settings.output_dir))
        logger.info("resuming from %s/%s", settings.adapter_repo, resume_dir.name)
        if resumed_from >= settings.max_steps:
            finish_trained_run(api, settings, resume_dir, resumed_from, has_final)
            return
    trainer = build_trainer(settings, factory=factory, weight_transfer=weight_transfer, api=api,
                            resumed_from=resumed_from)
    trainer.train(resume_from_checkpoint=str(resume_dir) if resume_dir else None)
    if settings.stop_after_step and trainer.state.global_step < settings.max_steps:
        logger.info("stopped after step %d (STOP_AFTER_STEP): its checkpoint is pushed; no final adapter yet",
                    trainer.state.global_step)
        return
    final_dir = Path(settings.output_dir) / "final"
    trainer.save_model(str(final_dir))
    push_final_adapter(api, settings, final_dir, trainer.state.global_step, train_metrics.dashboard_url(trainer))


def push_final_adapter(api: Any, settings: Settings, final_dir: Path, steps: int, dashboard_url: str | None) -> None:
    """The final adapter at the repo root with the training repo's model card, in one commit."""
    import model_cards

    (final_dir / "README.md").write_text(model_cards.training_card(settings.adapter_repo, steps, dashboard_url,
                                                                   resolved_config(settings)))
    adapter_repo.push_folder(api, settings.adapter_repo, final_dir, "", ignore=adapter_repo.FINAL_ADAPTER_IGNORE)


def finish_trained_run(api: Any, settings: Settings, checkpoint: Path, step: int, has_final: bool) -> None:
    """A start at or past MAX_STEPS (after a failed final push or eval) trains nothing, where transformers would run
    one more step; it pushes the final adapter from the newest checkpoint if the root lacks it."""
    logger.info("%s is at step %d (MAX_STEPS=%d): nothing to train; %s", settings.adapter_repo, step,
                settings.max_steps, "the root holds the final adapter" if has_final else f"pushing {checkpoint.name}")
    if has_final:
        return
    final_dir = Path(settings.output_dir) / "final"
    shutil.copytree(checkpoint, final_dir, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(*adapter_repo.FINAL_ADAPTER_IGNORE, adapter_repo.COMPLETE_MARKER))
    space = settings.dashboard_space if settings.report_to == "trackio" else None
    url = dashboard.SPACE_URL.format(dashboard.space_id(space, api.whoami()["name"])) if space else None
    push_final_adapter(api, settings, final_dir, step, url)


def run(dry_run: bool) -> None:
    """Check the versions and settings, then train (or print the settings); a failure TRL wraps ends in its reason."""
    started = time.time()
    recipe.check_versions()
    settings = settings_from_env(os.environ, need_token=not dry_run)
    if dry_run:
        print(json.dumps(resolved_config(settings), indent=2))
        return
    try:
        train(settings)
    except (recipe.ConfigError, adapter_repo.Failure):
        raise  # already one line (a relaunch resumes from the last checkpoint)
    except Exception as error:
        ledger = recipe.read_json(recipe.work_file(settings.heartbeat_file, recipe.LEDGER_NAME))
        if ledger and ledger["started"] >= started and ledger.get("stopped"):  # the rollout guard's verdict,
            raise adapter_repo.Failure(ledger["stopped"]) from error  # which TRL re-raises wrapped
        if full := disk_full(settings.output_dir):
            raise adapter_repo.Failure(f"{full} ({adapter_repo.describe(error)})") from error
        raise


def disk_full(folder: str) -> str | None:
    """Why the trainer failed, if the disk holding `folder` is full: measured, since torch.save's own error on a full
    disk never says so (`[enforce fail at inline_container.cc:672] . unexpected pos`, no ENOSPC in its chain)."""
    path = Path(folder).absolute()
    usage = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists()))
    if usage.free >= 2**30:  # a checkpoint (adapter + optimizer state) is ~0.5 GB: under twice that, the disk is full
        return None
    return (f"the disk holding {folder} is full ({usage.free / 2**20:.1f} MB free of {usage.total / 2**20:.0f} MB): "
            "free space there or set OUTPUT_DIR to a larger disk, then relaunch to resume from the last checkpoint")


def main(argv: list[str] | None = None) -> int:
    """Entry point: a failure ends in one line on stderr (DEBUG=1 prints the traceback first), as in every script."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the resolved configuration as JSON and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return adapter_repo.run_cli("train_lora.py", functools.partial(run, args.dry_run))


if __name__ == "__main__":
    sys.exit(main())
