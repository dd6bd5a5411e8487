"""The training repo's model card (train_lora.py) and the published one (export_adapter.py): every value from
recipe.py or the run, the metadata through huggingface_hub's ModelCardData (docs/training.md says what the Hub reads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import recipe

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # chat_template.py's template, under the name transformers saves it as
HOW = ("trained with async GRPO inside the unmodified OpenCode agent harness: each rollout runs OpenCode on a "
       "data-analysis task in its own sandbox, a verifier grades the answer, and the adapter learns from the exact "
       "tokens and logprobs the OpenEnv capture proxy recorded")


def card_data(*, merged: bool = False, model_name: str | None = None, results: dict[str, Any] | None = None,
              dashboard_url: str | None = None) -> Any:
    """Base model, library, license, tags, datasets (+ informational revisions), a finished eval's model-index."""
    from huggingface_hub import EvalResult, ModelCardData

    tags = ["lora", "peft", "grpo", "trl", "reinforcement-learning", "agent", "opencode", "lfm2"]
    tags += ["merged-lora"] if merged else []
    if dashboard_url:  # as transformers' Trackio callback tags it: the Hub shows the Space under "Training metrics"
        tags += ["trackio", f"trackio:{dashboard_url}"]
    adapter = results["summary"]["adapter"] if results else {}
    evals = [EvalResult(
        task_type="text-generation", task_name="Agentic data analysis in OpenCode", dataset_type=results["dataset"],
        dataset_name="SmolDataEnvs Harbor (held-out test tasks)", dataset_split="test",
        dataset_revision=results["dataset_revision"], metric_type="pass@1", metric_name="pass@1",
        metric_value=adapter["pass_at_1"],
        metric_args={**{k: adapter[k] for k in ("scored", "correct", "unscorable")},
                     "ci95_low": adapter["ci95"][0], "ci95_high": adapter["ci95"][1]},
    )] if results and adapter["pass_at_1"] is not None else None
    return ModelCardData(
        base_model=recipe.BASE_MODEL, base_model_relation="finetune" if merged else "adapter",
        base_model_revision=recipe.BASE_MODEL_REVISION, library_name="transformers" if merged else "peft",
        license="other", license_name="lfm1.0", pipeline_tag="text-generation", tags=tags,
        license_link=f"https://huggingface.co/{recipe.BASE_MODEL}/blob/main/LICENSE",
        datasets=[recipe.TRAIN_DATASET, recipe.TEST_DATASET],
        dataset_revisions={recipe.TRAIN_DATASET: recipe.TRAIN_REVISION, recipe.TEST_DATASET: recipe.TEST_REVISION},
        model_name=model_name if results else None, eval_results=evals)


