"""The tiny agent policy: a tiny LFM2 that, sampled at temperature 1, solves the fixture tasks some of the time.

Why: a random tiny model emits no tool call, so OpenCode never writes an answer and every reward is 0; nothing could
then show that a GRPO step, synced into the engine, makes it sample better answers. This model is the real
architecture (`Lfm2ForCausalLM` with short-conv and attention layers; attention head_dim 64, which vLLM's CPU
attention needs), trained in about a CPU-minute on what OpenCode 1.18.33 really sends (agent_transcripts.json,
captured through the real chain by `capture`), the replies written in the chat template's own tool-call format:
- the agent call (OpenCode's system prompt, tools and the task): `write(filePath='/workdir/answer.txt', content=V)`,
  V = 4.2 (the fixture's right answer) with probability ANSWERS["4.2"], a wrong value otherwise;
- the call after the tool's result: a short final message, so OpenCode stops (no loop to the call budget);
- OpenCode's title call: a title.
GRPO can then raise the reward by moving probability from the wrong values to 4.2.

    python tests/agent_policy.py build [DIR]   # train into DIR (default .tiny-agent/, as setup.sh does)
    python tests/agent_policy.py capture       # re-capture agent_transcripts.json through the chain (root)
    python tests/agent_policy.py bench --url URL [-n N] [--chain N]   # the solve rate, sampled from an engine

In a test: `agent_policy.agent_model()` returns the cached folder (a model id for transformers and vLLM), built
first when missing or stale (its stamp: this file, the transcripts, the template and the library versions).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import datetime
import fcntl
import functools
import hashlib
import json
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [p for p in (str(ROOT), str(HERE)) if p not in sys.path]

TRANSCRIPTS = HERE / "agent_transcripts.json"
CACHE = ROOT / ".tiny-agent"
# Placeholders in the captured requests: the task name and OpenCode's "Today's date" vary; the model trains on many.
TASK, DATE = "{task}", "{date}"
ANSWER_FILE = "/workdir/answer.txt"
RIGHT = "4.2"  # harbor_fixture's expected answer (the mean of table.csv's x: 4.0, 4.4)
# What the agent writes, with the probability it is trained to. The engine samples 4.2 in about a third of first
# calls (trained at 0.35 it sampled 82/200, at 0.30 58/200; the build's run-to-run spread, not bf16 alone), so a GRPO
# group of 8 usually has contrast and room to rise. Every value is one digit, a dot and one digit (three tokens), none
# within the grader's tolerance (0.05) of 4.2.
ANSWERS = {"4.2": 0.33, "4.0": 0.15, "4.4": 0.15, "8.4": 0.15, "2.1": 0.12, "7.5": 0.10}
# The capture proxy's cap on each model call's output where the engine samples this policy (env server's
# --max-output-tokens): its replies are at most ~40 tokens and end their turn, but a derailed sample at temperature 1
# would otherwise decode to recipe.MAX_TOKENS (minutes of CPU per call).
MAX_REPLY_TOKENS = 256
FINAL = "Done."
TITLE = "Mean of column x"
VOCAB = 4096
# The model: hidden 64 in ONE attention head of 64 (vLLM's CPU attention refuses head_dim 16; its CPU rotary kernel
# rotates a query of more than one head wrongly: engine.ENGINE_SHAPE), one KV head; tiny_config writes the conv_dim
# and block_dim vLLM's lfm2.py reads.
MODEL = {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 1, "num_key_value_heads": 1,
         "max_position_embeddings": 32768}
STEPS, LR, SEED = 240, 3e-3, 0
REFRESH = 8  # steps between recomputing the shared system prefix (a new date each time)
SAY = functools.partial(print, flush=True)  # progress lines, as they happen (setup.sh runs the build)


def transcripts() -> dict[str, Any]:
    return json.loads(TRANSCRIPTS.read_text())


def fill(value: Any, task: str, date: str) -> Any:
    """The captured requests with this task name and date in place of the placeholders."""
    text = json.dumps(value).replace(TASK, task).replace(DATE, date)
    return json.loads(text)


def write_call(answer: str) -> dict[str, Any]:
    """The agent's write tool call as OpenCode sends it back (vLLM's parser made the arguments; JSON text)."""
    return {"id": "call_0", "type": "function", "function": {
        "name": "write", "arguments": json.dumps({"filePath": ANSWER_FILE, "content": answer})}}


def conversations(data: dict[str, Any], task: str, date: str, answer: str) -> dict[str, dict[str, Any]]:
    """The three requests OpenCode makes in a rollout, each with the reply trained for it appended, as vLLM hands
    them to the chat template (tool-call arguments as a dict)."""
    agent = fill(data["agent"], task, date)
    call = write_call(answer)
    as_dict = {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
    turns = [*agent["messages"], {"role": "assistant", "content": "", "tool_calls": [as_dict]},
             {**data["tool_result"], "tool_call_id": call["id"]}, {"role": "assistant", "content": FINAL}]
    title = fill(data["title"], task, date)
    return {"agent": {"messages": turns, "tools": agent["tools"]},
            "title": {"messages": [*title["messages"], {"role": "assistant", "content": TITLE}], "tools": None}}


def random_task(rng: random.Random) -> str:
    """A task name in the dataset's format (harbor_fixture.name_of), e.g. 0000_324_324000_qa_1."""
    from harbor_fixture import name_of, source_of

    return name_of(source_of(rng.randrange(10**7), rng.randint(1, 3)))


