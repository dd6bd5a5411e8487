"""The real rollout chain: `openenv harbor serve` (openenv 0.10.0) -> Harbor 0.25's Trial -> the OpenCode 1.18.33
binary -> the capture proxy -> the task's own tests/test.sh + grader.py, driven through harbor_sessions.py (the
session client the trainer and the eval use) and train_rollouts.

The env server runs on the public path, as the job runs it: serve_env.sh (unchanged) with SPACE_HOST at a loopback
TLS front that strips `Authorization` as the HF Jobs proxy does (tests/chain/tls_front.py), so every OpenCode in a
trial reaches the capture proxy at https://$SPACE_HOST/capture through capture_gateway.py, its session only as the
`x-api-key` seam_patch.py adds; the image trusts the front's CA through one more overlay layer.

Only the remote pieces are stood in for (tests/chain/): the HF Sandbox (bubblewrap + overlayfs over the image root
setup.sh builds, registered in the env server's process for `hf-sandbox`), the data bucket (loopback HTTP) and vLLM
(tests/rehearsal/policy_server.py with a Script: the tiny model's tokens and its real logprobs for them). Tasks are
made by prepare_tasks.py from the synthetic fixture, so the server serves prepared tasks (docker_image, 1 CPU/4 GB).
One server and one policy for the module; rollouts run concurrently. Needs root, bubblewrap and the image root
(`bash setup.sh`); without them the module is skipped, and under CI=true it fails.
"""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from chain import envserver, tls_front
from stubs import jobs_proxy_double

import recipe

MODEL = recipe.SERVED_MODEL_NAME
RIGHT, WRONG = "4.2", "7.5"  # harbor_fixture's EXPECTED_ANSWER, and one the grader refuses
AGENT_TIMEOUT_S = 240.0  # far above a scripted rollout's need, on a loaded 2-core machine too


envserver.require()


class Chain:
    """The module's env server, policy and bucket, and a way to run rollouts through harbor_sessions + the guard."""

    def __init__(self, root: Path, tasks: Path, policy, bucket, server: envserver.EnvServer) -> None:
        self.root, self.tasks, self.policy, self.bucket, self.server = root, tasks, policy, bucket, server
        self.env_url = server.url
        self.names = sorted(p.name for p in (tasks / "train" / "tasks").iterdir())

    def factory(self, **overrides):
        from openenv.core.harness.capture.upstream import training_sampling

        import harbor_sessions

        kwargs = {"llm_url": self.policy.url, "model": MODEL, "sandbox": recipe.SANDBOX,
                  "agent_timeout_sec": AGENT_TIMEOUT_S, "agent_step_limit": recipe.AGENT_CALL_LIMIT,
                  "sampling": training_sampling({"temperature": recipe.TEMPERATURE}), **overrides}
        return functools.partial(harbor_sessions.HarborSessionFactory, self.env_url, **kwargs)

    def rollouts(self, plan: list[str], ledger: Path, **overrides) -> tuple[list[tuple], dict]:
        """One rollout per entry of `plan` (task names), all at once, through train_rollouts as TRL's worker runs
        them (create, wait, trace, verify, close); returns [(task, session, trace or the failure, reward)] and the
        ledger."""
        import train_rollouts

        factory = self.factory(**overrides)
        guarded = train_rollouts.guarded(factory, ledger)(sampling=factory.keywords["sampling"])
        prompts = {r["task_name"]: r["prompt"] for r in guarded.inner.prompt_rows()}

        def one(task: str) -> tuple:
            try:
                session = guarded.create(prompts[task])
            except train_rollouts.RolloutFailure as error:
                return task, None, error, None
            try:
                try:
                    session.wait_for_completion()
                except TimeoutError:
                    pass  # TRL trains the captured turns, flagged timed out
                except train_rollouts.RolloutFailure as error:
                    return task, session, error, None  # TRL scores it unscorable
                try:
                    trace = session.fetch_training_trace()
                    reward = session.verify([]).env_reward
                except train_rollouts.RolloutFailure as error:
                    trace, reward = error, None
                return task, session, trace, reward
            finally:
                session.close()

        with ThreadPoolExecutor(max_workers=len(plan)) as pool:
            out = list(pool.map(one, plan))
        return out, recipe.read_json(ledger)

    def rollouts_apart(self, plans: dict[str, tuple[list[str], dict]],
                       root: Path) -> dict[str, tuple[list[tuple], dict]]:
        """Each plan (its tasks, its factory overrides) through `rollouts` with a ledger of its own in root/NAME, all
        at once; the client finds the server's trial folders by openenv's rule, as in the job."""
        with pytest.MonkeyPatch.context() as patch, ThreadPoolExecutor(max_workers=len(plans)) as pool:
            patch.setenv("OPENENV_HARBOR_TRIALS_DIR", str(self.root / "trials"))
            runs = {name: pool.submit(self.rollouts, tasks, root / name / "rollouts.json", **overrides)
                    for name, (tasks, overrides) in plans.items()}
            return {name: run.result() for name, run in runs.items()}


