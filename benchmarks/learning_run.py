"""The learning run (issue 40 item 6): do GRPO steps, synced into vLLM's engine, make it sample better answers?

train_lora.train() runs through the whole real chain (tests/rehearsal/rehearse.py --real-chain: the env server,
Harbor's Trial in the bubblewrap sandbox, the real OpenCode, the task's verifier, vLLM 0.31's own CPU engine serving
the tiny agent policy of tests/agent_policy.py, synced after every step through TRL's WeightTransferClient on the gloo
stand-in, each sync checked), then eval_adapter.evaluate() scores the base against the trained adapter on the
fixture's held-out test tasks, the adapter hot-loaded into the engine in LoRA mode. It prints the step table and ends:

    learning: reward A -> B over N steps; pass@1 base X adapter Y (McNemar p=P)

The goal: the mean reward of the last quarter of steps above the first quarter's, and the adapter better than the base
with McNemar p < GOAL_P. The exit status says whether it was met (0) or not (1). `--no-sync` is the negative control:
every sync sends nothing, the engine samples the base throughout (no rise), and the adapter, trained only on samples
of the base, stays within the importance-ratio clip of it. `--quick` runs a few steps and no eval (the suite's check
that the script runs: tests/test_rehearsal_chain.py's resumed start); its exit status says whether every sync served
the trainer's policy, and its last line how many of those checks had the power to fail a sync that sends nothing.

    nice -n 5 .venv/bin/python benchmarks/learning_run.py               # training 27 min, eval 8 (2 cores at load 20)
    nice -n 5 .venv/bin/python benchmarks/learning_run.py --no-sync     # the control: must not meet the goal
    .venv/bin/python benchmarks/learning_run.py --quick [--vllm-url URL --workdir W]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "rehearsal")]

# The run's learning rate, group size and steps, chosen for what 2 shared cores allow in an hour. An in-process GRPO
# simulation of the agent policy's first call (exact answer probabilities, Adam, groups of 8) took the right answer's
# share of the six trained values 0.38 -> 0.72 in 8 steps at lr 1e-3 and 0.38 -> 0.86 at 2e-3; through the chain 2e-3
# moved the policy too far a step from step 6 (ratio 0.67, then 0.35) and 6e-3 wrecked it in one. A group of 4 has
# contrast in 75% of groups at a solve rate of 0.3 (1 - 0.3^4 - 0.7^4) and costs half a group of 8's trainer time.
LR = 2e-3
GROUP = 8
STEPS = 16
EVAL_TASKS = 40  # held-out test tasks, each scored once by the base and once by the adapter (paired: McNemar)
EVAL_CONCURRENCY = 8
GOAL_P = 0.05
QUICK = {"steps": 2, "group": 2}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="the run's folder, kept (default: a new temp folder)")
    parser.add_argument("--steps", type=int, help=f"optimizer steps (default {STEPS}; --quick {QUICK['steps']})")
    parser.add_argument("--group", type=int, help=f"rollouts a group (default {GROUP}; --quick {QUICK['group']})")
    parser.add_argument("--lr", type=float, default=LR, help=f"learning rate (default {LR}; --quick: the rehearsal's)")
    parser.add_argument("--eval-tasks", type=int, default=EVAL_TASKS)
    parser.add_argument("--no-sync", action="store_true", help="negative control: the engine keeps the base weights")
    parser.add_argument("--quick", action="store_true",
                        help="a few steps at the rehearsal's learning rate, no eval (the suite's run; a --workdir "
                             "with a checkpoint resumes from it, up to --steps)")
    parser.add_argument("--vllm-url", help="an engine in training mode already serving WORKDIR/model (with --quick)")
    parser.add_argument("--eval-only", action="store_true", help="the eval of a trained --workdir (after a crash)")
    args = parser.parse_args(argv)
    if args.quick:  # None: rehearse.py's REHEARSAL_LR; the suite's check is that the path runs, not that it learns
        args.lr = None
    defaults = QUICK if args.quick else {"steps": STEPS, "group": GROUP}
    args.steps, args.group = args.steps or defaults["steps"], args.group or defaults["group"]
    if args.vllm_url and not (args.quick and args.workdir):
        parser.error("--vllm-url goes with --quick and --workdir (the eval needs its own engine in LoRA mode)")
    if args.steps < 4 and not args.quick:
        parser.error("--steps must be at least 4: the goal compares the first quarter of steps with the last")
    return args


def prepare(workdir: Path, eval_tasks: int) -> None:
    """The fixture's tasks (the rehearsal's train tasks and `eval_tasks` held-out ones) and the agent policy's copy,
    where rehearse.py --real-chain looks for them."""
    if not (workdir / "fixture" / "tasks" / "train").is_dir():
        from harbor_fixture import materialized
        from rehearse import CHAIN_TASKS

        materialized(workdir / "fixture", **{**CHAIN_TASKS, "n_test": eval_tasks})
    if not (workdir / "model" / "config.json").is_file():
        from agent_policy import agent_model

        shutil.copytree(agent_model(), workdir / "model")


def train(args: argparse.Namespace, workdir: Path) -> tuple[int, dict[str, Any], str]:
    """rehearse.py --real-chain for the run's steps, in its own process group; its exit status, report and output.
    Not imported: its trainer's imports cost a --quick run 11 CPU-seconds in this process (benchmarks/LOG.md)."""
    from stubs.procs import run_apart

    extra = ["--real-chain", "--max-steps", str(args.steps), "--save-steps", str(args.steps),
             "--group", str(args.group), *(["--lr", repr(args.lr)] if args.lr is not None else []),
             *(["--no-sync"] if args.no_sync else []), *(["--vllm-url", args.vllm_url] if args.vllm_url else [])]
    done = run_apart(ROOT / "tests" / "rehearsal" / "rehearse.py", workdir, *extra, env={},
                     timeout=args.steps * 600 + 900)
    report = workdir / "report.json"
    return done.returncode, json.loads(report.read_text()) if report.is_file() else {}, done.stdout


