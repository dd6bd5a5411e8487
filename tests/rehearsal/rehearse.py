"""Rehearse locally: train_lora.train() runs real optimizer steps on CPU, end to end through the real capture proxy.

    .venv/bin/python tests/rehearsal/rehearse.py                         # MAX_STEPS=3, SAVE_STEPS=2, temp workdir
    .venv/bin/python tests/rehearsal/rehearse.py --workdir W --crash-after-checkpoint 2   # dies after pushing it
    .venv/bin/python tests/rehearsal/rehearse.py --workdir W             # resumes from checkpoint-2, runs step 3
    .venv/bin/python tests/rehearsal/rehearse.py --real-chain            # every rollout through the real chain

The production code path of train_lora.py runs unchanged (settings_from_env -> train -> build_trainer, TRL's
AsyncGRPOTrainer and HarnessRolloutWorker, the merge-free weight sync, heartbeat, checkpoint push, resume), and so
does vLLM: the policy is served by vLLM 0.31's own engine (CPU build), started by serve_policy.sh in training mode,
and after every optimizer step the trainer syncs into it through TRL's own WeightTransferClient and vLLM's own
receiving path. Only what cannot exist on a CPU machine is substituted, each piece under tests/:

    LiquidAI/LFM2.5-2.6B  -> tests/tiny_lfm2.py: a random tiny Lfm2ForCausalLM + LFM2.5 chat template, built locally
                             (one attention head of 64: tests/engine.ENGINE_SHAPE says why); with --real-chain the
                             tiny agent policy (tests/agent_policy.py: same architecture, trained to call OpenCode's
                             write tool and to write the right answer about a third of the time), so rewards differ
    GPU 1                 -> the CPU (tests/engine: serve_policy.sh with CPU-only environment)
    NCCL                  -> gloo, in vLLM's NCCL weight-transfer modules (tests/engine/site/cpu_engine_plugin.py)
    env server + HF Sandbox + OpenCode -> sessions.py: scripted agent through the REAL OpenEnv capture proxy
        or, with --real-chain, the real chain as tests/test_chain.py runs it: `openenv harbor serve` (started by
        tests/chain/envserver.py) -> Harbor's Trial in the bubblewrap sandbox -> the real OpenCode -> the task's own
        verifier, on the synthetic fixture's prepared tasks, through the factory train_lora builds from ENV_URL
    the Hub               -> tests/hub_double.py: LocalHub in the workdir
    the dashboard Space   -> Trackio's local storage (TRACKIO_DIR), project named after the adapter repo
    GPU kernels           -> tests/trl_cpu_shims.py: sdpa attention, torch log-probs, no vLLM import check

After every sync (the cold one at each start too) the engine's logprobs for a fixed token sequence must equal the
trainer's policy's (tests/engine/sync_check.py): the step table shows that gap and how far the policy is from what a
sync that sent nothing, or sent the base, would have left served. The learning rate is REHEARSAL_LR, not the
recipe's: at 1e-6 a step moves no bf16 weight, and a check that cannot tell a sync from none would prove nothing.
Prints the step table (reward mean, loss, importance ratio, kl by staleness, clipped and unbounded tokens,
zero-contrast and bonus-only rows, the LoRA's update, learning rate, rollouts ended by budget, context or output cap,
sync ms, the check) and writes it to WORKDIR/report.json, with every finished rollout (train_rollouts' rollout log:
task, verifier reward, outcome, Harbor trial folder and whether it was kept). Exits 1 if any check failed.
`--no-sync` is the negative control benchmarks/learning_run.py runs: every sync sends nothing (TRL's client still
pauses and resumes the engine), so the engine keeps serving the base and every check after step 0 fails.
`--vllm-url` uses an engine that already serves WORKDIR/model (a test's, kept up across starts as run_job.sh keeps
vLLM up across trainer restarts); without it the rehearsal starts its own and stops it at the end. With
--smoke-report it ends as the smoke job does: smoke_report.py reads what the run left (train_log.json, rollouts.json,
the checkpoints downloaded back from the hub double) and writes WORKDIR/smoke_report.json, pushed to the hub double;
NO-GO exits 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

# One torch thread per process (this one, TRL's rollout child, the capture proxy), set before torch loads: the tiny
# model gains nothing from more, and OpenMP's spinning threads made a run take 170 s instead of 94 s on 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]

import engine  # noqa: E402

engine.importable()  # before TRL's weight-transfer client is imported: it imports vLLM's NCCL helpers

import httpx  # noqa: E402
from agent_policy import MAX_REPLY_TOKENS, agent_model  # noqa: E402
from chain.bucket import Bucket  # noqa: E402
from chain.envserver import EnvServer, missing  # noqa: E402
from engine.sync_check import AGENT_TOLERANCE, TOLERANCE, SyncCheck  # noqa: E402
from fake_sessions import write_task_list  # noqa: E402
from harbor_fixture import BUCKET, materialized  # noqa: E402
from hub_double import LocalHub  # noqa: E402
from sessions import FAULTS, ScriptedAgentSessionFactory, make_tasks  # noqa: E402
from stubs import procs  # noqa: E402
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402
from trl_cpu_shims import cpu_trainer_shims  # noqa: E402

import adapter_repo  # noqa: E402
import recipe  # noqa: E402
import smoke_report  # noqa: E402
import train_lora  # noqa: E402

ADAPTER_REPO = "rehearsal/LFM2.5-tiny-opencode-lora-RL"
# Not a credential: train_lora requires HF_TOKEN to be set, and LocalHub ignores it.
PLACEHOLDER_TOKEN = "hf_rehearsal_placeholder"
REHEARSAL_STEPS = 3
REHEARSAL_SAVE_STEPS = 2
REHEARSAL_TASKS = 4  # tasks the scripted sessions serve (and the list in WORKDIR/data names)
# The rehearsal's learning rate, not the recipe's 1e-6 (at which a step moves no bf16 weight, and no sync check could
# tell a sync from none): each step moves the served policy by 2-5 times the check's tolerance (1e-3: 0.032-0.060).
REHEARSAL_LR = 1.5e-3
# The tiny random model served in bf16 is not LFM2.5, and REHEARSAL_LR moves it 1,500 times as far a step: a rollout
# sampled one step before it is trained is that much further off-policy. Its per-sample importance ratio is checked
# against this band, not the recipe's 0.998-1.0 (seen 0.957-1.089 at 1.5e-3; tests/test_rehearsal.py asserts it).
REHEARSAL_RATIO_BAND = (0.85, 1.15)
# Two of the smoke verdict's limits describe the production chain, not these stand-ins; every other limit is the
# recipe's. `--faults all` fails one rollout of each kind among the first start's ~40 on purpose, a share no real smoke
# may have (recipe.SMOKE_MAX_UNSCORABLE). And the scripted agent sends its draft back as text decoded from random
# tiny-model tokens, which need not re-render to the sampled ids: nearly every rollout forks here (fork_frac 0.98
# seen). The product's fork fraction is measured on real OpenCode conversations (tests/test_chat_template.py,
# benchmarks/fork_frac.py) and judged by a real smoke run.
REHEARSAL_LIMITS = {"unscorable": 0.5, "fork": 1.0}
CRASH_MOVED = "moved"  # --crash-after-checkpoint moved: after the first checkpoint whose step moved the adapter
FAULTS_SETTLE_S = 120  # how long --crash-after-checkpoint waits for the injected faults to reach the ledger
# --real-chain: 4 prepared train tasks (a group per step, one more in flight, one spare; TRL cycles through them).
# Groups of 2 rollouts (--group), one group in flight, not the recipe's 8 and 32: every trained row is OpenCode's whole
# prompt (~6k tokens of the agent policy's tokenizer), each costs far more than a real one on CPU, and 32 concurrent
# sandboxes would swamp a 2-core machine; the code path is the same at any size. The data each task's healthcheck
# pulls from the loopback bucket:
CHAIN_TASKS = {"n_medium": 2, "n_hard": 2, "n_test": 1}
CHAIN_GROUP = 2
CHAIN_TABLE = b"x\n4.0\n4.4\n"


class StepLog(TrainerCallback):
    """Collects each step's logged metrics and heartbeat; rewrites the report after each step.

    Writing per step means a rehearsal killed on purpose still leaves the steps it ran on disk.
    """

    def __init__(self, report_file: Path, heartbeat_file: Path, check: SyncCheck, resumed_from: int | None) -> None:
        self.report_file, self.heartbeat_file, self.check = report_file, heartbeat_file, check
        self.resumed_from = resumed_from
        self.logs: dict[int, dict[str, Any]] = {}
        self.heartbeats: list[int] = []
        self.trainer: Any = None  # set when train_lora builds it (watch_trainer)
        self.trained: dict[int, dict[str, Any]] = {}

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any) -> None:
        # train_callbacks.Heartbeat runs before this one, so the file already says this step.
        self.heartbeats.append(int(self.heartbeat_file.read_text().split()[0]))
        # The groups trained so far (TRL's ids: offsets from this start's prompt index), as the checkpoint saved
        # right after this step sees them; logged before that save, so a run killed after its push still has them.
        self.trained[state.global_step] = {
            "start": self.trainer.rollout_worker._loop_kwargs["dataset_start_index"],
            "groups": sorted(self.trainer._trained_groups)}

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **_: Any) -> None:
        if logs and "loss" in logs:
            self.logs[state.global_step] = dict(logs)
            self.report_file.write_text(json.dumps(self.report(), indent=2))

    def rows(self) -> list[dict[str, Any]]:
        """One row per optimizer step: reward mean, loss, importance ratio (TRL's mean, the token-weighted one), what
        says whether it learns (train_metrics: STEP_METRICS), and the sync after it, checked."""
        syncs = {record.step: record for record in self.check.records}
        rows = []
        for step, logs in sorted(self.logs.items()):
            sync = syncs.get(step)
            seconds = logs.get("perf/weight_sync_s")
            rows.append({"step": step, "reward": logs.get("reward"), "loss": logs.get("loss"),
                         "ratio": logs.get("ratio"), **{key: logs.get(key) for key in STEP_METRICS},
                         "sync_ms": None if seconds is None else seconds * 1000,
                         "served_vs_policy": sync.served_vs_policy if sync else None,
                         "moved": sync.moved if sync else None, "from_base": sync.from_base if sync else None,
                         "sync_ok": bool(sync and sync.ok)})
        return rows

    def report(self) -> dict[str, Any]:
        return {"resumed_from": self.resumed_from, "steps": self.rows(), "heartbeats": self.heartbeats,
                "syncs": [asdict(record) for record in self.check.records], "served_dtype": recipe.SERVE_DTYPE,
                "rollouts": self.rollout_counts(), "rollout_log": self.rollout_log(), "trained_groups": self.trained,
                "logs": self.logs, "tolerance": self.check.tolerance}

    def rollout_log(self) -> list[dict[str, Any]]:
        """Every finished rollout of every start in this workdir, as the guard logged it (train_rollouts)."""
        log = recipe.work_file(self.heartbeat_file, recipe.ROLLOUT_LOG_NAME)
        return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []

    def rollout_counts(self) -> dict[str, Any] | None:
        """The rollout guard's counts, read where README says they are: rollouts.json next to the heartbeat."""
        ledger = recipe.work_file(self.heartbeat_file, recipe.LEDGER_NAME)
        return json.loads(ledger.read_text()) if ledger.is_file() else None


class CrashingHub(LocalHub):
    """LocalHub that kills the rehearsal (and the processes it started) right after checkpoint-N is pushed, or the
    first checkpoint whose step moved the adapter (`moved`: a real-chain start's groups may all lack contrast).

    With faults injected it first waits (up to FAULTS_SETTLE_S) until the rollout guard's ledger counts all of
    them, so that a killed run's ledger always holds every injected failure, whatever order rollouts finished in.
    """

    def __init__(self, root: Path, crash_after: str, proxy: subprocess.Popen, ledger: Path, faults: int,
                 own_engine: engine.Engine | None) -> None:
        super().__init__(root)
        self.crash_after = crash_after
        self.proxy, self.ledger, self.faults, self.own_engine = proxy, ledger, faults, own_engine

    def crashes_after(self, repo_id: str, paths: list[str]) -> str | None:
        """The checkpoint this commit completes, if the run dies after it: checkpoint-N, or with `moved` the first
        whose step moved the adapter (its trainer_state.json logs TRL's grad_norm > 0 for that step)."""
        done = [path.split("/")[0] for path in paths if path.endswith(f"/{adapter_repo.COMPLETE_MARKER}")]
        if not done or not done[0].startswith("checkpoint-"):
            return None
        if self.crash_after != CRASH_MOVED:
            return done[0] if done[0] == f"checkpoint-{self.crash_after}" else None
        step = int(done[0].removeprefix("checkpoint-"))
        state = recipe.read_json(self.root / repo_id / done[0] / "trainer_state.json") or {"log_history": []}
        moved = any(row.get("step") == step and row.get("grad_norm", 0.0) > 0 for row in state["log_history"])
        return done[0] if moved else None

    def faults_counted(self) -> bool:
        counts = recipe.read_json(self.ledger)
        return bool(counts) and counts["unscorable_total"] + counts["timed_out"] >= self.faults

    def create_commit(self, repo_id: str, operations: list[object], **kwargs: Any) -> Any:
        info = super().create_commit(repo_id, operations, **kwargs)
        if checkpoint := self.crashes_after(repo_id, [getattr(op, "path_in_repo", "") for op in operations]):
            deadline = time.monotonic() + FAULTS_SETTLE_S
            while not self.faults_counted() and time.monotonic() < deadline:
                time.sleep(0.2)
            print(f"rehearse: {checkpoint} pushed; crashing on purpose (SIGKILL)", flush=True)
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGKILL)
            os.kill(self.proxy.pid, signal.SIGKILL)
            if self.own_engine is not None:  # an engine a test started (--vllm-url) outlives the crash, as in a job
                self.own_engine.stop()
            os.kill(os.getpid(), signal.SIGKILL)
        return info


