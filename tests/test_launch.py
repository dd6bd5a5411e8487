"""launch.py: the four job specs, the preflight checks one by one, the real upload+launch path, no token leaks.

The Hub and Jobs cannot be reached here: the real (non-dry) path runs against `LocalHub` with a recording
`run_job`, and huggingface_hub's version is monkeypatched to stand for the launcher's >=2.1.1 environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest

import launch
import recipe
import smoke_report
from adapter_repo import COMPLETE_MARKER
from tests import offline
from tests.hub_double import LocalHub

ROOT = Path(__file__).resolve().parents[1]
CANARY = "hf_" + "CanaryTokenValue0123456789abcdefXYZ"  # never in any output; assembled so scanners skip it
SANDBOX_CANARY = "dtn_SandboxKeyCanary_987654321"
ADAPTER = "alice/LFM2.5-2.6B-opencode-lora-RL"
CODE = "alice/lfm-opencode-lora-rl-code"
# What the recipe says each job is (recipe.txt "Launch"/"Evaluation"), written out on purpose.
EXPECTED = {
    "train": ("run_job.sh", "h200x2", "72h", {"ADAPTER_REPO": ADAPTER, "MAX_STEPS": "1000"}),
    # The recipe's "MAX_STEPS=20 gives a ~40-min smoke run"; the cap is the plan's worst case with its margin.
    "smoke": ("run_job.sh", "h200x2", "8h", {"ADAPTER_REPO": ADAPTER + "-smoke", "MODE": "smoke", "MAX_STEPS": "20",
                                             "SAVE_STEPS": "5", "EVAL_TASKS": "4"}),
    "eval-watch": ("run_eval_watch.sh", "h200", "48h", {"ADAPTER_REPO": ADAPTER, "N_TASKS": "100"}),
    "eval": ("run_eval.sh", "h200", "12h", {"ADAPTER_REPO": ADAPTER, "CHECKPOINT": "final"}),
}
SCRIPTS = ["recipe.py", "common.sh", "image_check.py", "prepare_tasks.py", "eval_adapter.py", "adapter_repo.py",
           "serve_policy.sh", "serve_env.sh", "seam_patch.py", "capture_gateway.py", "run_job.sh", "train_lora.py",
           "train_callbacks.py", "train_weight_sync.py", "train_rollouts.py", "run_eval_watch.sh", "eval_watch.py",
           "run_eval.sh", "launch.py", "export_adapter.py", "README.md", "dashboard.py",
           "train_metrics.py", "model_cards.py", "smoke_report.py", "train_resume.py", "chat_template.py",
           "sandbox_lifecycle.py", "harbor_sessions.py", "trajectories.py"]
BUNDLE = sorted([*SCRIPTS, "data/train.json", "data/test.json"])


def task_row(split: str, i: int, difficulty: str) -> dict[str, str]:
    instruction = f"{split} question {i}"
    return {"name": f"{split}-task-{i:04d}", "source": f"{split}_nb{i // 4}_qa_{i % 4}",
            "notebook": f"{split}_nb{i // 4}.ipynb", "difficulty": difficulty,
            "instruction_sha256": hashlib.sha256(instruction.encode()).hexdigest()}


def write_lists(bundle: Path, train: list[dict], test: list[dict]) -> None:
    (bundle / "data").mkdir(exist_ok=True)
    (bundle / "data" / "train.json").write_text(json.dumps(train))
    (bundle / "data" / "test.json").write_text(json.dumps(test))


def good_lists() -> tuple[list[dict], list[dict]]:
    train = [task_row("train", i, "medium" if i < 400 else "hard") for i in range(1000)]
    test = [task_row("test", i, "hard") for i in range(250)]
    return train, test


@pytest.fixture()
def bundle(tmp_path: Path) -> Path:
    """A checkout with every script (stubs), synthetic task lists, and files that must NOT be uploaded."""
    root = tmp_path / "checkout"
    root.mkdir()
    for name in SCRIPTS:
        (root / name).write_text(f"# {name}\n")
    write_lists(root, *good_lists())
    for junk in ["tests/test_x.py", "benchmarks/bench.py", ".venv/lib/site.py", "__pycache__/launch.cpython-312.pyc",
                 "data/notes.txt", "data/sub/extra.json", ".env", "requirements-dev.txt", "pyproject.toml"]:
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_text("not part of the bundle\n")
    return root


class RecordingHub(LocalHub):
    """LocalHub (whose `run_job` records each job) plus a way to seed adapters."""

    def seed_adapter(self, repo_id: str, folder: str = "") -> None:
        """Put an adapter's two files into `repo_id` (at the root = a finished run's final adapter; in a checkpoint
        folder with its completion marker, as the trainer pushes one)."""
        self.create_repo(repo_id, exist_ok=True)
        prefix = f"{folder}/" if folder else ""
        names = ["adapter_model.safetensors", "adapter_config.json"]
        for name in names + ([COMPLETE_MARKER] if folder else []):
            self.upload_file(path_or_fileobj=b"{}", path_in_repo=prefix + name, repo_id=repo_id)


def base_env(**extra: str) -> dict[str, str]:
    return {"HF_TOKEN": CANARY, "ADAPTER_REPO": ADAPTER, **extra}


def refuse_api(token: str) -> object:
    raise AssertionError("a dry run or a failed preflight must not create a Hub client")


def run_main(capsys, argv: list[str], env: dict[str, str], make_api=refuse_api, stored=None) -> tuple[int, str, str]:
    rc = launch.main(argv, env=env, make_api=make_api, stored_token=lambda: stored)
    out, err = capsys.readouterr()
    assert CANARY not in out + err and SANDBOX_CANARY not in out + err
    return rc, out, err


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_dry_run_prints_the_recipe_spec(capsys, bundle, mode):
    rc, out, _ = run_main(capsys, [mode, "--dry-run", "--bundle-dir", str(bundle)], base_env())
    assert rc == 0
    plan = json.loads(out)
    script, flavor, timeout, env = EXPECTED[mode]
    job = plan["job"]
    assert job["image"] == "vllm/vllm-openai:v0.31.0"
    assert (job["flavor"], job["timeout"], job["env"]) == (flavor, timeout, env)
    assert job["expose_public"] == [8000]
    assert job["secrets"] == {"HF_TOKEN": launch.REDACTED}
    assert job["command"][:2] == ["bash", "-c"]
    steps = job["command"][2].split(" && ")
    assert steps[0] == "pip -q install 'huggingface_hub>=1.31,<2.0'"  # the training stack's pin, never 2.x
    assert steps[1].startswith(f"hf download {CODE} --revision ") and steps[1].endswith("--local-dir /app")
    assert steps[2] == f"bash /app/{script}"
    assert plan["upload"] == {"repo": CODE, "files": BUNDLE}


SANDBOX_KEYS = {"daytona": {"DAYTONA_API_KEY": SANDBOX_CANARY},
                "daytona-jwt": {"DAYTONA_JWT_TOKEN": SANDBOX_CANARY, "DAYTONA_ORGANIZATION_ID": "org-1"},
                "e2b": {"E2B_API_KEY": SANDBOX_CANARY}}


@pytest.mark.parametrize("keys", list(SANDBOX_KEYS))
def test_a_daytona_or_e2b_launch_passes_its_key_as_a_secret_and_installs_its_extra(capsys, bundle, keys):
    sandbox = keys.split("-")[0]
    rc, out, err = run_main(capsys, ["smoke", "--dry-run", "--bundle-dir", str(bundle), "--sandbox", sandbox],
                            base_env(**SANDBOX_KEYS[keys], DAYTONA_TARGET="eu"))
    assert rc == 0
    plan = json.loads(out)
    assert plan["job"]["secrets"] == dict.fromkeys(["HF_TOKEN", *SANDBOX_KEYS[keys]], launch.REDACTED)
    assert plan["job"]["env"]["SANDBOX"] == sandbox
    assert plan["job"]["env"].get("DAYTONA_TARGET") == ("eu" if sandbox == "daytona" else None)  # the SDK reads it
    sdk = recipe.pinned_versions(recipe.SANDBOXES[sandbox]["requirements"])[sandbox]  # the release the doubles know
    assert {"trl[peft]==1.15.0", f"harbor[{sandbox}]", f"{sandbox}{sdk}"} <= set(plan["install"])  # one pip call
    assert plan["upload"]["files"] == BUNDLE  # the pins are recipe.py's: nothing the recipe's own upload leaves out
    # E2B's Hobby plan is below the recipe's in-flight rollouts: said in one line, not refused (docs/sandboxes.md).
    assert err == ("" if sandbox == "daytona" else f"launch.py: note: {recipe.E2B_NOTE}\n")


def test_the_default_backend_passes_no_sandbox_setting_and_installs_the_jobs_pins_alone(capsys, bundle):
    rc, out, _ = run_main(capsys, ["train", "--dry-run", "--bundle-dir", str(bundle)],
                          base_env(DAYTONA_API_KEY=SANDBOX_CANARY))
    plan = json.loads(out)
    assert rc == 0 and "SANDBOX" not in plan["job"]["env"] and "harbor[hf-sandbox]>=0.24,<0.26" in plan["install"]
    assert not [pin for pin in plan["install"] if pin.startswith(("harbor[daytona]", "harbor[e2b]", "daytona", "e2b"))]
    assert plan["job"]["secrets"] == {"HF_TOKEN": launch.REDACTED}  # another backend's key never leaves the machine


def test_dry_run_cli_works_on_the_training_hub_without_network(bundle, tmp_path):
    """`python launch.py train --dry-run` runs under huggingface_hub 1.x (no 2.1.1) and prints parseable JSON."""
    assert huggingface_hub.__version__.startswith("1.")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_TOKEN=CANARY, ADAPTER_REPO=ADAPTER, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "train", "--dry-run", "--bundle-dir", str(bundle)],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert CANARY not in proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["job"]["secrets"] == {"HF_TOKEN": launch.REDACTED}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_real_launch_uploads_the_bundle_and_calls_run_job(capsys, monkeypatch, bundle, tmp_path, mode):
    monkeypatch.setattr(huggingface_hub, "__version__", "2.4.0")
    hub = RecordingHub(tmp_path / "hub")
    if mode == "eval":
        hub.seed_adapter(ADAPTER)  # the final adapter it evaluates
    tokens: list[str] = []

    def make_api(token: str) -> RecordingHub:
        tokens.append(token)
        return hub

    rc, out, _ = run_main(capsys, [mode, "--bundle-dir", str(bundle)], base_env(), make_api)
    assert rc == 0 and tokens == [CANARY]
    assert hub.list_repo_files(CODE) == BUNDLE
    for name in BUNDLE:
        assert (hub.root / CODE / name).read_bytes() == (bundle / name).read_bytes()
    assert [c for c in hub.commits if c[0] == CODE] == [hub.commits[-1]]  # one atomic commit
    sha = hub.repo_info(CODE).sha
    script, flavor, timeout, env = EXPECTED[mode]
    [call] = hub.jobs
    assert call == {
        "image": "vllm/vllm-openai:v0.31.0",
        "command": ["bash", "-c", "pip -q install 'huggingface_hub>=1.31,<2.0' && "
                    f"hf download {CODE} --revision {sha} --local-dir /app && bash /app/{script}"],
        "flavor": flavor, "timeout": timeout, "env": env,
        "secrets": {"HF_TOKEN": CANARY}, "expose_public": [8000], "token": CANARY,
        "name": f"lfm-opencode-lora-rl-{mode}",
    }
    job_id = "68a" + "1".zfill(21)
    assert f"job id:       {job_id}" in out
    assert f"https://huggingface.co/jobs/alice/{job_id}" in out
    assert f"https://{job_id}--8000.hf.jobs/capture" in out
    assert f"uvx hf jobs logs -f {job_id}" in out and f"uvx hf jobs cancel {job_id}" in out  # uv is all it needs
    project = "LFM2.5-2.6B-opencode-lora-RL" + ("-smoke" if mode == "smoke" else "")
    assert (f"dashboard:    https://huggingface.co/spaces/alice/lfm-opencode-lora-rl-dashboard (Trackio project "
            f"{project})") in out


def test_old_hub_fails_with_the_needed_version_before_anything_remote(capsys, monkeypatch, bundle):
    monkeypatch.setattr(huggingface_hub, "__version__", "2.0.0")
    rc, out, err = run_main(capsys, ["train", "--bundle-dir", str(bundle)], base_env())
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "needs huggingface_hub>=2.1.1" in err
    assert "uv run launch.py" in err and "huggingface_hub>=2.1.1 and tomli-w==1.2.0" in err


def test_refused_upload_starts_no_job_and_says_so_in_one_line(capsys, monkeypatch, bundle, tmp_path):
    sleeps: list[float] = []
    monkeypatch.setattr("time.sleep", sleeps.append)
    hub = RecordingHub(tmp_path / "hub")
    hub.fail_uploads, hub.fail_status = 1, 403
    rc, out, err = launch_real(capsys, monkeypatch, bundle, hub, ["train"])
    assert rc == 1 and err.startswith("launch.py: commit ") and err.count("\n") == 1 and "HTTP 403" in err
    assert hub.jobs == [] and hub.commits == [] and sleeps == []


def test_upload_rides_out_a_hub_blip(capsys, monkeypatch, bundle, tmp_path):
    sleeps: list[float] = []
    monkeypatch.setattr("time.sleep", sleeps.append)
    hub = RecordingHub(tmp_path / "hub")
    hub.fail_uploads = 1  # HTTP 503
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, ["train"])
    assert rc == 0, err
    assert len(hub.jobs) == 1 and sleeps == [recipe.PUSH_BACKOFF_S]


def test_stored_login_token_is_used_when_hf_token_is_unset(capsys, bundle):
    env = base_env()
    del env["HF_TOKEN"]
    rc, out, _ = run_main(capsys, ["smoke", "--dry-run", "--bundle-dir", str(bundle)], env, stored=CANARY)
    assert rc == 0 and json.loads(out)["job"]["secrets"] == {"HF_TOKEN": launch.REDACTED}


def test_flags_override_environment(capsys, bundle):
    argv = ["train", "--dry-run", "--bundle-dir", str(bundle), "--max-steps", "300", "--code-repo", "org/code",
            "--adapter-repo", "org/adapter"]
    rc, out, _ = run_main(capsys, argv, base_env(MAX_STEPS="50"))
    plan = json.loads(out)
    assert rc == 0 and plan["job"]["env"] == {"ADAPTER_REPO": "org/adapter-300steps", "MAX_STEPS": "300"}
    assert plan["upload"]["repo"] == "org/code" and "hf download org/code " in plan["job"]["command"][2]


def test_dry_run_shows_the_reporter_and_dashboard_and_each_can_be_changed(capsys, bundle):
    rc, out, _ = run_main(capsys, ["train", "--dry-run", "--bundle-dir", str(bundle)], base_env())
    assert rc == 0 and json.loads(out)["dashboard"] == {
        "project": "LFM2.5-2.6B-opencode-lora-RL",
        "url": "https://huggingface.co/spaces/<token owner>/lfm-opencode-lora-rl-dashboard"}
    rc, out, _ = run_main(capsys, ["train", "--dry-run", "--bundle-dir", str(bundle), "--dashboard-space", "local"],
                          base_env())
    plan = json.loads(out)
    assert rc == 0 and plan["job"]["env"]["DASHBOARD_SPACE"] == "local" and "url" not in plan["dashboard"]
    rc, out, _ = run_main(capsys, ["eval-watch", "--dry-run", "--bundle-dir", str(bundle)],
                          base_env(REPORT_TO="none", DASHBOARD_SPACE="org/board"))
    plan = json.loads(out)
    assert rc == 0 and plan["dashboard"] is None
    assert (plan["job"]["env"]["REPORT_TO"], plan["job"]["env"]["DASHBOARD_SPACE"]) == ("none", "org/board")
    rc, out, err = run_main(capsys, ["train", "--dry-run", "--bundle-dir", str(bundle), "--report-to", "wandb"],
                            base_env())
    assert rc == 2 and out == "" and err == ("launch.py: REPORT_TO='wandb' is not offered (the job installs Trackio "
                                             "and no other dashboard): use REPORT_TO=trackio (or none)\n")


# --- preflight failures, one by one -----------------------------------------------------------------------
def _edit_list(split: str, edit):
    def apply(bundle: Path, env: dict) -> None:
        train, test = good_lists()
        rows = train if split == "train" else test
        edit(rows, train, test)
        write_lists(bundle, train, test)
    return apply


def _env(**changes: str | None):
    def apply(bundle: Path, env: dict) -> None:
        for key, value in changes.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
    return apply


def _remove(name: str):
    return lambda bundle, env: (bundle / name).unlink()


def _set_row(i: int, key: str, value: str | None):
    def edit(rows, train, test):
        if value is None:
            del rows[i][key]
        else:
            rows[i][key] = value
    return edit


PREFLIGHT = {
    "no token": ("train", _env(HF_TOKEN=None), "no Hugging Face token"),
    "no adapter repo": ("train", _env(ADAPTER_REPO=None), "ADAPTER_REPO is not set"),
    "bad adapter repo": ("eval", _env(ADAPTER_REPO="just-a-name"), "ADAPTER_REPO='just-a-name' is not a valid"),
    "bad code repo": ("train", _env(CODE_REPO="a/b/c"), "CODE_REPO='a/b/c' is not a valid"),
    "code repo is adapter repo": ("train", _env(CODE_REPO=ADAPTER), "give the code bundle its own repo"),
    "train list missing": ("train", _remove("data/train.json"),
                           "train.json is missing: restore the recipe's lists with `git checkout -- data`"),
    "test list not json": ("eval-watch", lambda b, e: (b / "data/test.json").write_text("[{"), "not valid JSON"),
    "train list not a list": ("train", lambda b, e: (b / "data/train.json").write_text("{}"),
                              "must hold a JSON list of task rows"),
    "train rows short": ("train", _edit_list("train", lambda r, tr, te: r.pop()),
                         "data/train.json has 400 medium, 599 hard; the recipe needs 400 medium and 600 hard"),
    "test rows long": ("smoke", _edit_list("test", lambda r, tr, te: r.append(task_row("test", 999, "hard"))),
                       "data/test.json has 251 tasks; the recipe needs 250"),
    "difficulty split": ("train", _edit_list("train", _set_row(0, "difficulty", "hard")),
                         "data/train.json has 399 medium, 601 hard"),
    "row lacks sha": ("train", _edit_list("train", _set_row(7, "instruction_sha256", None)),
                      "data/train.json row 7 must have string fields"),
    "row bad sha": ("train", _edit_list("test", _set_row(3, "instruction_sha256", "abc")),
                    "task test-task-0003 has no valid instruction_sha256"),
    "duplicate name": ("train", _edit_list("train", _set_row(5, "name", "train-task-0004")),
                       "lists task train-task-0004 2 times"),
    "shared notebook": ("train", _edit_list("test", _set_row(0, "notebook", "train_nb3.ipynb")),
                        "share notebook 'train_nb3.ipynb'"),
    "shared source": ("train", _edit_list("test", _set_row(0, "source", "train_nb3_qa_1")),
                      "share source 'train_nb3_qa_1'"),
    "shared name": ("train", _edit_list("test", _set_row(0, "name", "train-task-0009")),
                    "share name 'train-task-0009'"),
    "train script missing": ("train", _remove("run_job.sh"), "lacks run_job.sh"),
    "watch script missing": ("eval-watch", _remove("eval_watch.py"), "lacks eval_watch.py"),
    "common file missing": ("eval", _remove("image_check.py"), "lacks image_check.py"),
    "steps zero": ("train", _env(MAX_STEPS="0"), "MAX_STEPS=0 is out of range"),
    "steps text": ("train", _env(MAX_STEPS="lots"), "MAX_STEPS='lots' is not a whole number"),
    "steps beyond tasks": ("train", _env(MAX_STEPS="1001"), "MAX_STEPS=1001 is out of range: use 1..1000"),
    "n_tasks beyond test": ("eval-watch", _env(N_TASKS="251"), "N_TASKS=251 is out of range: use 1..250"),
    "bad checkpoint": ("eval", _env(CHECKPOINT="ckpt-5"), "CHECKPOINT='ckpt-5' is not a checkpoint name"),
    "unknown sandbox": ("train", _env(SANDBOX="modal"), "SANDBOX='modal' is not offered"),
    # Issue 26: each of these launched a paid job that could not succeed.
    "repo id with --": ("eval-watch", _env(ADAPTER_REPO="alice/x--y"),
                        "ADAPTER_REPO='alice/x--y' is not a valid repo id (the Hub's rule: Cannot have -- or .."),
    "repo id ending .git": ("smoke", _env(ADAPTER_REPO="alice/x.git"),
                            "ADAPTER_REPO='alice/x.git' is not a valid repo id (the Hub's rule: Repo_id cannot end"),
    "tensorboard": ("train", _env(REPORT_TO="tensorboard"),
                    "REPORT_TO='tensorboard' is not offered (the job installs Trackio and no other dashboard): use "
                    "REPORT_TO=trackio (or none)"),
    # Issue 42: daytona and e2b run, with their key; without it, one line naming it (Harbor's preflight rule).
    "daytona without its key": ("train", _env(SANDBOX="daytona", E2B_API_KEY=SANDBOX_CANARY),
                                "SANDBOX=daytona needs DAYTONA_API_KEY (or DAYTONA_JWT_TOKEN and "
                                "DAYTONA_ORGANIZATION_ID): set it (launch.py passes it to the job as a secret)"),
    "daytona jwt without its organization": ("smoke", _env(SANDBOX="daytona", DAYTONA_JWT_TOKEN=SANDBOX_CANARY),
                                             "SANDBOX=daytona needs DAYTONA_API_KEY (or DAYTONA_JWT_TOKEN and"),
    "e2b without its key": ("eval-watch", _env(SANDBOX="e2b", DAYTONA_API_KEY=SANDBOX_CANARY),
                            "SANDBOX=e2b needs E2B_API_KEY: set it"),
    "save steps past max steps": ("train", _env(MAX_STEPS="50", SAVE_STEPS="100"),
                                  "SAVE_STEPS=100 is out of range: use 3..50 (a checkpoint before MAX_STEPS"),
    "eval concurrency past env sessions": ("eval", _env(EVAL_CONCURRENCY="65"),
                                           "EVAL_CONCURRENCY=65 is out of range: use 1..64"),
    "bundle dir missing": ("train", lambda b, e: shutil.rmtree(b), "is not a folder: point --bundle-dir"),
    "smoke suffix too long": ("smoke", _env(ADAPTER_REPO="alice/" + "n" * 96),
                              "cannot take the '-smoke' suffix the smoke run pushes to"),
    "dry run word": ("train", _env(DRY_RUN="maybe"), "DRY_RUN='maybe' is not a yes/no value"),
    "checkpoint zero": ("eval", _env(CHECKPOINT="checkpoint-0"), "CHECKPOINT='checkpoint-0' is not a checkpoint"),
    "save steps text": ("train", _env(SAVE_STEPS="abc"), "SAVE_STEPS='abc' is not a whole number"),
    "weight sync word": ("smoke", _env(WEIGHT_SYNC="fast"), "WEIGHT_SYNC='fast' is not one of merge_free, stock"),
    "stall minutes text": ("train", _env(STALL_MINUTES="abc"), "STALL_MINUTES='abc' is not a positive number"),
    "final eval word": ("train", _env(FINAL_EVAL="maybe"), "FINAL_EVAL='maybe' is not a yes/no value"),
    "idle hours text": ("eval-watch", _env(MAX_IDLE_HOURS="six"), "MAX_IDLE_HOURS='six' is not a positive number"),
    "concurrency text": ("eval", _env(EVAL_CONCURRENCY="x"), "EVAL_CONCURRENCY='x' is not a whole number"),
    # Issue 43 (13): each of these was accepted without a word.
    "space a/b/c": ("train", _env(DASHBOARD_SPACE="a/b/c"), "DASHBOARD_SPACE='a/b/c' is not a Space name"),
    "model not passed": ("train", _env(MODEL="Qwen/Qwen3-4B"), "MODEL='Qwen/Qwen3-4B' is not passed to the job"),
    "a checkpoint every step": ("train", _env(SAVE_STEPS="1"), "SAVE_STEPS=1 is out of range: use 50..1000"),
    "stall under a call limit": ("train", _env(STALL_MINUTES="5"), "STALL_MINUTES=5 is out of range: use 30..4320"),
    "stall past the cap": ("smoke", _env(STALL_MINUTES="1e308"), "STALL_MINUTES=1e+308 is out of range: use 30..4320"),
    "idle past the cap": ("eval-watch", _env(MAX_IDLE_HOURS="1e308"), "MAX_IDLE_HOURS=1e+308 is out of range"),
}


@pytest.mark.parametrize("case", list(PREFLIGHT))
@pytest.mark.parametrize("dry_run", [False, True], ids=["real", "dry"])
def test_preflight_failure_is_one_line_and_touches_nothing(capsys, monkeypatch, bundle, tmp_path, case, dry_run):
    monkeypatch.setattr(huggingface_hub, "__version__", "2.4.0")
    mode, breakage, expected = PREFLIGHT[case]
    env = base_env()
    breakage(bundle, env)
    argv = [mode, "--bundle-dir", str(bundle)] + (["--dry-run"] if dry_run else [])
    rc, out, err = run_main(capsys, argv, env)  # refuse_api: nothing uploaded, no job
    assert rc == 2 and out == ""
    assert err.startswith("launch.py: ") and err.count("\n") == 1, err
    assert expected in err


def test_bundle_file_list_is_the_recipe_include_set(bundle):
    assert launch.bundle_files(bundle) == BUNDLE


def test_the_bundle_check_holds_every_module_the_jobs_python_scripts_import():
    """check_bundle's list holds every bundle module the jobs' Python scripts import, lazy imports included: a module
    missing from a partial bundle would otherwise surface on the job, after the install and the model load."""
    from test_runtime_imports import imported_modules

    modules = {p.stem for p in ROOT.glob("*.py")}
    needed = set(launch.JOB_FILES)
    assert {mode["script"] for mode in launch.MODES.values()} <= needed
    todo, imported = [name for name in needed if name.endswith(".py")], set()
    while todo:
        script = todo.pop()
        for module in imported_modules(ROOT / script) & modules:
            if f"{module}.py" not in imported:
                imported.add(f"{module}.py")
                todo.append(f"{module}.py")
    assert imported <= needed, sorted(imported - needed)


# --- checks that read the adapter repo (real launches only) -------------------------------------------------
def launch_real(capsys, monkeypatch, bundle, hub, argv):
    monkeypatch.setattr(huggingface_hub, "__version__", "2.4.0")
    return run_main(capsys, [*argv, "--bundle-dir", str(bundle)], base_env(), lambda t: hub)


class RacingLaunchHub(RecordingHub):
    """A second launch commits its own bundle to the code repo right after this launch's commit."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.mine: list[str] = []

    def create_commit(self, repo_id, operations, *, commit_message, parent_commit=None):
        info = super().create_commit(repo_id, operations, commit_message=commit_message, parent_commit=parent_commit)
        if repo_id == CODE and not self.mine:
            self.mine.append(info.oid)
            self.upload_file(path_or_fileobj=b"# another checkout\n", path_in_repo="train_lora.py", repo_id=CODE)
        return info


