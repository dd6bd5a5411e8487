r"""Publish a trained adapter (the final one or a checkpoint-N) with a model card; optionally a merged full model.

    .venv/bin/python export_adapter.py --source you/LFM2.5-2.6B-opencode-lora-RL --target you/LFM2.5-2.6B-opencode-lora
    .venv/bin/python export_adapter.py --source you/LFM2.5-2.6B-opencode-lora-RL --checkpoint checkpoint-500 --merged \
        --target you/LFM2.5-2.6B-opencode-lora-step500     # also pushes you/LFM2.5-2.6B-opencode-lora-step500-merged
    .venv/bin/python export_adapter.py --source ./run --target you/x --local-dir out/   # out/adapter (+ out/merged)

`--source` is the training repo (or a local folder with the same layout: the final adapter at the root,
checkpoint-N/ folders, eval/). The card's recipe table is generated from recipe.py and its eval table from
the source's eval/final_results.json (eval/checkpoint-N_full_results.json for a checkpoint) when present.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import adapter_repo
import model_cards
import recipe
from chat_template import chat_template

SCRIPT = "export_adapter.py"
# The adapter repo's copy of chat_template.py's template, under the name transformers saves a tokenizer's template.
CHAT_TEMPLATE_FILE = "chat_template.jinja"


# --- inputs -------------------------------------------------------------------------------------------------
def checked_args(args: argparse.Namespace) -> None:
    """Names well-formed before anything is downloaded, merged or pushed."""
    recipe.checkpoint_arg(args.checkpoint, "CHECKPOINT")
    if not args.source:
        raise recipe.ConfigError("--source is not set: pass the training repo id (or ADAPTER_REPO=you/...) or a folder")
    if args.source.startswith((".", "/", "~")) and not Path(args.source).expanduser().is_dir():
        raise recipe.ConfigError(f"--source {args.source}: folder not found (a repo id is owner/name): check the path")
    if not Path(args.source).is_dir():
        recipe.require_repo_id(args.source, "--source")
    recipe.require_repo_id(args.target, "--target", "you/LFM2.5-2.6B-opencode-lora")
    if args.merged_target and not args.merged:
        raise recipe.ConfigError(f"--merged-target={args.merged_target!r} (or MERGED_REPO) is set without --merged: "
                                 "add --merged to publish the merged model there too, or drop it")
    if args.merged:  # its default, <target>-merged, may be too long where the target is not: pass --merged-target
        recipe.require_repo_id(merged_repo(args), "--merged-target")
    targets = [("--target", args.target)] + ([("--merged-target", merged_repo(args))] if args.merged else [])
    for flag, repo in targets:
        if repo.casefold() == args.source.casefold():  # the Hub resolves repo ids case-insensitively
            raise recipe.ConfigError(f"{flag}={repo} is the training repo (--source {args.source}): publish to another "
                                     "repo; pushing there would replace its final adapter and card")


def merged_repo(args: argparse.Namespace) -> str:
    """Where the merged full model goes: its own repo, so `from_pretrained(repo)` and `vllm serve repo` just work."""
    return args.merged_target or f"{args.target}-merged"


def fetch(args: argparse.Namespace, api: Any, dest: Path) -> tuple[Path, dict[str, Any] | None, int | None]:
    """The adapter folder, the eval results document for `args.checkpoint` (None when there are none) and the
    optimizer steps it was trained for (None when the source has no checkpoint to read them from)."""
    results_path = adapter_repo.full_results_path(args.checkpoint)
    folder = adapter_repo.adapter_folder(args.checkpoint)
    source = Path(args.source)
    if source.is_dir():
        adapter = source / folder if folder else source
        files = [p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file()]
        if not adapter_repo.checkpoint_complete(files, args.checkpoint):
            raise recipe.ConfigError(f"{adapter} has no complete adapter for {args.checkpoint!r} (needs "
                                     f"{' + '.join(adapter_repo.ADAPTER_FILES)}, and for a checkpoint also its "
                                     f"completion marker {adapter_repo.COMPLETE_MARKER}): point --source at the "
                                     "training output or a full download of its repo")

        def read(path: str) -> dict[str, Any] | None:
            return json.loads((source / path).read_text()) if (source / path).is_file() else None

        return adapter, read(results_path), trained_steps(files, args.checkpoint, read)
    adapter = adapter_repo.download_adapter(api, args.source, args.checkpoint, dest)
    files = api.list_repo_files(args.source)
    return (adapter, adapter_repo.read_json(api, args.source, results_path),
            trained_steps(files, args.checkpoint, lambda path: adapter_repo.read_json(api, args.source, path)))


def trained_steps(files: list[str], checkpoint: str, read: Callable[[str], dict[str, Any] | None]) -> int | None:
    """The optimizer steps behind `checkpoint`, as the run recorded them: global_step in its trainer_state.json.

    The final adapter's are its run's last checkpoint's: the trainer always saves one at its last step (a 20-step
    smoke run's final adapter has 20, not the recipe's 1000).
    """
    steps = adapter_repo.complete_checkpoints(files)
    if checkpoint != adapter_repo.FINAL:
        step = int(checkpoint.removeprefix(adapter_repo.CHECKPOINT_PREFIX))
    elif steps:
        step = steps[-1]
    else:
        return None
    state = read(f"{adapter_repo.checkpoint_name(step)}/trainer_state.json") or {}
    return int(state.get("global_step", step))


def checked_adapter(adapter: Path) -> dict[str, Any]:
    """The adapter config, refused unless it is the recipe's LoRA (the card describes the recipe)."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    want = {"peft_type": "LORA", "r": recipe.LORA_R, "lora_alpha": recipe.LORA_ALPHA,
            "target_modules": sorted(recipe.LORA_TARGET_MODULES)}
    found = {**{k: config.get(k) for k in want}, "target_modules": sorted(config.get("target_modules") or [])}
    if found != want:
        diff = ", ".join(f"{k}={found[k]!r} (recipe {want[k]!r})" for k in want if found[k] != want[k])
        raise recipe.ConfigError(f"{adapter} is not the recipe's adapter: {diff}; export the adapter this recipe "
                                 "trained, or update recipe.py to match it")
    return config


