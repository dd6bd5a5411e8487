"""Model-card metadata shared by the training repo's card (train_lora.py) and the published one (export_adapter.py).

Built with `huggingface_hub.ModelCardData` / `EvalResult`, never hand-written YAML, so the Hub reads exactly what
recipe.py says: the base model, the library, tags, both datasets, the dashboard, and (published cards) a
`model-index` from the finished eval, whose `dataset.revision` is the test set's. The Hub reads `base_model` as a
repo id only, and `base_model_revision` / `dataset_revisions` not at all (they are informational): the base model's
machine-readable revision is adapter_config.json's `revision` (train_lora.lora_config), which PEFT's AutoPeftModel
loads the base at; the card's usage snippets pass it too (export_adapter.usage_section).
"""

from __future__ import annotations

from typing import Any

import recipe

LICENSE_LINK = f"https://huggingface.co/{recipe.BASE_MODEL}/blob/main/LICENSE"
TAGS = ["lora", "peft", "grpo", "trl", "reinforcement-learning", "agent", "opencode", "lfm2"]


def eval_results(doc: dict[str, Any]) -> list[Any]:
    """The adapter's pass@1 (and its 95% Wilson bounds) on the held-out tasks, as `model-index` entries."""
    from huggingface_hub import EvalResult

    adapter = doc["summary"]["adapter"]
    common = {
        "task_type": "text-generation",
        "task_name": "Agentic data analysis in OpenCode",
        "dataset_type": doc.get("dataset", recipe.TEST_DATASET),
        "dataset_name": "SmolDataEnvs Harbor (held-out test tasks)",
        "dataset_split": "test",
        "dataset_revision": doc.get("dataset_revision", recipe.TEST_REVISION),
    }
    if adapter["pass_at_1"] is None:
        return []
    low, high = adapter["ci95"]
    return [
        EvalResult(**common, metric_type="pass@1", metric_name="pass@1", metric_value=adapter["pass_at_1"],
                   metric_args={"scored": adapter["scored"], "correct": adapter["correct"],
                                "unscorable": adapter["unscorable"], "ci95_low": low, "ci95_high": high}),
    ]


def card_data(*, merged: bool = False, model_name: str | None = None, results: dict[str, Any] | None = None,
              dashboard_url: str | None = None) -> Any:
    """The card's metadata: base model, library, license, tags, datasets, model-index (+ informational revisions)."""
    from huggingface_hub import ModelCardData

    tags = TAGS + (["merged-lora"] if merged else [])
    if dashboard_url:  # what transformers' Trackio callback adds: the Hub shows the Space under "Training metrics"
        tags += ["trackio", f"trackio:{dashboard_url}"]
    return ModelCardData(
        base_model=recipe.BASE_MODEL,
        base_model_relation="finetune" if merged else "adapter",
        base_model_revision=recipe.BASE_MODEL_REVISION,
        library_name="transformers" if merged else "peft",
        license="other",
        license_name="lfm1.0",
        license_link=LICENSE_LINK,
        pipeline_tag="text-generation",
        tags=tags,
        datasets=[recipe.TRAIN_DATASET, recipe.TEST_DATASET],
        dataset_revisions={recipe.TRAIN_DATASET: recipe.TRAIN_REVISION, recipe.TEST_DATASET: recipe.TEST_REVISION},
        model_name=model_name if results else None,
        eval_results=eval_results(results) if results else None,
    )


def front_matter(data: Any) -> str:
    """The YAML block a README.md starts with."""
    return f"---\n{data.to_yaml()}\n---\n"


