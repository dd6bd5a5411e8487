"""export_adapter.py on a tiny LFM2 + a LoRA saved by PEFT: the card, the adapter round trip, the merged model, pushes.

The adapter is made with the production LoRA config (train_lora.lora_config) and random non-zero lora_B, so
the adapter really changes the logits and a merge that dropped it would be caught.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from peft import PeftConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import adapter_repo
import chat_template
import eval_adapter
import export_adapter
import model_cards
import recipe
import train_lora
from tests import offline
from tests.hub_double import LocalHub
from tests.opencode_rollout import tiny_model_with_hub_template
from tests.tiny_lfm2 import save_tiny_model, tiny_model

TARGET = "alice/LFM2.5-2.6B-opencode-lora"
SOURCE = "alice/LFM2.5-2.6B-opencode-lora-RL"
CANARY = "hf_" + "CanaryTokenValue0123456789abcdefXYZ"  # a fake, assembled so scanners skip it
INPUT = torch.tensor([[1, 40, 41, 42, 50, 60, 70, 80, 90, 100, 3, 5]])


def random_adapter(seed: int) -> PeftModel:
    """The recipe's LoRA on a tiny LFM2 with random (non-zero) lora_B, so the adapter changes the output."""
    model = get_peft_model(tiny_model()[0], train_lora.lora_config())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT).logits.float()


def results_doc(checkpoint: str = "final", complete: bool = True) -> dict:
    """A results document in eval_adapter's schema, summarized by its own summarize() from hand-made cells.

    10 tasks: base right on t0-t3, adapter right on t2-t7, t9 unscorable on the base side.
    => base 4/9 (44.4%), adapter 6/10 (60.0%); over 9 paired tasks both 2, only base 2, only adapter 4, neither 1.
    """
    base = {f"t{i}": (1.0 if i < 4 else 0.0) for i in range(10)}
    base["t9"] = None
    adapter = {f"t{i}": (1.0 if 2 <= i < 8 else 0.0) for i in range(10)}
    return {"schema": 1, "kind": "full", "checkpoint": checkpoint, "complete": complete,
            "dataset": recipe.TEST_DATASET, "dataset_revision": recipe.TEST_REVISION,
            "summary": eval_adapter.summarize(base, adapter)}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """A tiny base model dir and a training-output folder: final adapter at the root, checkpoint-100/, eval/."""
    root = tmp_path_factory.mktemp("export")
    base_dir = save_tiny_model(root / "base")
    final, ckpt = random_adapter(1), random_adapter(2)
    source = root / "run"
    final.save_pretrained(source)
    ckpt.save_pretrained(source / "checkpoint-100")
    marker = {p.name: p.stat().st_size for p in (source / "checkpoint-100").iterdir()}
    (source / "checkpoint-100" / adapter_repo.COMPLETE_MARKER).write_text(json.dumps({"files": marker}))
    (source / "eval").mkdir()
    (source / "eval" / "final_results.json").write_text(json.dumps(results_doc()))
    return {"base": base_dir, "source": source, "final": logits(final), "ckpt": logits(ckpt),
            "plain": logits(tiny_model()[0])}


def run(argv: list[str], capsys, env: dict | None = None, make_api=None) -> tuple[int, str, str]:
    rc = export_adapter.main(argv, env=env or {}, make_api=make_api or (lambda token: None),
                             stored_token=lambda: None)
    out, err = capsys.readouterr()
    assert CANARY not in out + err
    return rc, out, err


def card_parts(path: Path) -> tuple[dict, str]:
    text = path.read_text()
    assert text.startswith("---\n")
    _, meta, body = text.split("---\n", 2)
    return yaml.safe_load(meta), body


