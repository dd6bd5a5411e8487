"""serve_policy.sh and serve_env.sh, driven through bash with stub `vllm`/`nvidia-smi` on PATH, and the
public-port guarantee proven on the REAL env server (openenv 0.10.0, capture mounted at /capture) behind
capture_gateway.py: on the public port only /capture/... answers."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chain import envserver
from opencode_rollout import NO_OPENCODE, OPENCODE, opencode_env
from openenv.harbor import seams
from stubs import jobs_proxy_double, upstream_double
from stubs.procs import free_port, free_ports, start, stop, wait_http

import recipe
import seam_patch

ROOT = Path(__file__).resolve().parents[1]
STUBS = Path(__file__).resolve().parent / "stubs"
ADMIN = "gateway-test-admin"
# Flags both modes need: token-faithful capture, OpenCode's tool_choice="auto", unnarrowed sampling.
VLLM_FLAGS = ["--return-tokens-as-token-ids", "--logprobs-mode", "--enable-auto-tool-choice", "--generation-config"]


def bash_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Environment for the scripts: stubs first on PATH, the venv's python as PYTHON, secrets unset."""
    env = {k: v for k, v in os.environ.items() if k not in {"HF_TOKEN", "DAYTONA_API_KEY", "E2B_API_KEY", "SANDBOX"}}
    env.update(
        PATH=f"{STUBS / 'bin'}:{env['PATH']}", PYTHON=sys.executable, REAL_PYTHON=sys.executable,
        STUB_LOG=str(tmp_path / "stub.log"), LOG_DIR=str(tmp_path / "logs"),
    )
    env.update(extra)
    return env


def run(script: str, env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / script)], env=env, capture_output=True, text=True, timeout=timeout)


def planned(stdout: str) -> list[str]:
    """The argv of the single `  $ ...` line a dry run prints."""
    lines = [line for line in stdout.splitlines() if line.startswith("  $ ")]
    assert len(lines) == 1, stdout
    return shlex.split(lines[0][4:])


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# --- serve_policy.sh -------------------------------------------------------------------------------


def test_policy_training_mode_plan(tmp_path):
    out = run("serve_policy.sh", bash_env(tmp_path, DRY_RUN="1"))
    assert out.returncode == 0, out.stderr
    argv = planned(out.stdout)
    assert argv[:4] == ["env", f"CUDA_VISIBLE_DEVICES={recipe.VLLM_GPU}", "VLLM_SERVER_DEV_MODE=1", "vllm"]
    assert argv[4:6] == ["serve", recipe.BASE_MODEL]
    assert flag(argv, "--host") == recipe.LOOPBACK
    assert flag(argv, "--port") == str(recipe.VLLM_PORT)
    assert flag(argv, "--served-model-name") == recipe.SERVED_MODEL_NAME
    assert flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert flag(argv, "--tool-call-parser") == "lfm2"
    assert flag(argv, "--generation-config") == "vllm"
    assert json.loads(flag(argv, "--weight-transfer-config")) == {"backend": "nccl"}
    assert "--return-tokens-as-token-ids" in argv and "--enable-auto-tool-choice" in argv
    assert int(flag(argv, "--max-model-len")) == recipe.MAX_MODEL_LEN > recipe.MAX_TOKENS
    assert "--enable-lora" not in argv


def test_policy_lora_mode_plan(tmp_path):
    out = run("serve_policy.sh", bash_env(tmp_path, DRY_RUN="1", LORA="1", GPU="0", PORT="9123",
                                          LORA_MODULES="opencode-lora=/adapters/final"))
    assert out.returncode == 0, out.stderr
    argv = planned(out.stdout)
    assert "CUDA_VISIBLE_DEVICES=0" in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in argv
    assert "VLLM_SERVER_DEV_MODE=1" not in argv and "--weight-transfer-config" not in argv
    assert "--enable-lora" in argv and flag(argv, "--max-lora-rank") == str(recipe.LORA_R)
    assert flag(argv, "--lora-modules") == "opencode-lora=/adapters/final"
    assert flag(argv, "--port") == "9123"
    for name in VLLM_FLAGS:
        assert name in argv


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"HOST": "0.0.0.0"}, "HOST=0.0.0.0 would expose vLLM's unauthenticated endpoints"),
        ({"STUB_GPUS": "0"}, "GPU 1 not found (nvidia-smi lists: 0)"),
        ({"STUB_GPUS": "none"}, "GPU 1 not found (nvidia-smi lists: none)"),
        ({"LORA": "maybe"}, "LORA='maybe' is not a yes/no value"),
        ({"ALLOW_NON_LOOPBACK": "sure", "HOST": "0.0.0.0"}, "ALLOW_NON_LOOPBACK='sure' is not a yes/no value"),
        ({"MAX_LORAS": "0"}, "MAX_LORAS=0 is out of range"),
    ],
)
def test_policy_bad_input_stops_with_one_line(tmp_path, extra, message):
    out = run("serve_policy.sh", bash_env(tmp_path, **extra))
    assert out.returncode != 0
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "stub.log").exists()  # vllm never started