def recipe_rows(checkpoint: str, steps: int | None, learning_rate: float | None = None) -> list[tuple[str, str]]:
    """How it was trained, read from recipe.py (never retyped) and the run (its steps, and its learning rate where
    the caller knows it)."""
    r = recipe
    pins = r.pinned_versions()
    stack = ", ".join(f"`{name}{pins[name]}`" for name in ("trl", "transformers", "peft", "openenv") if name in pins)
    return [
        ("Base model", f"`{r.BASE_MODEL}` (revision `{r.BASE_MODEL_REVISION}`)"),
        ("Algorithm", "async GRPO: TRL `AsyncGRPOTrainer` + `HarnessRolloutWorker`, agent loop owned by OpenCode"),
        ("LoRA", f"r={r.LORA_R}, alpha={r.LORA_ALPHA}, dropout {r.LORA_DROPOUT}, targets "
                 f"`{', '.join(r.LORA_TARGET_MODULES)}` (short-conv projections left out)"),
        ("Optimizer steps", f"{steps if steps is not None else 'not recorded (no checkpoint in the source)'}; "
                            f"this adapter: `{checkpoint}`"),
        ("GRPO group", f"{r.NUM_GENERATIONS} rollouts of one task, scored against each other"),
        ("Optimizer step", f"{r.NUM_GENERATIONS} training rows: one GRPO group of {r.NUM_GENERATIONS} rollouts only "
                           "when each rollout is one row (the run's `rollout/samples_per_rollout` = 1); a rollout "
                           "whose capture forked is several rows, so its step trains part of a group"),
        ("Learning rate", f"{learning_rate or r.LEARNING_RATE:g}{'' if learning_rate else ' (the recipe default)'}, "
                          "constant; the recipe's lineage fine-tuned the full model at 3e-6, and LoRA is commonly run "
                          "~10x higher than full fine-tuning since its update B @ A starts from zero"),
        ("Sampling", f"temperature {r.TEMPERATURE}, top_p {r.TOP_P}, top_k {r.TOP_K} (disabled): full vocabulary"),
        ("Output cap", f"{r.MAX_TOKENS} tokens per model call, same in training and eval"),
        ("Agent budget", f"{r.MAX_TOOL_CALLING_ITERATIONS} model calls per rollout"),
        ("Max staleness", f"{r.MAX_STALENESS} optimizer steps"),
        ("Reward", f"`{r.CORRECT_REWARD} × env_reward + {r.TOOL_BONUS} × max(0, ({r.TOOL_BUDGET} − tool_calls) / "
                   f"{r.TOOL_BUDGET})`, the bonus on correct answers only"),
        ("Train tasks", f"`{r.TRAIN_DATASET}` @ `{r.TRAIN_REVISION}`: {r.TRAIN_MEDIUM} medium + {r.TRAIN_HARD} hard"),
        ("Test tasks", f"`{r.TEST_DATASET}` @ `{r.TEST_REVISION}`: {r.TEST_TASKS} held out (no shared notebook "
                       "or question)"),
        ("Precision", f"trainer {r.TRAINER_DTYPE} (frozen base + LoRA), vLLM serves {r.SERVE_DTYPE}"),
        ("Hardware", f"HF Jobs `{r.TRAIN_FLAVOR}` (trainer GPU {r.TRAINER_GPU}, vLLM GPU {r.VLLM_GPU}); one "
                     f"`{r.knob('SANDBOX')}` sandbox per rollout ({r.TASK_CPUS} CPU / {r.TASK_MEMORY_MB} MB)"),
        ("Stack", f"{stack}, `{r.VLLM_IMAGE}`"),
    ]


def recipe_table(checkpoint: str, steps: int | None, learning_rate: float | None = None) -> list[str]:
    return ["| Knob | Value |", "|---|---|",
            *(f"| {k} | {v} |" for k, v in recipe_rows(checkpoint, steps, learning_rate))]


def training_card(adapter_repo: str, steps: int, dashboard_url: str | None, learning_rate: float | None = None) -> str:
    """README.md of the training repo: what it holds, where the run's curves are, how it was trained."""
    name = adapter_repo.split("/")[-1]
    where = (f"Training and eval curves: [Trackio dashboard]({dashboard_url}) (project `{name}`)." if dashboard_url
             else f"Training and eval curves were logged to Trackio locally (project `{name}`), not to a Space.")
    return "\n".join([
        front_matter(card_data(dashboard_url=dashboard_url)),
        f"# {name}",
        "",
        f"The training repo of a LoRA adapter for `{recipe.BASE_MODEL}`, trained with async GRPO inside the "
        f"unmodified OpenCode agent harness ({steps} optimizer steps). The final adapter is at the root, each "
        "`checkpoint-N/` holds a resumable checkpoint, and `eval/` the per-checkpoint and final evaluations "
        "(`eval/learning_curve.png`, `eval/summary.json`, `eval/final_results.json`).",
        "",
        where,
        "",
        "Publish it with its eval table and `model-index`: `python export_adapter.py --source "
        f"{adapter_repo} --target <you>/<name>`.",
        "",
        "## How it was trained",
        "",
        *recipe_table("final", steps, learning_rate),
        "",
    ])