def watch_trainer(log: StepLog, check: SyncCheck, sync: bool = True) -> None:
    """Attach the step log and the sync check to the trainer train_lora builds (its build_trainer, wrapped here);
    `sync=False` (the --no-sync control) makes that trainer's weight-transfer client send nothing."""
    build = train_lora.build_trainer

    def build_and_watch(*args: Any, **kwargs: Any) -> Any:
        trainer = build(*args, **kwargs)
        log.trainer = trainer
        trainer.add_callback(log)
        if not sync:
            trainer.weight_transfer.send_weights = lambda weights: None
        check.attach(trainer)
        return trainer

    train_lora.build_trainer = build_and_watch


def start_capture_proxy(llm_url: str, log_file: Path) -> tuple[subprocess.Popen, str]:
    """Launch the real OpenEnv capture proxy CLI on loopback (it probes vLLM before serving)."""
    port = procs.free_port()
    command = [sys.executable, "-m", "openenv.core.harness.capture.server", "--llm-url", llm_url,
               "--model", recipe.SERVED_MODEL_NAME, "--host", recipe.LOOPBACK, "--port", str(port)]
    with log_file.open("ab") as log:
        proxy = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    return proxy, f"http://{recipe.LOOPBACK}:{port}"


def wait_for_proxy(proxy: subprocess.Popen, url: str, log_file: Path, timeout_s: float = 180) -> None:
    """Block until the proxy serves and has measured vLLM as trainable (`tokens`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proxy.poll() is not None:
            raise RuntimeError(f"capture proxy exited with {proxy.returncode}; see {log_file}")
        try:
            level = httpx.get(f"{url}/health", timeout=5).json().get("capture_level")
        except httpx.HTTPError:
            time.sleep(0.5)
            continue
        if level != "tokens":
            raise RuntimeError(f"capture proxy measured capture_level={level!r}, not 'tokens'; see {log_file}")
        return
    raise RuntimeError(f"capture proxy did not answer /health within {timeout_s:.0f} s; see {log_file}")


def run_env(workdir: Path, model_dir: Path, vllm_url: str, env_url: str, args: argparse.Namespace,
            task_data: str) -> dict[str, str]:
    """The environment train_lora.settings_from_env() reads, pointing at the local stand-ins."""
    return {
        "MODEL": str(model_dir), "ADAPTER_REPO": ADAPTER_REPO, "HF_TOKEN": PLACEHOLDER_TOKEN,
        "MAX_STEPS": str(args.max_steps), "SAVE_STEPS": str(args.save_steps), "VLLM_URL": vllm_url,
        "ENV_URL": env_url, "OUTPUT_DIR": str(workdir / "outputs"),
        "HEARTBEAT_FILE": str(workdir / recipe.HEARTBEAT_NAME),
        "RESUME": "1", "WEIGHT_SYNC": args.weight_sync, "DEVICE": "cpu",
        # Trackio logs locally (TRACKIO_DIR, default ~/.cache/huggingface/trackio): a rehearsal never makes a Space.
        "REPORT_TO": "trackio", "DASHBOARD_SPACE": "local", "JOB_ID": os.environ.get("JOB_ID", workdir.name),
        "TASK_DATA": task_data, "LEARNING_RATE": recipe.shell_value(args.lr),
    }


def chain_tasks(workdir: Path) -> tuple[Path, Path, list[str]]:
    """The fixture's prepared tasks (made once per workdir, so a resumed start serves the same): the tasks folder,
    the frozen lists' folder (TASK_DATA) and the train task names."""
    fixture = workdir / "fixture"
    if not (fixture / "tasks" / "train").is_dir():
        materialized(fixture, **CHAIN_TASKS)
    names = sorted(p.name for p in (fixture / "tasks" / "train" / "tasks").iterdir())
    return fixture / "tasks", fixture / "data", names