def test_policy_yes_no_knobs_take_any_spelling(tmp_path):
    out = run("serve_policy.sh", bash_env(tmp_path, DRY_RUN="true", LORA="Yes", HOST="0.0.0.0",
                                          ALLOW_NON_LOOPBACK="on", GPU="0"))
    assert out.returncode == 0, out.stderr
    argv = planned(out.stdout)
    assert "--enable-lora" in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in argv
    assert flag(argv, "--host") == "0.0.0.0"
    assert not (tmp_path / "stub.log").exists()  # DRY_RUN=true only printed the command
    off = planned(run("serve_policy.sh", bash_env(tmp_path, DRY_RUN="yes", LORA="off")).stdout)
    assert "--weight-transfer-config" in off and "--enable-lora" not in off


def test_policy_port_in_use_stops(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run("serve_policy.sh", bash_env(tmp_path, PORT=str(port)))
    assert out.returncode != 0
    assert f"port {port} is already in use" in out.stderr
    assert not (tmp_path / "stub.log").exists()


def test_policy_execs_vllm_on_its_gpu(tmp_path):
    port = free_port()
    proc = start(["bash", str(ROOT / "serve_policy.sh")], env=bash_env(tmp_path, PORT=str(port), GPU="1"))
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=120)  # after chat_template.py writes the template
        line = (tmp_path / "stub.log").read_text()
        assert "CUDA_VISIBLE_DEVICES=1 VLLM_SERVER_DEV_MODE=1" in line
        assert f"--host {recipe.LOOPBACK} --port {port}" in line
    finally:
        stop(proc)


# --- serve_env.sh: inputs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"DATASETS": ""}, "DATASETS is not set"),
        ({"SPACE_HOST": ""}, "SPACE_HOST is not set"),
        ({"HF_TOKEN": ""}, "SANDBOX=hf-sandbox needs HF_TOKEN"),
        ({"SANDBOX": "modal"}, "SANDBOX='modal' is not offered"),
        ({"SANDBOX": "daytona", "E2B_API_KEY": "e2b_x"}, "SANDBOX=daytona needs DAYTONA_API_KEY"),
        ({"SANDBOX": "e2b"}, "SANDBOX=e2b needs E2B_API_KEY"),
        ({"SPACE_HOST": "job--8000.hf.jobs/capture"}, "SPACE_HOST='job--8000.hf.jobs/capture' is not a host name"),
        ({"ENV_HOST": "0.0.0.0"}, "would expose the env server's task API"),
        ({"ENV_HOST": "0.0.0.0", "ALLOW_NON_LOOPBACK": "2"}, "ALLOW_NON_LOOPBACK='2' is not a yes/no value"),
        ({"DRY_RUN": "perhaps"}, "DRY_RUN='perhaps' is not a yes/no value"),
        ({"ENV_PORT": "8000", "PUBLIC_PORT": "8000"}, "ENV_PORT and PUBLIC_PORT are both 8000"),
    ],
)
def test_env_bad_input_stops_with_one_line(tmp_path, extra, message):
    env = bash_env(tmp_path, DATASETS=str(tmp_path), SPACE_HOST="job--8000.hf.jobs", HF_TOKEN="hf_secret_value")
    env.update(extra)
    out = run("serve_env.sh", env)
    assert out.returncode != 0
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "hf_secret_value" not in out.stdout + out.stderr


def test_env_allows_another_host_with_any_yes_spelling(tmp_path):
    env = bash_env(tmp_path, DRY_RUN="TRUE", DATASETS="/t/train", SPACE_HOST="job--8000.hf.jobs", HF_TOKEN="x",
                   ENV_HOST="10.0.0.5", ALLOW_NON_LOOPBACK="yes")
    out = run("serve_env.sh", env)
    assert out.returncode == 0, out.stderr
    server = [shlex.split(line[4:]) for line in out.stdout.splitlines() if line.startswith("  $ ")][0]
    assert flag(server, "--host") == "10.0.0.5"


def test_env_plan_keeps_task_api_on_loopback_and_never_prints_secrets(tmp_path):
    env = bash_env(tmp_path, DRY_RUN="1", DATASETS="/t/train", SPACE_HOST="https://job--8000.hf.jobs/",
                   HF_TOKEN="hf_secret_value")
    out = run("serve_env.sh", env)
    assert out.returncode == 0, out.stderr
    server, gateway = [shlex.split(line[4:]) for line in out.stdout.splitlines() if line.startswith("  $ ")]
    assert "SPACE_HOST=job--8000.hf.jobs" in server
    assert f"MAX_CONCURRENT_ENVS={recipe.ENV_MAX_SESSIONS}" in server
    assert json.loads(next(a for a in server if a.startswith("OPENENV_HARBOR_AGENT_VERSIONS=")).split("=", 1)[1]) == {
        "opencode": recipe.OPENCODE_VERSION
    }
    assert server[server.index("serve") + 1 :][:3] == ["--", "harbor", "serve"]
    assert flag(server, "--host") == recipe.LOOPBACK and flag(server, "--port") == str(recipe.ENV_PORT)
    assert flag(server, "--max-output-tokens") == str(recipe.MAX_TOKENS)
    assert flag(server, "--llm-url") == f"http://{recipe.LOOPBACK}:{recipe.VLLM_PORT}"
    assert flag(gateway, "--listen-port") == str(recipe.PUBLIC_PORT)
    assert flag(gateway, "--upstream") == f"http://{recipe.LOOPBACK}:{recipe.ENV_PORT}"
    assert "dtn_secret_value" not in out.stdout + out.stderr


