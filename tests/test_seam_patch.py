"""seam_patch against the real openenv 0.10.0: the opencode seam carries the session as x-api-key, and the
real capture proxy accepts a request whose only credential is that header (as behind the HF Jobs proxy)."""

from __future__ import annotations

import json
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from openenv.harbor import seams
from stubs import upstream_double
from stubs.procs import free_port, start, stop, wait_http

import seam_patch
from sandbox_lifecycle import ShapeError

ROOT = Path(__file__).resolve().parents[1]
SESSION = "rollout-session-1"
ADMIN = "test-admin-key"


@pytest.fixture
def patched(monkeypatch):
    """Apply the patch, restoring the pristine seam table afterwards."""
    monkeypatch.setitem(seams.SEAMS, "opencode", seams.SEAMS["opencode"])
    seam_patch.apply()
    return seams.SEAMS["opencode"]


def resolve(session: str = SESSION, training: bool = False) -> dict:
    _model, kwargs, _env, _proc = seams.get("opencode").resolve(
        base_url="https://job--8000.hf.jobs/capture", session=session, model="LiquidAI/LFM2.5-2.6B", training=training
    )
    return kwargs["opencode_config"]["provider"][seams.OPENCODE_PROVIDER]


def test_pristine_seam_has_no_header(monkeypatch):
    monkeypatch.setitem(seams.SEAMS, "opencode", seams.SEAMS["opencode"])
    if getattr(seams.SEAMS["opencode"].kwargs, seam_patch._PATCHED, False):
        pytest.skip("seam already patched in this process")
    assert "headers" not in resolve()["options"]


def test_patched_seam_sends_session_as_apikey_and_x_api_key(patched):
    provider = resolve()
    assert provider["options"]["headers"]["x-api-key"] == SESSION
    assert provider["options"]["apiKey"] == SESSION
    assert provider["options"]["baseURL"] == "https://job--8000.hf.jobs/capture/v1"
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    # A second session gets its own key, not the first one's (no shared mutable state).
    assert resolve("other-session")["options"]["headers"]["x-api-key"] == "other-session"


def test_training_resolution_keeps_header_and_training_profile(patched):
    _model, kwargs, _env, _proc = seams.get("opencode").resolve(
        base_url="http://x/capture", session=SESSION, model="m", training=True
    )
    config = kwargs["opencode_config"]
    assert config["provider"][seams.OPENCODE_PROVIDER]["options"]["headers"] == {"x-api-key": SESSION}
    assert config["tools"] == {"task": False, "question": False, "webfetch": False}


def trial_tools(tmp_path: Path, training: bool) -> dict:
    """The tools OpenCode gets in the trial config openenv's run_rollout builds for a rollout (training: the trainer
    passed its sampling policy; eval: it did not)."""
    from openenv.harbor.rollout import build_trial_config

    config = build_trial_config(task_dir=tmp_path, harness="opencode", sandbox="e2b", intercept_url="http://x/capture",
                                session_id=SESSION, model="LiquidAI/LFM2.5-2.6B", trial_name="t", trials_dir=tmp_path,
                                training=training)
    return config.agent.kwargs["opencode_config"].get("tools", {})


def test_an_eval_rollout_gets_the_tools_its_training_rollouts_had(patched, tmp_path):
    # openenv turns off delegation, questions and web fetch only where a training sampling policy is passed; an eval
    # without the patch scored the adapter with three tools it never trained with (a ~1,500-token longer prompt).
    assert trial_tools(tmp_path, training=False) == trial_tools(tmp_path, training=True)
    assert trial_tools(tmp_path, training=False) == {"task": False, "question": False, "webfetch": False}


def test_apply_twice_changes_nothing(patched):
    before = seams.SEAMS["opencode"]
    config_before = resolve()
    seam_patch.apply()
    assert seams.SEAMS["opencode"] is before
    assert resolve() == config_before