# A rehearsal started apart (for a test): its own process group, reaped whatever happens, JOB_ID after the workdir's
# parent (tests/stubs/procs.py).
run_apart = functools.partial(procs.run_apart, Path(__file__))


# The step table's metric columns beyond reward, loss and ratio (train_metrics and train_rollouts; docs/training.md
# "Reading the dashboard"): heading, metric, format.
COLUMNS = (("ratio_tok", "ratio/token_mean", ".4f"), ("kl", "kl", ".2g"), ("kl_fresh", "kl/fresh", ".2g"),
           ("kl_old", "kl/old", ".2g"), ("clip_f", "clip_ratio/fresh", ".3f"), ("clip_o", "clip_ratio/old", ".3f"),
           ("unb", "clip_ratio/unbounded_total", ".0f"), ("zero_c", "group/zero_contrast_frac", ".2f"),
           ("zero_a", "sample/zero_advantage_frac", ".2f"), ("bonus", "group/bonus_only_frac", ".2f"),
           ("lora_upd", "lora/update_norm", ".2g"), ("lr", "learning_rate", ".0e"),
           ("budget", "rollout/budget_stopped_total", ".0f"), ("ctx", "rollout/context_exhausted_total", ".0f"),
           ("cut", "rollout/cut_total", ".0f"))