@contextlib.contextmanager
def running(root: Path, modes_of: Callable[[list[str]], dict[str, list[str]]], *, n_hard: int = 4,
            public: bool = True, setup: Callable[[envserver.EnvServer], None] | None = None) -> Iterator[Chain]:
    """The chain over `root`: 5 medium and `n_hard` prepared tasks, their data in the bucket, the tiny model's policy
    playing `modes_of(task names)`, the env server (`setup` adjusts it before it starts); all stopped at the end."""
    from chain.bucket import Bucket
    from harbor_fixture import BUCKET, materialized
    from rehearsal.policy_server import PolicyServer, Script
    from tiny_lfm2 import save_tiny_model

    tasks = materialized(root, n_medium=5, n_hard=n_hard, n_test=1)
    names = sorted(p.name for p in (tasks / "train" / "tasks").iterdir())
    bucket = Bucket(BUCKET, {f"user__{name}": {"table.csv": b"x\n4.0\n4.4\n"} for name in names})
    model_dir = save_tiny_model(root / "model", vocab_size=envserver.CHAIN_VOCAB)
    policy = PolicyServer(model_dir, served_name=MODEL, dtype="float32", max_model_len=envserver.POLICY_MAX_MODEL_LEN,
                          script=Script(modes_of(names), RIGHT, WRONG))
    policy.start()
    server = envserver.EnvServer(root, tasks / "train", policy.url, bucket.url, public=public)
    chain = Chain(root, tasks, policy, bucket, server)
    try:
        if setup is not None:
            setup(server)
        server.start()
        yield chain
    finally:
        server.stop()
        policy.stop()
        bucket.stop()


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    def modes_of(names: list[str]) -> dict[str, list[str]]:
        return {names[0]: ["right", "wrong", "none", "malformed", "right", "wrong", "right", "none"],  # the group
                **{name: ["right"] for name in names[1:8]}, names[8]: ["loop"]}

    with running(tmp_path_factory.mktemp("chain"), modes_of) as chain:
        yield chain


@pytest.fixture(scope="module")
def played(chain, tmp_path_factory):
    """One GRPO group: NUM_GENERATIONS rollouts of one task at once, the policy playing a different agent in each
    (right, wrong, no answer, malformed tool call)."""
    plan = [chain.names[0]] * recipe.NUM_GENERATIONS
    seen = len(jobs_proxy_double.FORWARDED)
    start = time.monotonic()
    # The client finds the server's trial folders by openenv's rule, as in the job (one environment for both).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPENENV_HARBOR_TRIALS_DIR", str(chain.root / "trials"))
        out, ledger = chain.rollouts(plan, tmp_path_factory.mktemp("ledger") / "rollouts.json")
    wall = time.monotonic() - start
    for task, session, _, reward in out:
        result = session.result if session else None
        print(f"chain rollout {task}: {kind(session)}, reward {reward}, {getattr(result, 'wall_s', None)} s, "
              f"error {getattr(result, 'error', None)}")
    print(f"chain: a group of {len(plan)} concurrent rollouts in {wall:.0f} s")
    return {"out": out, "ledger": ledger, "wall": wall, "forwarded": jobs_proxy_double.FORWARDED[seen:]}