def usable_results(doc: dict[str, Any] | None, checkpoint: str) -> dict[str, Any] | None:
    """The results' summary if they are a finished eval of this checkpoint, else None (no table on the card)."""
    if not doc or not doc.get("complete") or not doc.get("summary") or doc.get("checkpoint") != checkpoint:
        return None
    return doc


# --- the model card ------------------------------------------------------------------------------------------
def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def eval_section(doc: dict[str, Any]) -> str:
    """Base vs adapter pass@1 with counts, the paired difference with its interval, and the agreement breakdown."""
    s = doc["summary"]
    base, adapter, paired = s["base"], s["adapter"], s["paired"]
    lines = [
        "## Evaluation",
        "",
        f"pass@1 on the held-out test tasks (`{doc.get('dataset', recipe.TEST_DATASET)}` @ "
        f"`{doc.get('dataset_revision', recipe.TEST_REVISION)}`), base model vs this adapter, same harness, "
        "sampling, output cap and agent budget. Unscorable cells (infrastructure failures) are left out of the "
        "denominators and counted apart.",
        "",
        "| | Base | Adapter |",
        "|---|---|---|",
        f"| pass@1 | {_pct(base['pass_at_1'])} ({base['correct']}/{base['scored']}) | "
        f"{_pct(adapter['pass_at_1'])} ({adapter['correct']}/{adapter['scored']}) |",
        f"| unscorable | {base['unscorable']} | {adapter['unscorable']} |",
        "",
    ]
    if paired.get("difference") is not None:
        low, high = paired["ci95"]
        lines += [
            f"Adapter − base over {paired['tasks']} paired tasks: **{100 * paired['difference']:+.1f} points**, "
            f"95% paired-bootstrap interval [{100 * low:+.1f}, {100 * high:+.1f}], exact McNemar p = "
            f"{paired['mcnemar_p']:.3g}.",
            "",
        ]
    lines += [
        "| both correct | only base | only adapter | neither |",
        "|---|---|---|---|",
        f"| {paired['both']} | {paired['only_base']} | {paired['only_adapter']} | {paired['neither']} |",
        "",
    ]
    return "\n".join(lines)