def step_table(report: dict[str, Any], tolerance: float) -> list[dict[str, Any]]:
    """One row per step: reward mean, the scorable share of the rollouts finished since the step before (the guard's
    counts, logged per interval), zero-contrast groups, ratio, kl, sync seconds and the sync check (served vs policy,
    and whether it had power: moved by more than the tolerance since the sync before)."""
    rows = []
    syncs = {s["step"]: s for s in report.get("syncs", [])}
    for step, logs in sorted(((int(k), v) for k, v in report.get("logs", {}).items())):
        finished = logs.get("rollout/finished_total", 0)
        failed = logs.get("rollout/unscorable_total", 0) + logs.get("rollout/timed_out_total", 0)
        sync = syncs.get(step, {})
        rows.append({"step": step, "reward": logs.get("reward"),
                     "scorable": (finished - failed) / finished if finished else None,
                     "zero_contrast": logs.get("group/zero_contrast_frac"), "ratio": logs.get("ratio"),
                     "kl": logs.get("kl"), "fork_frac": logs.get("rollout/fork_frac"),
                     "sync_s": logs.get("perf/weight_sync_s"), "served_vs_policy": sync.get("served_vs_policy"),
                     "moved": sync.get("moved"), "ok": bool(sync.get("ok")),
                     "power": (sync.get("moved") or 0) > tolerance,
                     "contrast": logs.get("group/zero_contrast_frac", 1.0) < 1.0})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print("| step | reward mean | scorable | zero-contrast groups | ratio | kl | sync s | served vs policy | moved "
          "| check |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        check = ("ok" if r["ok"] else "FAILED") + ("" if r["power"] else
                                                    " (no power)" if r["contrast"] else " (no contrast: no power)")
        print(f"| {r['step']} | {fmt(r['reward'], '.3f')} | {fmt(r['scorable'], '.2f')} | "
              f"{fmt(r['zero_contrast'], '.2f')} | {fmt(r['ratio'], '.4f')} | {fmt(r['kl'], '.2g')} | "
              f"{fmt(r['sync_s'], '.2f')} | {fmt(r['served_vs_policy'], '.4f')} | {fmt(r['moved'], '.4f')} | {check} |")