def test_a_fresh_train_launch_refuses_a_repo_holding_an_earlier_runs_checkpoints(capsys, monkeypatch, bundle,
                                                                                  tmp_path):
    hub = RecordingHub(tmp_path / "hub")
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, ["train", "--resume", "0"])
    assert rc == 0, err  # a new repo: nothing to mix with
    hub.seed_adapter(ADAPTER, "checkpoint-100")
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, ["train", "--resume", "0"])
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{ADAPTER} holds checkpoints of an earlier run (newest checkpoint-100): RESUME=0" in err
    assert len(hub.jobs) == 1  # the second launch started nothing


def test_job_pins_its_own_bundle_commit_when_another_launch_commits_meanwhile(capsys, monkeypatch, bundle, tmp_path):
    """Defect 5: the job must download the commit this launch made (CommitInfo.oid), not whatever is head now."""
    hub = RacingLaunchHub(tmp_path / "hub")
    rc, out, err = launch_real(capsys, monkeypatch, bundle, hub, ["train"])
    assert rc == 0, err
    [mine] = hub.mine
    assert mine != hub.repo_info(CODE).sha  # the other launch moved the head
    assert f"--revision {mine} " in hub.jobs[0]["command"][2]
    assert f"{CODE}@{mine}" in out


def test_train_refuses_a_repo_holding_a_finished_run(capsys, monkeypatch, bundle, tmp_path):
    hub = RecordingHub(tmp_path / "hub")
    hub.seed_adapter(ADAPTER, "checkpoint-100")
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, ["train"])
    assert rc == 0, err  # checkpoints only: a crashed run the trainer resumes
    hub.seed_adapter(ADAPTER)
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, ["train"])
    assert rc == 2 and "already holds a final adapter" in err and err.count("\n") == 1
    # A finished run whose final eval crashed is evaluated, not deleted: the message points there.
    assert f"launch.py eval --adapter-repo {ADAPTER}" in err and "delete" not in err
    assert len(hub.jobs) == 1  # the second launch started nothing


