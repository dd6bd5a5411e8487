# /// script
# requires-python = ">=3.12"
# dependencies = ["huggingface_hub>=2.1.1", "tomli-w==1.2.0", "packaging"]
# ///
"""Upload the code bundle and start one of the recipe's Hugging Face Jobs: train, smoke, eval-watch or eval.

    ADAPTER_REPO=you/LFM2.5-2.6B-opencode-lora-RL uv run launch.py smoke   # first; then train, eval-watch, eval
    .venv/bin/python launch.py train --dry-run    # prints the job spec and the upload list, touches nothing

`uv run` brings the inline metadata's huggingface_hub (check_hub_version says why). Every check runs before anything is
uploaded or started, each failure one line with its fix; the token (HF_TOKEN, or `hf auth login`'s) is never printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import adapter_repo as ar
import dashboard
import recipe
import smoke_report

HERE = Path(__file__).resolve().parent
PROJECT = "lfm-opencode-lora-rl"
CODE_REPO_NAME = f"{PROJECT}-code"
APP_DIR = "/app"
# The jobs' scripts and every module they import: a bundle that lacks one is a partial checkout.
JOB_FILES = ("run_job.sh", "run_eval.sh", "run_eval_watch.sh", "recipe.py", "common.sh", "image_check.py",
             "prepare_tasks.py", "eval_adapter.py", "eval_watch.py", "harbor_sessions.py", "adapter_repo.py",
             "serve_policy.sh", "chat_template.py", "serve_env.sh", "seam_patch.py", "capture_gateway.py",
             "dashboard.py", "sandbox_lifecycle.py", "trajectories.py", "train_lora.py", "train_callbacks.py",
             "train_weight_sync.py", "train_rollouts.py", "train_metrics.py", "model_cards.py", "train_resume.py",
             "smoke_report.py")
MODES: dict[str, dict[str, Any]] = {  # a smoke's timeout is its plan's cap (set in launch())
    "train": {"script": ar.TRAIN_SCRIPT, "flavor": recipe.TRAIN_FLAVOR, "timeout": recipe.TRAIN_TIMEOUT},
    "smoke": {"script": ar.TRAIN_SCRIPT, "flavor": recipe.TRAIN_FLAVOR, "timeout": None},
    "eval-watch": {"script": "run_eval_watch.sh", "flavor": recipe.EVAL_FLAVOR, "timeout": recipe.EVAL_WATCH_TIMEOUT},
    "eval": {"script": "run_eval.sh", "flavor": recipe.EVAL_FLAVOR, "timeout": recipe.EVAL_TIMEOUT},
}
# The knobs each mode (every mode: "all") passes to its job when given (flag or environment), checked as the job checks
# them (recipe.KNOBS); the smoke plan fixes SAVE_STEPS, RESUME and FINAL_EVAL.
JOB_KNOBS: dict[str, tuple[str, ...]] = {
    "all": ("SANDBOX", "REPORT_TO", "DASHBOARD_SPACE"),
    "train": ("SAVE_STEPS", "RESUME", "WEIGHT_SYNC", "STALL_MINUTES", "FINAL_EVAL", "LEARNING_RATE", "MAX_STALENESS"),
    "smoke": ("WEIGHT_SYNC", "STALL_MINUTES", "LEARNING_RATE", "MAX_STALENESS"),
    "eval-watch": ("MAX_IDLE_HOURS", "EVAL_CONCURRENCY"),
    "eval": ("EVAL_CONCURRENCY",),
}
REDACTED = "<redacted>"
TOKEN_OWNER = "<token owner>"
HF_CLI = "uvx hf"  # the Hub's CLI with nothing but uv


# --- preflight: each check raises ConfigError with the fix ---------------------------------------------------------
def check_hub_version(version: str) -> None:
    """A real launch needs run_job(expose_public=...), which older huggingface_hub releases lack."""
    from packaging.version import Version

    if Version(version) < Version(recipe.LAUNCHER_HUB_MIN):
        need, tomli_w = f"huggingface_hub>={recipe.LAUNCHER_HUB_MIN}", f"tomli-w{recipe.pinned_versions()['tomli-w']}"
        raise recipe.ConfigError(f"huggingface_hub {version} is too old for launch.py (run_job(expose_public=...) "
                                 f"needs {need}): run it as  uv run launch.py ...  (its inline metadata brings {need} "
                                 f"and {tomli_w})")


def suffixed_repo(adapter_repo: str, suffix: str, why: str) -> str:
    """A run's own repo beside ADAPTER_REPO (the smoke's, a short train's), away from the full run's watcher."""
    try:
        return recipe.require_repo_id(f"{adapter_repo}{suffix}", "ADAPTER_REPO")
    except recipe.ConfigError:
        raise recipe.ConfigError(
            f"ADAPTER_REPO={adapter_repo!r} cannot take the '{suffix}' suffix {why} ({adapter_repo}{suffix} is not a "
            "valid repo id; a name has at most 96 characters): use a shorter ADAPTER_REPO name") from None


def bundle_files(bundle: Path) -> list[str]:
    """Relative paths of the files the job downloads to /app, sorted: the recipe's own upload patterns (`hf upload
    --include`; Path.glob's * stays within one folder)."""
    return sorted({p.relative_to(bundle).as_posix() for pattern in ("*.py", "*.sh", "*.md", "data/*.json")
                   for p in bundle.glob(pattern) if p.is_file()})


def check_bundle(bundle: Path) -> list[str]:
    """The bundle's files; refused without a file a job runs (JOB_FILES) or with lists prepare_tasks.py refuses."""
    import prepare_tasks

    if not bundle.is_dir():
        raise recipe.ConfigError(f"--bundle-dir {bundle} is not a folder: point --bundle-dir (or BUNDLE_DIR) at a "
                                 f"checkout of {PROJECT}, or leave it unset to upload this one")
    lists = {split: prepare_tasks.load_list(bundle / "data", split) for split in prepare_tasks.SPLITS}
    prepare_tasks.check_lists(lists)
    files = bundle_files(bundle)
    if missing := sorted(set(JOB_FILES) - set(files)):
        raise recipe.ConfigError(f"the bundle in {bundle} lacks {', '.join(missing)}: run launch.py from a full "
                                 f"checkout of {PROJECT} (or pass --bundle-dir)")
    return files


def check_adapter_repo(api: Any, mode: str, adapter_repo: str, checkpoint: str | None, resume: bool = True) -> None:
    """Training starts on a repo without a finished run (the eval watcher would stop at its final adapter), and
    from step 0 (RESUME=0) only on one without checkpoints; an eval finds its checkpoint."""
    from huggingface_hub.errors import RepositoryNotFoundError

    if mode not in ("train", "eval"):
        return
    try:
        files = set(api.list_repo_files(adapter_repo))
    except RepositoryNotFoundError:
        files = set()
    if mode == "train" and ar.checkpoint_complete(files, ar.FINAL):
        raise recipe.ConfigError(f"{adapter_repo} already holds a final adapter (a finished run): evaluate it with "
                                 f"`uv run launch.py eval --adapter-repo {adapter_repo}`, or train into a new "
                                 "ADAPTER_REPO")
    if mode == "train" and not resume:
        ar.refuse_fresh_start(adapter_repo, files)
    if mode == "eval" and not ar.checkpoint_complete(files, checkpoint):
        have = ", ".join(ar.checkpoint_name(n) for n in ar.complete_checkpoints(files)[-5:])
        raise recipe.ConfigError(f"{adapter_repo} has no {checkpoint!r} adapter: pick one it has "
                                 f"({have or 'no complete checkpoints yet'}) with --checkpoint")


def check_no_live_job(api: Any, mode: str, adapter_repo: str, job_vars: dict[str, str]) -> None:
    """One job per repo and script (and checkpoint, for an eval): a second one would write the same files."""
    script = MODES[mode]["script"]
    for job in ar.live_jobs(api, adapter_repo, script):
        if mode == "eval" and (job.environment or {}).get("CHECKPOINT") != job_vars["CHECKPOINT"]:
            continue
        raise recipe.ConfigError(
            f"job {job.id} is still running {script} on {adapter_repo} ({job.status.stage}, {job.url}): a second job "
            f"would write the same repo; let it end, or stop it with `{HF_CLI} jobs cancel {job.id}` and launch again "
            "(training resumes from its last checkpoint)")


def check_write_access(api: Any, mode: str, adapter_repo: str, code_repo: str, job_vars: dict[str, str]) -> list[str]:
    """The token may write both repos (the Hub's auth-check; the trainer's own check comes after install, tasks and
    servers). Training creates its repo; an eval watcher's missing repo is its training job's to create (a note)."""
    from huggingface_hub.errors import RepositoryNotFoundError

    ar.require_write_access(api, code_repo)
    if mode not in ("train", "smoke"):  # an eval's repo exists: check_adapter_repo found its checkpoint
        try:
            api.repo_info(adapter_repo)
        except RepositoryNotFoundError:
            hours = recipe.shell_value(recipe.knob("MAX_IDLE_HOURS", job_vars))
            return [f"{adapter_repo} does not exist yet: the watcher waits for a job to create it, checking every "
                    f"{recipe.EVAL_POLL_SECONDS // 60} min, and fails after MAX_IDLE_HOURS={hours} h (the GPU is "
                    "billed meanwhile); launch the training job for this repo too (it creates the repo when it "
                    "starts), or fix the name and relaunch"]
    ar.require_write_access(api, adapter_repo)
    return []


# --- the job spec ---------------------------------------------------------------------------------------------------
def job_env(mode: str, adapter_repo: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """The job's environment (the rest is the bundle's recipe.py), each knob checked as the job's preflight will."""
    job = {"ADAPTER_REPO": adapter_repo}
    if mode == "train":
        job["MAX_STEPS"] = str(recipe.knob("MAX_STEPS", env, args.max_steps))
        if int(job["MAX_STEPS"]) <= recipe.SMOKE_STEPS:  # smoke-sized: no 250-task final eval unless asked for
            job["FINAL_EVAL"] = "0"  # a given FINAL_EVAL overrides it; notes() says so
    elif mode == "smoke":  # run_job.sh refuses other numbers than the plan's; MAX_STEPS defaults to SMOKE_STEPS
        raw = str(args.max_steps if args.max_steps is not None else env.get("MAX_STEPS", "")).strip()
        p = smoke_report.plan(recipe.knob("MAX_STEPS", value=raw) if raw else recipe.SMOKE_STEPS)
        job.update(MODE="smoke", MAX_STEPS=str(p["steps"]), SAVE_STEPS=str(p["save_steps"]),
                   EVAL_TASKS=str(p["eval_tasks"]))
    elif mode == "eval-watch":
        job["N_TASKS"] = str(recipe.SMOKE_WATCH_TASKS if args.smoke else recipe.knob("N_TASKS", env, args.n_tasks))
        if args.smoke:  # stops after the smoke run's final adapter, or idle for the rest of the smoke job's cap
            job["MAX_IDLE_HOURS"] = recipe.shell_value(smoke_report.plan()["cap_s"] / 3600)
    else:
        job["CHECKPOINT"] = recipe.knob("CHECKPOINT", env, args.checkpoint)
    for name in (*JOB_KNOBS["all"], *JOB_KNOBS[mode]):
        given = getattr(args, name.lower())
        if raw := str(given if given is not None else env.get(name, "")).strip():
            job[name] = raw
    return {name: recipe.shell_value(recipe.knob(name, job)) if name in recipe.KNOBS else value
            for name, value in job.items()}


def notes(mode: str, job: dict[str, str], args: argparse.Namespace, asked_repo: str) -> list[str]:
    """What the launch does differently from what a user may expect, said rather than done silently."""
    if mode != "train" or job["ADAPTER_REPO"] == asked_repo:
        return []
    steps = int(job["MAX_STEPS"])
    note = (f"MAX_STEPS={steps} ({'--max-steps' if args.max_steps is not None else 'from the environment'}) is below "
            f"the recipe's {recipe.MAX_STEPS}: this run trains into {job['ADAPTER_REPO']}, its own repo, so "
            f"{asked_repo} stays free for the full run (watch or evaluate it with --adapter-repo "
            f"{job['ADAPTER_REPO']})")
    if job.get("FINAL_EVAL") == "0" and steps <= recipe.SMOKE_STEPS:
        note += ("; no 250-task final eval (FINAL_EVAL=0; --final-eval 1 asks for it); for the smoke test (a stop and "
                 "a resume from the Hub, an eval subset, a go/no-go report) run `launch.py smoke`")
    return [note]


def cost(mode: str, job: dict[str, str], timeout: str) -> dict[str, Any]:
    """GPU-hours and sandbox-minutes, typical and worst (the caps), each with its source (recipe.py's cost figures)."""
    gpus, cap, minutes = (2 if MODES[mode]["flavor"] == recipe.TRAIN_FLAVOR else 1), recipe.hours(timeout), \
        recipe.TYPICAL_ROLLOUT_MINUTES
    sandboxes = recipe.MAX_INFLIGHT_ROLLOUTS if gpus == 2 else recipe.knob("EVAL_CONCURRENCY", job)
    plan = smoke_report.plan(int(job.get("MAX_STEPS") or recipe.SMOKE_STEPS)) if job["ADAPTER_REPO"].endswith(
        ar.SMOKE_SUFFIX) else None
    steps = plan["steps"] if plan else int(job.get("MAX_STEPS") or recipe.MAX_STEPS)
    def span(low: float, high: float) -> str:
        return "-".join(dict.fromkeys((f"{low:.3g}", f"{high:.3g}")))

    r1, r2, s1, s2 = (steps * h / recipe.MAX_STEPS for h in (*recipe.RECIPE_TRAIN_HOURS, *recipe.SIMULATED_TRAIN_HOURS))
    run, said = ((plan["total_s"] / 3600,) * 2, f"smoke_report.py plan: {smoke_report.duration(plan['total_s'])}; "
                 f"recipe: ~{recipe.RECIPE_SMOKE_MINUTES} min of training") if plan else (
        (r1, s2), f"recipe: {r1:g}-{r2:g} h; benchmarks/README.md's rollout-pipeline simulation: {s1:g}-{s2:g} h")
    if mode in ("train", "smoke"):
        per_step = recipe.SIMULATED_SANDBOX_MINUTES_PER_STEP
        gpu_hours = f"{span(gpus * run[0], gpus * run[1])} ({said}; x {gpus} GPUs)"
        sandbox = f"{steps * per_step[0]}-{steps * per_step[1]} (the simulation: {per_step[0]}-{per_step[1]} a step)"
    elif mode == "eval-watch":  # the base, every checkpoint and the final adapter, on N_TASKS
        evals = (len(plan["checkpoints"]) if plan else recipe.MAX_STEPS // recipe.SAVE_STEPS) + 2
        cells = evals * int(job["N_TASKS"])
        gpu_hours = f"{span(*run)} (the run it watches: {said}; it stops at that run's end)"
        sandbox = f"{cells * minutes} ({cells} cells x {minutes} min, the simulation's median rollout)"
    else:
        cells = 2 * recipe.TEST_TASKS
        gpu_hours = f"{-(-cells // sandboxes) * minutes / 60:.2g} ({cells} cells, {sandboxes} at a time, {minutes} min)"
        sandbox = f"{cells * minutes} ({cells} cells x {minutes} min, the simulation's median rollout)"
    return {"flavor": MODES[mode]["flavor"],
            "gpu_hours": {"typical": gpu_hours, "worst": f"{gpus * cap:g} (the job's {timeout} cap x {gpus} GPU)"},
            "sandbox_minutes": {"typical": sandbox, "worst": f"{sandboxes * cap * 60:g} ({sandboxes} sandboxes busy "
                                                            f"for the whole {timeout})"},
            "stop": f"{HF_CLI} jobs cancel <job id>"}


def job_spec(mode: str, code_repo: str, revision: str, env: dict[str, str], secrets: dict[str, str],
             timeout: str | None = None) -> dict[str, Any]:
    """The keyword arguments of `run_job`: download exactly the uploaded bundle commit to /app and run the mode's
    script (the image has python3, no git); every job runs OpenCode in remote sandboxes: all expose /capture."""
    hub = f"huggingface_hub{recipe.pinned_versions()['huggingface-hub']}"
    command = ["bash", "-c", f"pip -q install {shlex.quote(hub)} && hf download {shlex.quote(code_repo)} --revision "
               f"{shlex.quote(revision)} --local-dir {APP_DIR} && bash {APP_DIR}/{MODES[mode]['script']}"]
    return {"image": recipe.VLLM_IMAGE, "command": command,
            "flavor": MODES[mode]["flavor"], "timeout": timeout or MODES[mode]["timeout"], "env": env,
            "secrets": secrets, "expose_public": [recipe.PUBLIC_PORT], "name": f"{PROJECT}-{mode}"}


def dashboard_info(job: dict[str, str], owner: str) -> dict[str, str] | None:
    """Where the run's Trackio dashboard will be: a private Space under the token's owner, or local logs."""
    if recipe.knob("REPORT_TO", job) != "trackio":
        return None
    space = dashboard.space(job)
    where = ({"url": dashboard.SPACE_URL.format(dashboard.space_id(space, owner))} if space
             else {"local": "Trackio logs stay in the job (DASHBOARD_SPACE=local)"})
    return {"project": dashboard.project(job["ADAPTER_REPO"]), **where}


# --- upload + launch -------------------------------------------------------------------------------------
def knob_flag(parser: argparse.ArgumentParser, name: str) -> None:
    """--name for the job knob NAME, passed to the job when given (flag or environment)."""
    spec = recipe.KNOBS[name]
    offered = f"; or {', '.join(spec.kind[1:])}" if isinstance(spec.kind, tuple) else ""
    parser.add_argument(f"--{name.lower().replace('_', '-')}", dest=name.lower(), help=f"passed to the job as {name} "
                        f"(env {name}; unset: the job's default, {recipe.shell_value(spec.default)}{offered})")


def parse_args(argv: list[str] | None, env: dict[str, str]) -> argparse.Namespace:
    """Subcommand + flags; every flag defaults to its environment variable."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--adapter-repo", default=env.get("ADAPTER_REPO"),
                        help="repo the adapter and checkpoints are pushed to (env ADAPTER_REPO, required)")
    common.add_argument("--code-repo", default=env.get("CODE_REPO"),
                        help=f"repo the code bundle is uploaded to (env CODE_REPO; default <owner>/{CODE_REPO_NAME})")
    common.add_argument("--bundle-dir", type=Path, default=Path(env.get("BUNDLE_DIR", HERE)),
                        help="checkout to upload (env BUNDLE_DIR, default this script's folder)")
    common.add_argument("--dry-run", action="store_true", help="print the job spec and the files to upload as JSON; "
                        "touch nothing remote (env DRY_RUN=1, or true/yes/on)")
    for name in JOB_KNOBS["all"]:
        knob_flag(common, name)
    parser = argparse.ArgumentParser(prog="launch.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    train = sub.add_parser("train", parents=[common], help=f"full training run ({recipe.TRAIN_FLAVOR})")
    train.add_argument("--max-steps", help=f"optimizer steps (env MAX_STEPS, default {recipe.MAX_STEPS})")
    smoke = sub.add_parser("smoke", parents=[common], help=f"the recipe's smoke test: every stage at small scale "
                           f"({recipe.SMOKE_STEPS} steps, a resume, an eval subset, a go/no-go report) into "
                           f"<ADAPTER_REPO>{ar.SMOKE_SUFFIX}: do this first")
    smoke.add_argument("--max-steps", help=f"optimizer steps (env MAX_STEPS, default and most {recipe.SMOKE_STEPS}, "
                                           f"least {recipe.SMOKE_MIN_STEPS}); the cap follows from the plan")
    watch = sub.add_parser("eval-watch", parents=[common], help="per-checkpoint eval worker (live learning curve)")
    watch.add_argument("--n-tasks", help=f"fixed test subset size (env N_TASKS, default {recipe.EVAL_WATCH_TASKS})")
    watch.add_argument("--smoke", action="store_true",
                       help=f"watch the smoke run's repo (<ADAPTER_REPO>{ar.SMOKE_SUFFIX}) on "
                            f"{recipe.SMOKE_WATCH_TASKS} tasks; launch it next to `smoke`")
    evaluate = sub.add_parser("eval", parents=[common], help="standalone base-vs-adapter eval of one checkpoint")
    evaluate.add_argument("--checkpoint", help="checkpoint-N or final (env CHECKPOINT, default final)")
    subs = dict(zip(MODES, (train, smoke, watch, evaluate), strict=True))
    for mode, sub_parser in subs.items():
        for name in JOB_KNOBS[mode]:
            knob_flag(sub_parser, name)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would answer with the top-level usage; the subcommand's lists the flags that exist
        subs[args.mode].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def launch(args: argparse.Namespace, env: dict[str, str], *, stored_token: Callable[[], str | None],
           hub_version: str, make_api: Callable[[str], Any]) -> dict[str, Any]:
    """Preflight, then (unless --dry-run) upload the bundle and start the job; return what was (or would be) done."""
    mode, bundle = args.mode, args.bundle_dir
    args.dry_run = recipe.knob("DRY_RUN", env) or args.dry_run  # checked even beside --dry-run: a typo is refused
    if not args.dry_run:
        check_hub_version(hub_version)
    token = env.get("HF_TOKEN", "").strip() or (stored_token() or "").strip()  # the Hub's auth-check judges it
    if not token:
        raise recipe.ConfigError("no Hugging Face token: export HF_TOKEN=hf_... (a write token) or run `hf auth login`")
    adapter_repo = recipe.require_repo_id(args.adapter_repo, "ADAPTER_REPO")  # the code repo: its owner's by default
    code_repo = recipe.require_repo_id(args.code_repo or f"{adapter_repo.split('/')[0]}/{CODE_REPO_NAME}", "CODE_REPO")
    if code_repo == adapter_repo:
        raise recipe.ConfigError(f"CODE_REPO and ADAPTER_REPO are both {adapter_repo!r}: give the code bundle its own "
                                 "repo")
    asked_repo = adapter_repo
    if mode == "smoke" or getattr(args, "smoke", False):
        adapter_repo = suffixed_repo(adapter_repo, ar.SMOKE_SUFFIX, "the smoke run pushes to")
    elif mode == "train" and (steps := recipe.knob("MAX_STEPS", env, args.max_steps)) < recipe.MAX_STEPS:
        adapter_repo = suffixed_repo(adapter_repo, f"-{steps}steps", f"a {steps}-step run pushes to")
    files = check_bundle(bundle)
    if env.get("MODEL", "").strip() not in ("", recipe.BASE_MODEL):  # read by train_lora.py and serve_policy.sh alone
        raise recipe.ConfigError(f"MODEL={env['MODEL'].strip()!r} is not passed to the job: the recipe trains "
                                 f"{recipe.BASE_MODEL} (its LoRA targets, chat template, tool parser and pinned "
                                 "revision are that model's); unset MODEL")
    job_vars = job_env(mode, adapter_repo, args, env)
    secrets, sandbox = {"HF_TOKEN": token}, recipe.knob("SANDBOX", job_vars)
    if sandbox != recipe.SANDBOX:  # the backend's key rides as a secret; the job installs its extra
        secrets |= recipe.sandbox_keys(sandbox, env)
        job_vars |= {name: env[name].strip() for name in recipe.SANDBOXES[sandbox].get("settings", ())
                     if env.get(name, "").strip()}
    told = notes(mode, job_vars, args, asked_repo) + ([recipe.E2B_NOTE] if sandbox == "e2b" else [])
    said = {"notes": told} if told else {}
    # What the job's one pip call installs (`recipe.py --requirements SANDBOX`): the job's pins and the backend's.
    said["install"] = [line for line in recipe.requirements(sandbox).splitlines() if line and not line.startswith("#")]
    plan = smoke_report.plan(int(job_vars["MAX_STEPS"])) if mode == "smoke" else None  # what it does within its cap
    watch_cap_s = smoke_report.plan()["watch_cap_s"] if mode == "eval-watch" and args.smoke else None
    timeout = plan["timeout"] if plan else smoke_report.duration(watch_cap_s) if watch_cap_s else None  # smoke caps
    said["cost"] = cost(mode, job_vars, timeout or MODES[mode]["timeout"])
    if plan:
        said["smoke_plan"] = plan
    shown = dict.fromkeys(secrets, REDACTED)  # what is printed: never a secret's value
    if args.dry_run:
        spec = job_spec(mode, code_repo, "<commit of the uploaded bundle>", job_vars, shown, timeout)
        return {"job": spec, "upload": {"repo": code_repo, "files": files},
                "dashboard": dashboard_info(job_vars, TOKEN_OWNER), **said}
    from huggingface_hub import CommitOperationAdd

    api = make_api(token)
    check_adapter_repo(api, mode, adapter_repo, job_vars.get("CHECKPOINT"), job_vars.get("RESUME", "1") == "1")
    check_no_live_job(api, mode, adapter_repo, job_vars)
    if told := check_write_access(api, mode, adapter_repo, code_repo, job_vars):
        said["notes"] = said.get("notes", []) + told
    # One commit of exactly `files`; the job pins its own id (CommitInfo.oid): another launch may commit after it.
    ops = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(bundle / name)) for name in files]
    revision = ar.commit(api, code_repo, ops, f"{PROJECT} code bundle (launch.py)")
    spec = job_spec(mode, code_repo, revision, job_vars, secrets, timeout)
    job = api.run_job(**spec, token=token)
    try:
        owner = api.whoami()["name"]  # the dashboard Space's owner
    except Exception:  # noqa: BLE001 - only the printed URL is blurred; the job resolves the owner itself
        owner = TOKEN_OWNER
    board = dashboard_info(job_vars, owner)
    follow = [f"job id:       {job.id}", f"job page:     {job.url}",
              f"capture URL:  https://{job.id}--{recipe.PUBLIC_PORT}.hf.jobs/capture",
              f"follow logs:  {HF_CLI} jobs logs -f {job.id}", f"stop it:      {HF_CLI} jobs cancel {job.id}"]
    if board:
        follow.append(f"dashboard:    {board.get('url') or board['local']} (Trackio project {board['project']})")
    return {"job": {**spec, "secrets": shown}, "upload": {"repo": code_repo, "files": files, "revision": revision},
            "follow": follow, "dashboard": board, **said}


def main(argv: list[str] | None = None, *, env: dict[str, str] | None = None,
         make_api: Callable[[str], Any] | None = None, stored_token: Callable[[], str | None] | None = None) -> int:
    """CLI entry point; tests inject the environment, a Hub double and the stored-token lookup."""
    import huggingface_hub

    env = dict(os.environ if env is None else env)
    args = parse_args(argv, env)

    def run() -> None:
        done = launch(args, env, stored_token=stored_token or huggingface_hub.get_token,
                      hub_version=huggingface_hub.__version__,
                      make_api=make_api or (lambda token: huggingface_hub.HfApi(token=token)))
        for note in done.get("notes", []):
            print(f"launch.py: note: {note}", file=sys.stderr)
        if args.dry_run:
            print(json.dumps(done, indent=2))
        else:
            print(f"uploaded {len(done['upload']['files'])} files to {done['upload']['repo']}@"
                  f"{done['upload']['revision']}\n" + "\n".join(done["follow"]))

    return ar.run_cli("launch.py", run, env)


if __name__ == "__main__":
    sys.exit(main())
