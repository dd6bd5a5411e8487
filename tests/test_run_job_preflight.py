"""run_job.sh's checks before anything starts (tests/run_job_harness.py): the image's vLLM and pip check, bad input
stopping the job in one line (the same line as the eval jobs'), and each script's header as its environment
reference."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys

import pytest
from run_job_harness import ROOT, SECRET, make_job, own_site, run_job, stub_log

import recipe


@pytest.fixture
def job(tmp_path):
    return make_job(tmp_path)


def test_vllm_outside_version_window_stops_job_with_versions(job):
    own_site(job, "0.30.0")
    out = run_job(job)
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[-1]
    assert message.endswith(f"vllm 0.30.0 is installed, the recipe needs vllm=={recipe.VLLM_VERSION}: run in the "
                            f"{recipe.VLLM_IMAGE} image")
    assert stub_log(job) == []  # refused before anything is installed


def test_vllm_build_with_local_version_suffix_passes(job):
    own_site(job, f"{recipe.VLLM_VERSION}+cu130")  # how a CUDA build may name itself
    out = run_job(job, FINAL_EVAL="0")
    assert out.returncode == 0, out.stderr
    assert f"holding vllm=={recipe.VLLM_VERSION}+cu130 torch==" in out.stdout  # the install step's line


def test_pip_check_break_stops_job_naming_the_package(job):
    broken = "vllm 0.31.0 has requirement fastapi<0.137.0,>=0.133.0, but you have fastapi 0.165.0."
    out = run_job(job, STUB_PIP_CHECK=broken)
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[-1]
    assert "the install step broke a requirement: " + broken in message and "PIP_CHECK_ACCEPTED" in message
    assert not any(line.startswith(("prepare_tasks", "vllm")) for line in stub_log(job))


def test_accepted_pip_check_break_passes(job):
    out = run_job(job, FINAL_EVAL="0", STUB_PIP_CHECK="vllm 0.31.0 has requirement mcp<3.0.0,>=2.0.0, but you have "
                                                       "mcp 1.30.0.")
    assert out.returncode == 0, out.stderr


def test_vllm_api_server_not_importing_stops_job(job):
    (own_site(job) / "vllm" / "entrypoints" / "openai" / "api_server.py").write_text("import mcp.nonexistent\n")
    out = run_job(job)
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[-1]
    assert "vLLM's API server does not import after the install step" in message and "mcp.nonexistent" in message
    assert not any(line.startswith(("prepare_tasks", "vllm")) for line in stub_log(job))


# --- bad input stops the job at once, with one line ----------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"HF_TOKEN": ""}, "HF_TOKEN is not set"),
        ({"ADAPTER_REPO": ""}, "ADAPTER_REPO is not set"),
        ({"ADAPTER_REPO": "not a repo"}, "ADAPTER_REPO='not a repo' is not a valid repo id"),
        ({"SANDBOX": "modal"}, "SANDBOX='modal' is not offered"),
        # Issue 42: daytona and e2b run with their key; without it the job stops before it installs anything.
        ({"SANDBOX": "daytona", "E2B_API_KEY": "e2b_x"},
         "SANDBOX=daytona needs DAYTONA_API_KEY (or DAYTONA_JWT_TOKEN and DAYTONA_ORGANIZATION_ID): set it"),
        ({"SANDBOX": "e2b", "DAYTONA_API_KEY": "dtn_x"}, "SANDBOX=e2b needs E2B_API_KEY: set it"),
        ({"REPORT_TO": "tensorboard"}, "REPORT_TO='tensorboard' is not offered (the job installs Trackio and no other "
                                       "dashboard): use REPORT_TO=trackio (or none)"),
        ({"ADAPTER_REPO": "you/x--y"}, "ADAPTER_REPO='you/x--y' is not a valid repo id (the Hub's rule"),
        ({"MAX_STEPS": "3", "SAVE_STEPS": "5"}, "SAVE_STEPS=5 is out of range: use 1..3 (a checkpoint before"),
        ({"WATCH_INTERVAL": "3600", "STALL_SECONDS": ""}, "WATCH_INTERVAL=3600 is out of range: use at most 300"),
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
    ({"SANDBOX": "daytona"}, "SANDBOX=daytona needs DAYTONA_API_KEY"),
    ({"REPORT_TO": "tensorboard"}, "REPORT_TO='tensorboard' is not offered"),
    ({"JOB_ID": ""}, "cannot derive the job's public host"),
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
    assert "SPACE_HOST=custom--8000.hf.jobs" in next(line for line in out.stdout.splitlines() if "DATASETS=" in line)


# --- each script's header (or the docs page it names) is its environment reference ------------------------------------
def knobs_checked(script: str, common: str) -> set[str]:
    """The knobs a script's text checks (env_knobs, job_knobs), itself or through the common.sh functions it calls."""
    functions = dict(re.findall(r"^([a-z_]+)\(\) \{(.*?)^\}", common, re.M | re.S))
    found: set[str] = set()
    seen: set[str] = set()
    texts = [script]
    while texts:
        text = texts.pop().replace("\\\n", " ")
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
    reference = header + "".join((ROOT / doc).read_text() for doc in set(re.findall(r"docs/\w+\.md", header)))
    assert {name for name in checked if not re.search(rf"\b{name}\b", reference)} == set()
    assert {name for name in re.findall(r"<([A-Z][A-Z0-9_]*)>", header) if not hasattr(recipe, name)} == set()