@pytest.mark.parametrize("smoke", [False, True], ids=["watch", "watch-smoke"])
def test_eval_watch_says_when_its_repo_does_not_exist_yet_and_what_the_watcher_will_do(capsys, monkeypatch, bundle,
                                                                                        tmp_path, smoke):
    hub = RecordingHub(tmp_path / "hub")
    # The smoke watcher idles at most the smoke job's cap (its plan's worst case); the real one, MAX_IDLE_HOURS.
    hours = recipe.shell_value(smoke_report.plan()["cap_s"] / 3600 if smoke else recipe.MAX_IDLE_HOURS)
    repo = ADAPTER + "-smoke" if smoke else ADAPTER
    argv = ["eval-watch", *(["--smoke"] if smoke else [])]
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, argv)
    assert rc == 0 and len(hub.jobs) == 1  # a watcher may rightly start before its training job creates the repo
    [note] = [line for line in err.splitlines() if line.startswith("launch.py: note: ")]
    assert note == (f"launch.py: note: {repo} does not exist yet: the watcher waits for a job to create it, checking "
                    f"every {recipe.EVAL_POLL_SECONDS // 60} min, and fails after MAX_IDLE_HOURS={hours} h (the GPU is "
                    "billed meanwhile); launch the training job for this repo too (it creates the repo when it "
                    "starts), or fix the name and relaunch")
    hub.create_repo(repo)
    hub.end_job(job_ids(hub)[0], "CANCELED")
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, argv)
    assert rc == 0 and "note:" not in err and len(hub.jobs) == 2


