"""The ground every script stands on: recipe.py's checks, the pinned window, and the README/CI contract."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import recipe

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("repo_id", ["you/LFM2.5-2.6B-opencode-lora-RL", "Org-1/name_2.x"])
def test_require_repo_id_accepts_owner_name(repo_id: str) -> None:
    assert recipe.require_repo_id(repo_id, "ADAPTER_REPO") == repo_id


@pytest.mark.parametrize(
    ("repo_id", "fragment"),
    [
        ("", "ADAPTER_REPO is not set"),
        (None, "ADAPTER_REPO is not set"),
        ("just-a-name", "not a valid repo id"),
        ("a/b/c", "not a valid repo id"),
        ("you/na me", "not a valid repo id"),
        ("you/..", "not a valid repo id"),
        ("https://huggingface.co/you/repo", "not a valid repo id"),
        # The Hub's own rules (huggingface_hub's validate_repo_id), which a looser check of ours once let through.
        ("you/x--y", r"not a valid repo id \(the Hub's rule: Cannot have -- or \.\. in repo_id"),
        ("you/x.git", r"not a valid repo id \(the Hub's rule: Repo_id cannot end by '\.git'"),
    ],
)
def test_require_repo_id_rejects_malformed(repo_id: str | None, fragment: str) -> None:
    with pytest.raises(recipe.ConfigError, match=fragment) as err:
        recipe.require_repo_id(repo_id, "ADAPTER_REPO")
    assert "\n" not in str(err.value)


def test_require_token_reads_env_and_explains_when_missing() -> None:
    assert recipe.require_token({"HF_TOKEN": " hf_abc "}) == "hf_abc"
    with pytest.raises(recipe.ConfigError, match="HF_TOKEN is not set"):
        recipe.require_token({"HF_TOKEN": "  "})


def test_pins_hold_in_the_installed_environment() -> None:
    pins = recipe.pinned_versions()
    assert pins["trl"] == "==1.15.0"  # 1.16 refuses Lfm2ForCausalLM.
    assert pins["transformers"] == "==5.17.0"
    assert pins["kernels"] == "==0.16.0"
    recipe.check_versions(("trl", "transformers", "peft", "openenv", "kernels", "harbor", "huggingface-hub"))


def test_check_versions_names_the_fix_for_a_wrong_version() -> None:
    with pytest.raises(recipe.ConfigError) as err:
        recipe.check_versions(("trl",), "trl[peft]==1.16.0  # what a user might have\n")
    assert f"trl {metadata.version('trl')} is installed" in str(err.value)
    assert "pip install 'trl==1.16.0'" in str(err.value)


def test_check_versions_reports_a_missing_package() -> None:
    with pytest.raises(recipe.ConfigError, match="no-such-package-xyz is not installed"):
        recipe.check_versions(("no-such-package-xyz",), "no-such-package-xyz==1.0\n")


def test_recipe_cli_prints_knobs_for_shell_scripts() -> None:
    out = subprocess.run(
        [sys.executable, "recipe.py", "MAX_TOKENS", "LORA_TARGET_MODULES"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    assert out == [str(recipe.MAX_TOKENS), ",".join(recipe.LORA_TARGET_MODULES)]
    bad = subprocess.run([sys.executable, "recipe.py", "os"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown knob 'os'" in bad.stderr


def test_common_sh_reads_every_knob_once_and_answers_as_recipe_py_does() -> None:
    """common.sh loads `recipe.py --all` when sourced; its `recipe` function then answers without Python, the same
    lines `recipe.py NAME...` prints, and fails on a name recipe.py does not know."""
    names = ["MAX_TOKENS", "LORA_TARGET_MODULES", "TASK_IMAGE", "PIP_CHECK_ACCEPTED", "TEMPERATURE"]
    direct = subprocess.run([sys.executable, "recipe.py", *names], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    script = f'source common.sh; recipe {" ".join(names)}; recipe os || echo "refused: $?"'
    env = {**os.environ, "PYTHON": sys.executable, "DRY_RUN": "1"}
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout == direct + "refused: 1\n", out.stderr
    assert "unknown knob os" in out.stderr


def test_cleanup_waits_for_children_only_as_long_as_they_take_to_stop(tmp_path: Path) -> None:
    """cleanup TERMs every child's process group and KILLs what a grace later is left: a script that started no
    child exits at once (a refused input is one line, not one line and a second's wait), a child that stops on TERM
    ends the wait, and one that ignores TERM is killed when the grace is up. `at_once` calls cleanup right after
    each of 30 starts, before the child's setsid may have made its group: TERM to the group alone left about one
    child in four running."""
    stubborn = "trap '' TERM; while :; do sleep 0.1; done"
    script = f"""source common.sh
sleep() {{ printf '%s\\n' "$1" >>"$SLEEPS"; command sleep "$1"; }}
LOG_DIR={tmp_path}/logs
started=()
case "$CASE" in
  none) ;;
  quick) start_bg quick sleep 300 ;;
  at_once)  # each child cleaned up on its own: a later cleanup would also stop an earlier survivor
    for _ in $(seq 30); do CHILD_PIDS=(); start_bg at_once sleep 300; cleanup; started+=("${{CHILD_PIDS[@]}}"); done
    CHILD_PIDS=() ;;
  stubborn) start_bg stubborn bash -c "{stubborn}"; command sleep 0.5 ;;
