"""run_job.sh driven through bash with stub `vllm`/`nvidia-smi`/`python3 -m pip` on PATH and fake
trainer/task-prep/eval scripts: the plan, the order of a full run, the stall watchdog, crashing children,
bad input stopping the job before anything starts, and no process left behind."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from stubs.procs import free_port

import recipe
import smoke_report

ROOT = Path(__file__).resolve().parents[1]
STUBS = Path(__file__).resolve().parent / "stubs"
REAL = ["run_job.sh", "common.sh", "recipe.py", "image_check.py", "requirements.txt", "serve_policy.sh",
        "chat_template.py", "serve_env.sh", "seam_patch.py", "capture_gateway.py", "train_rollouts.py",
        "sandbox_lifecycle.py"]
FAKES = {"train_lora.py": "fake_trainer.py", "prepare_tasks.py": "fake_prepare_tasks.py",
         "run_eval.sh": "fake_run_eval.sh", "smoke_report.py": "fake_smoke_report.py",
         "harbor_sessions.py": "fake_harbor_sessions.py"}
SECRET = "hf_secret_token_value"


@pytest.fixture
def job(tmp_path):
    """A bundle folder with the real scripts and fake trainer/prep/eval, plus the environment to run it."""
    app = tmp_path / "app"
    app.mkdir()
    for name in REAL:
        shutil.copy(ROOT / name, app / name)
    for name, fake in FAKES.items():
        shutil.copy(STUBS / fake, app / name)
    site = tmp_path / "site"
    fake_vllm(site, recipe.VLLM_VERSION)
    startup_site(tmp_path / "startup", site)
    token = uuid.uuid4().hex
    ports = {"POLICY_PORT": free_port(), "ENV_PORT": free_port(), "PUBLIC_PORT": free_port()}
    env = {k: v for k, v in os.environ.items()
           if k not in {"HF_TOKEN", "SANDBOX", "DAYTONA_API_KEY", "E2B_API_KEY", "SPACE_HOST", "JOB_ID", "HF_JOB_ID"}}
    env.update(
        PATH=f"{STUBS / 'bin'}:{env['PATH']}", PYTHON=str(STUBS / "bin" / "python3"), REAL_PYTHON=sys.executable,
        PYTHONPATH=str(tmp_path / "startup"), SITE_PACKAGES=str(site), STUB_LOG=str(tmp_path / "stub.log"),
        LOG_DIR=str(tmp_path / "logs"), WORK_DIR=str(tmp_path / "work"),
        ADAPTER_REPO="you/LFM2.5-2.6B-opencode-lora-RL",
        HF_TOKEN=SECRET, JOB_ID="job123", MAX_STEPS="3", PUBLIC_HOST="127.0.0.1", WATCH_INTERVAL="0.2",
        WAIT_POLL="0.2", READY_TIMEOUT="30", STALL_SECONDS="30", STUB_POLICY_PORT=str(ports["POLICY_PORT"]),
        RUN_JOB_TEST_TOKEN=token, REAL_SMOKE_REPORT=str(ROOT / "smoke_report.py"),
        **{k: str(v) for k, v in ports.items()},
    )
    return {"app": app, "env": env, "tmp": tmp_path, "token": token, "ports": ports}


def fake_vllm(site: Path, version: str) -> None:
    """vLLM's package metadata (importlib.metadata reads it) and an importable empty `vllm.entrypoints.openai.
    api_server` stand in for the image's vLLM (tests/test_vllm_cpu.py imports the real one)."""
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                   "Requires-Dist: fastapi[standard]<0.137.0,>=0.133.0\nRequires-Dist: mcp<3,>=2\n")
    api = site / "vllm" / "entrypoints" / "openai"
    api.mkdir(parents=True, exist_ok=True)
    for folder in (site / "vllm", site / "vllm" / "entrypoints", api):
        (folder / "__init__.py").touch()
    (api / "api_server.py").touch()


def startup_site(folder: Path, site: Path) -> None:
    """Makes `site` a site-packages folder read at interpreter start (its .pth files too), as the image's is."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site)!r})\n")


def run_job(job, timeout: float = 90, **extra: str) -> subprocess.CompletedProcess:
    env = {**job["env"], **extra}
    out = subprocess.run(["bash", str(job["app"] / "run_job.sh")], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert SECRET not in out.stdout + out.stderr
    return out


def stub_log(job) -> list[str]:
    path = job["tmp"] / "stub.log"
    return path.read_text().splitlines() if path.exists() else []


def leftovers(token: str) -> list[int]:
    """Live processes (not zombies) carrying this test's token in their environment."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if f"RUN_JOB_TEST_TOKEN={token}".encode() in (proc / "environ").read_bytes():
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


def assert_no_leftovers(token: str) -> None:
    deadline = time.monotonic() + 5
    while leftovers(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers(token) == []


def index_of(lines: list[str], prefix: str) -> int:
    return next(i for i, line in enumerate(lines) if line.startswith(prefix))


# --- the plan --------------------------------------------------------------------------------------


def test_dry_run_prints_ordered_plan_and_starts_nothing(job):
    out = run_job(job, DRY_RUN="1", STUB_GPUS="none", MAX_STEPS="20")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    steps = ["preflight", "install", "openenv", "seam-patch", "tasks", "vllm", "env-server", "watchdog", "train",
             "final-eval"]
    starts = [next(i for i, line in enumerate(lines) if line.endswith(f"] step {n}/9 {name}"))
              for n, name in enumerate(steps)]
    assert starts == sorted(starts)
    commands = [shlex.split(line[4:]) for line in lines if line.startswith("  $ ")]
    vllm = next(c for c in commands if "serve" in c and c[c.index("serve") - 1] == "vllm")
    assert f"CUDA_VISIBLE_DEVICES={recipe.VLLM_GPU}" in vllm and "VLLM_SERVER_DEV_MODE=1" in vllm
    assert vllm[vllm.index("--host") + 1] == "127.0.0.1"
    for needed in ["--return-tokens-as-token-ids", "--enable-auto-tool-choice", "--weight-transfer-config"]:
        assert needed in vllm
    assert vllm[vllm.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert vllm[vllm.index("--tool-call-parser") + 1] == "lfm2"
    assert vllm[vllm.index("--generation-config") + 1] == "vllm"
    trainer = next(c for c in commands if c[-1].endswith("train_lora.py"))
    assert f"CUDA_VISIBLE_DEVICES={recipe.TRAINER_GPU}" in trainer and "MAX_STEPS=20" in trainer
    assert "DEBUG=1" in trainer  # a crash hours in keeps its traceback in the log, above the one-line reason
    assert "CAPTURE_URL=https://job123--{}.hf.jobs/capture".format(job["ports"]["PUBLIC_PORT"]) in trainer
    server = next(c for c in commands if "harbor" in c)
    assert server[server.index("--host") + 1] == "127.0.0.1"
    gateway = next(c for c in commands if c[1].endswith("capture_gateway.py"))
    assert gateway[gateway.index("--listen-port") + 1] == str(job["ports"]["PUBLIC_PORT"])
    sessions_check = next(i for i, line in enumerate(lines) if line.endswith("harbor_sessions.py check"))
    order = [sessions_check] + [index_of(lines, p) for p in (
        "  $ env CUDA_VISIBLE_DEVICES=1", "  $ env DATASETS=", "  $ env CUDA_VISIBLE_DEVICES=0",
        "  stop vllm and env_server", "  $ env ADAPTER_REPO=")]
    assert order == sorted(order)
    assert "CHECKPOINT=final" in lines[order[-1]]
    assert stub_log(job) == []  # nothing ran
    assert not (job["tmp"] / "work").exists()


# --- a full run ------------------------------------------------------------------------------------


def test_full_run_in_order_and_cleans_up(job):
    out = run_job(job)
    assert out.returncode == 0, out.stdout + out.stderr
    log = stub_log(job)
    kinds = [line.split()[0] for line in log]
    assert kinds == ["pip", "pip", "pip", "harbor_sessions", "prepare_tasks", "vllm", "env_server", "trainer",
                     "run_eval"], log
    assert log[0] == "pip install -q --no-deps transformers==5.17.0"
    assert log[1].startswith("pip install -q -c ")
    assert log[2] == "pip check"
    constraints = (job["tmp"] / "work" / "constraints.txt").read_text().split()
    assert f"vllm=={recipe.VLLM_VERSION}" in constraints and "transformers==5.17.0" in constraints
    assert any(c.startswith("torch==") for c in constraints)
    # vLLM's own range holds the install step, except the accepted mcp break (fake_vllm declares both).
    assert "fastapi<0.137.0,>=0.133.0" in constraints and not any(c.startswith("mcp") for c in constraints)
    assert log[3] == "harbor_sessions check"
    assert "CUDA_VISIBLE_DEVICES=1 VLLM_SERVER_DEV_MODE=1" in log[5] and "--host 127.0.0.1" in log[5]
    public = f"job123--{job['ports']['PUBLIC_PORT']}.hf.jobs"
    assert f"SPACE_HOST={public}" in log[6] and "--host 127.0.0.1" in log[6]
    assert "CUDA_VISIBLE_DEVICES=0" in log[7] and "HF_TOKEN_SET=True" in log[7] and "MAX_STEPS=3" in log[7]
    assert log[8] == f"run_eval ADAPTER_REPO=you/LFM2.5-2.6B-opencode-lora-RL CHECKPOINT=final SPACE_HOST={public} " \
                     "EVAL_TASKS= training_vllm=down"
    for n, name in enumerate(["preflight", "install", "openenv", "seam-patch", "tasks", "vllm", "env-server",
                              "watchdog", "train", "final-eval"]):
        assert any(f"step {n}/9 {name}: " in line and line.endswith("s)") for line in out.stdout.splitlines())
    assert "trainer finished 3 steps" in out.stdout
    assert_no_leftovers(job["token"])


# --- the smoke run ------------------------------------------------------------------------------------------------

SMOKE_REPO = "you/LFM2.5-2.6B-opencode-lora-RL-smoke"
SMOKE = {"MODE": "smoke", "ADAPTER_REPO": SMOKE_REPO, "MAX_STEPS": str(recipe.SMOKE_STEPS),
         "SAVE_STEPS": str(recipe.SMOKE_SAVE_STEPS), "EVAL_TASKS": str(recipe.SMOKE_EVAL_TASKS)}


def test_smoke_dry_run_prints_the_plan_two_trainer_starts_the_subset_eval_and_the_report(job):
    out = run_job(job, DRY_RUN="1", STUB_GPUS="none", **SMOKE)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    plan = smoke_report.plan()  # printed by the preflight: the real plan, with the job's cap
    assert smoke_report.render_plan(plan).splitlines()[0] in lines and plan["steps"] == recipe.SMOKE_STEPS == 20
    commands = [shlex.split(line[4:]) for line in lines if line.startswith("  $ ")]
    clear = next(i for i, line in enumerate(lines) if line.endswith("smoke_report.py clear"))
    trainers = [i for i, line in enumerate(lines) if line.startswith("  $ env CUDA_VISIBLE_DEVICES=0")]
    starts = [c for c in commands if c[-1].endswith("train_lora.py")]
    assert len(starts) == 2 and clear < trainers[0] < trainers[1]
    install = next(i for i, line in enumerate(lines) if line.endswith("] step 1/10 install"))
    assert clear < install  # emptied before anything can read the repo (issue 26 item 4)
    first, second = starts
    assert "STOP_AFTER_STEP=5" in first and not any(a.startswith("STOP_AFTER_STEP") for a in second)
    for start in starts:
        assert {"MAX_STEPS=20", "SAVE_STEPS=5", "RESUME=1"} <= set(start)
    work = job["tmp"] / "work"
    assert f"OUTPUT_DIR={work}/output" in first and f"OUTPUT_DIR={work}/output-resume" in second
    for n, name in enumerate(["preflight", "install", "openenv", "seam-patch", "tasks", "vllm", "env-server",
                              "watchdog", "train", "resume", "final-eval"]):
        assert any(line.endswith(f"] step {n}/10 {name}") for line in lines), name
    evaluation = next(c for c in commands if c[-1].endswith("run_eval.sh"))
    assert "EVAL_TASKS=4" in evaluation and "CHECKPOINT=final" in evaluation
    assert evaluation[evaluation.index("timeout") + 1].endswith("s")  # what the smoke deadline leaves
    assert lines[-1].endswith(f"smoke_report.py report --work-dir {work} --stages {work}/{recipe.STAGES_NAME}")
    assert stub_log(job) == []


@pytest.mark.parametrize(("extra", "message"), [
    ({"ADAPTER_REPO": "you/LFM2.5-2.6B-opencode-lora-RL"}, "ADAPTER_REPO=you/LFM2.5-2.6B-opencode-lora-RL must end "
                                                            "with -smoke"),
    ({"MAX_STEPS": "21"}, "a smoke run takes MAX_STEPS=2..20"),
    ({"MAX_STEPS": "7", "SAVE_STEPS": "5"},
     "MODE=smoke runs its budgeted plan (MAX_STEPS=7 SAVE_STEPS=3 EVAL_TASKS=4)"),
    ({"MODE": "quick"}, "MODE='quick' is not one of train, smoke"),
])
def test_smoke_bad_input_stops_at_once(job, extra, message):
    out = run_job(job, timeout=30, **{**SMOKE, **extra})
    assert out.returncode != 0
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert stub_log(job) == []


def test_a_shorter_smoke_takes_its_plans_checkpoints(job):
    """MAX_STEPS below the recipe's 20: the plan's save steps for it (the first start stops at its first checkpoint)."""
    out = run_job(job, DRY_RUN="1", STUB_GPUS="none", MODE="smoke", ADAPTER_REPO=SMOKE_REPO, MAX_STEPS="7")
    assert out.returncode == 0, out.stderr
    starts = [shlex.split(line[4:]) for line in out.stdout.splitlines() if line.endswith("train_lora.py")]
    assert len(starts) == 2 and "STOP_AFTER_STEP=3" in starts[0]
    assert all({"MAX_STEPS=7", "SAVE_STEPS=3"} <= set(start) for start in starts)


def test_smoke_run_stops_resumes_evaluates_the_subset_and_reports(job):
    out = run_job(job, **SMOKE)
    assert out.returncode == 0, out.stdout + out.stderr
    log = stub_log(job)
    kinds = [line.split()[0] for line in log]
    assert kinds == ["smoke_report", "pip", "pip", "pip", "harbor_sessions", "prepare_tasks", "vllm", "env_server",
                     "trainer", "trainer", "run_eval", "smoke_report"], log
    assert log[0] == f"smoke_report clear ADAPTER_REPO={SMOKE_REPO}"  # the preflight's last act
    assert "STOP_AFTER_STEP=5" in log[8] and "STOP_AFTER_STEP=None" in log[9]
    assert "EVAL_TASKS=4 training_vllm=down" in log[10]
    steps = ["preflight", "install", "openenv", "seam-patch", "tasks", "vllm", "env-server", "watchdog", "train",
             "resume", "final-eval"]
    assert log[11] == "smoke_report report " + " ".join(f"{kind}:{name}" for name in steps for kind in ("start", "end"))
    assert "SMOKE REPORT: GO" in out.stdout
    assert_no_leftovers(job["token"])


def test_the_second_trainer_start_keeps_the_first_starts_rollout_counts_where_the_report_reads_them(job):
    """Each start's rollout child begins a new ledger: run_job.sh keeps the first one aside under recipe.py's rule,
    the one smoke_report.py reads every start's counts by."""
    out = run_job(job, **SMOKE)
    assert out.returncode == 0, out.stdout + out.stderr
    work = job["tmp"] / "work"
    [kept] = recipe.kept_ledgers(work)
    assert json.loads(kept.read_text()) == {"output_dir": f"{work}/output"}
    assert json.loads((work / recipe.LEDGER_NAME).read_text()) == {"output_dir": f"{work}/output-resume"}


def test_smoke_no_go_fails_the_job(job):
    out = run_job(job, STUB_REPORT="NO-GO", **SMOKE)
    assert out.returncode != 0 and "SMOKE REPORT: NO-GO" in out.stdout
    assert "run_job: FAILED" in out.stdout


def test_smoke_stage_past_the_deadline_is_stopped_and_still_reported(job):
    out = run_job(job, STUB_TRAIN="stall", STALL_SECONDS="60", STUB_DEADLINE="3", STUB_REPORT="NO-GO", **SMOKE)
    assert out.returncode != 0
    assert "smoke deadline reached: trainer ran past the plan's budget" in out.stderr
    report = stub_log(job)[-1]
    assert report.startswith("smoke_report report ") and report.endswith("start:train")  # died in train: failed
    assert not any(line.startswith("run_eval") for line in stub_log(job))
    assert_no_leftovers(job["token"])


# --- failures end the job, loudly, with nothing left running ------------------------------------------


@pytest.mark.parametrize(("mode", "tail"), [
    ("stall", "trainer| step 1 done; now hanging"),
    ("wedged", "trainer| waiting for the first group of rollouts"),  # rollouts still finish: not progress
])
def test_watchdog_kills_stalled_trainer(job, mode, tail):
    started = time.monotonic()
    out = run_job(job, STUB_TRAIN=mode, STALL_SECONDS="2")
    assert out.returncode != 0
    assert "trainer stalled: no optimizer step and no finished rollout for" in out.stderr
    assert "(limit 2s)" in out.stderr
    assert tail in out.stderr  # its log tail
    assert time.monotonic() - started < 40
    assert not any(line.startswith("run_eval") for line in stub_log(job))
    assert_no_leftovers(job["token"])  # the trainer's grandchild `sleep` included


def test_watchdog_spares_a_first_step_longer_than_its_limit_while_rollouts_finish(job):
    """Issue 14, defect 4: a whole group must finish before step 1, which can take longer than STALL_MINUTES."""
    out = run_job(job, STUB_TRAIN="slow_first_step", STALL_SECONDS="2", FINAL_EVAL="0")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "trainer stalled" not in out.stderr and "step 9/9 final-eval: skipped" in out.stdout
    assert_no_leftovers(job["token"])



def test_failing_final_eval_fails_the_job(job):
    out = run_job(job, STUB_EVAL="fail")
    assert out.returncode != 0
    assert "final eval failed (status 6)" in out.stderr
    assert "trainer finished 3 steps" in out.stdout
    assert_no_leftovers(job["token"])


def test_crashing_trainer_ends_job_with_log_tail(job):
    out = run_job(job, STUB_TRAIN="crash")
    assert out.returncode != 0
    assert f"run_job: FAILED (exit 1); logs in {job['env']['LOG_DIR']}" in out.stdout
    assert "trainer exited with status 7" in out.stderr
    assert "trainer| RuntimeError: simulated trainer crash" in out.stderr
    assert_no_leftovers(job["token"])


def test_crashing_vllm_ends_job_with_log_tail(job):
    out = run_job(job, STUB_VLLM="crash")
    assert out.returncode != 0
    assert "vllm exited before it was ready" in out.stderr
    assert "vllm| stub vllm: CUDA out of memory (simulated)" in out.stderr
    assert not any(line.startswith(("env_server", "trainer")) for line in stub_log(job))
    assert_no_leftovers(job["token"])


def test_env_server_failing_at_start_ends_job(job):
    out = run_job(job, STUB_ENV="crash")
    assert out.returncode != 0
    assert "env_server exited before it was ready" in out.stderr
    assert "simulated start-up failure" in out.stderr
    assert_no_leftovers(job["token"])


def test_env_server_dying_during_training_ends_job(job):
    out = run_job(job, STUB_ENV="die_after", STUB_ENV_SECONDS="3", STUB_TRAIN="stall", STALL_SECONDS="60")
    assert out.returncode != 0
    assert "env_server exited (status 1) while training" in out.stderr
    assert "simulated crash while serving" in out.stderr
    assert_no_leftovers(job["token"])


def test_sigterm_stops_everything(job):
    env = {**job["env"], "STUB_TRAIN": "stall", "STALL_SECONDS": "60"}
    proc = subprocess.Popen(["bash", str(job["app"] / "run_job.sh")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(line.startswith("trainer") for line in stub_log(job)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_no_leftovers(job["token"])


def test_openenv_whose_sessions_trl_cannot_train_stops_job(job):
    out = run_job(job, STUB_OPENENV="old")
    assert out.returncode != 0
    assert "TrainableSession: False" in out.stderr.strip().splitlines()[-1]
    assert not any(line.startswith("vllm") for line in stub_log(job))


def test_vllm_outside_version_window_stops_job_with_versions(job):
    shutil.rmtree(job["tmp"] / "site" / f"vllm-{recipe.VLLM_VERSION}.dist-info")
    fake_vllm(job["tmp"] / "site", "0.30.0")
    out = run_job(job)
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[-1]
    assert f"vllm 0.30.0 is installed, the recipe needs vllm=={recipe.VLLM_VERSION}" in message
    assert "versions found: trl 1.15.0" in message and "transformers 5.17.0" in message
    assert not any(line.startswith("harbor_sessions") for line in stub_log(job))


def test_vllm_build_with_local_version_suffix_passes(job):
    shutil.rmtree(job["tmp"] / "site" / f"vllm-{recipe.VLLM_VERSION}.dist-info")
    fake_vllm(job["tmp"] / "site", f"{recipe.VLLM_VERSION}+cu130")  # how a CUDA build may name itself
    out = run_job(job, FINAL_EVAL="0")
    assert out.returncode == 0, out.stderr
    assert f"vllm {recipe.VLLM_VERSION}+cu130" in out.stdout  # the versions line


def test_pip_check_break_stops_job_naming_the_package(job):
    broken = "vllm 0.31.0 has requirement fastapi<0.137.0,>=0.133.0, but you have fastapi 0.165.0."
    out = run_job(job, STUB_PIP_CHECK=broken)
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[-1]
    assert "the install step broke a requirement: " + broken in message and "PIP_CHECK_ACCEPTED" in message
    assert not any(line.startswith(("harbor_sessions", "vllm")) for line in stub_log(job))


def test_accepted_pip_check_break_passes(job):
    out = run_job(job, FINAL_EVAL="0", STUB_PIP_CHECK="vllm 0.31.0 has requirement mcp<3.0.0,>=2.0.0, but you have "
                                                       "mcp 1.30.0.")
    assert out.returncode == 0, out.stderr


def test_vllm_api_server_not_importing_stops_job(job):
    (job["tmp"] / "site" / "vllm" / "entrypoints" / "openai" / "api_server.py").write_text("import mcp.nonexistent\n")
    out = run_job(job)
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[-1]
    assert "vLLM's API server does not import after the install step" in message and "mcp.nonexistent" in message
    assert not any(line.startswith(("harbor_sessions", "vllm")) for line in stub_log(job))


# --- bad input stops the job at once, with one line ----------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"HF_TOKEN": ""}, "HF_TOKEN is not set"),
        ({"ADAPTER_REPO": ""}, "ADAPTER_REPO is not set"),
        ({"ADAPTER_REPO": "not a repo"}, "ADAPTER_REPO='not a repo' is not a valid repo id"),
        ({"SANDBOX": "modal"}, "SANDBOX='modal' is not offered"),
        # Issue 26: each started a paid job that could not succeed.
        ({"SANDBOX": "daytona", "DAYTONA_API_KEY": "dtn_x"},
         "SANDBOX='daytona' is not offered (the job installs and checks only harbor[hf-sandbox]): use SANDBOX="),
        ({"SANDBOX": "e2b", "E2B_API_KEY": "e2b_x"}, "SANDBOX='e2b' is not offered"),
        ({"REPORT_TO": "tensorboard"}, "REPORT_TO='tensorboard' is not offered (the job installs Trackio and no other "
                                       "dashboard): use REPORT_TO=trackio (or none)"),
        ({"ADAPTER_REPO": "you/x--y"}, "ADAPTER_REPO='you/x--y' is not a valid repo id (the Hub's rule"),
        ({"MAX_STEPS": "3", "SAVE_STEPS": "5"}, "SAVE_STEPS=5 is more than MAX_STEPS=3"),
        ({"WATCH_INTERVAL": "3600", "STALL_SECONDS": ""}, "WATCH_INTERVAL=3600 is too long"),
        ({"STALL_MINUTES": "40"}, "STALL_SECONDS=30 and STALL_MINUTES=40 are both set"),
        ({"POLICY_PORT": "8001", "ENV_PORT": "8001"}, "POLICY_PORT and ENV_PORT are both 8001"),
        ({"SPACE_HOST": "https://job123--8000.hf.jobs/capture"}, "SPACE_HOST='https://job123--8000.hf.jobs/capture' "
                                                                  "is not a host name"),
        ({"STUB_GPUS": "0"}, "GPU 1 not found (nvidia-smi lists: 0)"),
        ({"JOB_ID": ""}, "cannot derive the job's public host: set SPACE_HOST="),
        ({"MAX_STEPS": "0"}, "MAX_STEPS=0 is out of range: use 1..1000"),
        ({"STALL_MINUTES": "abc", "STALL_SECONDS": ""}, "STALL_MINUTES='abc' is not a positive number"),
        ({"SAVE_STEPS": "abc"}, "SAVE_STEPS='abc' is not a whole number"),
        ({"WEIGHT_SYNC": "fast"}, "WEIGHT_SYNC='fast' is not one of merge_free, stock"),
        ({"READY_TIMEOUT": "abc"}, "READY_TIMEOUT='abc' is not a whole number"),
        ({"WATCH_INTERVAL": "0"}, "WATCH_INTERVAL='0' is not a positive number"),
        ({"RESUME": "maybe"}, "RESUME='maybe' is not a yes/no value"),
        ({"FINAL_EVAL": "maybe"}, "FINAL_EVAL='maybe' is not a yes/no value"),
        ({"DRY_RUN": "maybe"}, "DRY_RUN='maybe' is not a yes/no value"),
        ({"PUBLIC_PORT": "99999"}, "PUBLIC_PORT=99999 is out of range: use 1..65535"),
    ],
)
def test_bad_input_stops_at_once(job, extra, message):
    out = run_job(job, timeout=30, **extra)
    assert out.returncode != 0
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert stub_log(job) == []  # nothing installed or started
    assert "logs in" not in out.stdout  # no log folder to point at yet


# One preflight (common.sh job_preflight) for the training job and the eval jobs: run_job.sh's final eval is
# run_eval.sh, started with the training job's environment, so an input the eval refuses must stop the training job
# before its 72 hours, not after them.
SAME_LINE = [
    ({"HF_TOKEN": ""}, "HF_TOKEN is not set"),
    ({"ADAPTER_REPO": "you/x--y"}, "ADAPTER_REPO='you/x--y' is not a valid repo id"),
    ({"SANDBOX": "daytona"}, "SANDBOX='daytona' is not offered"),
    ({"REPORT_TO": "tensorboard"}, "REPORT_TO='tensorboard' is not offered"),
    ({"JOB_ID": ""}, "cannot derive the job's public host"),
    ({"JOB_ID": "a/b"}, "JOB_ID=a/b is not a job id"),
    ({"SPACE_HOST": "a host"}, "SPACE_HOST='a host' is not a host name"),
    ({"POLICY_PORT": "8001", "ENV_PORT": "8001"}, "POLICY_PORT and ENV_PORT are both 8001"),
    ({"READY_TIMEOUT": "soon"}, "READY_TIMEOUT='soon' is not a whole number"),
    ({"EVAL_TASKS": "251"}, "EVAL_TASKS=251 is out of range"),
    ({"EVAL_CONCURRENCY": "0"}, "EVAL_CONCURRENCY=0 is out of range"),  # run_eval.sh refused it, run_job.sh did not
    ({"DEBUG": "maybe"}, "DEBUG='maybe' is not a yes/no value"),  # every Python step refused it, no preflight did
]


@pytest.mark.parametrize(("extra", "message"), SAME_LINE)
def test_the_training_and_eval_jobs_refuse_the_same_bad_input_with_the_same_line(tmp_path, extra, message):
    env = {"PATH": os.environ["PATH"], "PYTHON": sys.executable, "DRY_RUN": "1", "LOG_DIR": str(tmp_path / "logs"),
           "WORK_DIR": str(tmp_path / "work"), "ADAPTER_REPO": "you/x", "HF_TOKEN": SECRET, "JOB_ID": "job123",
           **extra}
    lines = {}
    for script in ("run_job.sh", "run_eval.sh", "run_eval_watch.sh"):
        out = subprocess.run(["bash", str(ROOT / script)], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "step 1/" not in out.stdout, (script, out.stdout)
        [line] = out.stderr.strip().splitlines()
        lines[script] = line.split("] ", 1)[1]  # less the time stamp
    assert message in lines["run_job.sh"] and len(set(lines.values())) == 1, lines


def test_port_in_use_stops_at_once(job):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", job["ports"]["PUBLIC_PORT"]))
        busy.listen()
        out = run_job(job, timeout=30)
    assert out.returncode != 0
    assert f"port {job['ports']['PUBLIC_PORT']} is already in use" in out.stderr
    assert stub_log(job) == []


def test_yes_no_knobs_take_any_spelling_and_dry_run_true_starts_nothing(job):
    out = run_job(job, DRY_RUN="true", FINAL_EVAL="Yes", RESUME="on", STUB_GPUS="none")
    assert out.returncode == 0, out.stderr
    assert "DRY_RUN=1: printing the plan" in out.stdout
    trainer = next(line for line in out.stdout.splitlines() if line.endswith("train_lora.py"))
    assert "RESUME=1" in shlex.split(trainer[4:])
    assert "  stop vllm and env_server" in out.stdout  # FINAL_EVAL=Yes runs the final eval
    assert stub_log(job) == []  # nothing installed or started
    assert not (job["tmp"] / "work").exists()
    skipped = run_job(job, DRY_RUN="on", FINAL_EVAL="off")
    assert skipped.returncode == 0 and "final-eval: skipped (FINAL_EVAL=0)" in skipped.stdout


def test_space_host_wins_over_job_id(job):
    out = run_job(job, DRY_RUN="1", SPACE_HOST="https://custom--8000.hf.jobs/")
    assert out.returncode == 0, out.stderr
    assert "CAPTURE_URL=https://custom--8000.hf.jobs/capture" in out.stdout


# --- each script's header is its environment reference ------------------------------------------------------------
def knobs_checked(script: str, common: str) -> set[str]:
    """The knobs a script's text checks (env_knobs, job_knobs), itself or through the common.sh functions it calls."""
    functions = dict(re.findall(r"^([a-z_]+)\(\) \{(.*?)^\}", common, re.M | re.S))
    arrays = dict(re.findall(r"^([A-Z_]+)=\(([A-Z_ ]*)\)$", common, re.M))
    found: set[str] = set()
    seen: set[str] = set()
    texts = [script]
    while texts:
        text = texts.pop().replace("\\\n", " ")
        for array, names in arrays.items():
            text = text.replace(f'"${{{array}[@]}}"', names)
        found |= {name for args in re.findall(r"\b(?:env|job)_knobs ((?:[A-Z_]+ *)+)", text) for name in args.split()}
        for name, body in functions.items():
            if name not in seen and re.search(rf"(?<![\w-]){name}\b(?!\(\))", text):
                seen.add(name)
                texts.append(body)
    return found


@pytest.mark.parametrize("script", ["run_job.sh", "run_eval.sh", "serve_env.sh", "serve_policy.sh"])
def test_a_scripts_header_names_every_knob_it_checks_and_only_recipe_defaults(script):
    text = (ROOT / script).read_text()
    header = "".join(re.match(r"#!.*\n((?:#.*\n)+)", text).group(1))
    checked = knobs_checked(text, (ROOT / "common.sh").read_text()) | {"DRY_RUN"}  # common.sh checks it for all
    assert {name for name in checked if not re.search(rf"\b{name}\b", header)} == set()
    assert {name for name in re.findall(r"<([A-Z][A-Z0-9_]*)>", header) if not hasattr(recipe, name)} == set()