def kind(session) -> str:
    """Which agent the policy played in this rollout, read off what its first model call returned."""
    first = session.result.turns[0] if session and session.result and session.result.turns else None
    agent = [t for t in session.result.turns if t.role == "agent"] if first else []
    if not agent:
        return "none-captured"
    calls = agent[0].tool_calls
    if calls:
        content = json.loads(calls[0]["arguments"]).get("content") if isinstance(calls[0]["arguments"], str) \
            else calls[0]["arguments"].get("content")
        return {RIGHT: "right", WRONG: "wrong"}.get(content, "other")
    return "malformed" if "<|tool_call_start|>" in agent[0].text else "none"


def of_kind(played, wanted: str) -> list[tuple]:
    return [(s, t, r) for _, s, t, r in played["out"] if kind(s) == wanted]


def check_trace(chain, session, trace, agent_turns: int) -> None:
    """The trace is the agent's turns only, each masked to its completion, with the tiny model's real logprobs for
    the tokens its tokenizer makes, and TRL chains it into one clean sequence."""
    import torch

    import train_rollouts

    result = session.result
    assert result.rollout_type == "train" and result.ok, result.error
    assert len(trace.turns) == agent_turns
    assert result.n_turns == agent_turns + 1  # OpenCode's title call was captured too, and left out (auxiliary)
    assert [c.role for c in result.conversations].count("auxiliary") == 1
    eos = chain.policy.tokenizer.eos_token_id
    for turn in trace.turns:
        assert turn.loss_mask == [0] * len(turn.prompt_token_ids) + [1] * len(turn.completion_token_ids)
        assert turn.completion_token_ids[-1] == eos
    # Each prompt extends the previous prompt + completion.
    assert len(train_rollouts._trl_capture(trace).sequences) == 1
    # The served model scored afresh, no cache, in one pass over the last turn: it holds every earlier turn.
    last = trace.turns[-1]
    sequence = list(last.prompt_token_ids) + list(last.completion_token_ids)
    with torch.inference_mode():
        logprobs = torch.log_softmax(chain.policy.model(input_ids=torch.tensor([sequence])).logits[0].float(), -1)
    for turn in trace.turns:
        at = len(turn.prompt_token_ids)
        ids = torch.tensor(turn.completion_token_ids)
        assert sequence[at:at + len(ids)] == turn.completion_token_ids
        expected = logprobs[at - 1 + torch.arange(len(ids)), ids]
        assert torch.allclose(torch.tensor(turn.per_token_logps), expected, atol=1e-4)


