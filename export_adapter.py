"""Publish a trained adapter (final or checkpoint-N) with its model card, and with --merged a merged full model.

    .venv/bin/python export_adapter.py --source you/LFM2.5-2.6B-opencode-lora-RL --target you/LFM2.5-2.6B-opencode-lora

Flags and checks: docs/jobs.md (export_adapter.py).
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
from recipe import ConfigError


def checked_args(args: argparse.Namespace) -> None:
    """Names well-formed before anything is downloaded, merged or pushed; fills in the merged model's repo."""
    recipe.checkpoint_arg(args.checkpoint, "CHECKPOINT")
    if (args.source or "").startswith((".", "/", "~")) and not Path(args.source).expanduser().is_dir():
        raise ConfigError(f"--source {args.source}: folder not found (a repo id is owner/name): check the path")
    if not args.source or not Path(args.source).is_dir():  # unset: require_repo_id says so
        recipe.require_repo_id(args.source, "--source")
    recipe.require_repo_id(args.target, "--target", "you/LFM2.5-2.6B-opencode-lora")
    if args.merged_target and not args.merged:
        raise ConfigError(f"--merged-target={args.merged_target!r} (or MERGED_REPO) is set without --merged: "
                          "add --merged to publish the merged model there too, or drop it")
    if args.merged:  # its own repo, so `from_pretrained(repo)` and `vllm serve repo` just work
        args.merged_target = args.merged_target or f"{args.target}-merged"
        recipe.require_repo_id(args.merged_target, "--merged-target")  # the default may be too long for the Hub
    for flag, repo in (("--target", args.target), ("--merged-target", args.merged_target)):
        if repo and repo.casefold() == args.source.casefold():  # the Hub resolves repo ids case-insensitively
            raise ConfigError(f"{flag}={repo} is the training repo (--source {args.source}): publish to another "
                              "repo; pushing there would replace its final adapter and card")


def fetch(args: argparse.Namespace, api: Any, dest: Path) -> tuple[Path, dict[str, Any] | None, int | None]:
    """The adapter folder, its eval results and its optimizer steps (None: not there): checkpoint-N's N, or the final
    adapter's run's last checkpoint's (the trainer saves one at its last step: a 20-step smoke's says 20)."""
    source, results = Path(args.source), adapter_repo.full_results_path(args.checkpoint)
    if source.is_dir():
        files = [p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file()]
        adapter = source / adapter_repo.adapter_folder(args.checkpoint)
        if not adapter_repo.checkpoint_complete(files, args.checkpoint):
            raise ConfigError(f"{adapter} has no complete adapter for {args.checkpoint!r} (needs "
                              f"{' + '.join(adapter_repo.ADAPTER_FILES)}, and for a checkpoint also its completion "
                              f"marker {adapter_repo.COMPLETE_MARKER}): point --source at the training output or a "
                              "full download of its repo")
        doc = json.loads((source / results).read_text()) if (source / results).is_file() else None
    else:
        adapter = adapter_repo.download_adapter(api, args.source, args.checkpoint, dest)
        files = api.list_repo_files(args.source)
        doc = adapter_repo.read_json(api, args.source, results)
    steps = adapter_repo.complete_checkpoints(files)
    if args.checkpoint != adapter_repo.FINAL:
        steps = [int(args.checkpoint.removeprefix(adapter_repo.CHECKPOINT_PREFIX))]
    return adapter, doc, steps[-1] if steps else None


