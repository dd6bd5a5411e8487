"""The rehearsal (issue 9): train_lora.train() on CPU, end to end through the real capture proxy, sampling from vLLM's
own engine (tests/engine), which the trainer syncs into after every step through TRL's own weight-transfer client.

The policy double (policy_server.py, which tests/test_chain.py still plays scripted agents with) is checked first
against the real things that consume it (OpenEnv's endpoint probe, the tokenizer's template). One engine serves the
module, started once, as run_job.sh keeps vLLM up across trainer restarts: the scripted agent's sessions through the
real capture proxy; the sync check (tests/engine/sync_check.py) passing a real sync and failing one that sends nothing
and one that sends the base; then the rehearsal itself, twice in one workdir: with one rollout failure of each class
injected, killed right after checkpoint-2 is pushed; then restarted, which must resume there and train step 3 only,
and end as the smoke job does, with a go/no-go report read from what the two starts left. (One pair of starts covers
what an uninterrupted run does too: each start goes through the same train_lora.train(); the README's plain
`rehearse.py` differs only in being neither killed nor faulted.)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import engine
import pytest
import torch
from engine.sync_check import TOLERANCE
from huggingface_hub import ModelCard
from openenv.core.harness.capture.validate_llm import validate_llm
from peft import PeftModel
from safetensors.torch import load_file
from tiny_lfm2 import save_tiny_model, tiny_model
from transformers import AutoModelForCausalLM

import adapter_repo
import dashboard
import recipe
import smoke_report

engine.require()

REHEARSAL = Path(__file__).resolve().parent / "rehearsal"
sys.path.insert(0, str(REHEARSAL))

from policy_server import ANSWER_FILE, OldestTaskFirst, PolicyServer, Script  # noqa: E402
from rehearse import ADAPTER_REPO, REHEARSAL_RATIO_BAND, run_apart, start_capture_proxy, wait_for_proxy  # noqa: E402
from sessions import ScriptedAgentSessionFactory, make_tasks, passes  # noqa: E402

MODEL = recipe.SERVED_MODEL_NAME
TRAIN_SAMPLING = {"temperature": recipe.TEMPERATURE, "top_p": recipe.TOP_P, "top_k": recipe.TOP_K}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module", autouse=True)
def starting_engine(tmp_path_factory: pytest.TempPathFactory):
    """vLLM in training mode (serve_policy.sh) on the rehearsal's model, in the rehearsal's workdir: started before the
    module's first test, so the policy double's tests run while it loads."""
    workdir = tmp_path_factory.mktemp("engine") / "rehearsal"
    runner = engine.Engine(engine.save_engine_model(workdir / "model"), workdir / "engine")
    runner.start(wait=False)
    yield runner
    runner.stop()


@pytest.fixture()
def vllm(starting_engine: engine.Engine) -> engine.Engine:
    starting_engine.wait()
    return starting_engine


@pytest.fixture(scope="module")
def server(model_dir: Path):
    """The policy double, served in recipe.SERVE_DTYPE."""
    policy = PolicyServer(model_dir, served_name=MODEL, dtype=recipe.SERVE_DTYPE, max_model_len=recipe.MAX_MODEL_LEN)
    policy.start()
    yield policy
    policy.stop()


def chat(server: PolicyServer, **body: object) -> dict:
    import httpx

    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **body}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=60)
    return {"status": response.status_code, **response.json()}


def test_policy_server_passes_openenv_probe_as_trainable(tmp_path: Path) -> None:
    """OpenEnv's own endpoint probe (what the capture proxy runs) grades it `tokens` with processed logprobs.

    The probe needs a top-2 logit gap it can measure, which a random model lacks: scale its (tied) embedding.
    """
    model, tokenizer = tiny_model()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(40)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    peaked = PolicyServer(tmp_path, served_name=MODEL, dtype=recipe.SERVE_DTYPE, max_model_len=recipe.MAX_MODEL_LEN)
    peaked.start()
    try:
        report = validate_llm(peaked.url, MODEL, check_tools=False)
    finally:
        peaked.stop()
    assert report.capture_level == "tokens", report.findings
    assert report.logprobs_mode == "processed", report.findings


def test_logprobs_are_the_models_at_the_requested_temperature(server: PolicyServer) -> None:
    temperature = 0.7
    reply = chat(server, max_tokens=8, temperature=temperature, logprobs=True, top_logprobs=0, return_token_ids=True)
    choice = reply["choices"][0]
    prompt, ids = reply["prompt_token_ids"], choice["token_ids"]
    assert prompt == server.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in ids]
    # Recompute with one full forward (no KV cache) of the served weights: same numbers.
    with torch.no_grad():
        logits = server.model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    expected = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
    served = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
    assert torch.allclose(served, expected, atol=0.05), (served, expected)
    assert bool((served < 0).all())


def test_scripted_agent_turns_are_the_tokenizers_rendering_with_the_models_logprobs(server: PolicyServer) -> None:
    write = {"type": "function", "function": {"name": "write", "parameters": {"type": "object", "properties": {
        "filePath": {"type": "string"}, "content": {"type": "string"}}}}}
    server.script = Script({"task-7": ["right"]}, "4.2", "7.5")
    try:
        messages = [{"role": "system", "content": "agent"}, {"role": "user", "content": "Solve task-7."}]
        first = chat(server, messages=messages, tools=[write], logprobs=True, return_token_ids=True, temperature=1.0)
        call = first["choices"][0]["message"]["tool_calls"][0]
        assert first["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["name"] == "write"
        assert json.loads(call["function"]["arguments"]) == {"filePath": ANSWER_FILE, "content": "4.2"}
        messages += [first["choices"][0]["message"], {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
        second = chat(server, messages=messages, tools=[write], logprobs=True, return_token_ids=True, temperature=1.0)
    finally:
        server.script = None
    assert second["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in second["choices"][0]["message"]
    ids = first["choices"][0]["token_ids"]
    assert server.tokenizer.decode(ids) == "<|tool_call_start|>[write(filePath='/workdir/answer.txt', content='4.2')]" \
                                           "<|tool_call_end|><|im_end|>"  # the lfm2 template's own rendering
    full = first["prompt_token_ids"] + ids
    assert second["prompt_token_ids"][:len(full)] == full  # the next turn extends it: TRL chains one sequence
    # Both turns' logprobs, recomputed in one full forward (no cache) of the served weights: the served numbers.
    sequence = second["prompt_token_ids"] + second["choices"][0]["token_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(server.model(input_ids=torch.tensor([sequence])).logits[0].float(), -1)
    for reply in (first, second):
        at, got = len(reply["prompt_token_ids"]), reply["choices"][0]["token_ids"]
        expected = logprobs[at - 1 + torch.arange(len(got)), torch.tensor(got)]
        served = torch.tensor([e["logprob"] for e in reply["choices"][0]["logprobs"]["content"]])
        assert torch.allclose(served, expected, atol=0.05), (served, expected)


def test_engine_serves_the_oldest_task_first_and_later_turns_before_first_ones() -> None:
    """So that a group's rollouts finish together, as they do on a batching GPU (see OldestTaskFirst)."""
    engine, served = OldestTaskFirst(), []
    engine.acquire("task A", depth=2)  # busy: everything below queues
    requests = [("task B", 2), ("task A", 2), ("task B", 4), ("task C", 4), ("task A", 4)]
    threads = []
    for task, depth in requests:
        def serve(task: str = task, depth: int = depth) -> None:
            engine.acquire(task, depth)
            served.append((task, depth))
            engine.release()
        threads.append(threading.Thread(target=serve))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while len(engine._waiting) < len(threads) and time.monotonic() < deadline:
            time.sleep(0.01)
    engine.release()
    for thread in threads:
        thread.join(10)
    assert served == [("task A", 4), ("task A", 2), ("task B", 4), ("task B", 2), ("task C", 4)]