def test_a_right_answer_scores_one_with_a_clean_trainable_trace(chain, played, monkeypatch):
    right = of_kind(played, "right")
    assert right and all(reward == 1.0 for _, _, reward in right)
    session, trace, _ = right[0]
    check_trace(chain, session, trace, agent_turns=2)  # the write call, then the final message
    assert trace.turns[0].response["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "write"
    # The session found the env server's Harbor trial folder by openenv's own rule (the job runs both with one env),
    # timed its phases from Harbor's result, and removed it once its trace was taken (a scored rollout).
    monkeypatch.setenv("OPENENV_HARBOR_TRIALS_DIR", str(chain.root / "trials"))
    assert session.trial_dir.parent == chain.root / "trials" and not session.trial_dir.exists()
    assert {"sandbox_start_s", "agent_setup_s", "agent_run_s", "verifier_s"} <= set(session.timing)


def test_a_wrong_answer_scores_zero_with_a_clean_trainable_trace(chain, played):
    wrong = of_kind(played, "wrong")
    assert wrong and all(reward == 0.0 for _, _, reward in wrong)
    check_trace(chain, *wrong[0][:2], agent_turns=2)


def test_no_answer_scores_zero_with_one_trainable_turn(chain, played):
    none = of_kind(played, "none") + of_kind(played, "malformed")
    assert len(none) == 3 and all(reward == 0.0 for _, _, reward in none)
    check_trace(chain, *none[0][:2], agent_turns=1)


def test_a_concurrent_group_of_eight_is_scored_with_contrast(chain, played):
    kinds = sorted(kind(s) for _, s, _, _ in played["out"])
    assert kinds == sorted(chain.policy.script.modes[chain.names[0]])  # every rollout played one agent
    rewards = [r for _, _, _, r in played["out"]]
    assert sorted(rewards) == sorted(1.0 if k == "right" else 0.0 for k in kinds)
    assert 0.0 in rewards and 1.0 in rewards  # a GRPO group with contrast
    ledger = played["ledger"]
    assert (ledger["rollouts"], ledger["scored"], ledger["unscorable_total"]) == (recipe.NUM_GENERATIONS,) * 2 + (0,)
    # Every rollout's setup was measured into the ledger, as the smoke report reads it (sandbox_lifecycle's parts).
    timing = ledger["timing"]
    assert timing["count"] == recipe.NUM_GENERATIONS and 0 < timing["max"]["setup_s"] < recipe.ROLLOUT_SETUP_BUDGET_S


# --- The public path: the sandboxes reach the capture proxy as the job's do ---------------------------------------
CAPTURE_CALL = "/capture/v1/chat/completions"


def test_the_public_host_answers_over_tls_with_a_certificate_only_the_test_ca_vouches_for(chain):
    server = chain.server

    def health(context: ssl.SSLContext) -> bytes:
        with socket.create_connection((server.address, 443), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname=server.host) as tls:
            tls.sendall(f"GET /capture/health HTTP/1.1\r\nHost: {server.host}\r\nConnection: close\r\n\r\n".encode())
            return tls.recv(64)

    assert health(ssl.create_default_context(cafile=str(server.certs.ca))).startswith(b"HTTP/1.1 200")
    with pytest.raises(ssl.SSLCertVerificationError):  # no public root vouches for it: the image must trust the CA
        health(ssl.create_default_context())


def test_the_public_hosts_front_starts_without_a_name_lookup_off_loopback(monkeypatch):
    """The front listens on a 127/8 address of its own, which no hosts file names: http.server's bind looks its name
    up (socket.getfqdn), a DNS query to this machine's resolver, off loopback."""

    def lookup(*args: object) -> None:
        raise AssertionError(f"a name lookup of {args}")

    monkeypatch.setattr(socket, "gethostbyaddr", lookup)
    server = jobs_proxy_double.start("http://127.0.0.1:9", address=(tls_front.loopback_address(), 0))
    server.shutdown()
    server.server_close()


def test_every_model_call_reached_the_gateway_through_the_front_as_x_api_key_alone(played):
    """Every call the gateway answered is one turn of its session's trace. A call the engine failed (the gateway
    answers 502; seen once in CI, when the policy's connection dropped under load) is no turn, and OpenCode sends
    it again: so the answered calls are counted, and each other call must be that 502."""
    calls = [(headers, status) for method, path, headers, status in played["forwarded"]
             if method == "POST" and path == CAPTURE_CALL]
    assert calls and all("authorization" not in headers for headers, _ in calls)  # the front cut every Bearer ...
    answered = [headers.get("x-api-key") for headers, status in calls if status == 200]
    assert all(status in (200, 502) for _, status in calls), calls
    for _, session, _, _ in played["out"]:  # ... and each session's calls (its title call too) carried its key
        key = session.result.session_id
        assert answered.count(key) == session.result.n_turns
        assert f"Bearer {key}" in jobs_proxy_double.DROPPED  # OpenCode did send the Bearer (apiKey = the session)
    assert len(answered) == sum(session.result.n_turns for _, session, _, _ in played["out"])


# --- Faults: each rollout ends as its class in train_rollouts' ledger -----------------------------------------------
def test_an_env_server_restart_fails_the_rollout_in_flight_as_a_rollout_failure(chain, tmp_path):
    import threading

    trials = chain.root / "trials"
    before = set(trials.iterdir()) if trials.exists() else set()
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(
        zip(("out", "ledger"), chain.rollouts([chain.names[1]], tmp_path / "rollouts.json"), strict=True)))
    worker.start()
    deadline = time.monotonic() + 300
    while not (set(trials.iterdir()) - before if trials.exists() else set()):  # the rollout's trial has begun
        assert time.monotonic() < deadline and worker.is_alive()
        time.sleep(0.5)
    chain.server.kill()  # the env server dies mid-rollout (OOM, a crash), and comes back
    chain.server.start(wait=False)
    worker.join(timeout=300)
    (_, session, _, reward), = result["out"]
    assert reward is None and session.failure == "rollout", session.error
    assert (result["ledger"]["rollouts"], result["ledger"]["unscorable"]["rollout"]) == (1, 1)
    # Back: the fault rollouts below run on the restarted server.
    chain.server.wait()
    assert len(chain.factory()().prompt_rows()) == len(chain.names)