def test_unexpected_seam_shape_is_a_clear_error(monkeypatch):
    odd = replace(seams.SEAMS["opencode"], kwargs=lambda base_url, session, model: {"opencode_config": {}})
    monkeypatch.setitem(seams.SEAMS, "opencode", odd)
    with pytest.raises(ShapeError, match="opencode_config.provider.intercepted.options; missing: 'provider'"):
        seam_patch.apply()


def test_missing_seam_is_a_clear_error(monkeypatch):
    monkeypatch.delitem(seams.SEAMS, "opencode")
    with pytest.raises(ShapeError, match="opencode seam is not the shape .* missing: 'opencode'"):
        seam_patch.apply()


def test_check_command_exits_zero_and_says_so():
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "seam_patch.py"), "check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "apiKey and x-api-key" in out.stdout
    assert "failed at the engine" in out.stdout


def test_check_reads_the_rollout_seam_without_importing_openenv_core():
    """run_job.sh's step 2 runs `check` before vLLM starts: importing openenv.harbor.rollout would import openenv.core
    (with gradio, as in the job's image: about 4 of the check's 5 CPU-s) only to wrap a function in a process that
    then exits."""
    import subprocess

    code = ("import sys, seam_patch; seam_patch.main(['check']); print('imported:', "
            "[m for m in ('openenv.core', 'openenv.harbor.rollout') if sys.modules.get(m) is not None])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "imported: []" in out.stdout, out.stdout


def test_the_rollout_seam_is_the_module_level_export_session_that_run_rollout_calls():
    """What `serve` wraps must be the name run_rollout looks up when it calls it; the installed openenv has that shape,
    and a rollout module that binds or calls it otherwise is refused."""
    import importlib.util

    source = Path(importlib.util.find_spec("openenv.harbor.rollout").origin).read_text()
    assert seam_patch.calls_export_session(source)
    moved = "from openenv.core.harness.capture import export\ndef run_rollout():\n    export.export_session(1)\n"
    inner = "def run_rollout():\n    from x import export_session\n    export_session(1)\n"
    unused = "from openenv.core.harness.capture.export import export_session\n"
    assert not any(map(seam_patch.calls_export_session, (moved, inner, unused)))


def _post(url: str, body: dict, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=20) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _get(url: str, headers: dict) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as reply:
        return json.loads(reply.read())


@pytest.fixture(scope="module")
def capture_proxy():
    """The real openenv capture proxy on 127.0.0.1, in front of a tiny vLLM double."""
    upstream = upstream_double.start(model="LiquidAI/LFM2.5-2.6B")
    port = free_port()
    proc = start([
        sys.executable, "-m", "openenv.core.harness.capture.server",
        "--llm-url", f"http://127.0.0.1:{upstream.server_address[1]}", "--model", "LiquidAI/LFM2.5-2.6B",
        "--host", "127.0.0.1", "--port", str(port), "--capture-level", "tokens", "--admin-key", ADMIN,
    ])
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
        upstream.shutdown()


def test_capture_proxy_accepts_session_in_x_api_key_only(capture_proxy, patched):
    status, created = _post(f"{capture_proxy}/sessions", {"session_id": SESSION}, {"authorization": f"Bearer {ADMIN}"})
    assert status == 200, created
    # Exactly the headers OpenCode is configured to send, with Authorization dropped (the Jobs proxy strips it).
    headers = resolve(created["session_id"])["options"]["headers"]
    assert set(headers) == {"x-api-key"}
    body = {"model": "LFM2.5-2.6B", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    status, reply = _post(f"{capture_proxy}/v1/chat/completions", body, headers)
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] == "ok"
    recorded = _get(f"{capture_proxy}/sessions/{SESSION}", {"authorization": f"Bearer {ADMIN}"})
    assert recorded["n_turns"] == 1


def test_capture_proxy_refuses_unknown_x_api_key(capture_proxy):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    before = len(upstream_double.REQUESTS)
    status, reply = _post(f"{capture_proxy}/v1/chat/completions", body, {"x-api-key": "not-a-session"})
    assert status == 401
    assert "unknown API key" in reply["error"]["message"]
    assert len(upstream_double.REQUESTS) == before  # nothing reached the model