def recipe_rows(checkpoint: str, steps: int | None, run: Mapping[str, Any] | None = None) -> list[tuple[str, str]]:
    """How it was trained: recipe.py's values, and the run's own knobs from its resolved config where known."""
    r, pins = recipe, recipe.pinned_versions()
    stack = ", ".join(f"`{name}{pins[name]}`" for name in ("trl", "transformers", "peft", "openenv") if name in pins)

    def knob(key: str, default: float) -> str:
        return f"{run[key]:g}" if run else f"{default:g} (the recipe default)"

    return [
        ("Base model", f"`{r.BASE_MODEL}` (revision `{r.BASE_MODEL_REVISION}`)"),
        ("Algorithm", "async GRPO: TRL `AsyncGRPOTrainer` + `HarnessRolloutWorker`, agent loop owned by OpenCode"),
        ("LoRA", f"r={r.LORA_R}, alpha={r.LORA_ALPHA}, dropout {r.LORA_DROPOUT}, targets "
                 f"`{', '.join(r.LORA_TARGET_MODULES)}` (short-conv projections left out)"),
        ("Optimizer steps", f"{'not recorded (no checkpoint in the source)' if steps is None else steps}; "
                            f"this adapter: `{checkpoint}`"),
        ("GRPO group", f"{r.NUM_GENERATIONS} rollouts of one task, scored against each other"),
        ("Optimizer step", f"{r.NUM_GENERATIONS} training rows: one GRPO group of {r.NUM_GENERATIONS} rollouts only "
                           "when each rollout is one row (the run's `rollout/samples_per_rollout` = 1)"),
        ("Learning rate", f"{knob('learning_rate', r.LEARNING_RATE)}, constant"),
        ("Sampling", f"temperature {r.TEMPERATURE}, top_p {r.TOP_P}, top_k {r.TOP_K} (full vocabulary); at most "
                     f"{r.MAX_TOKENS} tokens per model call and {r.MAX_TOOL_CALLING_ITERATIONS} model calls per "
                     "rollout, same in training and eval"),
        ("Max staleness", f"{knob('max_staleness', r.MAX_STALENESS)} optimizer steps"),
        ("Reward", f"`{r.CORRECT_REWARD} × env_reward + {r.TOOL_BONUS} × max(0, ({r.TOOL_BUDGET} − tool_calls) / "
                   f"{r.TOOL_BUDGET})`, the bonus on correct answers only"),
        ("Tasks", f"train `{r.TRAIN_DATASET}` @ `{r.TRAIN_REVISION}`: {r.TRAIN_MEDIUM} medium + {r.TRAIN_HARD} hard; "
                  f"test `{r.TEST_DATASET}` @ `{r.TEST_REVISION}`: {r.TEST_TASKS} held out"),
        ("Precision", f"trainer {r.TRAINER_DTYPE} (frozen base + LoRA), vLLM serves {r.SERVE_DTYPE}"),
        ("Hardware", f"HF Jobs `{r.TRAIN_FLAVOR}` (trainer GPU {r.TRAINER_GPU}, vLLM GPU {r.VLLM_GPU}); one "
                     f"`{r.knob('SANDBOX')}` sandbox per rollout ({r.TASK_CPUS} CPU / {r.TASK_MEMORY_MB} MB)"),
        ("Stack", f"{stack}, `{r.VLLM_IMAGE}`"),
    ]