def evaluate(workdir: Path, concurrency: int) -> dict[str, Any]:
    """eval_adapter.evaluate: the base and the final adapter on every held-out task, through the real chain, the
    adapter hot-loaded into the engine in LoRA mode (serve_policy.sh with LORA=1). The base's cells go to an engine of
    their own: vLLM 0.31's CPU LoRA path computes a base request batched with an adapter request with the adapter
    (next-token logprob of the answer's first token, this run's adapter: base alone -0.469, adapter -0.152, base
    batched with adapter requests -0.153), which made the base look as good as the adapter."""
    import engine
    from agent_policy import MAX_REPLY_TOKENS
    from chain.bucket import Bucket
    from chain.envserver import EnvServer
    from harbor_fixture import BUCKET
    from hub_double import LocalHub
    from rehearse import ADAPTER_REPO, CHAIN_TABLE

    import adapter_repo
    import eval_adapter
    import recipe

    tasks = workdir / "fixture" / "tasks" / "test"
    names = sorted(p.name for p in (tasks / "tasks").iterdir())
    vllm = engine.Engine(workdir / "model", workdir / "eval-engine", lora=True)
    base = engine.Engine(workdir / "model", workdir / "eval-base-engine")
    bucket = Bucket(BUCKET, {f"user__{name}": {"table.csv": CHAIN_TABLE} for name in names})
    server = EnvServer(workdir / "eval-chain", tasks, vllm.url, bucket.url, max_output_tokens=MAX_REPLY_TOKENS)
    try:
        vllm.start(wait=False)
        base.start()
        vllm.wait()
        server.start()  # it probes vLLM before it serves
        os.environ.update(ENV_URL=server.url, VLLM_URL=vllm.url)
        factory, tasks, lora = eval_adapter.servers(recipe.SANDBOX)

        def routed(task_index: int, model: str) -> Any:
            return factory(task_index, model, **({"llm_url": base.url} if model == recipe.SERVED_MODEL_NAME else {}))

        doc = eval_adapter.evaluate(LocalHub(workdir / "hub"), ADAPTER_REPO, adapter_repo.FINAL, routed, tasks, lora,
                                    workdir / "eval", concurrency=concurrency)
    finally:
        server.stop()
        vllm.stop()
        base.stop()
        bucket.stop()
    return doc["summary"]


def quarters(rewards: list[float]) -> tuple[float, float]:
    """Mean reward of the first and of the last quarter of the steps (at least one step each)."""
    quarter = max(1, len(rewards) // 4)
    return statistics.fmean(rewards[:quarter]), statistics.fmean(rewards[-quarter:])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="learning-run-"))
    workdir.mkdir(parents=True, exist_ok=True)
    prepare(workdir, 1 if args.quick else args.eval_tasks)
    if args.eval_only:
        status, report, output = 0, json.loads((workdir / "report.json").read_text()), ""
    else:
        status, report, output = train(args, workdir)
    print(output, end="")
    rows = step_table(report, report.get("tolerance", 0.0))
    print_table(rows)
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    if len(rewards) < args.steps - (report.get("resumed_from") or 0):  # a resumed start trains the steps left
        print(f"learning: the trainer ran {len(rewards)} of {args.steps} steps (rehearse exited {status}); "
              f"see {workdir}", file=sys.stderr)
        return 1
    first, last = quarters(rewards)
    forks = [r["fork_frac"] for r in rows if r["fork_frac"] is not None]
    trained_s = time.monotonic() - began
    lr = args.lr if args.lr is not None else next(iter(report.get("logs", {}).values()), {}).get("learning_rate")
    print(f"learning: trained {args.steps} steps of {args.group} rollouts at lr {lr:g}"
          f"{' WITHOUT syncing the engine (--no-sync)' if args.no_sync else ''} in {trained_s:.0f} s; "
          f"rollout/fork_frac mean {statistics.fmean(forks) if forks else float('nan'):.3f} over {len(forks)} steps")
    if args.quick:
        served, powered = all(r["ok"] for r in rows), sum(r["power"] for r in rows)
        print(f"learning: reward {first:.3f} -> {last:.3f} over {len(rewards)} steps; no eval (--quick); "
              f"{'every sync served the policy' if served else 'a sync did NOT serve the policy'} ({powered} of "
              f"{len(rows)} checks moved enough to fail a sync that sends nothing)")
        return 0 if served and status == 0 else 1
    summary = evaluate(workdir, EVAL_CONCURRENCY)
    base, adapter, paired = summary["base"], summary["adapter"], summary["paired"]
    (workdir / "learning_run.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                           "steps": rows, "eval": summary}, indent=1))
    print(f"eval: base {base['correct']}/{base['scored']}, adapter {adapter['correct']}/{adapter['scored']} "
          f"(unscorable {base['unscorable']} and {adapter['unscorable']}); paired {paired['tasks']}: only base "
          f"{paired['only_base']}, only adapter {paired['only_adapter']}; {time.monotonic() - began:.0f} s in all")
    print(f"learning: reward {first:.3f} -> {last:.3f} over {len(rewards)} steps; pass@1 base "
          f"{base['pass_at_1']:.3f} adapter {adapter['pass_at_1']:.3f} (McNemar p={paired['mcnemar_p']:.3g})")
    met = last > first and adapter["pass_at_1"] > base["pass_at_1"] and paired["mcnemar_p"] < GOAL_P
    print(f"learning: goal {'MET' if met else 'NOT met'} (last quarter's reward above the first's, and the adapter "
          f"above the base with p < {GOAL_P}); workdir {workdir}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
