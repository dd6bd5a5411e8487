"""serve_policy.sh and serve_env.sh, driven through bash with stub `vllm`/`nvidia-smi` on PATH, and the
public-port guarantee proven on the REAL env server (openenv 0.10.0, capture mounted at /capture) behind
capture_gateway.py: on the public port only /capture/... answers."""

from __future__ import annotations

import http.client
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
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
        ({"STUB_GPUS": "none"}, "nvidia-smi failed"),
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
        ({"ENV_PORT": "8000", "PUBLIC_PORT": "8000"}, "must not share the public port"),
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


@pytest.fixture(scope="module")
def job_ports(tmp_path_factory):
    """serve_env.sh (real env server + gateway) in front of a vLLM double; yields (env_port, public_port)."""
    tmp = tmp_path_factory.mktemp("serve_env")
    upstream = upstream_double.start(model=recipe.SERVED_MODEL_NAME)
    env_port, public_port = free_ports(2)
    env = bash_env(
        tmp, DATASETS=str(synthetic_tasks(tmp / "train")), SPACE_HOST=f"job--{public_port}.hf.jobs",
        HF_TOKEN="hf_dummy", POLICY_URL=f"http://127.0.0.1:{upstream.server_address[1]}",
        ENV_PORT=str(env_port), PUBLIC_PORT=str(public_port), PUBLIC_HOST="127.0.0.1",
        OPENENV_CAPTURE_ADMIN_KEY=ADMIN,
    )
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
    status, text = request(public_port, "GET", "/capture/health")
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
    assert status == 401 and "unknown API key" in text


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
    _, public_port, _ = job_ports
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


def test_gateway_refuses_a_chunked_body_over_the_cap_while_reading_it():
    """No Content-Length to go by: the gateway stops reading past the cap and forwards nothing (its upstream here is a
    closed port: a forwarded request would be a 502)."""
    from starlette.testclient import TestClient

    import capture_gateway
    from tests.offline import closed_url

    chunk = b"x" * 65536

    def body():
        for _ in range(recipe.CAPTURE_MAX_BODY_BYTES // len(chunk) + 1):
            yield chunk

    with TestClient(capture_gateway.create_app(closed_url())) as client:
        reply = client.post("/capture/v1/chat/completions", content=body(), headers={"x-api-key": "s-1"})
        assert reply.status_code == 413 and "request body over" in reply.text
        reply = client.post("/capture/v1/chat/completions", content=b"{}", headers={"x-api-key": "s-1"})
        assert reply.status_code == 502  # under the cap it is forwarded (and the closed upstream refuses it)


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


# --- stretch: the real OpenCode client through a proxy that strips Authorization ---------------------

# setup.sh installs the pinned client under .opencode/; OPENCODE_BIN or PATH may point elsewhere.
_LOCAL_OPENCODE = Path(__file__).resolve().parents[1] / ".opencode" / "node_modules" / ".bin" / "opencode"
OPENCODE = os.environ.get("OPENCODE_BIN") or (
    str(_LOCAL_OPENCODE) if _LOCAL_OPENCODE.exists() else shutil.which("opencode")
)


def run_opencode(tmp: Path, config: dict) -> subprocess.CompletedProcess:
    """`opencode run` one-shot, isolated from this machine's config (FACTS.md: OpenCode 1.18.33)."""
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    (tmp / "opencode.json").write_text(json.dumps(config))
    env = {
        "PATH": os.environ["PATH"], "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".data"), "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".state"), "OPENCODE_CONFIG": str(tmp / "opencode.json"),
        "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    }
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


@pytest.mark.skipif(not OPENCODE, reason="needs the OpenCode CLI: npm install opencode-ai@1.18.33, set OPENCODE_BIN")
def test_real_opencode_through_stripping_proxy_and_gateway(job_ports, tmp_path, monkeypatch):
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
