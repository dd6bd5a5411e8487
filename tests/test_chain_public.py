"""The public path as the job runs it: serve_env.sh (the production script, unchanged) with SPACE_HOST at the job's
public host, a real Harbor trial whose OpenCode reaches the capture proxy at https://$SPACE_HOST/capture through a
TLS front that strips `Authorization` as the HF Jobs proxy does (tests/chain/tls_front.py), then capture_gateway.py
on PUBLIC_PORT, then the env server's mounted capture app. The session reaches the capture proxy only as the
`x-api-key` seam_patch.py adds, so a right answer scoring 1.0 with a clean trace proves the seam inside a real trial.

The rest of the chain is test_chain.py's (its Chain, policy Script, bucket and tasks; the same skip/fail rule, by
importing it): the bubblewrap sandbox over setup.sh's image root, with one more overlay layer in which the image
trusts the test's CA and resolves SPACE_HOST to the front's loopback address.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import sys
import time
from pathlib import Path

import pytest
from stubs import jobs_proxy_double
from stubs.procs import free_port, start, stop, wait_http
from test_chain import IMAGE_ROOT, MODEL, RIGHT, WRONG, Chain, check_trace, kind

import recipe

ROOT = Path(__file__).resolve().parents[1]
CAPTURE_CALL = "/capture/v1/chat/completions"


@pytest.fixture(scope="module")
def public(tmp_path_factory):
    """serve_env.sh behind the TLS front, with test_chain's policy, bucket and tasks; yields (Chain, SPACE_HOST, the
    front's address, the certificates)."""
    from chain import tls_front
    from chain.bucket import Bucket
    from harbor_fixture import BUCKET, materialized
    from rehearsal.policy_server import PolicyServer, Script
    from tiny_lfm2 import save_tiny_model

    root = tmp_path_factory.mktemp("public")
    tasks = materialized(root, n_medium=1, n_hard=1, n_test=1)
    names = sorted(p.name for p in (tasks / "train" / "tasks").iterdir())
    bucket = Bucket(BUCKET, {f"user__{name}": {"table.csv": b"x\n4.0\n4.4\n"} for name in names})
    policy = PolicyServer(save_tiny_model(root / "model"), served_name=MODEL, dtype="float32", max_model_len=262144,
                          script=Script({names[0]: ["right"]}, RIGHT, WRONG))
    policy.start()
    env_port, public_port = free_port(), free_port()
    host, address = f"job-public--{public_port}.hf.jobs", tls_front.loopback_address()
    certs = tls_front.make_certs(root / "certs", host)
    layer = tls_front.trust_layer(root / "trust-layer", IMAGE_ROOT, certs, host, address)
    front = tls_front.start(f"http://127.0.0.1:{public_port}", certs, address)
    env = {**{k: v for k, v in os.environ.items() if k not in ("SANDBOX", "SPACE_HOST", "JOB_ID", "HF_JOB_ID")},
           "DATASETS": str(tasks / "train"), "SPACE_HOST": host, "HF_TOKEN": "hf_dummy", "POLICY_URL": policy.url,
           "ENV_PORT": str(env_port), "PUBLIC_PORT": str(public_port), "PUBLIC_HOST": "127.0.0.1",
           "PYTHON": sys.executable, "PYTHONPATH": str(ROOT / "tests" / "chain" / "site"),  # the stand-ins, in-process
           "HOME": str(root / "home"), "OPENENV_HARBOR_TRIALS_DIR": str(root / "trials"),
           "CHAIN_SANDBOX_DIR": str(root / "sandboxes"), "CHAIN_HF_ENDPOINT": bucket.url,
           "CHAIN_IMAGES": json.dumps({recipe.TASK_IMAGE: [str(layer), str(IMAGE_ROOT)]}),
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # Harbor's LiteLLM would fetch its price list from GitHub
    log = (root / "serve_env.log").open("w")  # closed in the finally below
    server = start(["bash", str(ROOT / "serve_env.sh")], env=env, log=log)
    chain = Chain(root, tasks, policy, bucket, f"http://127.0.0.1:{env_port}", server)
    try:
        wait_http(f"{chain.env_url}/health", server, timeout=180)
        wait_http(f"http://127.0.0.1:{public_port}/capture/health", server, timeout=30)
        yield chain, host, address, certs
    finally:
        stop(server)
        log.close()
        front.shutdown()
        policy.stop()
        bucket.stop()


@pytest.fixture(scope="module")
def played(public, tmp_path_factory):
    """One right answer, every model call over the public path (test_chain grades the wrong ones with the same
    verifier; one rollout keeps the suite's time): (session, trace, reward, ledger, what the front forwarded)."""
    chain = public[0]
    seen = len(jobs_proxy_double.FORWARDED)
    began = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:  # the client finds the server's trial folders, as in the job
        patch.setenv("OPENENV_HARBOR_TRIALS_DIR", str(chain.root / "trials"))
        out, ledger = chain.rollouts(chain.names[:1], tmp_path_factory.mktemp("ledger") / "rollouts.json")
    (task, session, trace, reward), = out
    print(f"public path: rollout {task} ({kind(session)}) in {time.monotonic() - began:.0f} s, reward {reward}, "
          f"error {getattr(session.result, 'error', None)}")
    return session, trace, reward, ledger, jobs_proxy_double.FORWARDED[seen:]


def test_the_public_host_answers_over_tls_with_a_certificate_only_the_test_ca_vouches_for(public):
    _chain, host, address, certs = public

    def health(context: ssl.SSLContext) -> bytes:
        with socket.create_connection((address, 443), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname=host) as tls:
            tls.sendall(f"GET /capture/health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            return tls.recv(64)

    assert health(ssl.create_default_context(cafile=str(certs.ca))).startswith(b"HTTP/1.1 200")
    with pytest.raises(ssl.SSLCertVerificationError):  # no public root vouches for it: the image must trust the CA
        health(ssl.create_default_context())


def test_a_right_answer_over_the_public_path_scores_one_with_a_clean_trace(public, played):
    session, trace, reward, ledger, _ = played
    assert reward == 1.0, session.error
    check_trace(public[0], session, trace, agent_turns=2)
    assert (ledger["rollouts"], ledger["scored"], ledger["unscorable_total"]) == (1, 1, 0)


def test_every_model_call_reached_the_gateway_through_the_front_as_x_api_key_alone(played):
    session, forwarded = played[0], played[4]
    key = session.result.session_id
    calls = [headers for method, path, headers in forwarded if method == "POST" and path == CAPTURE_CALL]
    # OpenCode's title call and its two agent turns all came by https://$SPACE_HOST/capture ...
    assert len(calls) == session.result.n_turns == 3
    assert all("authorization" not in headers for headers in calls)  # ... the front cut the Bearer ...
    assert [headers.get("x-api-key") for headers in calls] == [key] * 3  # ... and the seam's header carried the key
    assert f"Bearer {key}" in jobs_proxy_double.DROPPED  # OpenCode did send the Bearer (apiKey = the session too)