def write_adapter(adapter: Path, out: Path, card: str, results: dict[str, Any] | None, checkpoint: str) -> None:
    """Only the recipe's LoRA (the card describes the recipe): its weights, the config pointing at the real base model
    id, the chat template it was trained with (the base repo's differs), the card and the eval results."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    want = {"peft_type": "LORA", "r": recipe.LORA_R, "lora_alpha": recipe.LORA_ALPHA,
            "target_modules": sorted(recipe.LORA_TARGET_MODULES)}
    found = {**{k: config.get(k) for k in want}, "target_modules": sorted(config.get("target_modules") or [])}
    if found != want:
        diff = ", ".join(f"{k}={found[k]!r} (recipe {want[k]!r})" for k in want if found[k] != want[k])
        raise ConfigError(f"{adapter} is not the recipe's adapter: {diff}; export the adapter this recipe trained, "
                          "or update recipe.py to match it")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(adapter / "adapter_model.safetensors", out / "adapter_model.safetensors")
    config["base_model_name_or_path"] = recipe.BASE_MODEL
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / model_cards.CHAT_TEMPLATE_FILE).write_text(chat_template())
    (out / "README.md").write_text(card)
    if results:
        path = out / adapter_repo.full_results_path(checkpoint)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")


def write_merged(base_model: str, adapter: Path, out: Path, card: str, dtype: str) -> None:
    """Merge the LoRA into the base in fp32 (one rounding, at the final cast) and save a plain transformers model
    whose tokenizer carries the template the run trained and served with (vLLM and apply_chat_template read it)."""
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


def base_revision(base_model: str) -> str | None:
    """The recipe's base loads at the commit it was trained on; another --base-model is the user's own choice."""
    return recipe.BASE_MODEL_REVISION if base_model == recipe.BASE_MODEL else None


def write(args: argparse.Namespace, api: Any, source: Path, out: Path) -> None:
    """Fetch and check the adapter, then write it (and the merged model) with their cards under `out`."""
    adapter, doc, steps = fetch(args, api, source)
    results = doc if doc and doc.get("complete") else None  # its file is the checkpoint's own, by name
    if doc and not results:
        print(f"the eval of {args.checkpoint} is unfinished: the card has no eval table", file=sys.stderr)
    size_mb = (adapter / "adapter_model.safetensors").stat().st_size / 1e6
    card = model_cards.published_card(args.target, args.checkpoint, steps, results, False, size_mb)
    write_adapter(adapter, out / "adapter", card, results, args.checkpoint)
    if args.merged:
        card = model_cards.published_card(args.merged_target, args.checkpoint, steps, results, True, size_mb)
        write_merged(args.base_model, out / "adapter", out / "merged", card, args.merged_dtype)


def parse_args(argv: list[str] | None, env: dict[str, str]) -> argparse.Namespace:
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
    parser.add_argument("--dry-run", action="store_true", help="check the inputs, print the plan as JSON, do nothing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, *, env: dict[str, str] | None = None,
         make_api: Callable[[str | None], Any] | None = None,
         stored_token: Callable[[], str | None] | None = None) -> int:
    """CLI entry point; tests inject the environment, a Hub double and the stored-token lookup."""
    env = dict(os.environ if env is None else env)
    args = parse_args(argv, env)
    return adapter_repo.run_cli("export_adapter.py", lambda: export(args, env, make_api, stored_token), env)


def export(args: argparse.Namespace, env: dict[str, str], make_api: Callable[[str | None], Any] | None,
           stored_token: Callable[[], str | None] | None) -> None:
    """Check, then write (or print the plan), then push; a failed push keeps the files and says how to upload them."""
    import huggingface_hub
    from huggingface_hub import constants

    checked_args(args)
    token = env.get("HF_TOKEN", "").strip() or (stored_token or huggingface_hub.get_token)()
    if not args.local_dir and not token:
        raise ConfigError("pushing needs a write token: export HF_TOKEN=hf_... or run `hf auth login`")
    repos = [(args.target, "adapter")] + ([(args.merged_target, "merged")] if args.merged else [])
    if args.dry_run:
        revision = base_revision(args.base_model)
        print(json.dumps({"source": args.source, "checkpoint": args.checkpoint,
                          **({"write": args.local_dir} if args.local_dir else {"push": [r for r, _ in repos]}),
                          **({"merged_dtype": args.merged_dtype,
                              "base_model": f"{args.base_model}{f'@{revision}' if revision else ''}"}
                             if args.merged else {})}, indent=1))
        return
    merge_from_hub = args.merged and not Path(args.base_model).is_dir()
    needs_hub = not args.local_dir or not Path(args.source).is_dir() or merge_from_hub
    api = (make_api or (lambda tok: huggingface_hub.HfApi(token=tok)))(token) if needs_hub else None
    if merge_from_hub and not constants.HF_HUB_OFFLINE:
        # ask for the base now: a wrong id or no network fails in a second, not after its download's retries
        api.model_info(args.base_model, revision=base_revision(args.base_model))
    work = Path(tempfile.mkdtemp(prefix="export-adapter-"))
    out = Path(args.local_dir) if args.local_dir else work / "out"
    try:
        write(args, api, work / "source", out)
    except BaseException:
        shutil.rmtree(work)  # nothing worth keeping yet
        raise
    shutil.rmtree(work / "source", ignore_errors=True)  # the downloaded copy: everything needed is in `out`
    if args.local_dir:
        shutil.rmtree(work)
        print(f"wrote {out / 'adapter'}" + (f" and {out / 'merged'}" if args.merged else ""))
        return
    pending = [(repo_id, out / folder) for repo_id, folder in repos]
    try:
        while pending:
            repo_id, folder = pending[0]
            api.create_repo(repo_id, private=args.private, exist_ok=True)
            adapter_repo.push_folder(api, repo_id, folder, "")
            print(f"pushed {folder.name} to https://huggingface.co/{repo_id}")
            pending.pop(0)
    except Exception as err:  # the written cards and weights stay on disk: nothing is lost
        private = " --private" if args.private else ""
        upload = " and ".join(f"`.venv/bin/hf upload {repo} {folder}{private}`" for repo, folder in pending)
        raise adapter_repo.Failure(f"{adapter_repo.failure_line(err)[0]}; everything is kept in {out}: upload it "
                                   f"with {upload}, then delete {work}") from err
    shutil.rmtree(work)


if __name__ == "__main__":
    sys.exit(main())