def test_smoke_dry_run_shows_the_plan(capsys, bundle):
    rc, out, _ = run_main(capsys, ["smoke", "--dry-run", "--bundle-dir", str(bundle)], base_env())
    plan = json.loads(out)["smoke_plan"]
    assert rc == 0 and plan == smoke_report.plan()
    assert plan["steps"] == 20 and plan["checkpoints"] == [5, 10, 15, 20] and plan["deadline_s"] < plan["cap_s"]
    assert json.loads(out)["job"]["timeout"] == plan["timeout"] == "8h"


def test_eval_watch_smoke_watches_the_smoke_repo_on_a_few_tasks(capsys, bundle):
    rc, out, _ = run_main(capsys, ["eval-watch", "--smoke", "--dry-run", "--bundle-dir", str(bundle)], base_env())
    job = json.loads(out)["job"]
    assert rc == 0 and "smoke_plan" not in json.loads(out)
    assert job["env"] == {"ADAPTER_REPO": ADAPTER + "-smoke", "N_TASKS": "2", "MAX_IDLE_HOURS": "8"}
    assert (job["flavor"], job["timeout"]) == ("h200", "9h")  # the smoke's cap, plus an hour for the last waves


def test_smoke_ignores_the_real_runs_final_adapter(capsys, monkeypatch, bundle, tmp_path):
    hub = RecordingHub(tmp_path / "hub")
    hub.seed_adapter(ADAPTER)
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, ["smoke"])
    assert rc == 0, err
    assert hub.jobs[0]["env"]["ADAPTER_REPO"] == ADAPTER + "-smoke"