FAULT_AGENT_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def faulted(chain, tmp_path_factory):
    """Five faulty rollouts at once, one per task: the sandbox does not start, the healthcheck fails (the task's data
    is not in the bucket), OpenCode's install fails (the image has another OpenCode, so Harbor's own install runs and
    cannot reach GitHub), the verifier crashes, the agent loops until its timeout."""
    start, health, install, verifier, loop = chain.names[4:9]  # 1-3: the env-server restart
    stale = tmp_path_factory.mktemp("stale-opencode")
    (stale / "usr" / "local" / "bin").mkdir(parents=True)
    (stale / "usr" / "local" / "bin" / "opencode").write_text("#!/bin/sh\necho 1.0.0\n")
    (stale / "usr" / "local" / "bin" / "opencode").chmod(0o755)
    chain.server.faults_file.write_text(json.dumps({start: {"start": "image pull failed (injected)"},
                                                        install: {"layers": [str(stale)]}}))
    del chain.bucket.files[f"user__{health}"]
    toml = chain.tasks / "train" / "tasks" / health / "task.toml"
    toml.write_text(toml.read_text().replace("retries = 30", "retries = 1").replace("interval_sec = 2.0",
                                                                                      "interval_sec = 0.5"))
    crash = "#!/bin/bash\necho grader crashed >&2\nexit 3\n"
    (chain.tasks / "train" / "tasks" / verifier / "tests" / "test.sh").write_text(crash)
    # Only the looping agent runs under the short cap; the verifier's rollout ends on its own and keeps the module's
    # (a suite run here failed it and the timeout test's counts together, as that rollout timing out would).
    plans = {"faults": ([start, health, install, verifier], {}),
             "timeout": ([loop], {"agent_timeout_sec": FAULT_AGENT_TIMEOUT_S})}
    began = time.monotonic()
    done = chain.rollouts_apart(plans, tmp_path_factory.mktemp("faults"))
    (out, ledger), (looped, timeout_ledger) = done["faults"], done["timeout"]
    print(f"chain faults: {len(out) + len(looped)} concurrent rollouts in {time.monotonic() - began:.0f} s")
    for task, session, _, reward in [*out, *looped]:
        print(f"chain fault {task}: reward {reward}, {getattr(session, 'failure', None)}: "
              f"{getattr(session, 'error', '')}")
    return {**dict(zip(("start", "healthcheck", "install", "verifier"), out, strict=True)), "timeout": looped[0]}, \
        {"faults": ledger, "timeout": timeout_ledger}


