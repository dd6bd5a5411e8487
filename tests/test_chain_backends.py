"""SANDBOX=daytona and SANDBOX=e2b through the real rollout chain: `openenv harbor serve` with the job's env-server
patches (seam_patch.py: each backend's lifetime, E2B's shared template) -> Harbor 0.25's Trial and its real
`DaytonaEnvironment` / `E2BEnvironment` -> the OpenCode binary -> the capture proxy -> the task's own verifier, driven
through harbor_sessions.py and train_rollouts as the trainer drives them.

Only the backends' clouds are stood in for: the daytona and e2b SDK names Harbor imports are replaced, in the env
server's process, by doubles typed against the installed SDKs (tests/chain/daytona_double.py, e2b_double.py, their
signatures checked by tests/test_sdk_doubles.py), whose sandboxes bubblewrap runs over the image root, as
tests/test_chain.py's are. Each double records what it was asked (create requests, template builds, deletes), so
the lifetimes are read where they reach the SDK. Per backend, one wave at once: a group (a right and a wrong answer,
each trace checked), a create the API first refuses as rate-limited, one it always refuses: three tasks of one image,
at once, which on E2B all use one template built once. Needs root, bubblewrap and the image root
(`bash setup.sh`), as tests/test_chain.py.
"""

from __future__ import annotations

import json
import time

import pytest
from chain import envserver
from test_chain import check_trace, kind, running

import recipe
import sandbox_lifecycle

envserver.require()

# A group is one right and one wrong rollout of one task: the fewest that show each backend grades both ways, and
# contrast. The job's group of recipe.NUM_GENERATIONS at once is test_chain.py's (the backends change only where the
# sandbox runs); each wave still runs 4 rollouts of 3 tasks at once, E2B's all racing for its one template.
GROUP = ["right", "wrong"]
# What each backend's API answers the fault tasks' creates: Daytona's transient class (a 429) is retried at 60 s times
# the attempt (Harbor's SANDBOX_RETRY) and a 500 three times; E2B's create is tried twice, a second apart.
FAULTS = {"daytona": {"rate_limited_once": {"status": 429, "times": 1}, "never": {"status": 500}},
          "e2b": {"rate_limited_once": {"status": 429, "times": 1}, "never": {"status": 429}}}
PLANS = {backend: ("group", "rate_limited_once", "never") for backend in FAULTS}  # three tasks of one image each


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("backends")
    tasks_of: dict[str, dict[str, str]] = {}

    def modes_of(names: list[str]) -> dict[str, list[str]]:  # three tasks per backend, by role
        tasks_of.update({backend: dict(zip(plan, names[3 * i:], strict=False))
                         for i, (backend, plan) in enumerate(PLANS.items())})
        return {task: GROUP if role == "group" else ["right"]
                for plan in tasks_of.values() for role, task in plan.items()}

    def setup(server: envserver.EnvServer) -> None:
        # The env server the job runs for SANDBOX=e2b (its preflight and template checked at start), with both keys:
        # the client picks the backend per rollout.
        server.env.update(SANDBOX="e2b", E2B_API_KEY="e2b_chain_placeholder", DAYTONA_API_KEY="dtn_chain_placeholder",
                          CHAIN_SDK_CALLS=str(root / "sdk_calls.jsonl"))
        refusals = {tasks_of[backend][role]: {"create": fault} for backend, faults in FAULTS.items()
                    for role, fault in faults.items()}
        server.faults_file.write_text(json.dumps(refusals))

    with running(root, modes_of, n_hard=1, public=False, setup=setup) as chain:  # 6 tasks
        chain.tasks_of = tasks_of
        yield chain


def sdk_calls(chain, backend: str) -> list[dict]:
    lines = (chain.root / "sdk_calls.jsonl").read_text().splitlines()
    return [call for call in map(json.loads, lines) if call["backend"] == backend]


def wave(chain, backend: str, tmp_path_factory) -> dict:
    """Every rollout of the backend's plan at once (the group's and one per other task)."""
    tasks = chain.tasks_of[backend]
    plan = [tasks[role] for role in PLANS[backend] for _ in range(len(GROUP) if role == "group" else 1)]
    began = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:  # the client finds the server's trial folders, as in the job
        patch.setenv("OPENENV_HARBOR_TRIALS_DIR", str(chain.root / "trials"))
        out, ledger = chain.rollouts(plan, tmp_path_factory.mktemp(backend) / "rollouts.json", sandbox=backend)
    print(f"chain {backend}: {len(plan)} concurrent rollouts in {time.monotonic() - began:.0f} s")
    by_role = {role: [o for o in out if o[0] == task] for role, task in tasks.items()}
    return {"by_role": by_role, "ledger": ledger, "calls": sdk_calls(chain, backend)}