def test_eval_refuses_a_checkpoint_the_repo_lacks(capsys, monkeypatch, bundle, tmp_path):
    hub = RecordingHub(tmp_path / "hub")
    for step in (100, 200, 1000):
        hub.seed_adapter(ADAPTER, f"checkpoint-{step}")
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, ["eval", "--checkpoint", "checkpoint-300"])
    assert rc == 2 and err.count("\n") == 1
    assert "has no 'checkpoint-300' adapter: pick one it has (checkpoint-100, checkpoint-200, checkpoint-1000)" in err
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, ["eval"])
    assert rc == 2 and "has no 'final' adapter" in err
    assert hub.jobs == [] and CODE not in {c[0] for c in hub.commits}
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, ["eval", "--checkpoint", "checkpoint-200"])
    assert rc == 0, err
    assert hub.jobs[0]["env"]["CHECKPOINT"] == "checkpoint-200"


def test_launcher_imports_only_the_stdlib_hub_client_and_tomli_w(bundle, tmp_path):
    """launch.py runs in `uv run --with huggingface_hub>=2.1.1 --with tomli-w` (hub 2.x even drops httpx): on
    every path it may import nothing but the standard library, huggingface_hub, packaging, tomli_w and the bundle's
    own standard-library modules."""
    script = f"""
import sys
from pathlib import Path
sys.path[:0] = [{str(ROOT)!r}]
import huggingface_hub
from huggingface_hub import CommitOperationAdd, HfApi, get_token, errors  # the client's own imports are fine
from tests.hub_double import LocalHub
huggingface_hub.__version__ = "2.4.0"
hub = LocalHub(Path({str(tmp_path / 'hub')!r}))
hub.create_repo({ADAPTER!r})
for name in ("adapter_model.safetensors", "adapter_config.json", {COMPLETE_MARKER!r}):
    hub.upload_file(path_or_fileobj=b"{{}}", path_in_repo="checkpoint-100/" + name, repo_id={ADAPTER!r})
before = {{m.split(".")[0] for m in sys.modules}}
import launch
env = {{"HF_TOKEN": {CANARY!r}, "ADAPTER_REPO": {ADAPTER!r}}}
for argv in (["train"], ["smoke"], ["eval-watch"], ["eval", "--checkpoint", "checkpoint-100"], ["train", "--dry-run"],
             ["smoke", "--dry-run"], ["eval-watch", "--smoke"]):
    assert launch.main([*argv, "--bundle-dir", {str(bundle)!r}], env=env, make_api=lambda t: hub,
                       stored_token=lambda: None) == 0, argv
new = {{m.split(".")[0] for m in sys.modules}} - before - set(sys.stdlib_module_names)
assert new <= {{"launch", "adapter_repo", "recipe", "prepare_tasks", "smoke_report", "tomli_w",
               "packaging", "dashboard", "sandbox_lifecycle"}}, new
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_a_fresh_clone_dry_runs_every_mode_without_the_hub(tmp_path, mode):
    """The tracked files alone (the committed task lists included), offline, no stored login: no extra step."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    clone = tmp_path / "clone"
    for name in tracked.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            (clone / name).write_bytes((ROOT / name).read_bytes())
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "HF_TOKEN": CANARY, "ADAPTER_REPO": ADAPTER}
    res = subprocess.run([sys.executable, "launch.py", mode, "--dry-run"], cwd=clone, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert {"data/train.json", "data/test.json"} <= set(plan["upload"]["files"])
    assert plan["job"]["flavor"] == EXPECTED[mode][1] and CANARY not in res.stdout


# --- money and safety: DRY_RUN spellings, knobs the job gets, what the launcher says ------------------------------
@pytest.mark.parametrize("word", ["1", "true", "TRUE", "yes", "On"])
def test_dry_run_in_any_spelling_never_reaches_the_hub(capsys, monkeypatch, bundle, word):
    monkeypatch.setattr(huggingface_hub, "__version__", "2.4.0")  # a real launch would go ahead here
    rc, out, err = run_main(capsys, ["train", "--bundle-dir", str(bundle)], base_env(DRY_RUN=word))  # refuse_api
    assert rc == 0, err
    assert json.loads(out)["job"]["secrets"] == {"HF_TOKEN": launch.REDACTED}


def test_dry_run_off_words_launch_for_real(capsys, monkeypatch, bundle, tmp_path):
    monkeypatch.setattr(huggingface_hub, "__version__", "2.4.0")
    hub = RecordingHub(tmp_path / "hub")
    rc, _, err = run_main(capsys, ["train", "--bundle-dir", str(bundle)], base_env(DRY_RUN="off"), lambda t: hub)
    assert rc == 0, err
    assert len(hub.jobs) == 1


def test_job_knobs_the_launcher_passes_show_in_the_dry_run_spec(capsys, bundle):
    env = base_env(SAVE_STEPS="50", RESUME="true", WEIGHT_SYNC="stock", STALL_MINUTES="45", FINAL_EVAL="no",
                   MAX_IDLE_HOURS="12", EVAL_CONCURRENCY="8")
    rc, out, err = run_main(capsys, ["train", "--dry-run", "--bundle-dir", str(bundle), "--save-steps", "75",
                                     "--learning-rate", "1e-5"], env)
    assert rc == 0, err
    assert json.loads(out)["job"]["env"] == {"ADAPTER_REPO": ADAPTER, "MAX_STEPS": "1000", "SAVE_STEPS": "75",
                                             "RESUME": "1", "WEIGHT_SYNC": "stock", "STALL_MINUTES": "45",
                                             "FINAL_EVAL": "0", "LEARNING_RATE": "1e-05"}
    rc, out, err = run_main(capsys, ["eval-watch", "--dry-run", "--bundle-dir", str(bundle)], env)
    assert rc == 0 and json.loads(out)["job"]["env"] == {"ADAPTER_REPO": ADAPTER, "N_TASKS": "100",
                                                         "MAX_IDLE_HOURS": "12", "EVAL_CONCURRENCY": "8"}
    rc, out, err = run_main(capsys, ["eval", "--dry-run", "--bundle-dir", str(bundle), "--eval-concurrency", "4"], env)
    assert rc == 0 and json.loads(out)["job"]["env"] == {"ADAPTER_REPO": ADAPTER, "CHECKPOINT": "final",
                                                         "EVAL_CONCURRENCY": "4"}


def test_save_steps_is_checked_against_the_max_steps_the_job_gets(capsys, bundle):
    """The job checks SAVE_STEPS against its own MAX_STEPS: here the flag's, not the environment's."""
    argv = ["train", "--dry-run", "--bundle-dir", str(bundle), "--max-steps", "50"]
    rc, out, err = run_main(capsys, argv, base_env(SAVE_STEPS="60", MAX_STEPS="1000"))
    assert rc == 2 and out == "" and err.startswith("launch.py: SAVE_STEPS=60 is out of range: use 3..50 (")


def test_a_shorter_smoke_may_be_asked_for_and_a_longer_one_is_refused(capsys, bundle):
    rc, out, err = run_main(capsys, ["smoke", "--dry-run", "--bundle-dir", str(bundle), "--max-steps", "7"], base_env())
    done = json.loads(out)
    assert rc == 0 and err == "" and "notes" not in done
    assert {k: done["job"]["env"][k] for k in ("MAX_STEPS", "SAVE_STEPS")} == {"MAX_STEPS": "7", "SAVE_STEPS": "3"}
    assert done["smoke_plan"] == smoke_report.plan(7) and done["job"]["timeout"] == smoke_report.plan(7)["timeout"]
    rc, out, err = run_main(capsys, ["smoke", "--dry-run", "--bundle-dir", str(bundle)], base_env(MAX_STEPS="21"))
    assert rc != 0 and out == "" and err.count("\n") == 1
    assert "a smoke run takes MAX_STEPS=2..20" in err and "launch.py train --max-steps 21" in err


def test_a_smoke_sized_train_launch_skips_the_full_final_eval_and_says_so(capsys, bundle):
    """The recipe's own way, MAX_STEPS=20 on a plain train launch: no 250-task final eval unless asked for."""
    rc, out, err = run_main(capsys, ["train", "--dry-run", "--bundle-dir", str(bundle)], base_env(MAX_STEPS="20"))
    done = json.loads(out)
    assert rc == 0 and done["job"]["env"]["FINAL_EVAL"] == "0"
    assert err.count("\n") == 1 and "no 250-task final eval (FINAL_EVAL=0" in err and "run `launch.py smoke`" in err
    rc, out, err = run_main(capsys, ["train", "--dry-run", "--bundle-dir", str(bundle), "--final-eval", "1"],
                            base_env(MAX_STEPS="20"))
    assert rc == 0 and json.loads(out)["job"]["env"]["FINAL_EVAL"] == "1" and "final eval" not in err
    rc, out, err = run_main(capsys, ["train", "--dry-run", "--bundle-dir", str(bundle)], base_env(MAX_STEPS="21"))
    assert rc == 0 and "FINAL_EVAL" not in json.loads(out)["job"]["env"] and "final eval" not in err


# The job scripts' own preflight runs the launcher's checks: same value, same line, before step 1.
SHARED = [("train", "run_job.sh", "MAX_STEPS", "1001"), ("train", "run_job.sh", "SAVE_STEPS", "abc"),
          ("train", "run_job.sh", "WEIGHT_SYNC", "fast"), ("train", "run_job.sh", "STALL_MINUTES", "abc"),
          ("train", "run_job.sh", "FINAL_EVAL", "maybe"), ("train", "run_job.sh", "RESUME", "later"),
          ("train", "run_job.sh", "DRY_RUN", "maybe"), ("eval", "run_eval.sh", "CHECKPOINT", "checkpoint-0"),
          ("eval", "run_eval.sh", "EVAL_CONCURRENCY", "0"), ("eval-watch", "run_eval_watch.sh", "N_TASKS", "500"),
          ("eval-watch", "run_eval_watch.sh", "MAX_IDLE_HOURS", "six"),
          # Issue 26: the job scripts refuse these as the launcher does, when a job is started directly.
          ("eval-watch", "run_eval_watch.sh", "ADAPTER_REPO", "alice/x--y"),
          ("train", "run_job.sh", "ADAPTER_REPO", "alice/x.git"), ("train", "run_job.sh", "REPORT_TO", "tensorboard"),
          ("eval", "run_eval.sh", "REPORT_TO", "tensorboard"), ("train", "run_job.sh", "SANDBOX", "daytona"),
          ("eval", "run_eval.sh", "SANDBOX", "e2b"), ("train", "run_job.sh", "SAVE_STEPS", "2000"),
          ("train", "run_job.sh", "STALL_MINUTES", "0.1"), ("eval", "run_eval.sh", "EVAL_CONCURRENCY", "65"),
          ("train", "run_job.sh", "LEARNING_RATE", "fast"), ("smoke", "run_job.sh", "MAX_STALENESS", "-1"),
          # Issue 28: every Python step refused a bad DEBUG, hours in; the job's one preflight (job_knobs) does at once.
          ("train", "run_job.sh", "DEBUG", "maybe"), ("eval", "run_eval.sh", "DEBUG", "maybe")]


@pytest.mark.parametrize(("mode", "script", "var", "value"), SHARED, ids=[f"{s}-{v}" for _, s, v, _ in SHARED])
def test_job_scripts_refuse_what_the_launcher_refuses_with_the_same_line(capsys, bundle, tmp_path, mode, script,
                                                                         var, value):
    rc, _, err = run_main(capsys, [mode, "--dry-run", "--bundle-dir", str(bundle)], base_env(**{var: value}))
    assert rc == 2 and err.startswith("launch.py: ")
    said = err.removeprefix("launch.py: ").strip()
    env = {"PATH": os.environ["PATH"], "PYTHON": sys.executable, "DRY_RUN": "1", "ADAPTER_REPO": ADAPTER,
           "HF_TOKEN": CANARY, "JOB_ID": "abc", "LOG_DIR": str(tmp_path / "logs"), var: value}
    job = subprocess.run(["bash", str(ROOT / script)], env=env, capture_output=True, text=True, timeout=60)
    assert job.returncode != 0 and CANARY not in job.stdout + job.stderr
    [line] = job.stderr.strip().splitlines()
    assert line.split("ERROR: ", 1)[1] == said
    assert "step 1/" not in job.stdout and "logs in" not in job.stdout  # stopped before step 1; no log folder yet


# --- one line, not a traceback -----------------------------------------------------------------------------------
def test_real_launch_offline_is_one_line_and_debug_shows_the_traceback(tmp_path):
    """The real `launch.py train` (its __main__, the real HfApi) with the Hub at a closed port. huggingface_hub 2.x is
    not installed here, so its version number is stood in (as in the tests above): the first Hub call fails."""
    driver = ("import runpy, sys, huggingface_hub; huggingface_hub.__version__ = '2.4.0'; "
              "sys.argv = ['launch.py', 'train']; runpy.run_path('launch.py', run_name='__main__')")
    env = offline.offline_env(tmp_path, ADAPTER_REPO=ADAPTER)
    line = offline.one_line(offline.run(["-c", driver], env), "launch.py")
    assert line.startswith(f"launch.py: could not reach the Hugging Face Hub at {env['HF_ENDPOINT']} (ConnectError: ")
    assert "no network, or HF_ENDPOINT or a proxy setting points elsewhere; check the connection and rerun" in line
    debug = offline.run(["-c", driver], {**env, "DEBUG": "1"})
    assert debug.returncode == 1 and debug.stderr.startswith("Traceback") and "httpx.ConnectError" in debug.stderr
    assert debug.stderr.splitlines()[-1] == line
    bad = offline.run(["-c", driver], {**env, "DEBUG": "verbose"})
    assert offline.one_line(bad, "launch.py") == ("launch.py: DEBUG='verbose' is not a yes/no value: use DEBUG=1 (or "
                                                  "true, yes, on) or DEBUG=0 (or false, no, off)")
    assert bad.returncode == 2


# --- issue 43: nothing bills by surprise ------------------------------------------------------------------------------
def job_ids(hub: RecordingHub) -> list[str]:
    return [job.id for job in hub.list_jobs()][::-1]  # oldest first


def test_a_second_job_on_the_same_adapter_repo_is_refused_naming_the_running_one(capsys, monkeypatch, bundle,
                                                                                 tmp_path):
    """Item 2: "relaunch a crashed or stalled job with the same command", but a stalled job may still run: two
    training jobs would write one repo. The running one is named with the command that stops it."""
    hub = RecordingHub(tmp_path / "hub")
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, ["train"])
    assert rc == 0, err
    [first] = job_ids(hub)
    commits = len(hub.commits)
    rc, out, err = launch_real(capsys, monkeypatch, bundle, hub, ["train"])
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert f"job {first} is still running run_job.sh on {ADAPTER}" in err and f"hf jobs cancel {first}" in err
    assert len(hub.jobs) == 1 and len(hub.commits) == commits  # nothing uploaded, nothing started
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, ["eval-watch"])  # the watcher beside it is expected
    assert rc == 0, err
    hub.end_job(first, "ERROR")  # the crashed job has ended: the same command relaunches it
    rc, _, err = launch_real(capsys, monkeypatch, bundle, hub, ["train"])
    assert rc == 0 and len(hub.jobs) == 3, err