def test_local_export_card_and_adapter_round_trip(made, tmp_path, capsys):
    out = tmp_path / "out"
    rc, _, err = run(["--source", str(made["source"]), "--target", TARGET, "--local-dir", str(out),
                      "--base-model", str(made["base"])], capsys)
    assert rc == 0, err
    meta, body = card_parts(out / "adapter" / "README.md")
    assert meta["base_model"] == "LiquidAI/LFM2.5-2.6B"
    assert meta["library_name"] == "peft"
    assert (meta["license"], meta["license_name"]) == ("other", "lfm1.0")
    assert meta["license_link"] == "https://huggingface.co/LiquidAI/LFM2.5-2.6B/blob/main/LICENSE"
    assert {"lora", "grpo", "opencode"} <= set(meta["tags"])
    assert meta["datasets"] == ["FineEnvs/SmolDataEnvs-harbor-train", "FineEnvs/SmolDataEnvs-harbor-test"]
    # revisions of both datasets are in the card body
    assert "4719635555de1666f374d847baebb500d368e493" in body and "b130595b579fc6026ad5762925a9a3b40e72f5bb" in body
    # the eval table, numbers as counted by hand in results_doc()
    assert "| pass@1 | 44.4% (4/9) | 60.0% (6/10) |" in body
    assert "| unscorable | 1 | 0 |" in body
    assert "over 9 paired tasks: **+22.2 points**" in body and "95% paired-bootstrap interval [" in body
    assert "| 2 | 2 | 4 | 1 |" in body
    # the two ways to use it
    assert f'PeftModel.from_pretrained(base, "{TARGET}")' in body
    assert (f"vllm serve LiquidAI/LFM2.5-2.6B --revision {recipe.BASE_MODEL_REVISION} --tokenizer-revision "
            f"{recipe.BASE_MODEL_REVISION} --enable-lora --max-lora-rank 32 --lora-modules opencode-lora={TARGET}"
            in body)
    # the adapter loads back with PEFT and gives the trained adapter's logits
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "LiquidAI/LFM2.5-2.6B"
    loaded = PeftModel.from_pretrained(tiny_model()[0], str(out / "adapter")).eval()
    torch.testing.assert_close(logits(loaded), made["final"])
    assert not torch.allclose(made["final"], made["plain"], atol=1e-3)  # the adapter matters
    assert json.loads((out / "adapter" / "eval" / "final_results.json").read_text())["complete"] is True
    assert not (out / "merged").exists()


def test_adapter_repo_carries_the_chat_template_and_its_card_uses_it(made, tmp_path, capsys):
    """Served on (or loaded with) the base repo's tokenizer, the adapter would get the base's template, not the one it
    trained and was served with: the export ships that one as chat_template.jinja, and both usage snippets use it."""
    out = tmp_path / "out"
    rc, _, err = run(["--source", str(made["source"]), "--target", TARGET, "--local-dir", str(out)], capsys)
    assert rc == 0, err
    shipped = out / "adapter" / "chat_template.jinja"
    assert shipped.read_text() == chat_template.chat_template()
    _, body = card_parts(out / "adapter" / "README.md")
    python, bash = re.findall(r"```python\n(.*?)```", body, re.S), re.findall(r"```bash\n(.*?)```", body, re.S)
    assert len(python) == len(bash) == 1
    compile(python[0], "card snippet", "exec")
    assert f'tokenizer.chat_template = Path(hf_hub_download("{TARGET}", "{shipped.name}")).read_text()' in python[0]
    download, serve = bash[0].splitlines()
    assert download == f"hf download {TARGET} {shipped.name} --local-dir ."
    assert serve.startswith("vllm serve ") and serve.endswith(f" --chat-template {shipped.name}")


def test_card_metadata_and_model_index_parse_back_with_huggingface_hub(made, tmp_path, capsys):
    """huggingface_hub's own parser reads the card: base model + revision, datasets + revisions, the model-index."""
    out = tmp_path / "out"
    rc, _, err = run(["--source", str(made["source"]), "--target", TARGET, "--local-dir", str(out)], capsys)
    assert rc == 0, err
    data = ModelCard.load(out / "adapter" / "README.md").data
    assert (data.base_model, data.base_model_revision) == (recipe.BASE_MODEL, recipe.BASE_MODEL_REVISION)
    assert (data.library_name, data.base_model_relation) == ("peft", "adapter")
    assert data.datasets == [recipe.TRAIN_DATASET, recipe.TEST_DATASET]
    assert data.dataset_revisions == {recipe.TRAIN_DATASET: recipe.TRAIN_REVISION,
                                      recipe.TEST_DATASET: recipe.TEST_REVISION}
    assert data.model_name == TARGET.split("/")[-1]
    [result] = data.eval_results
    assert (result.task_type, result.metric_type, result.dataset_split) == ("text-generation", "pass@1", "test")
    assert (result.dataset_type, result.dataset_revision) == (recipe.TEST_DATASET, recipe.TEST_REVISION)
    assert result.metric_value == pytest.approx(6 / 10)  # the adapter side of results_doc(), counted by hand
    low, high = eval_adapter.wilson_ci(6, 10)
    assert result.metric_args == {"scored": 10, "correct": 6, "unscorable": 0, "ci95_low": low, "ci95_high": high}

    shutil.rmtree(out)
    source = tmp_path / "run"
    shutil.copytree(made["source"], source, ignore=shutil.ignore_patterns("eval"))
    rc, _, err = run(["--source", str(source), "--target", TARGET, "--local-dir", str(out)], capsys)
    assert rc == 0, err
    assert ModelCard.load(out / "adapter" / "README.md").data.eval_results is None  # no eval, no model-index