def test_server_refuses_truncated_sampling_and_unknown_models_as_vllm_would(server: PolicyServer) -> None:
    reply = chat(server, max_tokens=2, top_p=0.9)
    assert reply["status"] == 400 and "top_p" in reply["error"]["message"]
    assert chat(server, max_tokens=2, model="intercepted")["status"] == 404
    too_long = chat(server, max_tokens=recipe.MAX_MODEL_LEN)
    assert too_long["status"] == 400 and "maximum context length" in too_long["error"]["message"]


def test_sync_check_passes_a_real_sync_and_fails_one_that_sends_nothing_or_the_base(vllm, tmp_path) -> None:
    """TRL's WeightTransferClient into the engine (vLLM's NCCL engine on gloo), three rounds, each then checked: the
    merge-free stream passes; a round that sends nothing and one that sends the base weights fail, each by about how
    far the trainer's policy was from what the engine was left serving."""
    out = subprocess.run([sys.executable, str(Path(engine.__file__).parent / "sync_check.py"), "--vllm-url", vllm.url,
                          "--model", str(vllm.model), "--json", str(tmp_path / "syncs.json")],
                         capture_output=True, text=True, timeout=300)
    print(out.stdout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    real, nothing, base = json.loads((tmp_path / "syncs.json").read_text()).values()
    assert real["ok"] and real["served_vs_policy"] <= TOLERANCE < real["from_base"]
    assert not nothing["ok"] and nothing["served_vs_policy"] == pytest.approx(nothing["moved"], abs=TOLERANCE)
    assert not base["ok"] and base["served_vs_policy"] == pytest.approx(base["from_base"], abs=TOLERANCE)
    assert "sends nothing" in out.stdout and "FAIL" in out.stdout


def test_sessions_run_the_agent_through_the_real_capture_proxy(vllm: engine.Engine, tmp_path: Path) -> None:
    proxy, url = start_capture_proxy(vllm.url, tmp_path / "capture.log")
    try:
        wait_for_proxy(proxy, url, tmp_path / "capture.log")
        factory = ScriptedAgentSessionFactory(url, llm_url=vllm.url, model=MODEL, sampling=TRAIN_SAMPLING,
                                              sandbox_root=str(tmp_path))
        rows = factory.prompt_rows()
        assert [r["prompt"][0]["content"] for r in rows] == [t["instruction"] for t in make_tasks(len(rows))]
        with pytest.raises(KeyError):
            factory.create([{"role": "user", "content": "a task the server does not serve"}])
        session = factory.create(rows[1]["prompt"], seed=0, episode_id="e1")
        try:
            assert session.wait_for_completion() == 0
            trace = session.fetch_training_trace()
            answer = (session.workdir / "answer.txt").read_bytes()
            reward = session.verify([]).env_reward
        finally:
            session.close()
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
    assert len(trace.turns) == 2  # draft + final answer, both captured as trainable agent turns
    for turn in trace.turns:
        assert turn.completion_token_ids and len(turn.per_token_logps) == len(turn.completion_token_ids)
        assert sum(turn.loss_mask) == len(turn.completion_token_ids)
        assert turn.metadata["sampling_params"]["temperature"] == recipe.TEMPERATURE
    assert reward == (1.0 if passes(answer, make_tasks(2)[1]) else 0.0)  # what the agent wrote, graded
    assert not session.workdir.exists()


def run_rehearsal(workdir: Path, vllm: engine.Engine, *extra: str, timeout: int = 280) -> subprocess.CompletedProcess:
    return run_apart(workdir, "--vllm-url", vllm.url, *extra, env={"MAX_STEPS": "3", "SAVE_STEPS": "2"},
                     timeout=timeout)


def assert_checked(syncs: list[dict], steps: list[int]) -> None:
    """Each of these syncs was checked (cold sync at a start, then one per step) and passed, and each after a step
    could have failed: the policy had moved from the last one and from the base by more than the tolerance."""
    assert [sync["step"] for sync in syncs] == steps
    assert all(sync["ok"] and sync["served_vs_policy"] <= TOLERANCE for sync in syncs), syncs
    assert all(sync["moved"] > TOLERANCE and sync["from_base"] > TOLERANCE for sync in syncs[1:]), syncs


# What `--faults all` injects (sessions.FAULTS, one rollout each), as train_rollouts counts it: unscorable by class.
# The eighth, the timed-out agent, is counted under `timed_out` instead: its captured turn is still trained.
FAULT_COUNTS = {"create": 1, "rollout": 2, "capture": 1, "empty_trace": 2, "verifier": 1}


def test_rehearsal_survives_each_rollout_failure_is_killed_after_checkpoint_2_and_resumes_for_step_3(vllm):
    """The README's rehearsal commands in one workdir, as a relaunched smoke job lives them.

    First start, with `--faults all`: the first rollouts fail once in each way a production rollout can (issue
    20); each costs that rollout only (unscorable, counted by class) and training goes on to checkpoint-2, where
    the run is SIGKILLed. Second start: resumes there, trains step 3 only, pushes the final adapter with its card,
    and ends as the smoke job does, with a GO read from what both starts left (their ledgers, the checkpoints
    read back, one Trackio run for steps 1-3).
    """
    workdir = vllm.model.parent  # the engine serves its model
    repo = workdir / "hub" / ADAPTER_REPO

    first = run_rehearsal(workdir, vllm, "--faults", "all", "--crash-after-checkpoint", "2")
    assert first.returncode == -signal.SIGKILL, first.stdout[-3000:]
    report = json.loads((workdir / "report.json").read_text())
    assert report["resumed_from"] is None
    assert [row["step"] for row in report["steps"]] == [1, 2]
    assert report["heartbeats"] == [1, 2]
    assert_checked(report["syncs"], [0, 1, 2])
    low, high = REHEARSAL_RATIO_BAND
    assert all(low < row["ratio"] < high and row["loss"] is not None for row in report["steps"])
    ledger = json.loads((workdir / recipe.LEDGER_NAME).read_text())  # the killed start's, as run_job.sh keeps it
    assert {k: n for k, n in ledger["unscorable"].items() if n} == FAULT_COUNTS, ledger
    assert ledger["timed_out"] == 1 and ledger["stopped"] is None
    assert ledger["scored"] >= 2 * recipe.NUM_GENERATIONS  # every trained sample came from a scored rollout
    pushed = {p.name for p in (repo / "checkpoint-2").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", adapter_repo.COMPLETE_MARKER} <= pushed
    assert not (repo / "adapter_model.safetensors").exists()  # killed before the final push
    [logs] = (repo / adapter_repo.LOGS_DIR).iterdir()  # the killed start's records, pushed with its checkpoint
    assert [row["step"] for row in json.loads((logs / recipe.TRAIN_LOG_NAME).read_text())["logs"]][-1] == 2
    assert json.loads((logs / recipe.LEDGER_NAME).read_text())["rollouts"] >= 2 * recipe.NUM_GENERATIONS
    assert (logs / recipe.ROLLOUT_LOG_NAME).read_text().count("\n") >= 2 * recipe.NUM_GENERATIONS
    checkpoint_2 = load_file(repo / "checkpoint-2" / "adapter_model.safetensors")
    position = json.loads((repo / "checkpoint-2" / "rollout_state.json").read_text())
    assert_relaunch_redoes_no_trained_group(position, report["trained_groups"]["2"])

    second = run_rehearsal(workdir, vllm, "--smoke-report")
    assert second.returncode == 0, second.stdout[-3000:]
    report = json.loads((workdir / "report.json").read_text())
    assert report["resumed_from"] == 2
    assert [row["step"] for row in report["steps"]] == [3] and report["heartbeats"] == [3]
    assert_checked(report["syncs"], [2, 3])  # the resumed start's cold sync sends checkpoint-2's policy
    table = second.stdout.split("served vs policy", 1)[1]
    assert " 3 " in table and "ok" in table and "FAILED" not in table
    for step in (2, 3):  # every save_steps, and the last step too: nothing trained is left unpushed
        pushed = {p.name for p in (repo / f"checkpoint-{step}").iterdir()}
        assert {"adapter_model.safetensors", adapter_repo.COMPLETE_MARKER} <= pushed
    state = json.loads((repo / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    trained = report["trained_groups"]["3"]  # the resumed start's, its ids offsets from checkpoint-2's position
    assert trained["start"] == position["prompt_index"]
    assert not set(trained["groups"]) & set(position["consumed_ahead"])  # nothing the first start consumed, again
    assert_relaunch_redoes_no_trained_group(json.loads((repo / "checkpoint-3" / "rollout_state.json").read_text()),
                                            trained)

    final = load_file(repo / "adapter_model.safetensors")
    lora_b = [k for k in final if "lora_B" in k]
    assert lora_b and all(final[k].abs().sum() > 0 for k in lora_b)  # PEFT starts every lora_B at zero
    assert any(not torch.equal(final[k], checkpoint_2[k]) for k in final)  # step 3 moved the adapter
    base = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32)
    ids = torch.tensor([[1, 3, 40, 41, 42, 43]])
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        tuned = PeftModel.from_pretrained(base, repo)
        assert not torch.equal(tuned(input_ids=ids).logits, base_logits)
    counts = check_smoke_report(workdir, second.stdout, ledger)
    assert_trackio_logged_three_steps(f"train-{workdir.parent.name}", counts)
    assert_training_repo_card(repo / "README.md")


def assert_relaunch_redoes_no_trained_group(state: dict, trained: dict) -> None:
    """A relaunch from this rollout_state.json hands out no group trained before it was saved: each trained group
    (TRL's id, an offset from its start's prompt index) lies below `prompt_index` or among `consumed_ahead`. TRL
    1.15 alone saves the lowest group not trained, so every group trained above an unscorable, stale-dropped or
    still running one was trained again."""
    ahead = {state["prompt_index"] + offset for offset in state["consumed_ahead"]}
    positions = [trained["start"] + group for group in trained["groups"]]
    assert [p for p in positions if p >= state["prompt_index"] and p not in ahead] == [], (state, trained)


def check_smoke_report(workdir: Path, stdout: str, first: dict) -> dict:
    """The smoke job's ending on the rehearsed run: the report read from what the two starts left (train_log.json,
    both starts' rollout counts, the checkpoints downloaded back from the hub double and checked), pushed.
    `first` is the killed start's ledger. Returns the rollout counts of both starts together."""
    report = json.loads((workdir / smoke_report.REPORT_PATH).read_text())
    assert json.loads((workdir / "hub" / ADAPTER_REPO / smoke_report.REPORT_PATH).read_text()) == report
    assert report["verdict"] == "GO" and report["reasons"] == [], report["reasons"]
    assert "SMOKE REPORT: GO" in stdout and "2:ok, 3:ok" in stdout
    resume = report["resume"]
    assert {k: resume[k] for k in ("verified", "from", "why")} == {
        "verified": True, "from": 2, "why": "resumed_from 2, state began at step 2, first step trained 3"}
    assert resume["consumed"] >= 2  # the first start's two trained groups at least; the position skipped them all
    training = report["training"]
    assert training["steps_done"] == 3 and training["step_s"]["max"] > 0
    low, high = REHEARSAL_RATIO_BAND
    assert low < training["ratio"]["min"] <= training["ratio"]["max"] < high
    assert [(c["step"], c["verified"]) for c in report["checkpoints"]] == [(2, True), (3, True)]
    counts = report["rollouts"]  # both starts: the killed one's counts were kept aside
    assert len(recipe.kept_ledgers(workdir)) == 1
    second = json.loads((workdir / recipe.LEDGER_NAME).read_text())
    # The second start injects nothing: the only rollouts it may count unscorable are those still running when its
    # training ended, which TRL closes (their capture is gone: empty_trace). Seen once in a fresh-clone CI run.
    assert {k for k, n in second["unscorable"].items() if n} <= {"empty_trace"}, second
    assert counts["unscorable"] == {c: n + second["unscorable"][c] for c, n in first["unscorable"].items()}, counts
    assert counts["scored"] == first["scored"] + second["scored"] >= 3 * recipe.NUM_GENERATIONS
    assert counts["cut"] >= 1  # the scripted agent asks for 6 tokens: the engine cuts its answers (finish "length")
    assert counts["stopped"] is None
    return counts


# Beyond TRL's own: the recipe's counts (train_rollouts, train_metrics), the ratio and kl it judges and splits by age
# (no row is old enough here for the `old` half), the groups' contrast, the LoRA's movement.
RECIPE_METRICS = ("rollout/finished_total", "rollout/unscorable_total", "rollout/timed_out_total",
                  "rollout/forked_total", "rollout/tool_calls_mean", "rollout/budget_stopped_total",
                  "rollout/context_exhausted_total", "rollout/cut_total", "ratio/sample_min", "ratio/sample_max",
                  "ratio/token_mean", "kl/fresh", "clip_ratio/fresh", "clip_ratio/unbounded_total",
                  "group/zero_contrast_frac", "group/bonus_only_frac", "sample/zero_advantage_frac",
                  "lora/update_norm", "lora/b_norm")
TRL_METRICS = ("loss", "reward", "ratio", "kl", "perf/weight_sync_s", "perf/step_s", "sample/staleness_mean",
               "sample/staleness_max", "sample/time_in_queue_s")


def assert_trackio_logged_three_steps(run: str, ledger: dict) -> None:
    """Read the rehearsal's metrics back from Trackio's local storage (TRACKIO_DIR, set in conftest.py): both
    starts log to one run; the dashboard's rollout counts must agree with train_rollouts' ledgers (`ledger`, both
    starts' counts together)."""
    from trackio.sqlite_storage import SQLiteStorage

    project = dashboard.project(ADAPTER_REPO)
    assert run in SQLiteStorage.get_runs(project)
    steps = [row for row in SQLiteStorage.get_logs(project, run) if "train/loss" in row]
    logged = [row["train/global_step"] for row in steps]
    # One run across both starts (resume="allow"). SIGKILL loses what Trackio had not sent yet (it sends every
    # 0.5 s), which may be step 2, logged just before the kill: a relaunched job's dashboard can miss that point.
    assert logged[0] == 1 and logged[-1] == 3 and logged == sorted(set(logged)), logged
    names = set().union(*steps)
    # perf/step_s is the time since the start's previous step, so the first step of each start (1, 3) has none.
    expected = {f"train/{name}" for name in RECIPE_METRICS + TRL_METRICS} - {"train/perf/step_s"}
    assert expected <= names, sorted(expected - names)
    assert all("train/perf/step_s" in row for row in steps if row["train/global_step"] == 2)
    low, high = REHEARSAL_RATIO_BAND
    for row in steps:
        assert row["train/ratio/sample_min"] <= row["train/ratio"] <= row["train/ratio/sample_max"]
        assert row["train/lora/update_norm"] > 0 and low < row["train/ratio/token_mean"] < high
    # Every rollout of a trained group finished before its group was trained (rollout metrics are pushed
    # through a separate queue, so allow for the last group's arriving after the last log).
    assert sum(row["train/rollout/finished_total"] for row in steps) >= (len(steps) - 1) * recipe.NUM_GENERATIONS
    # The injected failures (the first rollouts) are on the dashboard, never more than the ledger counted.
    assert 1 <= sum(row["train/rollout/unscorable_total"] for row in steps) <= ledger["unscorable_total"]
    assert sum(row["train/rollout/timed_out_total"] for row in steps) <= ledger["timed_out"]


def assert_training_repo_card(readme: Path) -> None:
    """The final push's README.md is the training repo's card, read back by huggingface_hub's own parser."""
    card = ModelCard.load(readme)
    data = card.data
    assert (data.base_model, data.base_model_revision) == (recipe.BASE_MODEL, recipe.BASE_MODEL_REVISION)
    assert (data.library_name, data.base_model_relation) == ("peft", "adapter")
    assert {"lora", "grpo", "opencode"} <= set(data.tags) and "trackio" not in data.tags  # local logs: no Space
    assert data.dataset_revisions == {recipe.TRAIN_DATASET: recipe.TRAIN_REVISION,
                                      recipe.TEST_DATASET: recipe.TEST_REVISION}
    assert data.datasets == [recipe.TRAIN_DATASET, recipe.TEST_DATASET]
    assert f"project `{dashboard.project(ADAPTER_REPO)}`" in card.text and "3 optimizer steps" in card.text