@pytest.mark.parametrize("writable", [CODE, ADAPTER])
def test_write_access_to_both_repos_is_checked_before_anything_is_uploaded_or_started(capsys, monkeypatch, bundle,
                                                                                      tmp_path, writable):
    """Item 3: the job used to find a read-only ADAPTER_REPO after install, tasks and servers (~25 min of h200x2)."""
    hub = RecordingHub(tmp_path / "hub")
    hub.create_repo(ADAPTER)
    hub.create_repo(CODE)
    hub.token_role, hub.writable = "fineGrained", {writable}
    rc, out, err = launch_real(capsys, monkeypatch, bundle, hub, ["train"])
    refused = ADAPTER if writable == CODE else CODE
    assert rc == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"launch.py: HF_TOKEN cannot write to {refused} (HTTP 403")
    assert hub.jobs == [] and hub.commits == []


@pytest.mark.parametrize("given", ["flag", "environment"])
def test_a_short_train_goes_to_its_own_repo_and_says_so(capsys, bundle, given):
    """Item 4: the recipe's "MAX_STEPS=20 ... do that first" through `train` (or an exported MAX_STEPS left in the
    shell) used to finish a run in the real adapter repo, and the full run was then refused there."""
    flag = ["--max-steps", "20"] if given == "flag" else []
    env = base_env(**({"MAX_STEPS": "20"} if given == "environment" else {}))
    rc, out, err = run_main(capsys, ["train", "--dry-run", "--bundle-dir", str(bundle), *flag], env)
    assert rc == 0, err
    assert json.loads(out)["job"]["env"]["ADAPTER_REPO"] == f"{ADAPTER}-20steps"
    [note] = err.splitlines()
    assert note.startswith(f"launch.py: note: MAX_STEPS=20 ({'--max-steps' if flag else 'from the environment'}) is "
                           f"below the recipe's 1000: this run trains into {ADAPTER}-20steps")
    assert f"{ADAPTER} stays free for the full run" in note
    rc, out, err = run_main(capsys, ["train", "--dry-run", "--bundle-dir", str(bundle)], base_env())
    assert rc == 0 and json.loads(out)["job"]["env"]["ADAPTER_REPO"] == ADAPTER and err == ""


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_every_dry_run_says_what_the_job_costs_with_sources_and_how_to_stop_it(capsys, bundle, mode):
    """Item 5: GPU-hours and sandbox-minutes, typical and worst, each with where the number comes from."""
    rc, out, err = run_main(capsys, [mode, "--dry-run", "--bundle-dir", str(bundle)], base_env())
    assert rc == 0, err
    cost = json.loads(out)["cost"]
    for measure in ("gpu_hours", "sandbox_minutes"):
        assert set(cost[measure]) == {"typical", "worst"}
        assert all("(" in said and said[0].isdigit() for said in cost[measure].values()), cost[measure]
    assert cost["stop"] == "uvx hf jobs cancel <job id>"
    if mode == "train":
        assert "recipe: 10-25 h" in cost["gpu_hours"]["typical"] and "27-47 h" in cost["gpu_hours"]["typical"]
        assert cost["gpu_hours"]["worst"].startswith("144 (")
    if mode == "smoke":
        assert "recipe: ~40 min" in cost["gpu_hours"]["typical"]