def usage_section(target: str, merged: bool) -> str:
    """The two ways to use it: transformers (+PEFT) and vLLM (tool-call flags included: OpenCode needs them)."""
    tools = "--enable-auto-tool-choice --tool-call-parser lfm2"
    if merged:
        load = (f'model = AutoModelForCausalLM.from_pretrained("{target}", dtype="bfloat16")\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{target}")')
        imports = "from transformers import AutoModelForCausalLM, AutoTokenizer"
        serve = f"vllm serve {target} {tools}"
    else:  # the base at the revision the adapter was trained on, never whatever `main` is later; its template
        rev = recipe.BASE_MODEL_REVISION
        load = (f'base = AutoModelForCausalLM.from_pretrained("{recipe.BASE_MODEL}", revision="{rev}", '
                'dtype="bfloat16")\n'
                f'model = PeftModel.from_pretrained(base, "{target}")\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{recipe.BASE_MODEL}", revision="{rev}")\n'
                f'tokenizer.chat_template = Path(hf_hub_download("{target}", "{CHAT_TEMPLATE_FILE}")).read_text()')
        imports = ("from pathlib import Path\n\nfrom huggingface_hub import hf_hub_download\n"
                   "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer")
        serve = (f"hf download {target} {CHAT_TEMPLATE_FILE} --local-dir .\n"
                 f"vllm serve {recipe.BASE_MODEL} --revision {rev} --tokenizer-revision {rev} --enable-lora "
                 f"--max-lora-rank {recipe.LORA_R} --lora-modules {recipe.ADAPTER_SERVED_NAME}={target} {tools} "
                 f"--chat-template {CHAT_TEMPLATE_FILE}")
    lines = [
        "## Use it", "", "With transformers:", "", "```python", imports, "", load, "```", "",
        "With vLLM (OpenAI-compatible server; OpenCode sends `tool_choice=auto`, so keep the tool-call flags):", "",
        "```bash", serve, "```", "",
    ]
    if not merged:
        lines += [f"`{CHAT_TEMPLATE_FILE}` in this repo is the chat template the adapter was trained and served with "
                  "(TRL's LFM2.5 template); the base repo's own differs (it opens `<think>` in the generation prompt): "
                  "set it on the tokenizer and pass it to vLLM, as above.", ""]
        lines += [f"The base model's revision is recorded in `adapter_config.json` (`revision`: "
                  f"`{recipe.BASE_MODEL_REVISION}`), where PEFT's `AutoPeftModelForCausalLM` reads it to load the "
                  "base; the Hub reads the metadata's `base_model` as a repo id only.", ""]
    return "\n".join(lines)


def model_card(target: str, checkpoint: str, steps: int | None, results: dict[str, Any] | None, merged: bool,
               size_mb: float) -> str:
    """The README.md pushed with the adapter (or the merged model)."""
    what = (f"`{recipe.BASE_MODEL}` with the LoRA adapter merged into its weights (a full model)" if merged else
            f"A LoRA adapter ({size_mb:.1f} MB) for `{recipe.BASE_MODEL}`")
    data = model_cards.card_data(merged=merged, model_name=target.split("/")[-1], results=results)
    parts = [
        model_cards.front_matter(data),
        f"# {target.split('/')[-1]}",
        "",
        f"{what}, trained with reinforcement learning inside the unmodified OpenCode agent harness: each rollout "
        "runs OpenCode on a data-analysis task in its own HF Sandbox, a verifier grades the answer, and async GRPO "
        "updates the adapter from the exact tokens and logprobs recorded by the OpenEnv capture proxy.",
        "",
        "## How it was trained",
        "",
        *model_cards.recipe_table(checkpoint, steps),
        "",
    ]
    if results:
        parts.append(eval_section(results))
    parts.append(usage_section(target, merged))
    return "\n".join(parts)