def card_for(source: Path, tmp_path: Path, capsys, *extra: str) -> str:
    out = tmp_path / "out"
    rc, _, err = run(["--source", str(source), "--target", TARGET, "--local-dir", str(out), *extra], capsys)
    assert rc == 0, err
    meta, body = card_parts(out / "adapter" / "README.md")
    assert meta["library_name"] == "peft"
    return body


def test_card_omits_eval_table_without_results(made, tmp_path, capsys):
    source = tmp_path / "run"
    shutil.copytree(made["source"], source, ignore=shutil.ignore_patterns("eval"))
    body = card_for(source, tmp_path, capsys)
    assert "## Evaluation" not in body and "pass@1" not in body and "| Base | Adapter |" not in body
    assert "## How it was trained" in body and "## Use it" in body
    assert not (tmp_path / "out" / "adapter" / "eval").exists()


def test_card_omits_unfinished_results(made, tmp_path, capsys):
    source = tmp_path / "run"
    shutil.copytree(made["source"], source)
    (source / "eval" / "final_results.json").write_text(json.dumps(results_doc(complete=False)))
    body = card_for(source, tmp_path, capsys)
    assert "## Evaluation" not in body and "pass@1" not in body


def test_checkpoint_export_uses_that_checkpoint_and_its_own_results(made, tmp_path, capsys):
    body = card_for(made["source"], tmp_path, capsys, "--checkpoint", "checkpoint-100")
    assert "## Evaluation" not in body  # final_results.json describes another adapter
    assert "this adapter: `checkpoint-100`" in body
    loaded = PeftModel.from_pretrained(tiny_model()[0], str(tmp_path / "out" / "adapter")).eval()
    torch.testing.assert_close(logits(loaded), made["ckpt"])

    (made["source"] / "eval" / "checkpoint-100_full_results.json").write_text(
        json.dumps(results_doc("checkpoint-100")))
    try:
        shutil.rmtree(tmp_path / "out")
        body = card_for(made["source"], tmp_path, capsys, "--checkpoint", "checkpoint-100")
    finally:
        (made["source"] / "eval" / "checkpoint-100_full_results.json").unlink()
    assert "| pass@1 | 44.4% (4/9) | 60.0% (6/10) |" in body