# --- issue 43, items 7 and 12: the recipe's own upload, and dry runs from a checkout ----------------------------------
RECIPE_UPLOAD = ["*.py", "*.sh", "*.md", "data/*.json"]  # the recipe's `hf upload . --include ...`, as written
DOT_FOLDERS = (".venv", ".vllm", ".vllm-cpu", ".opencode", ".chain-image")


def set_up_checkout(tmp_path: Path) -> Path:
    """A clone after `bash setup.sh`: the tracked files, and setup.sh's folders where its own function puts them, each
    holding the kind of files a real set-up leaves there (tens of thousands of *.py and *.md in all)."""
    from test_setup_chain import setup_functions

    root = tmp_path / "checkout"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in tracked.split():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, root / name)
    subprocess.run(["bash", "-c", setup_functions() + "place_local_folders"], cwd=root, check=True, timeout=30,
                   env={"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home")})
    for folder in DOT_FOLDERS:
        for inside in ("lib/site.py", "bin/activate.sh", "node_modules/pkg/README.md", "root/usr/lib/x.py"):
            (root / folder / inside).parent.mkdir(parents=True, exist_ok=True)
            (root / folder / inside).write_text("# part of the set-up, not of the bundle\n")
    return root


def recipe_upload(folder: Path) -> list[str]:
    """What `hf upload REPO . --include ...` takes from `folder`: HfApi.upload_folder's listing (`glob("**/*")`, files
    only) through huggingface_hub's own filter, with its default ignore patterns."""
    from huggingface_hub.utils import filter_repo_objects
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

    listed = [p.relative_to(folder).as_posix() for p in sorted(folder.glob("**/*")) if p.is_file()]
    return list(filter_repo_objects(listed, allow_patterns=RECIPE_UPLOAD, ignore_patterns=DEFAULT_IGNORE_PATTERNS))