# --- outputs -------------------------------------------------------------------------------------------------
def write_adapter(adapter: Path, out: Path, card: str, results: dict[str, Any] | None, checkpoint: str) -> None:
    """Adapter weights, its config pointing at the real base model id, the chat template it was trained with (the
    base repo's differs), the card and the eval results."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(adapter / "adapter_model.safetensors", out / "adapter_model.safetensors")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = recipe.BASE_MODEL
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / CHAT_TEMPLATE_FILE).write_text(chat_template())
    (out / "README.md").write_text(card)
    if results:
        path = out / adapter_repo.full_results_path(checkpoint)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")


def write_merged(base_model: str, adapter: Path, out: Path, card: str, dtype: str) -> None:
    """Merge the LoRA into the base in fp32 (one rounding, at the final cast) and save a plain transformers model.

    Its tokenizer carries chat_template.py's template, the one the run trained and served with, not the base
    repo's: `vllm serve` and `apply_chat_template` of the merged model read the saved one.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    revision = base_revision(base_model)
    tokenizer = AutoTokenizer.from_pretrained(base_model, revision=revision)
    tokenizer.chat_template = chat_template()
    base = AutoModelForCausalLM.from_pretrained(base_model, revision=revision, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.to(getattr(torch, dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(card)


def push(api: Any, repo_id: str, folder: Path, private: bool) -> None:
    """Create the repo and upload `folder` as one commit, with the adapter repo's retry policy."""
    api.create_repo(repo_id, private=private, exist_ok=True)
    adapter_repo.push_folder(api, repo_id, folder, "")
    print(f"pushed {folder.name} to https://huggingface.co/{repo_id}")


def base_revision(base_model: str) -> str | None:
    """The recipe's base loads at the commit it was trained on; another --base-model is the user's own choice."""
    return recipe.BASE_MODEL_REVISION if base_model == recipe.BASE_MODEL else None


def check_base_model(api: Any, base_model: str) -> None:
    """--merged downloads the base from the Hub: ask for it before anything is written, so a wrong id or no network
    fails in a second (the download itself retries for a minute per file). HF_HUB_OFFLINE=1 merges from the cache."""
    from huggingface_hub import constants

    if not Path(base_model).is_dir() and not constants.HF_HUB_OFFLINE:
        api.model_info(base_model, revision=base_revision(base_model))


def write(args: argparse.Namespace, api: Any, source: Path, out: Path) -> None:
    """Fetch and check the adapter, then write it (and the merged model) with their cards under `out`."""
    adapter, doc, steps = fetch(args, api, source)
    checked_adapter(adapter)
    results = usable_results(doc, args.checkpoint)
    if doc and not results:
        print(f"eval results for {args.checkpoint} are incomplete or for another checkpoint: card has no eval table",
              file=sys.stderr)
    size_mb = (adapter / "adapter_model.safetensors").stat().st_size / 1e6
    write_adapter(adapter, out / "adapter", model_card(args.target, args.checkpoint, steps, results, False, size_mb),
                  results, args.checkpoint)
    if args.merged:
        card = model_card(merged_repo(args), args.checkpoint, steps, results, True, size_mb)
        write_merged(args.base_model, out / "adapter", out / "merged", card, args.merged_dtype)


def parse_args(argv: list[str] | None, env: dict[str, str]) -> argparse.Namespace:
    """Flags with environment-variable defaults."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=env.get("ADAPTER_REPO"),
                        help="training repo id or local folder (env ADAPTER_REPO)")
    parser.add_argument("--checkpoint", default=env.get("CHECKPOINT", adapter_repo.FINAL),
                        help="final or checkpoint-N (env CHECKPOINT, default final)")
    parser.add_argument("--target", default=env.get("TARGET_REPO"), help="repo to publish to (env TARGET_REPO)")
    parser.add_argument("--merged", action="store_true", help="also merge into the base and publish a full model")
    parser.add_argument("--merged-target", default=env.get("MERGED_REPO"),
                        help="repo for the merged model (env MERGED_REPO, default <target>-merged)")
    parser.add_argument("--merged-dtype", default=env.get("MERGED_DTYPE", recipe.SERVE_DTYPE),
                        choices=("bfloat16", "float16", "float32"),
                        help=f"dtype of the saved merged weights (env MERGED_DTYPE, default {recipe.SERVE_DTYPE})")
    parser.add_argument("--base-model", default=env.get("BASE_MODEL", recipe.BASE_MODEL),
                        help=f"base weights to merge into (env BASE_MODEL, default {recipe.BASE_MODEL})")
    parser.add_argument("--local-dir", default=env.get("LOCAL_DIR"),
                        help="write DIR/adapter (and DIR/merged) instead of pushing (env LOCAL_DIR)")
    parser.add_argument("--private", action="store_true", help="create the target repo(s) private")
    parser.add_argument("--dry-run", action="store_true", help="check the inputs, print what would be published as "
                                                                "JSON; download, merge and push nothing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, *, env: dict[str, str] | None = None,
         make_api: Callable[[str | None], Any] | None = None,
         stored_token: Callable[[], str | None] | None = None) -> int:
    """CLI entry point; tests inject the environment, a Hub double and the stored-token lookup."""
    import huggingface_hub

    env = dict(os.environ if env is None else env)
    args = parse_args(argv, env)
    try:
        recipe.knob("DEBUG", env)
        checked_args(args)
        token = env.get("HF_TOKEN", "").strip() or (stored_token or huggingface_hub.get_token)()
        if not args.local_dir and not token:
            raise recipe.ConfigError("pushing needs a write token: export HF_TOKEN=hf_... or run `hf auth login`")
        if args.dry_run:
            revision = base_revision(args.base_model)
            print(json.dumps({"source": args.source, "checkpoint": args.checkpoint,
                              **({"write": args.local_dir} if args.local_dir else {"push": [
                                  args.target, *([merged_repo(args)] if args.merged else [])]}),
                              **({"merged_dtype": args.merged_dtype,
                                  "base_model": f"{args.base_model}{f'@{revision}' if revision else ''}"}
                                 if args.merged else {})}, indent=1))
            return 0
        merge_from_hub = args.merged and not Path(args.base_model).is_dir()
        needs_hub = not args.local_dir or not Path(args.source).is_dir() or merge_from_hub
        api = (make_api or (lambda tok: huggingface_hub.HfApi(token=tok)))(token) if needs_hub else None
        if merge_from_hub:
            check_base_model(api, args.base_model)
    except Exception as err:  # noqa: BLE001 - one line: what failed, the likely cause, the fix (DEBUG=1: traceback)
        return adapter_repo.report_failure(SCRIPT, err, env)
    work = Path(tempfile.mkdtemp(prefix="export-adapter-"))
    out = Path(args.local_dir) if args.local_dir else work / "out"
    try:
        write(args, api, work / "source", out)
    except Exception as err:  # noqa: BLE001 - nothing worth keeping yet: the temp folder goes, the line stays
        shutil.rmtree(work)
        return adapter_repo.report_failure(SCRIPT, err, env)
    shutil.rmtree(work / "source", ignore_errors=True)  # the downloaded copy: everything needed is in `out`
    if args.local_dir:
        shutil.rmtree(work)
        print(f"wrote {out / 'adapter'}" + (f" and {out / 'merged'}" if args.merged else ""))
        return 0
    pending = [(args.target, out / "adapter")] + ([(merged_repo(args), out / "merged")] if args.merged else [])
    try:
        while pending:
            push(api, *pending[0], args.private)
            pending.pop(0)
    except Exception as err:  # noqa: BLE001 - the written cards and weights stay on disk: nothing is lost
        private = " --private" if args.private else ""
        upload = " and ".join(f"`.venv/bin/hf upload {repo} {folder}{private}`" for repo, folder in pending)
        return adapter_repo.report_failure(SCRIPT, err, env, f"everything is kept in {out}: upload it with {upload}, "
                                                             f"then delete {work}")
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