@pytest.fixture(scope="module")
def daytona(chain, tmp_path_factory):
    return wave(chain, "daytona", tmp_path_factory)


@pytest.fixture(scope="module")
def e2b(chain, tmp_path_factory):
    return wave(chain, "e2b", tmp_path_factory)


@pytest.mark.parametrize("backend", ["daytona", "e2b"])
def test_a_group_scores_right_one_and_wrong_zero_with_clean_traces(chain, backend, request):
    played = request.getfixturevalue(backend)
    group = played["by_role"]["group"]
    assert len(group) == len(GROUP)
    kinds = sorted(kind(session) for _, session, _, _ in group)
    assert kinds == sorted(GROUP)
    for _, session, trace, reward in group:
        assert session.result.sandbox == backend
        assert reward == (1.0 if kind(session) == "right" else 0.0), (session.failure, session.error)
        check_trace(chain, session, trace, agent_turns=2)  # the write call, then the final message
    total = sum(len(outs) for outs in played["by_role"].values())
    assert (played["ledger"]["rollouts"], played["ledger"]["scored"]) == (total, total - 1)  # all but "never"


@pytest.mark.parametrize("backend", ["daytona", "e2b"])
def test_a_create_refused_as_rate_limited_is_retried_and_the_rollout_scores(chain, backend, request):
    played = request.getfixturevalue(backend)
    ((task, session, trace, reward),) = played["by_role"]["rate_limited_once"]
    assert reward == 1.0 and len(trace.turns) == 2, (session.failure, session.error)
    creates = [call for call in played["calls"] if call["event"] == "create" and task in call["trial"]]
    assert [call["refused"] for call in creates] == [429, None]  # Harbor's own retry made the second one


@pytest.mark.parametrize(("backend", "says"), [("daytona", "Internal Server Error"), ("e2b", "Too Many Requests")])
def test_a_create_that_never_succeeds_is_one_unscorable_rollout(chain, backend, says, request):
    played = request.getfixturevalue(backend)
    ((task, session, _, reward),) = played["by_role"]["never"]
    assert reward is None and session.failure == "rollout" and says in session.error, session.error
    creates = [call for call in played["calls"] if call["event"] == "create" and task in call["trial"]]
    assert len(creates) == {"daytona": 3, "e2b": 2}[backend] and all(call["refused"] for call in creates)
    assert played["ledger"]["unscorable"]["rollout"] == 1 and played["ledger"]["unscorable_total"] == 1


def test_every_daytona_create_asks_for_the_recipes_auto_stop_and_delete_on_stop(daytona):
    requests = [call["request"] for call in daytona["calls"] if call["event"] == "create"]
    assert len(requests) == len(GROUP) + 2 + 3  # the group, the rate-limited task twice, the 500s
    for request in requests:  # Harbor's own default is 0: never stops
        assert request["autoStopInterval"] * 60 >= recipe.SANDBOX_IDLE_TIMEOUT_S, request["autoStopInterval"]
        assert request["autoStopInterval"] == sandbox_lifecycle.lifetime_kwargs("daytona")["auto_stop_interval_mins"]
        assert request["autoDeleteInterval"] == 0  # deleted once stopped
        assert (request["cpu"], request["memory"]) == (recipe.TASK_CPUS, recipe.TASK_MEMORY_MB // 1024)
    made = [call for call in daytona["calls"] if call["event"] == "create" and not call["refused"]]
    assert len([call for call in daytona["calls"] if call["event"] == "delete"]) == len(made)  # none left running


def test_every_e2b_create_asks_for_the_recipes_timeout_on_one_template_built_once(e2b, chain):
    creates = [call for call in e2b["calls"] if call["event"] == "create"]
    assert {call["timeout"] for call in creates} == {recipe.SANDBOX_IDLE_TIMEOUT_S}
    builds = [call for call in e2b["calls"] if call["event"] == "build"]
    name = sandbox_lifecycle.template_name(recipe.TASK_IMAGE, recipe.TASK_CPUS, recipe.TASK_MEMORY_MB)
    assert builds == [{"backend": "e2b", "event": "build", "alias": name, "image": recipe.TASK_IMAGE,
                       "cpu_count": recipe.TASK_CPUS, "memory_mb": recipe.TASK_MEMORY_MB}]
    assert {call["template"] for call in creates} == {name}
    # Three tasks, a concurrent group among them, every rollout scored but the one whose create never succeeds.
    scored = [reward for role, outs in e2b["by_role"].items() if role != "never" for _, _, _, reward in outs]
    assert len(scored) == len(GROUP) + 1 and None not in scored
    made = [call for call in creates if not call["refused"]]
    assert len([call for call in e2b["calls"] if call["event"] == "kill"]) == len(made)