esac
cleanup
command sleep 0.5  # time to be reaped: a zombie still answers kill -0
for pid in "${{CHILD_PIDS[@]}}" "${{started[@]}}"; do
  ps -o stat= -g "$pid" | grep -qv '^Z' && echo "alive: $pid" && kill -KILL -- "-$pid"
done
true"""
    slept = {}
    for case in ("none", "quick", "stubborn", "at_once"):
        sleeps = tmp_path / f"{case}.sleeps"
        env = {**os.environ, "PYTHON": sys.executable, "CASE": case, "SLEEPS": str(sleeps)}
        out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "alive" not in out.stdout, (case, out.stdout, out.stderr)
        slept[case] = sum(float(s) for s in sleeps.read_text().split()) if sleeps.exists() else 0.0
    assert slept["none"] == 0.0, slept
    assert slept["quick"] < slept["stubborn"], slept


def test_wait_http_polls_a_server_until_it_answers_2xx_without_a_python_start_per_poll(tmp_path: Path) -> None:
    """wait_http, the scripts' readiness wait, polls in bash itself: a Python start per poll (about a tenth of a
    CPU-second with its imports) added up over a job script's waits. It waits through a server's non-2xx answers
    until a 2xx, and a server that never answers 2xx ends the wait at its timeout, naming it."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        answered = 0

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            Health.answered += 1
            self.send_response(200 if self.path == "/health" and Health.answered > 3 else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pythons = tmp_path / "pythons.log"
    recording = tmp_path / "python"
    recording.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >>{pythons}\nexec {sys.executable} "$@"\n')
    recording.chmod(0o755)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    script = f': >{pythons}; wait_http srv {url}/health 30; wait_http never {url}/other 1'
    env = {**os.environ, "PYTHON": str(recording), "WAIT_POLL": "0.05", "LOG_DIR": str(tmp_path)}
    try:
        out = subprocess.run(["bash", "-c", f"source common.sh; {script}"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
    finally:
        server.shutdown()
    assert re.search(r"srv ready at .*/health", out.stdout), out.stdout + out.stderr
    assert "ERROR: never not ready at" in out.stderr and out.returncode != 0, out.stderr
    assert Health.answered > 4  # the 503s, the 200, and the never-ready URL's polls
    assert pythons.read_text() == ""  # no Python started by either wait


def test_lora_targets_leave_the_short_conv_alone() -> None:
    assert "out_proj" not in recipe.LORA_TARGET_MODULES  # a bare suffix would also wrap conv.out_proj
    assert "self_attn.out_proj" in recipe.LORA_TARGET_MODULES


def readme_commands() -> list[str]:
    """The commands in README's set-up block (the first bash block), comments stripped."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md has no bash block with the set-up and test commands"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.split("#", 1)[0].strip()]


def test_ci_runs_exactly_the_readme_commands() -> None:
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith("#") and not line.startswith(("set -", "cd "))
    ]
    assert ci == readme_commands()
    assert len(ci) == 2


def test_the_suite_keeps_each_module_on_one_worker(tmp_path: Path) -> None:
    """pyproject.toml's xdist options, run on two throw-away modules: each module's tests on one worker (its
    module-scoped set-ups once), both workers used. `--dist loadgroup` stopped grouping on pytest 9.2 without a
    word (pytest-dev/pytest-xdist#1386) and the vLLM child ran twice per suite; this is what would have said so."""
    import tomllib

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    (tmp_path / "pytest.ini").write_text(f"[pytest]\naddopts = {addopts}\n")
    for module in ("a", "b"):
        (tmp_path / f"test_{module}.py").write_text(
            "import os, pytest\n"
            "@pytest.mark.parametrize('n', range(6))\n"
            "def test_n(n):\n"
            f"    with open('{module}.log', 'a') as f: f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n")
    # Only xdist among the installed plugins: the others do not take part, and each of the four processes
    # would import them.
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-p", "no:cacheprovider"], cwd=tmp_path,
                         env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-2000:]
    workers = {module: set((tmp_path / f"{module}.log").read_text().split()) for module in ("a", "b")}
    assert all(len(w) == 1 for w in workers.values()) and workers["a"] != workers["b"], workers


# What the bundle's processes but the env server import from OpenEnv: its own modules, the capture proxy's CLI, the
# Harbor client the sessions run rollouts with.
OPENENV_USERS = ("harbor_sessions", "seam_patch", "eval_adapter", "openenv.core.harness.capture.server",
                 "openenv.harbor.rollout", "openenv.harbor.contract")


def test_every_python_the_suite_starts_hides_gradio_and_openenv_falls_back_without_it() -> None:
    """tests/site/sitecustomize.py's rule, as a child of the suite sees it (PYTHONPATH from conftest.py): gradio does
    not import, and every piece of OpenEnv the bundle uses outside the env server loads with OpenEnv's own
    web-interface fallback (None); the env server's process keeps gradio for its UI. A new OpenEnv that needed gradio
    elsewhere would fail here, not by a test elsewhere going quiet."""
    code = ("import importlib, sys\n"
            f"for name in {OPENENV_USERS!r}: importlib.import_module(name)\n"
            "from openenv.core import env_server\n"
            "print(env_server.create_web_interface_app, sys.modules.get('gradio'))\n"
            "import gradio\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["None", "None"], out.stdout + out.stderr[-2000:]
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith("ModuleNotFoundError"), out.stderr
    # The env server serves OpenEnv's gradio UI (openenv.harbor.ui): its process keeps gradio.
    server = subprocess.run([sys.executable, "-c", "import openenv.harbor.ui", "harbor", "serve"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert server.returncode == 0, server.stderr[-2000:]


def test_every_python_the_suite_starts_maps_packages_to_distributions_as_importlib_does(tmp_path: Path) -> None:
    """tests/site/sitecustomize.py keeps `importlib.metadata.packages_distributions()` (transformers and TRL each call
    it at import, about a CPU-second each) in a file per sys.path and its folders' mtimes: every Python the suite
    starts gets the mapping importlib itself makes, and a distribution installed in a folder on its path is seen at
    the next start."""
    code = ("import json; from importlib import metadata\n"
            "print(json.dumps(metadata.packages_distributions(), sort_keys=True))\n"
            "print(json.dumps(getattr(metadata.packages_distributions, 'cache_file', None)))\n")

    def run(extra: Path, *, site: bool = True) -> tuple[dict, str | None]:
        """A child's mapping and cache file, `extra` first on its path; without the site, importlib's own."""
        inherited = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                     if e and (site or Path(e) != ROOT / "tests" / "site")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(extra), *inherited])}
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        mapping, cache_file = out.stdout.splitlines()
        return json.loads(mapping), json.loads(cache_file)

    def dist(folder: Path, name: str) -> None:
        info = folder / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "top_level.txt").write_text(f"{name}_pkg\n")

    extra = tmp_path / "site-packages"
    extra.mkdir()
    dist(extra, "first")
    cached, cache_file = run(extra)
    assert cache_file and Path(cache_file).is_file()
    assert cached == run(extra)[0] == run(extra, site=False)[0]  # read back: what importlib makes without the site
    assert cached["first_pkg"] == ["first"]
    dist(extra, "second")  # an install into a folder on the path: the next start sees it
    later, later_file = run(extra)
    assert later_file != cache_file and later["second_pkg"] == ["second"] and later == run(extra, site=False)[0]
    # A folder on the path that holds no distribution (a script's folder, the run_job tests' new bundle folder in
    # each test) changes nothing the map is made from: the map kept for the path without it is read.
    (empty := tmp_path / "no-distributions").mkdir()
    assert run(empty) == run(tmp_path / "nothing-here")
    # Until a distribution is installed there: then the next start makes the map again and sees it.
    dist(empty, "third")
    third, third_file = run(empty)
    assert third_file != run(tmp_path / "nothing-here")[1] and third["third_pkg"] == ["third"]
    assert third == run(empty, site=False)[0]


def test_ruff_is_clean() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run([str(ruff), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shell_scripts_are_shellcheck_clean() -> None:
    shellcheck = Path(sys.executable).with_name("shellcheck")
    scripts = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("*.sh")) + [".ci/run"]
    result = subprocess.run([str(shellcheck), "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_setup_refuses_without_python_312(tmp_path: Path) -> None:
    """setup.sh must stop with a clear line, not build a venv on an old Python."""
    fake = tmp_path / "bin"
    fake.mkdir()
    old = fake / "python3"
    old.write_text("#!/bin/sh\nexit 1\n")
    old.chmod(0o755)
    func = re.search(r"^find_python\(\) \{.*?^\}", (ROOT / "setup.sh").read_text(), re.S | re.M).group(0)
    result = subprocess.run(
        ["/bin/bash", "-c", f"{func}\nfind_python"],
        env={"PATH": str(fake), "HOME": str(tmp_path), "PYTHON": str(old)},
        capture_output=True, text=True,
    )
    assert result.returncode == 1
    assert "no Python >= 3.12 found" in result.stderr


# --- environment knobs: one parser, one check each, shared by every script ------------------------------------------
@pytest.mark.parametrize(("word", "value"), [
    ("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True), (" yes ", True),
    ("0", False), ("false", False), ("No", False), ("OFF", False),
])
def test_yes_no_takes_the_usual_spellings(word: str, value: bool) -> None:
    assert recipe.knob("DRY_RUN", {"DRY_RUN": word}) is value
    assert recipe.knob("RESUME", {"RESUME": word}) is value


@pytest.mark.parametrize("word", ["maybe", "2", "y", "enable", "1.0"])
def test_yes_no_refuses_anything_else_naming_the_variable(word: str) -> None:
    expected = f"^FINAL_EVAL={re.escape(repr(word))} is not a yes/no value: use FINAL_EVAL=1"
    with pytest.raises(recipe.ConfigError, match=expected) as err:
        recipe.knob("FINAL_EVAL", {"FINAL_EVAL": word})
    assert "\n" not in str(err.value)


def test_unset_or_empty_knob_is_the_recipe_default() -> None:
    for env in ({}, {"RESUME": "", "DRY_RUN": " ", "STALL_MINUTES": ""}):
        assert (recipe.knob("RESUME", env), recipe.knob("DRY_RUN", env)) == (True, False)
        assert recipe.knob("STALL_SECONDS", env) == recipe.STALL_MINUTES * 60
    assert recipe.knob("STALL_SECONDS", {"STALL_MINUTES": "30.001"}) == 1801  # rounds up, never down
    assert recipe.knob("MAX_STEPS", {"MAX_STEPS": "9"}, value="12") == 12  # a flag wins over the environment


def test_the_watchdog_checks_at_least_as_often_as_a_short_stall_limit() -> None:
    """An unset WATCH_INTERVAL follows a STALL_SECONDS under its own default (a stall is seen within the limit), as
    the shell scripts read it too; a given one longer than the limit is refused."""
    assert recipe.knob("WATCH_INTERVAL", {"STALL_SECONDS": "10"}) == 10
    assert recipe.knob("WATCH_INTERVAL", {}) == recipe.WATCH_INTERVAL_S
    out = subprocess.run([sys.executable, "recipe.py", "--env", "STALL_SECONDS", "WATCH_INTERVAL"], cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "STALL_SECONDS": "10"}, capture_output=True, text=True)
    assert out.stdout.splitlines() == ["STALL_SECONDS=10", "WATCH_INTERVAL=10"], out.stderr
    with pytest.raises(recipe.ConfigError, match="^WATCH_INTERVAL=11 is out of range: use at most 10 "):
        recipe.knob("WATCH_INTERVAL", {"STALL_SECONDS": "10", "WATCH_INTERVAL": "11"})


def test_recipe_env_cli_prints_checked_knobs_for_shell_scripts() -> None:
    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "Yes", "MAX_IDLE_HOURS": "6.0", "N_TASKS": " 40 "}
    out = subprocess.run([sys.executable, "recipe.py", "--env", "DRY_RUN", "MAX_IDLE_HOURS", "N_TASKS", "RESUME"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["DRY_RUN=1", "MAX_IDLE_HOURS=6", "N_TASKS=40", "RESUME=1"]
    bad = subprocess.run([sys.executable, "recipe.py", "--env", "DRY_RUN", "N_TASKS"], cwd=ROOT,
                         env={**env, "N_TASKS": "500"}, capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stdout == ""
    assert bad.stderr == "N_TASKS=500 is out of range: use 1..250 (tasks in data/test.json)\n"


# Knobs each fine alone that fail together (issue 26): refused by `recipe.py --env` (the job scripts' preflight) in one
# line, before any GPU time.
SAME_PORT = "give each of POLICY_PORT, ENV_PORT, PUBLIC_PORT its own"
SAVES = "a checkpoint before MAX_STEPS, and at most 20 in a run: each is a ~0.5 GB push and an eval by the watcher"
WATCH = "the watchdog sees a stall or a dead server only at its checks"
TOGETHER = {
    "save after the last step": (
        {"MAX_STEPS": "50", "SAVE_STEPS": "100"}, f"SAVE_STEPS=100 is out of range: use 3..50 ({SAVES})"),
    "a checkpoint every step": ({"SAVE_STEPS": "1"}, f"SAVE_STEPS=1 is out of range: use 50..1000 ({SAVES})"),
    "watchdog never looks": (
        {"WATCH_INTERVAL": "86400"},
        f"WATCH_INTERVAL=86400 is out of range: use at most {recipe.WATCH_INTERVAL_MAX_S} ({WATCH})"),
    "watchdog slower than the stall limit": (
        {"WATCH_INTERVAL": "120", "STALL_SECONDS": "60"},
        f"WATCH_INTERVAL=120 is out of range: use at most 60 ({WATCH})"),
    "two stall limits": (
        {"STALL_SECONDS": "60", "STALL_MINUTES": "40"},
        "STALL_SECONDS=60 and STALL_MINUTES=40 are both set, and STALL_SECONDS would win: set only one"),
    "policy port is the env port": (
        {"POLICY_PORT": str(recipe.ENV_PORT)}, f"POLICY_PORT and ENV_PORT are both {recipe.ENV_PORT}: {SAME_PORT}"),
    "policy port is the public port": (
        {"POLICY_PORT": "9000", "PUBLIC_PORT": "9000"}, f"POLICY_PORT and PUBLIC_PORT are both 9000: {SAME_PORT}"),
    "public port is the default env port": (
        {"PUBLIC_PORT": str(recipe.ENV_PORT)}, f"PUBLIC_PORT and ENV_PORT are both {recipe.ENV_PORT}: {SAME_PORT}"),
    "space host with a path": (
        {"SPACE_HOST": "https://abc--8000.hf.jobs/capture"},
        "SPACE_HOST='https://abc--8000.hf.jobs/capture' is not a host name: use the job's public host, e.g. "
        "SPACE_HOST=<job-id>--8000.hf.jobs (no path, no port)"),
    "space host with a space": ({"SPACE_HOST": "abc 8000.hf.jobs"}, "SPACE_HOST='abc 8000.hf.jobs' is not a host name"),
    "more eval rollouts than env sessions": (
        {"EVAL_CONCURRENCY": str(recipe.ENV_MAX_SESSIONS + 1)},
        f"EVAL_CONCURRENCY={recipe.ENV_MAX_SESSIONS + 1} is out of range: use 1..{recipe.ENV_MAX_SESSIONS} (the env "
        "server's ENV_MAX_SESSIONS; rollouts past it would fail)"),
}
JOB_KNOB_NAMES = ["MAX_STEPS", "SAVE_STEPS", "STALL_MINUTES", "STALL_SECONDS", "WATCH_INTERVAL", "POLICY_PORT",
                  "ENV_PORT", "PUBLIC_PORT", "SPACE_HOST", "EVAL_CONCURRENCY"]


@pytest.mark.parametrize("case", list(TOGETHER))
def test_knobs_that_fail_together_are_refused_in_one_line_by_the_preflight(case: str) -> None:
    given, line = TOGETHER[case]
    out = subprocess.run([sys.executable, "recipe.py", "--env", *JOB_KNOB_NAMES], cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", **given}, capture_output=True, text=True)
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr.startswith(line) and out.stderr.count("\n") == 1, out.stderr


def test_space_host_is_kept_as_a_bare_host_and_a_sane_combination_passes() -> None:
    env = {"PATH": "/usr/bin:/bin", "SPACE_HOST": "https://68abc--8000.hf.jobs/", "MAX_STEPS": "50",
           "SAVE_STEPS": "50", "STALL_SECONDS": "60", "WATCH_INTERVAL": "60", "EVAL_CONCURRENCY": "64"}
    out = subprocess.run([sys.executable, "recipe.py", "--env", *JOB_KNOB_NAMES], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert "SPACE_HOST=68abc--8000.hf.jobs" in out and "SAVE_STEPS=50" in out and "STALL_SECONDS=60" in out


# Values that once crashed `--help` with a raw ValueError, and others each entry point reads.
BAD_ENV = {"N_TASKS": "abc", "EVAL_CONCURRENCY": "x", "MAX_IDLE_HOURS": "six", "MAX_STEPS": "lots",
           "SAVE_STEPS": "abc", "CHECKPOINT": "ckpt", "DRY_RUN": "maybe", "RESUME": "maybe", "WEIGHT_SYNC": "fast",
           "STALL_MINUTES": "abc", "MERGED_DTYPE": "int3", "BUNDLE_DIR": "/no/such/dir"}


@pytest.mark.parametrize("script", ["eval_watch.py", "eval_adapter.py", "train_lora.py", "launch.py",
                                    "export_adapter.py", "prepare_tasks.py", "capture_gateway.py"])
def test_help_works_whatever_the_environment_holds(script: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    result = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env={**env, **BAD_ENV},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: ") and "Traceback" not in result.stderr


# --- the README runs what exists, as it says ----------------------------------------------------------------------
def test_every_script_the_readme_runs_is_executable() -> None:
    # A library the scripts `source` (common.sh) is named in the file table but never run.
    sourced = {name for p in ROOT.glob("*.sh")
               for name in re.findall(r"^source .*/([a-z_]+\.sh)\"?$", p.read_text(), re.M)}
    assert "common.sh" in sourced
    named = set(re.findall(r"\b([a-z_]+\.sh)\b", (ROOT / "README.md").read_text())) - sourced
    scripts = {p.name for p in ROOT.glob("*.sh")}
    assert {"run_job.sh", "serve_env.sh", "serve_policy.sh", "run_eval.sh"} <= named <= scripts
    assert [name for name in sorted(named) if not os.access(ROOT / name, os.X_OK)] == []
    tracked = subprocess.run(["git", "ls-files", "-s", *sorted(named)], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0 and tracked.stdout:  # a git checkout: the mode a fresh clone gets
        assert {line.split()[0] for line in tracked.stdout.splitlines()} == {"100755"}, tracked.stdout


def test_readme_launches_with_one_plain_command_in_any_shell() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "$LAUNCH" not in readme and "LAUNCH=" not in readme
    for mode in ("smoke", "train", "eval-watch", "eval --checkpoint"):
        assert f"uv run launch.py {mode}" in readme


def test_launcher_inline_metadata_brings_its_own_hub_client() -> None:
    """`uv run launch.py` reads the PEP 723 block: it must ask for the hub client run_job(expose_public=) needs
    and the tomli-w pin of recipe.JOB_REQUIREMENTS (prepare_tasks.py imports it)."""
    source = (ROOT / "launch.py").read_text()
    block = re.search(r"^# /// script$\n((?:^#(?: .*)?$\n)+)^# ///$", source, re.M)
    assert block, "launch.py has no `# /// script` block"
    import tomllib

    meta = tomllib.loads("\n".join(line[2:] for line in block.group(1).splitlines()))
    deps = meta["dependencies"]
    assert f"huggingface_hub>={recipe.LAUNCHER_HUB_MIN}" in deps
    assert f"tomli-w{recipe.pinned_versions()['tomli-w']}" in deps
    assert meta["requires-python"] == ">=3.12"


def test_readme_vllm_serve_line_has_the_tool_flags_opencode_needs() -> None:
    """The README's own `vllm serve ... --enable-lora` line must carry the tool-call flags serve_policy.sh always sets
    (OpenCode sends tool_choice="auto"; without a parser every call is a 400)."""
    lines = re.findall(r"`(vllm serve [^`]*)`", (ROOT / "README.md").read_text().replace("\n", " "))
    assert lines, "README.md has no `vllm serve ...` line"
    policy = (ROOT / "serve_policy.sh").read_text()
    assert "--enable-auto-tool-choice --tool-call-parser lfm2" in policy
    for line in lines:
        assert "--enable-auto-tool-choice --tool-call-parser lfm2" in " ".join(line.split()), line


def test_readme_vllm_serve_line_serves_the_chat_template_the_run_trained_with() -> None:
    """Served on the base repo, the adapter would get the base's own template (it opens <think>; rollouts forked on
    it): the line passes `--chat-template FILE` and the README writes FILE with chat_template.py, as serve_policy.sh
    does."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    lines = re.findall(r"`(vllm serve [^`]*--enable-lora[^`]*)`", readme)
    assert lines, "README.md has no `vllm serve ... --enable-lora` line"
    for line in lines:
        template = re.search(r"--chat-template (\S+)", line)
        assert template, line
        assert f"chat_template.py {template.group(1)}`" in readme, f"README never writes {template.group(1)}"


def test_the_ports_a_test_asks_for_at_once_are_never_the_same_port() -> None:
    """Each port is free when it is picked, and the ones asked for together are distinct: picked one at a time, the
    kernel may hand out a port it just closed again (about 6 in 20,000 picks of three here; a CI run failed on
    `ENV_PORT and PUBLIC_PORT are both 40633`)."""
    from stubs.procs import free_ports

    picks = [free_ports(3) for _ in range(20_000)]
    assert all(len(set(ports)) == 3 for ports in picks)
    assert all(0 < port < 65536 for ports in picks for port in ports)


def test_help_is_help_not_a_knob_or_a_file_name(tmp_path: Path) -> None:
    """Issue 43 (14): `recipe.py --help` said "unknown knob '--help'"; `chat_template.py --help` wrote the template
    to a file named --help and exited 0."""
    for script in ("recipe.py", "chat_template.py"):
        proc = subprocess.run([sys.executable, str(ROOT / script), "--help"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: "), (script, proc.stdout, proc.stderr)
    assert list(tmp_path.iterdir()) == []