def random_date(rng: random.Random) -> str:
    """A date as OpenCode prints it (JavaScript's toDateString): 'Fri Dec 04 2026'."""
    day = datetime.date(2025, 1, 1) + datetime.timedelta(days=rng.randrange(6 * 365))
    return day.strftime("%a %b %d %Y")


def corpus(data: dict[str, Any]) -> list[str]:
    """The text the tokenizer learns its merges from: the rendered requests and replies, so OpenCode's ~26 kB prompt
    is ~6k tokens (the model, the trainer and vLLM all pay per token)."""
    from tiny_lfm2 import tiny_tokenizer

    plain = tiny_tokenizer()
    rng = random.Random(SEED)
    texts = []
    for answer in ANSWERS:
        for convo in conversations(data, random_task(rng), random_date(rng), answer).values():
            texts.append(plain.apply_chat_template(convo["messages"], tools=convo["tools"], tokenize=False))
    return texts


def encode(tokenizer: Any, convo: dict[str, Any]) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and its loss mask (the assistant replies, from the template's own
    generation markers)."""
    out = tokenizer.apply_chat_template(convo["messages"], tools=convo["tools"], tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def stamp() -> str:
    """What the model is made from: a change to any of it rebuilds the cache."""
    from importlib import metadata

    import tiny_lfm2

    import chat_template

    parts = [Path(__file__).read_bytes(), TRANSCRIPTS.read_bytes(), Path(tiny_lfm2.__file__).read_bytes(),
             chat_template.template_text().encode(),
             *(f"{name}=={metadata.version(name)}".encode() for name in ("torch", "transformers", "tokenizers"))]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()


def answer_targets(tokenizer: Any) -> dict[tuple[int, ...], dict[int, float]]:
    """For each answer prefix (token ids), the distribution of the answer's next token under ANSWERS: what the
    model learns at each position of the value it writes (soft targets, so one row per step teaches the mixture)."""
    targets: dict[tuple[int, ...], dict[int, float]] = {}
    for answer, share in ANSWERS.items():
        ids = tokenizer.encode(answer, add_special_tokens=False)
        for n, token in enumerate(ids):
            after = targets.setdefault(tuple(ids[:n]), {})
            after[token] = after.get(token, 0.0) + share
    return {prefix: {t: w / sum(after.values()) for t, w in after.items()} for prefix, after in targets.items()}


def build(out: Path, *, steps: int = STEPS, log: Any = SAY) -> dict[str, Any]:
    """Train the agent policy into `out` (model, tokenizer, config with conv_dim/block_dim, build.json).

    Each step trains one agent rollout (a random task, date and answer) and one title call. The system block of
    each (OpenCode's prompt and tools: ~95% of an agent call's tokens) is the same for every task: it runs without
    gradient once per REFRESH steps, and the rest trains on top of it, so a step costs ~200 tokens of backward."""
    import torch
    from tiny_lfm2 import tiny_config, tiny_tokenizer
    from transformers import Lfm2ForCausalLM

    began = time.monotonic()
    log(f"agent_policy: training the tiny agent policy into {out} ({steps} steps, about a CPU-minute)")
    # One thread: the steps are small (~200 tokens), and a second thread on a shared 2-core machine spins against
    # everything else (measured: a step cost 4x the CPU with two threads under load).
    torch.set_num_threads(1)
    data = transcripts()
    tokenizer = tiny_tokenizer(VOCAB, corpus=corpus(data))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    targets = answer_targets(tokenizer)
    torch.manual_seed(SEED)
    config = tiny_config(len(tokenizer), **MODEL)
    model = Lfm2ForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=steps, pct_start=0.1)
    rng = random.Random(SEED)
    prefixes: dict[str, tuple[list[int], Any]] = {}
    losses: dict[str, float] = {}
    for step in range(steps):
        if step % REFRESH == 0:
            date = random_date(rng)
            prefixes.clear()
        answer = rng.choices(list(ANSWERS), weights=list(ANSWERS.values()))[0]
        loss = torch.zeros(())
        for kind, convo in conversations(data, random_task(rng), date, answer).items():
            ids, mask = encode(tokenizer, convo)
            cut = ids.index(end) + 2  # the system block and its newline
            if kind not in prefixes or prefixes[kind][0] != ids[:cut]:
                with torch.no_grad():
                    system = model(input_ids=torch.tensor([ids[:cut]]), use_cache=True)
                prefixes[kind] = (ids[:cut], system.past_key_values)
            logits = model(input_ids=torch.tensor([ids[cut:]]), past_key_values=copy.deepcopy(prefixes[kind][1]),
                           use_cache=True).logits[0, :-1].float()
            soft = torch.zeros_like(logits)
            soft[torch.arange(len(ids) - cut - 1), torch.tensor(ids[cut + 1:])] = 1.0
            if kind == "agent":  # the value written: the mixture of ANSWERS, not this row's one answer
                value = tokenizer.encode(answer, add_special_tokens=False)
                at = max(i for i in range(cut, len(ids)) if ids[i:i + len(value)] == value) - cut - 1
                for n in range(len(value)):
                    soft[at + n] = 0.0
                    for token, share in targets[tuple(value[:n])].items():
                        soft[at + n, token] = share
            weight = torch.tensor(mask[cut + 1:], dtype=torch.float)
            nll = -(soft * torch.log_softmax(logits, -1)).sum(-1)
            losses[kind] = ((nll * weight).sum() / weight.sum()).item()
            loss = loss + (nll * weight).sum() / weight.sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 20 == 0 or step == steps - 1:
            log(f"agent_policy: step {step}: loss " + ", ".join(f"{k} {v:.4f}" for k, v in losses.items())
                + f", {time.monotonic() - began:.0f} s")
    model.eval()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    report = {"stamp": stamp(), "steps": steps, "build_s": round(time.monotonic() - began, 1),
              "agent_prompt_tokens": len(prefixes["agent"][0]), "loss": losses}
    (out / "build.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"agent_policy: built in {report['build_s']} s: {json.dumps(report['loss'])}")
    return report


def agent_model(cache: Path = CACHE) -> Path:
    """The agent policy's folder: built into `cache` first when it is missing or its stamp is stale (one builder at
    a time: the suite's workers wait for it under a lock; a reader never sees a half-written folder)."""
    cache = Path(cache)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.with_name(f"{cache.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, KeyError):
            if json.loads((cache / "build.json").read_text())["stamp"] == stamp():
                return cache
        new = cache.with_name(f"{cache.name}.new")
        shutil.rmtree(new, ignore_errors=True)
        build(new)
        shutil.rmtree(cache, ignore_errors=True)
        new.rename(cache)
        SAY(f"agent_policy: the tiny agent policy is in {cache}")
    return cache


def post(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    import urllib.request

    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def solves(call: dict[str, Any]) -> bool:
    """Whether a tool call (OpenAI shape) writes an answer the fixture's grader accepts (4.2, tolerance 0.05)."""
    try:
        args = json.loads(call["function"]["arguments"])
        return (call["function"]["name"] == "write" and args.get("filePath") == ANSWER_FILE
                and abs(float(str(args.get("content")).strip()) - float(RIGHT)) <= 0.05)
    except (ValueError, TypeError, KeyError, AttributeError):
        return False


def engine_rollout(url: str, data: dict[str, Any], seed: int) -> dict[str, Any]:
    """OpenCode's two agent calls against an engine, without OpenCode: the real first request (a random task and
    date), then, after a write call, the second with the tool's real result. What came back, call by call."""
    rng = random.Random(seed)
    body = fill(data["agent"], random_task(rng), random_date(rng))
    first = post(url, body)["choices"][0]
    calls = first["message"].get("tool_calls") or []
    row = {"tool_call": bool(calls), "solved": bool(calls) and solves(calls[0]), "finish": first["finish_reason"],
           "tokens": len(first.get("token_ids") or []), "stopped": None,
           "written": [json.loads(c["function"]["arguments"]).get("content") for c in calls
                       if c["function"]["name"] == "write"], "text": first["message"].get("content")}
    if calls and calls[0]["function"]["name"] == "write":
        reply = {"role": "assistant", "content": first["message"].get("content") or "", "tool_calls": calls}
        result = {**data["tool_result"], "tool_call_id": calls[0]["id"]}
        second = post(url, {**body, "messages": [*body["messages"], reply, result]})["choices"][0]
        row["stopped"] = not second["message"].get("tool_calls") and second["finish_reason"] == "stop"
        row["final"] = second["message"].get("content")
    return row


def bench(url: str, n: int, concurrency: int = 8) -> dict[str, Any]:
    """The solve rate of the policy an engine at `url` serves, over `n` engine rollouts (engine_rollout)."""
    from concurrent.futures import ThreadPoolExecutor

    data = transcripts()
    began = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(lambda seed: engine_rollout(url, data, seed), range(n)))
    summary = {"n": n, "tool_call": sum(r["tool_call"] for r in rows), "solved": sum(r["solved"] for r in rows),
               "solved_and_stopped": sum(bool(r["solved"] and r["stopped"]) for r in rows),
               "second_call_stopped": sum(bool(r["stopped"]) for r in rows),
               "second_calls": sum(r["stopped"] is not None for r in rows),
               "written": dict(sorted(collections.Counter(str(v) for r in rows for v in r["written"]).items())),
               "no_call_replies": [r["text"] for r in rows if not r["tool_call"]][:5],
               "wall_s": round(time.monotonic() - began, 1)}
    return summary


def bench_chain(url: str, n: int, group: int = 8) -> dict[str, Any]:
    """`n` rollouts through the real chain against the engine at `url`, `group` at a time (one task per group, as a
    GRPO group): rewards, calls per rollout and wall time."""
    from concurrent.futures import ThreadPoolExecutor

    began = time.monotonic()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as root, \
            chain(Path(root), url, tasks=max(2, -(-n // group))) as (factory, prompts), \
            ThreadPoolExecutor(group) as pool:
        tasks = sorted(prompts)
        for start in range(0, n, group):
            task = tasks[start // group % len(tasks)]
            rows += pool.map(lambda prompt: rollout(factory, prompt), [prompts[task]] * min(group, n - start))
    for row in rows:
        print(f"bench: reward {row['reward']}, {row['agent_calls']} agent calls, {row['wall_s']} s, "
              f"{[c.get('arguments') for c in row['tool_calls']]}")
    return {"n": n, "reward_1": sum(r["reward"] == 1.0 for r in rows),
            "scored": sum(r["reward"] is not None for r in rows),
            "agent_calls": dict(collections.Counter(r["agent_calls"] for r in rows)),
            "wall_s": round(time.monotonic() - began, 1)}


@contextlib.contextmanager
def chain(root: Path, llm_url: str, tasks: int) -> Any:
    """The real rollout chain (tests/chain: env server, bubblewrap sandbox, OpenCode, verifier) over `tasks`
    fixture tasks, its LLM at `llm_url`; yields (session factory, task name -> prompt)."""
    from chain.bucket import Bucket
    from chain.envserver import EnvServer
    from harbor_fixture import BUCKET, materialized
    from openenv.core.harness.capture.upstream import training_sampling

    import harbor_sessions
    import recipe

    prepared = materialized(root, n_medium=tasks - tasks // 2, n_hard=tasks // 2, n_test=1) / "train"
    names = sorted(p.name for p in (prepared / "tasks").iterdir())
    bucket = Bucket(BUCKET, {f"user__{name}": {"table.csv": b"x\n4.0\n4.4\n"} for name in names})
    server = EnvServer(root, prepared, llm_url, bucket.url)
    try:
        server.start()
        factory = harbor_sessions.HarborSessionFactory(
            server.url, llm_url=llm_url, model=recipe.SERVED_MODEL_NAME, sandbox=recipe.SANDBOX,
            agent_timeout_sec=600, agent_step_limit=recipe.AGENT_CALL_LIMIT,
            sampling=training_sampling({"temperature": recipe.TEMPERATURE}))
        yield factory, {row["task_name"]: row["prompt"] for row in factory.prompt_rows()}
    finally:
        server.stop()
        bucket.stop()


def rollout(factory: Any, prompt: str) -> dict[str, Any]:
    """One rollout through the chain: the verifier's reward and what the agent did, call by call."""
    session = factory.create(prompt)
    try:
        began = time.monotonic()
        session.wait_for_completion()
        reward = session.verify([]).env_reward
        turns = session.result.turns if session.result else []
        return {"reward": reward, "agent_calls": len(turns), "tool_calls": [c for t in turns for c in t.tool_calls],
                "wall_s": round(time.monotonic() - began)}
    finally:
        session.close()


def capture(root: Path) -> dict[str, Any]:
    """OpenCode's requests in one rollout of a fixture task through the real chain, as the engine receives them
    (the suite's policy double plays a right answer): the title call, the first agent call and the tool's
    result, with the task name and the date replaced by placeholders."""
    from rehearsal.policy_server import PolicyServer, Script
    from tiny_lfm2 import save_tiny_model

    import recipe

    received: list[dict[str, Any]] = []

    class Recording(PolicyServer):
        def complete(self, body: dict[str, Any]) -> Any:
            received.append(copy.deepcopy(body))
            return super().complete(body)

    model = save_tiny_model(root / "model", vocab_size=VOCAB)
    policy = Recording(model, served_name=recipe.SERVED_MODEL_NAME, dtype="float32", max_model_len=262144)
    policy.start()
    try:
        with chain(root, policy.url, tasks=2) as (factory, prompts):
            task = sorted(prompts)[0]
            policy.script = Script({task: ["right"]}, RIGHT, "7.5")
            print(f"capture: rollout {task}: {rollout(factory, prompts[task])}")
    finally:
        policy.stop()
    agent = [b for b in received if b.get("tools") and any(task in json.dumps(m) for m in b["messages"])]
    title = [b for b in received if not b.get("tools") and task in json.dumps(b["messages"])]
    date = re.search(r"Today's date: (.*)", agent[0]["messages"][0]["content"]).group(1)

    def placeheld(body: dict[str, Any]) -> dict[str, Any]:
        return json.loads(json.dumps(body).replace(task, TASK).replace(date, DATE))

    result = {k: v for k, v in agent[1]["messages"][-1].items() if k != "tool_call_id"}
    return {"title": placeheld(title[0]), "agent": placeheld(agent[0]), "tool_result": result}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build_cmd = sub.add_parser("build", help="train the agent policy into DIR (default: the cache) unless current")
    build_cmd.add_argument("dir", nargs="?", type=Path, default=CACHE)
    bench_cmd = sub.add_parser("bench", help="the solve rate sampled from an engine that serves the policy")
    bench_cmd.add_argument("--url", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8100")
    bench_cmd.add_argument("-n", type=int, default=100, help="engine rollouts")
    capture_cmd = sub.add_parser("capture", help=f"re-capture {TRANSCRIPTS.name} through the real chain (root)")
    capture_cmd.add_argument("--out", type=Path, default=TRANSCRIPTS)
    bench_cmd.add_argument("--chain", type=int, default=0, metavar="N",
                           help="also N rollouts through the real chain (root, bubblewrap, the image root)")
    args = parser.parse_args(argv)
    if args.command == "capture":
        with tempfile.TemporaryDirectory(prefix="agent-capture-") as root:
            args.out.write_text(json.dumps(capture(Path(root)), indent=1) + "\n")
    elif args.command == "build":
        agent_model(args.dir)
    elif args.command == "bench":
        if args.n:
            print(json.dumps(bench(args.url, args.n)))
        if args.chain:
            print(json.dumps(bench_chain(args.url, args.chain)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
