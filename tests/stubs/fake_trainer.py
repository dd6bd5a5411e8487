"""Stand-in for train_lora.py in run_job.sh tests: records its environment, then behaves per STUB_TRAIN.

ok (default): writes this start's rollout ledger ({output_dir}) next to HEARTBEAT_FILE, touches the heartbeat once
  per step for MAX_STEPS steps and exits 0.
stall: starts a grandchild `sleep`, touches the heartbeat once and hangs. crash: exits 7 with a traceback.
slow_first_step: a healthy run whose first step takes 3 x STALL_SECONDS: rollouts keep finishing (the rollout
  child rewrites rollouts.json next to the heartbeat) while the trainer waits for samples and calls the real
  train_rollouts.refresh_heartbeat, as train_lora's worker does from TRL's check_health; then it steps and exits 0.
wedged: rollouts keep finishing but the trainer is stuck (never waits, never steps): must be killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import recipe  # the bundle's own, copied beside this stand-in

KEYS = ("CUDA_VISIBLE_DEVICES", "ADAPTER_REPO", "MAX_STEPS", "VLLM_URL", "ENV_URL", "SANDBOX",
        "SAVE_STEPS", "STOP_AFTER_STEP", "OUTPUT_DIR")


def main() -> None:
    env = os.environ
    with open(env["STUB_LOG"], "a") as log:
        fields = " ".join(f"{k}={env.get(k)}" for k in KEYS)
        log.write(f"trainer {fields} HF_TOKEN_SET={bool(env.get('HF_TOKEN'))}\n")
    heartbeat = Path(env["HEARTBEAT_FILE"])
    mode = env.get("STUB_TRAIN", "ok")
    if mode == "crash":
        print("Traceback (most recent call last):\nRuntimeError: simulated trainer crash", flush=True)
        sys.exit(7)
    if mode in ("slow_first_step", "wedged"):
        rollouts_finishing(heartbeat, mode == "slow_first_step", 3 * float(env["STALL_SECONDS"]))
    if mode == "stall":
        subprocess.Popen(["sleep", "300"])
        heartbeat.touch()
        print("step 1 done; now hanging", flush=True)
        time.sleep(300)
    ledger = recipe.work_file(heartbeat, recipe.LEDGER_NAME)  # this start's rollout child begins its own ledger
    ledger.write_text(json.dumps({"output_dir": env["OUTPUT_DIR"]}))
    for step in range(int(env["MAX_STEPS"])):
        time.sleep(0.1)
        heartbeat.touch()
        print(f"step {step + 1}", flush=True)


def rollouts_finishing(heartbeat: Path, waiting: bool, seconds: float) -> None:
    """`seconds` without an optimizer step while a rollout finishes every 0.2 s."""
    heartbeat.write_text(f"0 {time.time():.0f}\n")  # train_lora.Heartbeat at train begin
    ledger = recipe.work_file(heartbeat, recipe.LEDGER_NAME)
    try:
        from train_rollouts import refresh_heartbeat
    except ImportError:  # a bundle without the guard: the trainer's waiting is invisible to the watchdog
        refresh_heartbeat = None
    print("waiting for the first group of rollouts", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.2)
        ledger.write_text("{}")
        if waiting and refresh_heartbeat:
            refresh_heartbeat(heartbeat, ledger)


if __name__ == "__main__":
    main()