@pytest.mark.parametrize(("fault", "failure", "says"), [
    ("start", "rollout", "image pull failed"),
    ("healthcheck", "rollout", "ealth"),
    ("install", "rollout", "install"),
    ("verifier", "verifier", "RewardFileNotFoundError"),
])
def test_a_fault_in_the_real_chain_is_one_unscorable_rollout_of_its_class(faulted, fault, failure, says, chain,
                                                                         monkeypatch):
    (_, session, _, reward), ledger = faulted[0][fault], faulted[1]["faults"]
    monkeypatch.setenv("OPENENV_HARBOR_TRIALS_DIR", str(chain.root / "trials"))
    assert reward is None and session.failure == failure, (session.failure, session.error)
    assert says in session.error
    assert ledger["unscorable"][failure] >= 1
    if fault == "verifier":  # a failed rollout's trial folder is kept for diagnosis (sandbox_lifecycle.finish_trial)
        kept, key = session.inner.trial_dir, session.inner.result.session_id.encode()
        assert (kept / "result.json").is_file()
        assert [path for path in kept.rglob("*") if path.is_file() and key in path.read_bytes()] == []  # redacted


def test_an_agent_timeout_in_the_real_chain_is_scored_as_timed_out(faulted):
    (_, session, trace, reward), ledgers = faulted[0]["timeout"], faulted[1]
    assert session.failure is None and session.timed_out and reward == 0.0
    assert len(trace.turns) >= 1  # the turns it made before the timeout are trained
    ledger, faults = ledgers["timeout"], ledgers["faults"]
    assert (ledger["rollouts"], ledger["scored"], ledger["timed_out"]) == (1, 1, 1)
    assert not any(ledger["unscorable"].values()), ledger
    assert (faults["rollouts"], faults["scored"], faults["timed_out"]) == (4, 0, 0)
    assert faults["unscorable"] == {"create": 0, "rollout": 3, "upstream": 0, "capture": 0, "empty_trace": 0,
                                    "verifier": 1}


OUTAGE_AGENT_TIMEOUT_S = 60.0


def after_the_first_turn(status: int, message: str = "engine unavailable (injected)"):
    """An engine that answers OpenCode's title call and first agent call, then fails every call that carries a tool
    result (OpenCode's later turns and their retries) with `status` and vLLM's error body."""

    def refuse(method: str, path: str, body: bytes | None) -> tuple[int, str] | None:
        if method == "POST" and path.endswith("/chat/completions") and body:
            if any(m.get("role") == "tool" for m in json.loads(body).get("messages") or []):
                return status, message
        return None

    return refuse


@pytest.fixture(scope="module")
def stopped(chain, tmp_path_factory):
    """Three rollouts of a task whose agent writes its answer in its first call, at once: the engine dies after that
    call (503s), the engine refuses the next prompt as past its context (vLLM's 400), the proxy's call budget allows
    one agent call. Each through its own ledger."""
    fronts = {"outage": after_the_first_turn(503),
              "context": after_the_first_turn(400, "This model's maximum context length is 32768 tokens. However, you "
                                                   "requested 36864 tokens (32768 in the messages, 4096 in the "
                                                   "completion).")}
    servers = {name: jobs_proxy_double.start(chain.policy.url, refuse=refuse) for name, refuse in fronts.items()}
    plans = {name: {"llm_url": f"http://127.0.0.1:{server.server_port}"} for name, server in servers.items()}
    plans["budget"] = {"agent_step_limit": 2}  # OpenCode's title call and one agent call
    # The proxy retries a 503 twice (2 s, then 4 s) before it counts the call failed and answers the agent 502: give
    # the agent time to see that, on a loaded machine too, rather than time out with the call still in flight.
    plans["outage"]["agent_timeout_sec"] = OUTAGE_AGENT_TIMEOUT_S
    # The other two end on their own (the proxy ends the agent) and keep the module's cap: a CI run here timed the
    # budget rollout out at 30 s, before its second call.
    root = tmp_path_factory.mktemp("stopped")
    done = chain.rollouts_apart({name: ([chain.names[2]], plan) for name, plan in plans.items()}, root)
    for server in servers.values():
        server.shutdown()
    logs = {name: [json.loads(x) for x in (root / name / recipe.ROLLOUT_LOG_NAME).read_text().splitlines()]
            for name in plans}
    for name, ((out,), _) in done.items():
        result = out[1].result
        print(f"chain {name}: reward {result.reward}, budget stops {result.budget_stop_count}, error {result.error}, "
              f"findings {result.findings}")
    return {name: (out, ledger, logs[name]) for name, ((out,), ledger) in done.items()}