def test_recipe_table_is_generated_from_recipe(made, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(recipe, "LEARNING_RATE", 3e-6)
    monkeypatch.setattr(recipe, "MAX_TOKENS", 1234)
    monkeypatch.setattr(recipe, "TRAIN_REVISION", "0123456789abcdef0123456789abcdef01234567")
    body = card_for(made["source"], tmp_path, capsys)
    assert "| Learning rate | 3e-06 (the recipe default), constant |" in body
    assert f"| Max staleness | {recipe.MAX_STALENESS} (the recipe default) optimizer steps |" in body
    run = {"learning_rate": 1e-5, "max_staleness": 3}  # the training card has the run's resolved config
    assert "| Learning rate | 1e-05, constant |" in model_cards.training_card(SOURCE, 20, None, run)
    assert "at most 1234 tokens per model call" in body
    assert "@ `0123456789abcdef0123456789abcdef01234567`" in body
    assert "trl==1.15.0" in body and "transformers==5.17.0" in body  # read from recipe.JOB_REQUIREMENTS


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_model_is_plain_and_matches_peft_logits(made, tmp_path, capsys, dtype):
    out = tmp_path / "out"
    rc, _, err = run(["--source", str(made["source"]), "--target", TARGET, "--local-dir", str(out), "--merged",
                      "--merged-dtype", dtype, "--base-model", str(made["base"])], capsys)
    assert rc == 0, err
    merged_dir = out / "merged"
    assert not (merged_dir / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == "Lfm2ForCausalLM"
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert json.loads((merged_dir / "config.json").read_text())["dtype"] == dtype
    tolerance = {"float32": 1e-4, "bfloat16": 5e-2}[dtype]
    torch.testing.assert_close(logits(model), made["final"], atol=tolerance, rtol=0)
    assert (logits(model) - made["plain"]).abs().max() > 10 * tolerance  # the LoRA was merged, not dropped
    meta, body = card_parts(merged_dir / "README.md")
    assert meta["library_name"] == "transformers" and meta["base_model"] == "LiquidAI/LFM2.5-2.6B"
    assert f'AutoModelForCausalLM.from_pretrained("{TARGET}-merged"' in body
    assert (merged_dir / "tokenizer_config.json").exists()


def test_merged_model_carries_the_chat_template_the_run_trained_and_served_with(made, tmp_path, capsys):
    """The base repo's tokenizer has its own template (it opens <think>); `vllm serve` of the merged model reads the
    saved tokenizer's, so the merged export must carry chat_template.py's, the one serve_policy.sh passes vLLM."""
    base = tiny_model_with_hub_template(tmp_path / "base")
    assert AutoTokenizer.from_pretrained(base).chat_template != chat_template.chat_template()
    out = tmp_path / "out"
    rc, _, err = run(["--source", str(made["source"]), "--target", TARGET, "--local-dir", str(out), "--merged",
                      "--merged-dtype", "float32", "--base-model", str(base)], capsys)
    assert rc == 0, err
    assert AutoTokenizer.from_pretrained(out / "merged").chat_template == chat_template.chat_template()
    assert (out / "merged" / "chat_template.jinja").read_text() == chat_template.chat_template()


def hub_with_source(made, tmp_path) -> LocalHub:
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(SOURCE)
    hub.upload_folder(repo_id=SOURCE, folder_path=made["source"])
    return hub


def test_push_from_hub_source_with_retries(made, tmp_path, capsys, monkeypatch):
    sleeps = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    hub = hub_with_source(made, tmp_path)
    hub.fail_uploads = 2
    tokens = []

    def make_api(token):
        tokens.append(token)
        return hub

    rc, out, err = run(["--source", SOURCE, "--target", TARGET, "--merged", "--merged-dtype", "float32",
                        "--base-model", str(made["base"])], capsys, env={"HF_TOKEN": CANARY}, make_api=make_api)
    assert rc == 0, err
    assert tokens == [CANARY] and sleeps == [recipe.PUSH_BACKOFF_S, 2 * recipe.PUSH_BACKOFF_S]
    files = hub.list_repo_files(TARGET)
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors", "chat_template.jinja",
            "eval/final_results.json"} == set(files)
    merged = set(hub.list_repo_files(f"{TARGET}-merged"))
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= merged
    loaded = PeftModel.from_pretrained(tiny_model()[0], str(hub.root / TARGET)).eval()
    torch.testing.assert_close(logits(loaded), made["final"])
    assert f"https://huggingface.co/{TARGET}" in out


def test_failed_push_keeps_everything_on_disk(made, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda s: None)
    hub = hub_with_source(made, tmp_path)
    hub.fail_uploads = recipe.PUSH_RETRIES
    rc, _, err = run(["--source", SOURCE, "--target", TARGET], capsys, env={"HF_TOKEN": CANARY},
                     make_api=lambda t: hub)
    assert rc == 1 and err.count("\n") == 1 and f"failed {recipe.PUSH_RETRIES} times" in err
    kept = Path(err.split("everything is kept in ")[1].split(":")[0])
    try:
        assert {p.name for p in (kept / "adapter").iterdir()} >= {"README.md", "adapter_model.safetensors"}
        assert f"hf upload {TARGET} {kept / 'adapter'}" in err
    finally:
        shutil.rmtree(kept.parent)
    assert TARGET not in {repo for repo, _, _ in hub.commits}


def test_push_offline_keeps_the_written_files_and_says_where(made, tmp_path):
    """create_repo is the first Hub call of a push from a local folder: its failure keeps everything, too."""
    env = offline.offline_env(tmp_path)
    proc = offline.run(["export_adapter.py", "--source", str(made["source"]), "--target", TARGET, "--private"], env)
    line = offline.one_line(proc, "export_adapter.py")
    assert proc.returncode == 1 and proc.stdout == ""
    assert line.startswith(f"export_adapter.py: could not reach the Hugging Face Hub at {env['HF_ENDPOINT']} (Conn")
    [work] = (tmp_path / "tmp").iterdir()  # the one temp folder, announced
    out = work / "out"
    assert line.endswith(f"; everything is kept in {out}: upload it with `.venv/bin/hf upload {TARGET} "
                         f"{out / 'adapter'} --private`, then delete {work}")
    assert {p.name for p in (out / "adapter").iterdir()} >= {"README.md", "adapter_model.safetensors",
                                                             "adapter_config.json"}
    assert not (work / "source").exists()


@pytest.mark.parametrize("case", ["hub source", "merge from the hub"])
def test_offline_before_anything_is_written_is_one_line_and_leaves_no_temp_folder(made, tmp_path, case):
    """A Hub source, or --merged with the Hub's base model (asked for before writing: its download would retry
    for minutes), offline: one line, nothing left behind."""
    env = offline.offline_env(tmp_path)
    source, extra = (SOURCE, []) if case == "hub source" else (str(made["source"]), ["--merged", "--local-dir", "X"])
    extra = [str(tmp_path / "out") if a == "X" else a for a in extra]
    started = time.monotonic()
    proc = offline.run(["export_adapter.py", "--source", source, "--target", TARGET, *extra], env)
    line = offline.one_line(proc, "export_adapter.py")
    assert line.startswith(f"export_adapter.py: could not reach the Hugging Face Hub at {env['HF_ENDPOINT']} (Conn")
    assert proc.returncode == 1 and time.monotonic() - started < 60
    assert list((tmp_path / "tmp").iterdir()) == [] and not (tmp_path / "out").exists()


def test_successful_push_leaves_no_temp_folder(made, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    hub = hub_with_source(made, tmp_path)
    rc, _, err = run(["--source", SOURCE, "--target", TARGET], capsys, env={"HF_TOKEN": CANARY},
                     make_api=lambda t: hub)
    assert rc == 0, err
    assert list((tmp_path / "tmp").iterdir()) == []


def test_failed_merged_push_names_only_what_is_left_to_upload(made, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda s: None)
    hub = hub_with_source(made, tmp_path)
    real_push = adapter_repo.push_folder

    def push_adapter_only(api, repo_id, *args, **kwargs):
        if repo_id == f"{TARGET}-merged":
            hub.fail_uploads, hub.fail_status = 1, 403
        return real_push(api, repo_id, *args, **kwargs)

    monkeypatch.setattr(adapter_repo, "push_folder", push_adapter_only)
    rc, out, err = run(["--source", SOURCE, "--target", TARGET, "--merged", "--merged-dtype", "float32",
                        "--base-model", str(made["base"])], capsys, env={"HF_TOKEN": CANARY}, make_api=lambda t: hub)
    line = err.splitlines()[-1]  # after the merge's own progress bars
    assert rc == 1 and line.startswith("export_adapter.py: commit ") and "HTTP 403" in line
    assert "pushed adapter to" in out and err.count("export_adapter.py") == 1
    kept = Path(line.split("everything is kept in ")[1].split(":")[0])
    try:
        assert f"upload it with `.venv/bin/hf upload {TARGET}-merged {kept / 'merged'}`, then delete" in err
        assert f"hf upload {TARGET} " not in err  # the adapter landed
    finally:
        shutil.rmtree(kept.parent)


def test_card_reads_the_steps_from_the_run_a_20_step_smoke_adapter(made, tmp_path, capsys):
    """The final adapter's steps are its run's last checkpoint's global_step, not recipe.MAX_STEPS."""
    source = tmp_path / "smoke"
    shutil.copytree(made["source"], source, ignore=shutil.ignore_patterns("checkpoint-100", "eval"))
    shutil.copytree(made["source"] / "checkpoint-100", source / "checkpoint-20")
    (source / "checkpoint-20" / "trainer_state.json").write_text(json.dumps({"global_step": 20, "max_steps": 20}))
    row = "| Optimizer steps | 20; this adapter: `final` |"
    assert row in card_for(source, tmp_path / "local", capsys)
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(SOURCE)
    hub.upload_folder(repo_id=SOURCE, folder_path=source)
    rc, _, err = run(["--source", SOURCE, "--target", TARGET, "--local-dir", str(tmp_path / "from-hub")], capsys,
                     make_api=lambda t: hub)
    assert rc == 0, err
    body = card_parts(tmp_path / "from-hub" / "adapter" / "README.md")[1]
    assert row in body and "(recipe)" not in body
    shutil.rmtree(source / "checkpoint-20")
    assert "| Optimizer steps | not recorded (no checkpoint in the source); this adapter: `final` |" in card_for(
        source, tmp_path / "bare", capsys)
    # the training repo's own card (pushed with the final adapter) takes the trainer's global_step the same way
    assert row in model_cards.training_card(SOURCE, 20, None, {"learning_rate": 1e-5, "max_staleness": 3})


def test_a_long_target_needs_a_merged_target_only_when_merging(made, tmp_path, capsys):
    """`<target>-merged` is the merged model's default repo: a target too long to take the suffix is fine for the
    adapter alone, and with --merged the one line says which flag to pass."""
    target = "alice/" + "a" * 92  # a name the Hub takes (at most 96 characters); "-merged" makes it 99
    rc, _, err = run(["--source", str(made["source"]), "--target", target, "--local-dir", str(tmp_path / "out")],
                     capsys)
    assert rc == 0, err
    rc, _, err = run(["--source", str(made["source"]), "--target", target, "--local-dir", str(tmp_path / "m"),
                      "--merged", "--base-model", str(made["base"])], capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"export_adapter.py: --merged-target='{target}-merged' is not a valid repo id")


def test_a_merged_target_without_merged_is_refused_in_one_line(made, tmp_path, capsys):
    """--merged-target alone would be ignored: the user asked for a merged model and would get none."""
    rc, _, err = run(["--source", str(made["source"]), "--target", "alice/adapter", "--local-dir", str(tmp_path / "o"),
                      "--merged-target", "alice/merged"], capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert "--merged-target='alice/merged' (or MERGED_REPO) is set without --merged" in err
    assert not (tmp_path / "o").exists()


def _bad_rank(source: Path) -> None:
    config = json.loads((source / "adapter_config.json").read_text())
    config["r"] = 8
    (source / "adapter_config.json").write_text(json.dumps(config))


BAD = {
    "no token for push": ([], None, "pushing needs a write token"),
    "bad checkpoint": (["--checkpoint", "step-5"], None, "CHECKPOINT='step-5' is not a checkpoint name"),
    "bad target": (["--target", "nope"], None, "--target='nope' is not a valid repo id"),
    "missing checkpoint": (["--checkpoint", "checkpoint-900", "--local-dir", "X"], None,
                           "no complete adapter for 'checkpoint-900'"),
    "other rank": (["--local-dir", "X"], _bad_rank, "r=8 (recipe 32)"),
    "missing weights": (["--local-dir", "X"], lambda s: (s / "adapter_model.safetensors").unlink(),
                        "no complete adapter for 'final'"),
    "checkpoint without marker": (["--checkpoint", "checkpoint-100", "--local-dir", "X"],
                                  lambda s: (s / "checkpoint-100" / adapter_repo.COMPLETE_MARKER).unlink(),
                                  "no complete adapter for 'checkpoint-100'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_clear_line(made, tmp_path, capsys, case):
    extra, breakage, expected = BAD[case]
    source = tmp_path / "run"
    shutil.copytree(made["source"], source)
    if breakage:
        breakage(source)
    extra = [str(tmp_path / "out") if a == "X" else a for a in extra]
    argv = ["--source", str(source), "--target", TARGET, *extra]
    if "--target" in extra:
        argv = ["--source", str(source), *extra]
    rc, out, err = run(argv, capsys, make_api=lambda t: pytest.fail("no Hub client needed"))
    assert rc == 2 and err.startswith("export_adapter.py: ") and err.count("\n") == 1, err
    assert expected in err
    assert not (tmp_path / "out" / "adapter").exists()


@pytest.mark.parametrize("flags", [["--target", SOURCE], ["--target", SOURCE.upper()],
                                   ["--target", TARGET, "--merged", "--merged-target", SOURCE]],
                         ids=["target", "target-other-case", "merged-target"])
def test_a_target_that_is_the_training_repo_is_refused_before_anything_is_downloaded(capsys, flags):
    """Publishing over the training repo would replace its final adapter: the watcher would stop, resume refuse."""
    argv = ["--source", SOURCE, "--checkpoint", "checkpoint-500", *flags]
    rc, _, err = run(argv, capsys, env={"HF_TOKEN": CANARY}, make_api=lambda t: pytest.fail("no Hub client needed"))
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"export_adapter.py: --{'merged-' if '--merged' in flags else ''}target=") and (
        f"is the training repo (--source {SOURCE}): publish to another repo" in err)


def test_every_usage_snippet_loads_the_base_at_the_pinned_revision_which_the_adapter_records(made, tmp_path, capsys):
    """Issue 26 (14): the card's snippets load the base the adapter was trained on, not whatever `main` is later;
    the revision's machine-readable home is adapter_config.json's `revision` (PEFT's AutoPeftModel loads the
    base there), and the card says so: the Hub reads `base_model` as a repo id only."""
    out = tmp_path / "out"
    rc, _, err = run(["--source", str(made["source"]), "--target", TARGET, "--local-dir", str(out)], capsys)
    assert rc == 0, err
    _, body = card_parts(out / "adapter" / "README.md")
    revision = recipe.BASE_MODEL_REVISION
    code = [line for block in re.findall(r"```\w+\n(.*?)```", body, re.S) for line in block.splitlines()]
    loads_base = [line for line in code if recipe.BASE_MODEL in line]
    assert len(loads_base) == 3, loads_base  # the model and the tokenizer with transformers, vllm serve
    for line in loads_base:
        assert f'revision="{revision}"' in line or f"--revision {revision} --tokenizer-revision {revision}" in line
    assert PeftConfig.from_pretrained(str(out / "adapter")).revision == revision
    assert f"`adapter_config.json` (`revision`: `{revision}`)" in body


def test_messages_name_the_right_fix(made, tmp_path, capsys):
    """Issue 43 (14): without --target the example was the training repo's own name (which is then refused); a
    --source folder that does not exist was "not a valid repo id"."""
    rc, _, err = run(["--source", "you/LFM2.5-2.6B-opencode-lora-RL"], capsys, env={"HF_TOKEN": CANARY})
    assert rc == 2 and err.count("\n") == 1 and err.endswith("e.g. --target=you/LFM2.5-2.6B-opencode-lora\n")
    rc, _, err = run(["--source", "./nonexistent", "--target", "you/x"], capsys, env={"HF_TOKEN": CANARY})
    assert rc == 2 and err == ("export_adapter.py: --source ./nonexistent: folder not found (a repo id is owner/name): "
                               "check the path\n")


def test_dry_run_prints_the_plan_and_touches_nothing(made, tmp_path, capsys):
    """Issue 43 (14): export_adapter.py had no --dry-run."""
    argv = ["--source", "you/LFM2.5-2.6B-opencode-lora-RL", "--target", "you/pub", "--merged", "--dry-run"]
    rc, out, err = run(argv, capsys, env={"HF_TOKEN": CANARY}, make_api=lambda t: pytest.fail("no Hub client"))
    assert rc == 0 and err == ""
    assert json.loads(out) == {"source": "you/LFM2.5-2.6B-opencode-lora-RL", "checkpoint": "final",
                               "push": ["you/pub", "you/pub-merged"], "merged_dtype": "bfloat16",
                               "base_model": f"{recipe.BASE_MODEL}@{recipe.BASE_MODEL_REVISION}"}