# --- the public port, on the real env server ---------------------------------------------------------


def synthetic_tasks(root: Path) -> Path:
    """A one-task Harbor dataset folder (the shape prepare_tasks.py writes)."""
    task = root / "tasks" / "t-0001"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "instruction.md").write_text("How many rows does data.csv have?\n")
    (task / "task.toml").write_text(
        f'[environment]\ndocker_image = "{recipe.TASK_IMAGE}"\ncpus = 1\nmemory_mb = 4096\n[agent]\ntimeout_sec = 60\n'
    )
    (task / "environment" / "Dockerfile").write_text(f"FROM {recipe.TASK_IMAGE}\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    return root


# The gateway's read deadlines, short so that the tests below see them act (recipe.py: the job's values).
SHORT_DEADLINES = {"GATEWAY_HEAD_TIMEOUT": "2", "GATEWAY_BODY_TIMEOUT": "2"}


def serve_env_env(tmp: Path, upstream: object, env_port: int, public_port: int, **extra: str) -> dict[str, str]:
    """serve_env.sh's environment on loopback: one synthetic task, `upstream` (the vLLM double) as the policy."""
    return bash_env(tmp, DATASETS=str(synthetic_tasks(tmp / "train")), SPACE_HOST=f"job--{public_port}.hf.jobs",
                    HF_TOKEN="hf_dummy", POLICY_URL=f"http://127.0.0.1:{upstream.server_address[1]}",
                    ENV_PORT=str(env_port), PUBLIC_PORT=str(public_port), PUBLIC_HOST="127.0.0.1",
                    OPENENV_CAPTURE_ADMIN_KEY=ADMIN, **extra)


@pytest.fixture(scope="module")
def job_ports(tmp_path_factory):
    """serve_env.sh (real env server + gateway) in front of a vLLM double; yields (env_port, public_port)."""
    tmp = tmp_path_factory.mktemp("serve_env")
    upstream = upstream_double.start(model=recipe.SERVED_MODEL_NAME)
    env_port, public_port = free_ports(2)
    env = serve_env_env(tmp, upstream, env_port, public_port, **SHORT_DEADLINES)
    log = open(tmp / "serve_env.log", "w")  # closed in the finally below
    proc = start(["bash", str(ROOT / "serve_env.sh")], env=env, log=log)
    try:
        wait_http(f"http://127.0.0.1:{env_port}/health", proc, timeout=60)
        wait_http(f"http://127.0.0.1:{public_port}/capture/health", proc, timeout=30)
        yield env_port, public_port, tmp / "serve_env.log"
    finally:
        stop(proc)
        log.close()
        upstream.shutdown()


def request(port: int, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    """Raw HTTP (the path is sent byte for byte, never normalised): returns (status, text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
    reply = conn.getresponse()
    text = reply.read().decode()
    conn.close()
    return reply.status, text


def listeners(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_env_server_runs_patched_with_capture_mounted_at_public_host(job_ports):
    _, public_port, log = job_ports
    text = log.read_text()
    assert "seam_patch: opencode seam sends the capture session as apiKey and x-api-key" in text
    assert f"capture   mounted on this app -> https://job--{public_port}.hf.jobs/capture" in text


def test_env_server_listens_on_loopback_only(job_ports):
    env_port, _, _ = job_ports
    assert listeners(env_port) == {"0100007F"}  # 127.0.0.1


def test_task_api_answers_on_loopback(job_ports):
    env_port, _, _ = job_ports
    status, text = request(env_port, "GET", "/harbor_env/splits")
    assert status == 200 and "train" in text, text


def test_public_port_forwards_capture_data_plane(job_ports):
    env_port, public_port, _ = job_ports
    status, text = request(env_port, "GET", "/capture/health")
    assert status == 200 and json.loads(text)["capture_level"] == "tokens"
    session = "gw-session-1"
    status, text = request(env_port, "POST", "/capture/sessions", {"session_id": session},
                           {"authorization": f"Bearer {ADMIN}"})
    assert status == 200, text
    chat = {"model": "LFM2.5-2.6B", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    # Only x-api-key: the HF Jobs proxy strips Authorization.
    status, text = request(public_port, "POST", "/capture/v1/chat/completions", chat, {"x-api-key": session})
    assert status == 200, text
    assert json.loads(text)["choices"][0]["message"]["content"] == "ok"
    status, text = request(public_port, "POST", "/capture/v1/chat/completions", {**chat, "stream": True},
                           {"x-api-key": session})
    assert status == 200 and "data: " in text and "[DONE]" in text
    admin = {"authorization": f"Bearer {ADMIN}"}
    status, text = request(env_port, "GET", f"/capture/sessions/{session}", headers=admin)
    assert json.loads(text)["n_turns"] == 2
    status, text = request(public_port, "POST", "/capture/v1/chat/completions", chat, {"x-api-key": "unknown"})
    assert status == 401 and "unknown capture session key" in text


def answer_to_head(port: int, head: str, timeout: float = 10) -> tuple[int, str]:
    """Send only a request's head over a raw socket (none of the body it announces) and read the answer: the status
    and body of a reply that comes without the gateway waiting for that body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                next(line.split(b":", 1)[1] for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
                     if line.lower().startswith(b"content-length:"))):
            chunk = sock.recv(65536)  # a gateway that reads the whole body first never answers: socket.timeout
            if not chunk:
                break
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.split(b"\r\n\r\n", 1)[1].decode()


def test_public_port_refuses_a_request_without_a_session_key_before_reading_its_body(job_ports):
    """Issue 26, item 15: an unauthenticated caller announcing a 100 MB body is answered at once, body unread."""
    _, public_port, _ = job_ports
    head = ("POST /capture/v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            "content-length: 100000000\r\n\r\n")
    status, text = answer_to_head(public_port, head)
    assert status == 401 and "no capture session key: send the session as x-api-key" in text


def test_public_port_refuses_a_body_over_the_cap_before_reading_it(job_ports):
    env_port, public_port, _ = job_ports
    live_session(env_port, "gw-session-cap")
    head = ("POST /capture/v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-api-key: gw-session-cap\r\n"
            f"content-type: application/json\r\ncontent-length: {recipe.CAPTURE_MAX_BODY_BYTES + 1}\r\n\r\n")
    status, text = answer_to_head(public_port, head)
    assert status == 413 and f"request body over {recipe.CAPTURE_MAX_BODY_BYTES} bytes" in text


def test_public_port_passes_a_long_multi_turn_agent_request(job_ports):
    """The cap leaves room for OpenCode's longest real requests: a conversation that fills the model's whole context
    (MAX_MODEL_LEN tokens at ~4 bytes each, the last tool output in \\u-escaped text) passes to the capture proxy."""
    env_port, public_port, _ = job_ports
    session = "gw-session-long"
    admin = {"authorization": f"Bearer {ADMIN}"}
    assert request(env_port, "POST", "/capture/sessions", {"session_id": session}, admin)[0] == 200
    turn = "x" * (recipe.MAX_MODEL_LEN * 4 // 64)
    messages = [{"role": "system", "content": "You are OpenCode. " * 500}]
    for i in range(32):
        messages += [{"role": "user" if i == 0 else "tool", "content": turn, "tool_call_id": f"call_{i}"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": f"call_{i + 1}", "type": "function",
                          "function": {"name": "bash", "arguments": json.dumps({"command": "cat data.csv"})}}]}]
    messages.append({"role": "tool", "content": "\u00e9" * recipe.MAX_MODEL_LEN, "tool_call_id": "call_33"})
    chat = {"model": "LFM2.5-2.6B", "messages": messages, "max_tokens": 16}
    assert len(json.dumps(chat).encode()) > recipe.MAX_MODEL_LEN * 4  # what a full context is at least
    status, text = request(public_port, "POST", "/capture/v1/chat/completions", chat, {"x-api-key": session})
    assert status == 200, text[:300]


@pytest.mark.parametrize("headers", [
    {"authorization": "Bearer s-1"}, {"x-api-key": "s-1"}, {"x-goog-api-key": "s-1"},
    {"authorization": "Bearer s-1", "x-api-key": "s-2"}, {"Authorization": "Basic abc", "x-api-key": "s-2"},
    {"authorization": "Basic abc"}, {}, {"x-api-key": ""},
])
def test_gateway_finds_the_session_key_where_the_capture_proxy_does(headers):
    from openenv.core.harness.capture.sessions import extract_api_key
    from starlette.datastructures import Headers

    import capture_gateway

    assert capture_gateway.session_key(Headers(headers)) == (extract_api_key(headers) or None)


def test_gateway_refuses_a_chunked_body_over_the_cap_while_reading_it(job_ports):
    """No Content-Length to go by: the gateway stops reading a live session's body past the cap and forwards nothing;
    under the cap the same chunked body is forwarded."""
    env_port, public_port, _ = job_ports
    session = live_session(env_port, "gw-chunked")
    chunk = json.dumps(CHAT).encode() + b" " * 65536
    head = (f"POST /capture/v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-api-key: {session}\r\nconnection: close\r\n"
            "content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n").encode()
    over = b"%x\r\n%s\r\n" % (len(chunk), chunk) * (recipe.CAPTURE_MAX_BODY_BYTES // len(chunk) + 2)
    answer = exchange(public_port, head + over + b"0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413") and b"request body over" in answer, answer[:200]
    assert turns(env_port, session) == 0
    answer = exchange(public_port, head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert turns(env_port, session) == 1


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/"), ("GET", "/health"), ("GET", "/harbor_env/splits"), ("GET", "/harbor_env/tasks"),
        ("POST", "/reset"), ("POST", "/step"), ("GET", "/schema"), ("POST", "/mcp"), ("GET", "/web"),
        ("GET", "/docs"), ("GET", "/openapi.json"),
        # vLLM's paths, including the unauthenticated dev endpoints.
        ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/update_weights"),
        ("POST", "/init_weight_transfer_engine"), ("POST", "/v1/load_lora_adapter"),
        # The capture proxy's control plane, and paths that could be normalised into another route.
        ("GET", "/capture/sessions"), ("POST", "/capture/sessions"), ("GET", "/capture/sessions/x/rollout"),
        ("GET", "/capture/../harbor_env/splits"), ("GET", "/capture/%2e%2e/harbor_env/splits"),
        ("GET", "/capture/./health"), ("GET", "/capture//health"), ("GET", "/capture"), ("GET", "/captureX/health"),
        ("GET", "/capture%2fhealth"),
    ],
)
def test_public_port_refuses_everything_else(job_ports, method, path):
    env_port, public_port, _ = job_ports
    headers = {"authorization": f"Bearer {ADMIN}"}
    status, text = request(public_port, method, path, {} if method == "POST" else None, headers)
    assert status == 404, (path, status, text)
    assert "only /capture/ is served" in text


def test_refused_paths_exist_on_loopback(job_ports):
    """The 404s above are the gateway's doing: the same routes answer on the env server's own port."""
    env_port, _, _ = job_ports
    assert request(env_port, "GET", "/health")[0] == 200
    assert request(env_port, "GET", "/capture/sessions", headers={"authorization": f"Bearer {ADMIN}"})[0] == 200


# --- the public port under abuse (issue 44): limits the gateway itself enforces -------------------------------------
# Each test drives the real gateway (serve_env.sh's, or one more in front of the same env server) over raw sockets.
# Latency of a legit session during each abuse is measured by benchmarks/gateway_abuse.py, never asserted here.
CHAT = {"model": "LFM2.5-2.6B", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
CLOSE_WITHIN_S = 30  # far past every deadline the tests set (2 s): a connection still open then was never closed


def live_session(env_port: int, session: str) -> str:
    """A capture session registered on the env server (its key is what a sandbox's OpenCode sends)."""
    status, text = request(env_port, "POST", "/capture/sessions", {"session_id": session},
                           {"authorization": f"Bearer {ADMIN}"})
    assert status == 200, text
    return session


def chat_head(key: str, length: int, extra: str = "", close: bool = True) -> bytes:
    """A chat call's head; `close`: the server closes the connection after answering (exchange() reads till then)."""
    return (f"POST /capture/v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-api-key: {key}\r\n{extra}"
            f"{'connection: close\r\n' if close else ''}content-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n").encode()


def exchange(port: int, data: bytes, timeout: float = CLOSE_WITHIN_S) -> bytes:
    """Send `data` on a fresh connection and read until the server closes it: what the server answered (a server
    that closes mid-send may reset the connection: what came before the reset is the answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        answer = b""
        try:
            sock.sendall(data)
            while chunk := sock.recv(65536):
                answer += chunk
        except (BrokenPipeError, ConnectionResetError):
            pass
    return answer


def closed_by_server(sock: socket.socket, timeout: float = CLOSE_WITHIN_S, dribble: bytes = b"") -> bytes | None:
    """Wait up to `timeout` s for the server to close `sock`, sending one byte of `dribble` every 0.2 s meanwhile;
    returns what the server sent before closing, or None if it was still open at the end."""
    deadline, sent, answer = time.monotonic() + timeout, 0, b""
    while time.monotonic() < deadline:
        try:
            if sent < len(dribble):
                sock.sendall(dribble[sent:sent + 1])
                sent += 1
            ready, _, _ = select.select([sock], [], [], 0.2)
            if ready:
                chunk = sock.recv(65536)
                if not chunk:
                    return answer
                answer += chunk
        except (BrokenPipeError, ConnectionResetError):
            return answer
    return None


def test_public_port_refuses_heads_over_the_cap_and_forwards_nothing(job_ports):
    """Defect 1: a head past recipe.GATEWAY_MAX_HEAD_BYTES never reaches the env server, whether it arrives in one
    read (16 KB + 1) or streams in (4 MB); one under the cap passes."""
    env_port, public_port, _ = job_ports
    session = live_session(env_port, "gw-head-cap")
    body = json.dumps(CHAT).encode()
    calls = len(upstream_double.REQUESTS)
    answer = exchange(public_port, chat_head(session, len(body), f"x-pad: {'a' * recipe.GATEWAY_MAX_HEAD_BYTES}\r\n")
                      + body)
    assert answer.split(b" ", 2)[1:2] in ([b"400"], [b"431"]), answer[:200]
    # Refused while it streams in: the gateway closes with most of it unread, so the client may see only a reset.
    answer = exchange(public_port, chat_head(session, len(body), f"x-pad: {'a' * 4 * 2**20}\r\n") + body)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert turns(env_port, session) == 0 and len(upstream_double.REQUESTS) == calls
    answer = exchange(public_port, chat_head(session, len(body), f"x-pad: {'a' * 8192}\r\n") + body)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert turns(env_port, session) == 1


def test_public_port_closes_an_unfinished_head_past_the_cap_at_once(job_ports):
    """Defect 1: a head that never ends is not buffered: past the cap the gateway answers 400 and closes."""
    _, public_port, _ = job_ports
    with socket.create_connection(("127.0.0.1", public_port), timeout=CLOSE_WITHIN_S) as sock:
        try:
            sock.sendall(b"GET /capture/v1/models HTTP/1.1\r\nHost: x\r\n" + b"x-pad: a\r\n" * 8192)  # 80 KB, no end
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = closed_by_server(sock)
    assert answer is not None and answer.startswith(b"HTTP/1.1 400"), answer


def test_public_port_closes_a_head_that_never_finishes(job_ports):
    """Defect 2: a head dribbled a byte at a time (which resets uvicorn's keep-alive timer) or never sent at all is
    closed at recipe's GATEWAY_HEAD_TIMEOUT (2 s here), and so is a keep-alive connection whose next head dribbles."""
    env_port, public_port, _ = job_ports
    with socket.create_connection(("127.0.0.1", public_port), timeout=CLOSE_WITHIN_S) as silent, \
            socket.create_connection(("127.0.0.1", public_port), timeout=CLOSE_WITHIN_S) as dribbler:
        dribbler.sendall(b"POST /capture/v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        assert closed_by_server(dribbler, dribble=b"x-a: " + b"a" * 1000) is not None
        assert closed_by_server(silent) is not None
    session = live_session(env_port, "gw-keepalive")
    body = json.dumps(CHAT).encode()
    with socket.create_connection(("127.0.0.1", public_port), timeout=CLOSE_WITHIN_S) as sock:
        sock.sendall(chat_head(session, len(body), close=False) + body)
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert closed_by_server(sock, dribble=b"GET /capture/v1/models HTTP/1.1\r\n" + b"x" * 1000) is not None


def test_public_port_answers_408_to_a_body_that_stalls(job_ports):
    """Defect 2: a live session's body that stops arriving is answered 408 at GATEWAY_BODY_TIMEOUT (2 s here)."""
    env_port, public_port, _ = job_ports
    session = live_session(env_port, "gw-slow-body")
    with socket.create_connection(("127.0.0.1", public_port), timeout=CLOSE_WITHIN_S) as sock:
        sock.sendall(chat_head(session, 1000) + b'{"model": ')
        answer = closed_by_server(sock)
    assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
    assert turns(env_port, session) == 0


@pytest.fixture(scope="module")
def capped_gateway(job_ports, tmp_path_factory):
    """One more real gateway in front of the same env server, with a cap of 8 idle connections and the job's own
    60 s head deadline (so that only the cap closes connections in the test); yields its port."""
    env_port, _, _ = job_ports
    port = free_port()
    log = open(tmp_path_factory.mktemp("capped") / "gateway.log", "w")  # closed in the finally below
    proc = start([sys.executable, str(ROOT / "capture_gateway.py"), "--listen-host", "127.0.0.1", "--listen-port",
                  str(port), "--upstream", f"http://127.0.0.1:{env_port}"], log=log,
                 env={"GATEWAY_IDLE_CONNECTIONS": "8", "GATEWAY_HEAD_TIMEOUT": "60",
                      "OPENENV_CAPTURE_ADMIN_KEY": ADMIN})
    try:
        wait_http(f"http://127.0.0.1:{port}/capture/health", proc, timeout=30)
        yield port
    finally:
        stop(proc)
        log.close()


def test_a_connection_flood_closes_idle_connections_never_a_live_sessions(job_ports, capped_gateway):
    """Defect 2: past GATEWAY_IDLE_CONNECTIONS (8 here) the longest-idle connection is closed, so 24 silent
    connections cannot exhaust the gateway's descriptors; a live session's request in flight (its body half sent)
    is not idle, survives the flood and is answered."""
    env_port, _, _ = job_ports
    session = live_session(env_port, "gw-flood")
    body = json.dumps(CHAT).encode()
    with socket.create_connection(("127.0.0.1", capped_gateway), timeout=CLOSE_WITHIN_S) as legit:
        legit.sendall(chat_head(session, len(body)) + body[:5])
        time.sleep(0.5)  # the gateway has checked the key and is reading the body
        flood = [socket.create_connection(("127.0.0.1", capped_gateway), timeout=CLOSE_WITHIN_S) for _ in range(24)]
        try:
            closed = [sock for sock in flood if closed_by_server(sock, timeout=0.5) is not None]
            legit.sendall(body[5:])
            answer = legit.recv(65536)
        finally:
            for sock in flood:
                sock.close()
    assert len(closed) >= 16, len(closed)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert turns(env_port, session) == 1


def session_reads(log: Path) -> int:
    """How often the env server answered the capture proxy's session list (its access log)."""
    return log.read_text().count('"GET /capture/sessions HTTP/1.1" 200')


def test_made_up_keys_are_refused_before_their_bodies_and_cost_the_env_server_few_reads(job_ports):
    """Defect 3: 40 requests with made-up keys, each announcing a 4 MB body it never sends, are all answered 401
    at once; the gateway learnt the live sessions from the env server's session list, read at most once per
    recipe.GATEWAY_SESSION_READ_S however many keys were tried."""
    _, public_port, log = job_ports
    before, began = session_reads(log), time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: answer_to_head(public_port, chat_head(f"s{i:024x}", 4 * 2**20).decode()),
                                range(40)))
    elapsed = time.monotonic() - began
    assert all(status == 401 and "unknown capture session" in text for status, text in answers), answers[:3]
    assert session_reads(log) - before <= 2 + elapsed / recipe.GATEWAY_SESSION_READ_S


def test_count_tokens_and_models_answer_only_a_live_session(job_ports):
    """Defects 3 and 4: the capture app answers count_tokens before its session check and /v1/models to anyone (one
    vLLM call each): through the gateway both need a live session's key, and a made-up one costs vLLM nothing."""
    env_port, public_port, _ = job_ports
    session = live_session(env_port, "gw-aux")
    gets = len(upstream_double.GETS)
    messages = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 4000}]}
    for key in ({}, {"x-api-key": "junk"}):
        assert request(public_port, "POST", "/capture/v1/messages/count_tokens", messages, key)[0] == 401
        assert request(public_port, "GET", "/capture/v1/models", None, key)[0] == 401
    assert upstream_double.GETS[gets:] == []
    status, text = request(public_port, "POST", "/capture/v1/messages/count_tokens", messages, {"x-api-key": session})
    assert status == 200 and json.loads(text)["input_tokens"] > 0
    status, text = request(public_port, "GET", "/capture/v1/models", None, {"x-api-key": session})
    assert status == 200 and recipe.SERVED_MODEL_NAME in text