def test_an_engine_outage_mid_rollout_is_unscorable_never_a_grade(stopped):
    """Issue 41 defect 3, on the real chain: the agent's first call writes the answer, every later call fails at the
    engine; OpenCode gives up or times out and Harbor still grades the workspace. The env server reports the capture
    proxy's upstream errors (seam_patch.py) and the rollout is unscorable as `upstream`, never trained with a grade."""
    (_, session, _, reward), ledger, (line,) = stopped["outage"]
    assert reward is None and session.failure == "upstream", (reward, session.failure, session.error, ledger)
    assert session.result.reward is not None and recipe.upstream_errors(session.result) >= 1  # graded; engine failed
    assert (ledger["rollouts"], ledger["scored"], ledger["unscorable"]["upstream"]) == (1, 0, 1)
    assert line["outcome"] == "upstream" and line["reward"] is None


@pytest.mark.parametrize(("how", "ends"), [("context", {"context_exhausted": 1}), ("budget", {"budget_stops": 1})])
def test_a_rollout_the_proxy_ended_is_trained_as_graded_and_says_how_it_ended(stopped, how, ends):
    """Issue 41 defect 4, on the real chain: the capture proxy ends the agent gracefully when the engine refuses a
    prompt past its context (finding context_budget_exhausted) or the call budget is spent (budget_stop_count);
    Harbor grades, the rollout trains, and its log line and the ledger say which stop it was."""
    (_, session, _, reward), ledger, (line,) = stopped[how]
    assert reward == 1.0 and session.failure is None, (session.failure, session.error)
    expected = {"budget_stops": 0, "context_exhausted": 0, "cut_turns": 0, **ends}
    assert {key: line[key] for key in expected} == expected and line["outcome"] in ("scored", "timed_out")
    assert (ledger["scored"], ledger["budget_stopped"], ledger["context_exhausted"]) == (
        1, ends.get("budget_stops", 0), ends.get("context_exhausted", 0))


def test_opencode_sends_the_requests_the_agent_policy_was_trained_on(chain, played):
    """tests/agent_transcripts.json (what the tiny agent policy of tests/agent_policy.py trained on) is what this
    OpenCode sends: its title call, its first agent call (system prompt, tools, task) and the write tool's result.
    When OpenCode changes them, re-capture (`python tests/agent_policy.py capture`) and the policy rebuilds."""
    import re

    import agent_policy

    (session, trace, _), *_ = of_kind(played, "right")
    agent = next(t for t in session.result.turns if t.request_tools)  # the first call with tools
    title = next(c for c in session.result.conversations if c.role == "auxiliary")  # its messages + the reply
    date = re.search(r"Today's date: (.*)", agent.request_messages[0]["content"]).group(1)
    expected = agent_policy.fill(agent_policy.transcripts(), chain.names[0], date)  # the group's task
    stale = "OpenCode's requests changed: re-capture them with `python tests/agent_policy.py capture`"
    assert agent.request_messages == expected["agent"]["messages"], stale
    assert agent.request_tools == expected["agent"]["tools"], stale
    assert title.messages[:-1] == expected["title"]["messages"], stale
    result = trace.turns[1].request["messages"][-1]
    assert {k: v for k, v in result.items() if k != "tool_call_id"} == expected["tool_result"], stale