def card(data: Any, repo: str, intro: list[str], checkpoint: str, steps: int | None,
         run: Mapping[str, Any] | None = None, sections: Sequence[str] = ()) -> str:
    """README.md: the metadata, the title, `intro`'s paragraphs, how it was trained, then `sections`."""
    rows = recipe_rows(checkpoint, steps, run)
    return "\n".join([f"---\n{data.to_yaml()}\n---\n", f"# {repo.split('/')[-1]}", "",
                      *(line for paragraph in intro for line in (paragraph, "")), "## How it was trained", "",
                      "| Knob | Value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), "", *sections])


def training_card(adapter_repo: str, steps: int, dashboard_url: str | None, run: Mapping[str, Any]) -> str:
    """The training repo's: what it holds, where its curves are, how it was trained (`run`: its resolved config)."""
    name = adapter_repo.split("/")[-1]
    return card(card_data(dashboard_url=dashboard_url), adapter_repo, [
        f"The training repo of a LoRA adapter for `{recipe.BASE_MODEL}` ({steps} optimizer steps), {HOW}. The final "
        "adapter is at the root, each `checkpoint-N/` holds a resumable checkpoint, and `eval/` the evaluations.",
        f"Training and eval curves: [Trackio dashboard]({dashboard_url}) (project `{name}`)." if dashboard_url else
        f"Training and eval curves were logged to Trackio locally (project `{name}`), not to a Space.",
        f"Publish it with its eval table: `python export_adapter.py --source {adapter_repo} --target <you>/<name>`."],
        "final", steps, run)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def eval_section(doc: dict[str, Any]) -> list[str]:
    """Base vs adapter pass@1 with counts, the paired difference with its interval, and the agreement breakdown."""
    base, adapter, paired = doc["summary"]["base"], doc["summary"]["adapter"], doc["summary"]["paired"]
    lines = [
        "## Evaluation", "",
        f"pass@1 on the held-out test tasks (`{doc['dataset']}` @ `{doc['dataset_revision']}`), base model vs this "
        "adapter, same harness, sampling and budgets; unscorable cells (infrastructure failures) are counted apart.",
        "", "| | Base | Adapter |", "|---|---|---|",
        f"| pass@1 | {_pct(base['pass_at_1'])} ({base['correct']}/{base['scored']}) | "
        f"{_pct(adapter['pass_at_1'])} ({adapter['correct']}/{adapter['scored']}) |",
        f"| unscorable | {base['unscorable']} | {adapter['unscorable']} |", ""]
    if paired.get("difference") is not None:
        low, high = paired["ci95"]
        lines += [f"Adapter − base over {paired['tasks']} paired tasks: **{100 * paired['difference']:+.1f} points**, "
                  f"95% paired-bootstrap interval [{100 * low:+.1f}, {100 * high:+.1f}], exact McNemar p = "
                  f"{paired['mcnemar_p']:.3g}.", ""]
    return [*lines, "| both correct | only base | only adapter | neither |", "|---|---|---|---|",
            f"| {paired['both']} | {paired['only_base']} | {paired['only_adapter']} | {paired['neither']} |", ""]


def usage_section(target: str, merged: bool) -> list[str]:
    """transformers (+PEFT) and vLLM; the adapter's load the base at its trained revision, with the run's template."""
    rev, base = recipe.BASE_MODEL_REVISION, recipe.BASE_MODEL
    tools = "--enable-auto-tool-choice --tool-call-parser lfm2"  # OpenCode sends tool_choice=auto
    imports, notes = "from transformers import AutoModelForCausalLM, AutoTokenizer", []
    load = (f'model = AutoModelForCausalLM.from_pretrained("{target}", dtype="bfloat16")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{target}")')
    serve = f"vllm serve {target} {tools}"
    if not merged:
        imports = ("from pathlib import Path\n\nfrom huggingface_hub import hf_hub_download\n"
                   f"from peft import PeftModel\n{imports}")
        load = (f'base = AutoModelForCausalLM.from_pretrained("{base}", revision="{rev}", dtype="bfloat16")\n'
                f'model = PeftModel.from_pretrained(base, "{target}")\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{base}", revision="{rev}")\n'
                f'tokenizer.chat_template = Path(hf_hub_download("{target}", "{CHAT_TEMPLATE_FILE}")).read_text()')
        serve = (f"hf download {target} {CHAT_TEMPLATE_FILE} --local-dir .\nvllm serve {base} --revision {rev} "
                 f"--tokenizer-revision {rev} --enable-lora --max-lora-rank {recipe.LORA_R} --lora-modules "
                 f"{recipe.ADAPTER_SERVED_NAME}={target} {tools} --chat-template {CHAT_TEMPLATE_FILE}")
        notes = [f"`{CHAT_TEMPLATE_FILE}` is the chat template the adapter was trained and served with (the base "
                 "repo's own opens `<think>` in the generation prompt). The base revision is recorded in "
                 f"`adapter_config.json` (`revision`: `{rev}`), where PEFT's `AutoPeftModelForCausalLM` reads it.", ""]
    return ["## Use it", "", "With transformers:", "", "```python", imports, "", load, "```", "",
            "With vLLM (OpenCode sends `tool_choice=auto`, so keep the tool-call flags):", "",
            "```bash", serve, "```", "", *notes]


def published_card(target: str, checkpoint: str, steps: int | None, results: dict[str, Any] | None, merged: bool,
                   size_mb: float) -> str:
    """The README.md pushed with the adapter (or the merged model)."""
    what = (f"`{recipe.BASE_MODEL}` with the LoRA adapter merged into its weights (a full model)" if merged else
            f"A LoRA adapter ({size_mb:.1f} MB) for `{recipe.BASE_MODEL}`")
    data = card_data(merged=merged, model_name=target.split("/")[-1], results=results)
    return card(data, target, [f"{what}, {HOW}."], checkpoint, steps,
                sections=[*(eval_section(results) if results else []), *usage_section(target, merged)])