def test_the_recipes_own_upload_from_a_set_up_checkout_gives_a_bundle_that_runs(tmp_path):
    """Item 7: the recipe's patterns left out requirements.txt (the job then stopped at "requirements.txt has no
    transformers== pin"), and after `bash setup.sh` they took 41,206 files, 530 MB (fnmatch's `*` crosses `/`).
    Every sandbox backend runs from that upload (issue 42's pins are recipe.py's too)."""
    checkout = set_up_checkout(tmp_path)
    taken = recipe_upload(checkout)
    assert [name for name in taken if name.startswith(DOT_FOLDERS)] == []
    assert set(launch.JOB_FILES) <= set(taken) and {"data/train.json", "data/test.json"} <= set(taken)
    bundle = tmp_path / "app"  # what the recipe's job command downloads to /app
    for name in taken:
        (bundle / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(checkout / name, bundle / name)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": sys.executable,  # the image's python3
           "DRY_RUN": "1", "ADAPTER_REPO": ADAPTER, "HF_TOKEN": CANARY, "JOB_ID": "68a0", "MAX_STEPS": "1000"}
    for sandbox, spec in recipe.SANDBOXES.items():  # each backend's pins come with the upload too (recipe.py)
        keys = dict.fromkeys(spec["keys"][0], SANDBOX_CANARY) | {"HF_TOKEN": CANARY, "SANDBOX": sandbox}
        proc = subprocess.run(["bash", str(bundle / "run_job.sh")], env=env | keys, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, (sandbox, proc.stderr[-2000:])
        assert "run_job: done" in proc.stdout
        assert CANARY not in proc.stdout + proc.stderr and SANDBOX_CANARY not in proc.stdout + proc.stderr
        [install] = [line for line in proc.stdout.splitlines() if f"(recipe.py --requirements {sandbox}):" in line]
        assert "trl[peft]==1.15.0" in install.split() and (f"harbor[{sandbox}]" in install.split()) == (
            sandbox != recipe.SANDBOX), install


def test_shell_dry_runs_from_a_checkout_use_its_own_environment(tmp_path):
    """Item 12: a bare `python3` (here Debian's, without the stack) made every dry run fail with a wrong fix
    ("huggingface_hub is not installed; pip install ..."): from a checkout the scripts use its .venv."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DRY_RUN": "1", "ADAPTER_REPO": ADAPTER,
           "HF_TOKEN": CANARY, "JOB_ID": "68a0", "LOG_DIR": str(tmp_path / "logs")}
    for script in ("run_job.sh", "run_eval.sh", "run_eval_watch.sh"):
        proc = subprocess.run(["bash", str(ROOT / script)], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (script, proc.stderr[-2000:])
        assert f"{ROOT}/.venv/bin/python" in proc.stdout


def test_an_unknown_flag_shows_the_subcommands_usage(capsys):
    """Item 14: argparse's parent parser used to answer a subcommand's unknown flag with the top-level usage."""
    with pytest.raises(SystemExit) as exit_:
        launch.main(["train", "--steps", "20"], env=base_env(), make_api=refuse_api, stored_token=lambda: None)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: launch.py train ")
    assert "unrecognized arguments: --steps 20" in err


def test_a_smoke_below_its_least_steps_is_told_the_least(capsys, bundle):
    """Item 14: `smoke --max-steps 1` was told to use `train --max-steps 1` "for a longer run"."""
    rc, out, err = run_main(capsys, ["smoke", "--dry-run", "--bundle-dir", str(bundle), "--max-steps", "1"], base_env())
    assert rc == 2 and err.count("\n") == 1 and "longer" not in err
    assert "MAX_STEPS=1 is too few for a smoke run: use 2..20 (a checkpoint, a stop, a resume and a step after it)" \
        in err


def test_the_readme_states_the_costs_every_dry_run_prints(capsys, bundle):
    """Item 5: one table of cost and time in the README, typical and worst, agreeing with the dry runs' `cost`."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("**What it costs**"):readme.index("Use the adapter with")]

    def spelled(figure: str) -> str:  # "51000-90000 (..." -> "51,000-90,000"
        return "-".join(f"{float(n):,.10g}" for n in figure.split(" ", 1)[0].split("-"))

    for mode in EXPECTED:
        rc, out, _ = run_main(capsys, [mode, "--dry-run", "--bundle-dir", str(bundle)], base_env())
        cost = json.loads(out)["cost"]
        row = next(line for line in table.splitlines() if line.startswith(f"| `{mode}` "))
        assert spelled(cost["sandbox_minutes"]["typical"]) in row or mode == "smoke", (row, cost)
        assert cost["gpu_hours"]["worst"].split(" (the job's ")[1].split(" ")[0].replace("h", " h") in row
        if mode == "train":
            assert f"{spelled(cost['gpu_hours']['typical'])} GPU-hours" in row
            worst = f"{spelled(cost['gpu_hours']['worst'])} GPU-hours, {spelled(cost['sandbox_minutes']['worst'])}"
            assert worst in row
    plan = smoke_report.plan()
    assert f"| `smoke` (h200x2) | {plan['total_s'] // 3600} h {plan['total_s'] % 3600 // 60} min" in table
    lo, hi = recipe.RECIPE_TRAIN_HOURS
    assert f"{lo}-{hi} h (the recipe)" in table and f"~{recipe.RECIPE_SMOKE_MINUTES} min" in table
    assert "uvx hf jobs cancel <job id>" in readme