def test_keyless_health_says_ok_and_nothing_internal(job_ports):
    """Defect 4: the public readiness check shows no session count, no engine URL, no capture settings."""
    env_port, public_port, _ = job_ports
    live_session(env_port, "gw-health")
    status, text = request(public_port, "GET", "/capture/health")
    assert status == 200 and json.loads(text) == {"status": "ok"}, text


def children(pid: int) -> dict[int, str]:
    """The child processes of `pid`: pid -> command line."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
    return found


def test_a_killed_gateway_is_restarted_while_the_env_server_and_its_sessions_go_on(tmp_path):
    """If the gateway dies anyway (here: SIGKILL between two calls of a rollout's session), serve_env.sh restarts it
    and logs it; the env server (and so the trainer, which run_job.sh stops only when serve_env.sh exits) goes on, and
    the same session's next call is answered. Past GATEWAY_RESTARTS (1 here) in a row, serve_env.sh stops, saying so."""
    upstream = upstream_double.start(model=recipe.SERVED_MODEL_NAME)
    env_port, public_port = free_ports(2)
    env = serve_env_env(tmp_path, upstream, env_port, public_port, GATEWAY_RESTARTS="1")
    log_path = tmp_path / "serve_env.log"
    with log_path.open("w") as log:
        proc = start(["bash", str(ROOT / "serve_env.sh")], env=env, log=log)
        try:
            wait_http(f"http://127.0.0.1:{env_port}/health", proc, timeout=60)
            wait_http(f"http://127.0.0.1:{public_port}/capture/health", proc, timeout=30)
            session = live_session(env_port, "gw-restart")
            call = ("POST", "/capture/v1/chat/completions", CHAT, {"x-api-key": session})
            assert request(public_port, *call)[0] == 200
            server = next(pid for pid, cmd in children(proc.pid).items() if "seam_patch.py" in cmd)
            for kill in (1, 2):
                gateway = next(pid for pid, cmd in children(proc.pid).items() if "capture_gateway.py" in cmd)
                os.kill(gateway, signal.SIGKILL)
                if kill == 1:
                    wait_http(f"http://127.0.0.1:{public_port}/capture/health", proc, timeout=30)
                    assert request(public_port, *call)[0] == 200 and turns(env_port, session) == 2
                    assert server in children(proc.pid) and proc.poll() is None
            proc.wait(timeout=30)
        finally:
            stop(proc)
            upstream.shutdown()
    text = log_path.read_text()
    assert "capture gateway exited (status 137); restarting it (1 of 1 in a row)" in text
    assert "capture gateway exited (status 137) after 1 restarts in a row (GATEWAY_RESTARTS)" in text
    assert proc.returncode != 0


@pytest.mark.parametrize("restarts", [0, 1])
def test_gateway_restarts_counts_the_restarts_and_0_means_none(tmp_path, restarts):
    """GATEWAY_RESTARTS=N: serve_env.sh starts an exiting gateway N + 1 times, then stops, saying so; 0 is allowed.
    The env server and the gateway are a PYTHON wrapper's stand-ins (a sleep, an exit 3); recipe.py runs for real."""
    python = tmp_path / "python"
    python.write_text(f"""#!/usr/bin/env bash
case "$1" in
  */seam_patch.py) exec sleep 60 ;;
  */capture_gateway.py) echo started >>"{tmp_path}/gateway.starts"; exit 3 ;;
  *) exec "$REAL_PYTHON" "$@" ;;
esac
""")
    python.chmod(0o755)
    env_port, public_port = free_ports(2)
    env = bash_env(tmp_path, PYTHON=str(python), DATASETS=str(tmp_path), SPACE_HOST="job--8000.hf.jobs",
                   HF_TOKEN="hf_dummy", ENV_PORT=str(env_port), PUBLIC_PORT=str(public_port),
                   GATEWAY_RESTARTS=str(restarts))
    out = run("serve_env.sh", env)
    assert out.returncode != 0
    assert f"capture gateway exited (status 3) after {restarts} restarts in a row (GATEWAY_RESTARTS)" in out.stderr
    assert (tmp_path / "gateway.starts").read_text().count("started") == restarts + 1


# --- stretch: the real OpenCode client through a proxy that strips Authorization ---------------------


def run_opencode(tmp: Path, config: dict) -> subprocess.CompletedProcess:
    """`opencode run` one-shot, isolated from this machine's config (FACTS.md: OpenCode 1.18.33)."""
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    (tmp / "opencode.json").write_text(json.dumps(config))
    env = opencode_env(home, tmp / "opencode.json")
    model = f"{seams.OPENCODE_PROVIDER}/{seams.agent_facing_model(recipe.SERVED_MODEL_NAME)}"
    return subprocess.run([OPENCODE, "run", "--model", model, "Say ok."], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=120)


def opencode_config(base_url: str, session: str) -> dict:
    _model, kwargs, _env, _proc = seams.get("opencode").resolve(
        base_url=base_url, session=session, model=recipe.SERVED_MODEL_NAME
    )
    return kwargs["opencode_config"]


def turns(env_port: int, session: str) -> int:
    admin = {"authorization": f"Bearer {ADMIN}"}
    status, text = request(env_port, "GET", f"/capture/sessions/{session}", headers=admin)
    assert status == 200, text
    return json.loads(text)["n_turns"]


def test_real_opencode_through_stripping_proxy_and_gateway(job_ports, tmp_path, monkeypatch):
    envserver.require("a real OpenCode client", "" if OPENCODE else NO_OPENCODE)
    env_port, public_port, _ = job_ports
    proxy = jobs_proxy_double.start(f"http://127.0.0.1:{public_port}")
    base_url = f"http://127.0.0.1:{proxy.server_address[1]}/capture"
    try:
        # Unpatched seam: OpenCode's only credential is the Bearer, which the proxy drops -> 401, nothing recorded.
        monkeypatch.setitem(seams.SEAMS, "opencode", seams.SEAMS["opencode"])
        admin = {"authorization": f"Bearer {ADMIN}"}
        assert request(env_port, "POST", "/capture/sessions", {"session_id": "oc-plain"}, admin)[0] == 200
        (tmp_path / "plain").mkdir()
        plain = run_opencode(tmp_path / "plain", opencode_config(base_url, "oc-plain"))
        assert plain.returncode != 0
        assert "Bearer oc-plain" in jobs_proxy_double.DROPPED
        assert turns(env_port, "oc-plain") == 0
        # Patched seam: x-api-key survives the proxy; the agent call is recorded under the session.
        seam_patch.apply()
        assert request(env_port, "POST", "/capture/sessions", {"session_id": "oc-patched"}, admin)[0] == 200
        dropped_before = len(jobs_proxy_double.DROPPED)
        (tmp_path / "patched").mkdir()
        patched = run_opencode(tmp_path / "patched", opencode_config(base_url, "oc-patched"))
        assert patched.returncode == 0, patched.stdout + patched.stderr
        assert turns(env_port, "oc-patched") >= 1
        assert "Bearer oc-patched" in jobs_proxy_double.DROPPED[dropped_before:]  # OpenCode did send it; it was cut
    finally:
        proxy.shutdown()
