"""The bundle's vLLM invocations and its adapter, checked by vLLM 0.31.0's own code on CPU (tests/vllm_cpu.py,
with `.vllm/` from setup.sh first on PYTHONPATH): every `vllm serve` argv the scripts would run, taken from
their DRY_RUN plans, goes through vLLM's server parser; the adapter train_lora.py saves goes through vLLM's
PEFTHelper and LoRAModel loader. What still needs a GPU (the engine, the kernels) is left to the smoke run."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from tiny_lfm2 import save_tiny_model
from vllm_lora_double import save_tiny_adapter

import recipe

ROOT = Path(__file__).resolve().parents[1]
VLLM_CODE = ROOT / ".vllm"
STUBS = Path(__file__).resolve().parent / "stubs"
JOB = {"DRY_RUN": "1", "ADAPTER_REPO": "you/x", "HF_TOKEN": "x", "JOB_ID": "abc"}


def vllm_cpu(request: dict) -> object:
    """One request to tests/vllm_cpu.py in a child process running vLLM's code from .vllm/."""
    if not (VLLM_CODE / "vllm" / "__init__.py").is_file():
        pytest.fail("vLLM's code is not in .vllm/: run `bash setup.sh` (it installs requirements-vllm.txt there)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(VLLM_CODE), str(Path(__file__).parent)])}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_cpu.py"))], input=json.dumps(request),
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def vllm_argvs(script: str, **env: str) -> list[list[str]]:
    """Every `vllm serve` command a script's DRY_RUN plan prints, as argv (environment assignments dropped)."""
    full = {k: v for k, v in os.environ.items() if k not in {"HF_TOKEN", "SANDBOX", "SPACE_HOST", "JOB_ID"}}
    full.update(PATH=f"{STUBS / 'bin'}:{full['PATH']}", PYTHON=sys.executable, REAL_PYTHON=sys.executable,
                LOG_DIR=tempfile.mkdtemp(prefix="vllm-plan-"), **env)
    out = subprocess.run(["bash", str(ROOT / script)], env=full, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    argvs = []
    for line in out.stdout.splitlines():
        if not line.startswith("  $ "):
            continue
        words = shlex.split(line[4:])
        while words and (words[0] == "env" or re.match(r"^[A-Z_][A-Z0-9_]*=", words[0])):
            words.pop(0)
        if words[:2] == ["vllm", "serve"]:
            argvs.append(words)
            if "--chat-template" in words:  # written by serve_policy.sh before vLLM starts; a dry run writes nothing
                template = words[words.index("--chat-template") + 1]
                subprocess.run([sys.executable, str(ROOT / "chat_template.py"), template], check=True, timeout=120)
    return argvs


def readme_argvs() -> list[list[str]]:
    """The `vllm serve ...` commands README.md tells users to run, each `--chat-template F` written first as the
    README says (`chat_template.py F`), into a folder of its own (F is relative: the user's working directory)."""
    text = (ROOT / "README.md").read_text()
    argvs = [shlex.split(m) for m in re.findall(r"`(vllm serve [^`]+)`", text)]
    for words in argvs:
        if "--chat-template" in words:
            at = words.index("--chat-template") + 1
            assert f"chat_template.py {words[at]}" in text, "README must say how to write the template it serves"
            words[at] = str(Path(tempfile.mkdtemp(prefix="readme-template-")) / words[at])
            subprocess.run([sys.executable, str(ROOT / "chat_template.py"), words[at]], check=True, timeout=120)
    return argvs


@pytest.fixture(scope="module")
def plans() -> dict[str, list[str]]:
    """name -> argv, for every vLLM invocation of the bundle, plus two deliberately wrong ones."""
    cases: dict[str, list[str]] = {}
    (cases["training"],) = vllm_argvs("serve_policy.sh", DRY_RUN="1")
    (cases["eval"],) = vllm_argvs("serve_policy.sh", DRY_RUN="1", LORA="1")
    (cases["eval_modules"],) = vllm_argvs("serve_policy.sh", DRY_RUN="1", LORA="1", MAX_LORAS="2",
                                          LORA_MODULES=f"{recipe.ADAPTER_SERVED_NAME}=/adapters/final")
    (cases["run_job"],) = vllm_argvs("run_job.sh", **JOB)
    (cases["run_eval"],) = vllm_argvs("run_eval.sh", **JOB)
    for n, argv in enumerate(readme_argvs()):
        cases[f"readme{n}"] = argv
    assert any(name.startswith("readme") for name in cases)
    training = cases["training"]
    cases["misspelled"] = [("--logprob-mode" if a == "--logprobs-mode" else a) for a in training]
    cases["bad_value"] = [("processed_logprob" if a == "processed_logprobs" else a) for a in training]
    return cases


@pytest.fixture(scope="module")
def lora_request(tmp_path_factory) -> dict:
    """The tiny Lfm2ForCausalLM and three adapters train_lora.py's way (real PEFT), for vLLM's loader with
    --max-lora-rank recipe.LORA_R: the recipe's, one that also wraps conv.out_proj, one of rank 64."""
    tmp = tmp_path_factory.mktemp("lora")
    model = save_tiny_model(tmp / "model")
    adapters = [save_tiny_adapter(tmp / "recipe"),
                save_tiny_adapter(tmp / "conv", target_modules=[*recipe.LORA_TARGET_MODULES, "out_proj"]),
                save_tiny_adapter(tmp / "rank64", r=64, lora_alpha=128)]
    return {"model": str(model), "adapters": [[str(a), recipe.LORA_R] for a in adapters]}


@pytest.fixture(scope="module")
def answer(plans, lora_request) -> dict:
    """One child process for the whole module (vLLM's imports dominate its cost): every plan parsed, vLLM's API
    server imported, and the adapters through vLLM's LoRA loader."""
    return vllm_cpu({"parse": [plans[n] for n in plans], "lora": lora_request})  # type: ignore[return-value]


@pytest.fixture(scope="module")
def parsed(plans, answer) -> dict[str, dict]:
    return dict(zip(list(plans), answer["parsed"], strict=True))


def values(parsed: dict[str, dict], name: str) -> dict:
    assert "error" not in parsed[name], parsed[name]
    return parsed[name]["values"]


@pytest.mark.parametrize("name", ["training", "eval", "eval_modules", "run_job", "run_eval"])
def test_every_invocation_parses_with_the_recipe_values(parsed, name):
    v = values(parsed, name)
    assert v["model_tag"] == recipe.BASE_MODEL
    assert v["served_model_name"] == [recipe.SERVED_MODEL_NAME]
    assert v["dtype"] == recipe.SERVE_DTYPE and v["max_model_len"] == recipe.MAX_MODEL_LEN
    assert v["host"] == recipe.LOOPBACK
    assert v["logprobs_mode"] == "processed_logprobs" and v["return_tokens_as_token_ids"] is True
    assert v["generation_config"] == "vllm"
    assert v["enable_auto_tool_choice"] is True and v["tool_call_parser"] == "lfm2"
    assert v["tool_parser_class"] == "Lfm2ToolParser"  # registered in vLLM and importable


@pytest.mark.parametrize("name", ["training", "run_job"])
def test_training_mode_streams_weights_over_nccl(parsed, name):
    v = values(parsed, name)
    assert v["weight_transfer_backend"] == "nccl"
    assert not v["enable_lora"]


@pytest.mark.parametrize(("name", "max_loras", "modules"), [
    ("eval", 1, []), ("run_eval", 1, []),
    ("eval_modules", 2, [[recipe.ADAPTER_SERVED_NAME, "/adapters/final"]]),
])
def test_eval_mode_serves_loras_of_the_recipe_rank(parsed, name, max_loras, modules):
    v = values(parsed, name)
    assert v["enable_lora"] is True and v["max_lora_rank"] == recipe.LORA_R and v["max_loras"] == max_loras
    assert v["lora_modules"] == modules
    assert v["weight_transfer_backend"] is None


def test_readme_serve_command_parses(parsed):
    for name in (n for n in parsed if n.startswith("readme")):
        v = values(parsed, name)
        assert v["enable_lora"] is True and v["max_lora_rank"] == recipe.LORA_R


@pytest.mark.parametrize(("name", "error"), [("misspelled", "unrecognized arguments: --logprob-mode"),
                                             ("bad_value", "invalid choice: 'processed_logprob'")])
def test_vllm_refuses_a_wrong_flag(parsed, name, error):
    assert "exit 2" in parsed[name].get("error", ""), parsed[name]
    assert error in parsed[name]["error"]


def test_api_server_imports_with_the_jobs_mcp(answer):
    """The evidence for recipe.PIP_CHECK_ACCEPTED's (vllm, mcp): the job's mcp is outside vLLM's range, and
    vLLM's API server module imports with it (.vllm/ holds the job's versions, tests/image_resolution.json)."""
    from packaging.requirements import Requirement

    resolution = json.loads((ROOT / "tests" / "image_resolution.json").read_text())
    job_mcp = resolution["after"]["mcp"]["version"]
    declared = next(Requirement(r) for r in resolution["after"]["vllm"]["requires_dist"] if r.startswith("mcp"))
    assert answer["api_server"]["mcp"] == job_mcp and job_mcp not in declared.specifier


# --- the adapter, through vLLM's LoRA loader ---------------------------------------------------------


@pytest.fixture(scope="module")
def lora(answer, lora_request) -> dict:
    """vLLM's view of the tiny Lfm2ForCausalLM and of the three adapters (see `lora_request`), plus the modules
    PEFT saved for the recipe's."""
    assert isinstance(answer.get("lora"), dict), answer
    return {**answer["lora"], "peft": peft_modules(Path(lora_request["adapters"][0][0]))}


def peft_modules(adapter: Path) -> set[str]:
    """The module names PEFT saved LoRA weights for, as vLLM names them (PEFT's prefix dropped)."""
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        return {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in f.keys()}


def vllm_layer(name: str, packed: dict[str, list[str]]) -> str:
    """The vLLM layer an adapter module lands in: q/k/v in qkv_proj, w1/w3 in w13 (packed_modules_mapping)."""
    parent, leaf = name.rsplit(".", 1)
    return next((f"{parent}.{p}" for p, parts in packed.items() if leaf in parts), name)


def test_recipe_adapter_is_accepted_and_every_tensor_mapped(lora):
    model, (loaded, _, _) = lora["model"], lora["adapters"]
    assert "error" not in loaded, loaded["error"]
    assert loaded["rank"] == recipe.LORA_R
    assert set(loaded["modules"]) <= set(model["linear"])  # every LoRA sits on a real vLLM layer
    # Every module PEFT saved is there, q/k/v packed into qkv_proj and w1/w3 into w13 as vLLM serves them.
    assert set(loaded["modules"]) == {vllm_layer(name, model["packed"]) for name in lora["peft"]}
    assert {name.rsplit(".", 1)[1] for name in loaded["modules"]} == {"qkv_proj", "out_proj", "w13", "w2"}
    assert not any("conv" in name for name in loaded["modules"])  # the short convs stay untouched


def test_vllm_would_also_apply_a_plain_out_proj_target_to_the_convs(lora):
    """vLLM maps PEFT's conv.out_proj to its short_conv.out_proj: an adapter with a plain "out_proj" target loads
    and its LoRA lands on every short conv (why recipe.LORA_TARGET_MODULES says self_attn.out_proj)."""
    conv = lora["adapters"][1]
    assert "error" not in conv, conv["error"]
    assert set(conv["modules"]) <= set(lora["model"]["linear"])
    convs = {name for name in lora["model"]["linear"] if name.endswith(".short_conv.out_proj")}
    assert convs and convs <= set(conv["modules"])


def test_rank_above_max_lora_rank_is_refused(lora):
    assert lora["adapters"][2].get("error") == f"LoRA rank 64 is greater than max_lora_rank {recipe.LORA_R}."


# --- the CPU engine's kernels, as the test-only plugin leaves vLLM to choose them ----------------------------

KERNELS = """
import json, torch, cpu_engine_plugin
cpu_engine_plugin.register()
from vllm.platforms import current_platform
current_platform.import_kernels()
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
torch.manual_seed(0)
linear, conv = torch.nn.Linear(128, 256, bias=False).bfloat16(), torch.nn.Conv1d(128, 128, 3, groups=128)
x = torch.randn(5, 128).bfloat16()
want = torch.nn.functional.linear(x, linear.weight).float()
dispatch_cpu_unquantized_gemm(linear, remove_weight=False)
conv.weight.data = conv.weight.data.bfloat16()
dispatch_cpu_unquantized_gemm(conv, remove_weight=False)
got = linear.cpu_linear(x, linear.weight, None).float()
print(json.dumps({"gemm_error": (got - want).abs().max().item(), "conv_weight": list(conv.weight.shape)}))
"""


def test_the_engines_cpu_kernels_are_all_in_the_library_vllm_loads_and_keep_the_conv_width():
    """The engine's plugin (tests/engine/site/cpu_engine_plugin.py) describes a CPU to vLLM, which picks its kernel
    library by that description (`import_kernels`), then each layer's kernel by it too (`dispatch_cpu_unquantized_
    gemm`). Both must agree on every CPU the suite meets: a linear layer computes what torch's does (on an AMX CPU, a
    plugin that hid AVX512-BF16 alone made vLLM load the AVX512 library, then call an AMX op it lacks), and LFM2's
    short-conv weight keeps its width 3 (not prepacked for the width-4-only kernel)."""
    import engine

    engine.require()
    env = {**os.environ, "PYTHONPATH": engine.ENGINE_PYTHONPATH, "VLLM_TARGET_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, "-c", KERNELS], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["conv_weight"] == [128, 1, 3]
    assert result["gemm_error"] < 0.1, result