STEP_METRICS = tuple(metric for _, metric, _ in COLUMNS)


def print_table(rows: list[dict[str, Any]], tolerance: float) -> None:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(f"{'step':>4} {'reward':>7} {'loss':>9} {'ratio':>7} " + " ".join(f"{h:>{max(len(h), 7)}}"
                                                                              for h, _, _ in COLUMNS)
          + f" {'sync ms':>8}  served vs policy (moved, from base): <= {tolerance}")
    for row in rows:
        print(f"{row['step']:>4} {fmt(row['reward'], '.3f'):>7} {fmt(row['loss'], '.5f'):>9} "
              f"{fmt(row['ratio'], '.4f'):>7} " + " ".join(f"{fmt(row[m], spec):>{max(len(h), 7)}}"
                                                           for h, m, spec in COLUMNS)
              + f" {fmt(row['sync_ms'], '.1f'):>8}  {fmt(row['served_vs_policy'], '.4f')} "
              f"({fmt(row['moved'], '.4f')}, {fmt(row['from_base'], '.4f')}) {'ok' if row['sync_ok'] else 'FAILED'}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=os.environ.get("REHEARSAL_DIR") or None,
                        help="model, hub, outputs and logs; reuse it to resume (env REHEARSAL_DIR, default: temp dir)")
    parser.add_argument("--max-steps", type=int, default=int(os.environ.get("MAX_STEPS", REHEARSAL_STEPS)))
    parser.add_argument("--save-steps", type=int, default=int(os.environ.get("SAVE_STEPS", REHEARSAL_SAVE_STEPS)))
    parser.add_argument("--weight-sync", default=os.environ.get("WEIGHT_SYNC", "merge_free"))
    parser.add_argument("--crash-after-checkpoint", default="", metavar=f"N|{CRASH_MOVED}",
                        help="SIGKILL the rehearsal right after checkpoint-N is pushed (to rehearse resume); "
                             f"{CRASH_MOVED}: after the first checkpoint whose step moved the adapter (a trained "
                             "group had reward contrast)")
    parser.add_argument("--faults", default="", metavar="LIST",
                        help=f"fail the first rollouts, one per listed class: 'all' = {','.join(FAULTS)}")
    parser.add_argument("--smoke-report", action="store_true",
                        help="end as the smoke job does: smoke_report.json from what the run left (exit 1 on NO-GO)")
    parser.add_argument("--vllm-url", default=None,
                        help="an engine in training mode already serving WORKDIR/model (default: start one)")
    parser.add_argument("--real-chain", action="store_true",
                        help="every rollout through the real env server, Harbor trial, OpenCode and verifier, "
                             "sampled from the tiny agent policy (needs root, bubblewrap and the image root)")
    parser.add_argument("--group", type=int, default=CHAIN_GROUP,
                        help="--real-chain: rollouts per GRPO group (one group in flight)")
    parser.add_argument("--lr", type=float, default=REHEARSAL_LR, help="the learning rate")
    parser.add_argument("--no-sync", action="store_true",
                        help="negative control: every sync sends nothing, the engine keeps the base weights")
    args = parser.parse_args(argv)
    if args.crash_after_checkpoint not in ("", CRASH_MOVED) and not args.crash_after_checkpoint.isdigit():
        parser.error(f"--crash-after-checkpoint takes a step number or {CRASH_MOVED}, not "
                     f"{args.crash_after_checkpoint!r}")
    if args.real_chain and (args.faults or args.smoke_report):
        parser.error("--real-chain takes neither --faults (tests/test_chain.py injects real-chain faults) nor "
                     "--smoke-report (run those with the scripted sessions)")
    if args.real_chain and missing():
        parser.error(f"--real-chain needs {missing()}")
    if not args.vllm_url and engine.missing():
        parser.error(f"the engine needs {engine.missing()}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rehearsal-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / "model"
    if args.real_chain and not (model_dir / "config.json").is_file():
        shutil.copytree(agent_model(), model_dir)
    elif not (model_dir / "config.json").is_file():
        engine.save_engine_model(model_dir)
    own_engine = None if args.vllm_url else engine.Engine(model_dir, workdir / "engine")
    vllm_url = args.vllm_url or own_engine.start(wait=False)
    if args.real_chain:
        tasks, task_data, names = chain_tasks(workdir)
    else:
        task_data = write_task_list(workdir / "data", [task["task_name"] for task in make_tasks(REHEARSAL_TASKS)])
    bucket = env_server = proxy = None
    try:
        if own_engine is not None:
            own_engine.wait()
        else:  # a test's engine, maybe still loading
            engine.wait_ready(vllm_url)
        # Each server probes vLLM before it serves.
        if args.real_chain:
            bucket = Bucket(BUCKET, {f"user__{name}": {"table.csv": CHAIN_TABLE} for name in names})
            env_server = EnvServer(workdir / "chain", tasks / "train", vllm_url, bucket.url,
                                   max_output_tokens=MAX_REPLY_TOKENS)
            # The trainer's sessions find the server's trial folders by openenv's rule, as in the job (one environment).
            os.environ["OPENENV_HARBOR_TRIALS_DIR"] = str(env_server.trials)
            recipe.NUM_GENERATIONS = recipe.MAX_INFLIGHT_ROLLOUTS = args.group  # read when train_lora builds it
            proxy = env_server.start(wait=False)
            env_url = env_server.url
        else:
            proxy, env_url = start_capture_proxy(vllm_url, workdir / "capture.log")
        settings = train_lora.settings_from_env(run_env(workdir, model_dir, vllm_url, env_url, args, str(task_data)))
        faults = FAULTS if args.faults == "all" else tuple(f for f in args.faults.split(",") if f)
        ledger = recipe.work_file(settings.heartbeat_file, recipe.LEDGER_NAME)
        hub = (CrashingHub(workdir / "hub", args.crash_after_checkpoint, proxy, ledger, len(faults), own_engine)
               if args.crash_after_checkpoint else LocalHub(workdir / "hub"))
        resumable = (adapter_repo.complete_checkpoints(hub.list_repo_files(ADAPTER_REPO))
                     if (workdir / "hub" / ADAPTER_REPO).is_dir() else [])
        (workdir / "sandboxes").mkdir(exist_ok=True)
        recipe.keep_ledger_aside(ledger.parent)  # as run_job.sh does: a later start keeps the earlier start's counts
        # --real-chain: None, so train_lora builds the production factory (harbor_sessions) from ENV_URL.
        factory = None if args.real_chain else functools.partial(
            ScriptedAgentSessionFactory, env_url, llm_url=vllm_url, model=recipe.SERVED_MODEL_NAME,
            agent_step_limit=recipe.MAX_TOOL_CALLING_ITERATIONS, sandbox_root=str(workdir / "sandboxes"),
            faults=faults, num_tasks=REHEARSAL_TASKS)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        check = SyncCheck(functools.partial(engine.prompt_logprobs, vllm_url), vocab,
                          AGENT_TOLERANCE if args.real_chain else TOLERANCE)
        log = StepLog(workdir / "report.json", Path(settings.heartbeat_file), check,
                      resumable[-1] if resumable else None)
        watch_trainer(log, check, sync=not args.no_sync)
        if env_server:
            env_server.wait()
        else:
            wait_for_proxy(proxy, env_url, workdir / "capture.log")
        print(f"rehearse: workdir {workdir}; vLLM {vllm_url}; "
              f"{'env server' if env_server else 'capture proxy'} {env_url} ({time.monotonic() - started:.0f} s)",
              flush=True)
        with cpu_trainer_shims():
            train_lora.train(settings, factory=factory, api=hub)  # TRL builds its own WeightTransferClient
    finally:
        if env_server:
            env_server.stop()
            bucket.stop()
        elif proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=30)
        if own_engine is not None:
            own_engine.stop()
    (workdir / "report.json").write_text(json.dumps(log.report(), indent=2))
    print_table(log.rows(), check.tolerance)
    for line in log.rollout_log() if args.real_chain else []:
        print(f"rehearse: rollout {line['task']}: {line['outcome']}, reward {line['reward']}, trial "
              f"{Path(line['trial']).name if line['trial'] else '-'} {'kept' if line['trial_kept'] else 'removed'}")
    counts = log.report()["rollouts"] or {}
    print(f"rehearse: rollouts {counts.get('rollouts')} finished, {counts.get('scored')} scored "
          f"({counts.get('timed_out')} timed out), unscorable {counts.get('unscorable')}")
    print(f"rehearse: done in {time.monotonic() - started:.0f} s; report {workdir / 'report.json'}")
    if check.failed():
        first = check.failed()[0]
        print(f"rehearse: {len(check.failed())} sync(s) left the engine serving another policy than the trainer's: "
              f"after step {first.step}, logprobs differ by up to {first.served_vs_policy:.4f} (> {check.tolerance})",
              file=sys.stderr)
        return 1
    if args.smoke_report:
        stage = {"stage": "resume" if resumable else "train", "ok": True,
                 "seconds": round(time.monotonic() - started), "note": f"trainer finished {args.max_steps} steps"}
        pushed = smoke_report.checkpoint_steps(args.max_steps, args.save_steps)
        expect = {"steps": args.max_steps, "checkpoints": pushed,
                  "resume_at": resumable[-1] if resumable else None, "eval": False, "ratio": REHEARSAL_RATIO_BAND,
                  # Scripted sessions start no sandbox: there is no per-rollout setup to time.
                  "sandbox": False, "limits": REHEARSAL_LIMITS}
        smoke = smoke_report.collect(hub, ADAPTER_REPO, workdir, [stage], expect)
        (workdir / smoke_report.REPORT_PATH).write_text(json.dumps(smoke, indent=1, sort_keys=True))
        smoke_report.push(hub, ADAPTER_REPO, smoke)
        print(smoke_report.render(smoke))
        return 0 if smoke["verdict"] == "GO" else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
