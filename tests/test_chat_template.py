"""One chat template for vLLM and the trainer, checked prefix-stable, so a real OpenCode rollout is one training row.

TRL 1.15 chains a rollout's turns into one row only while each prompt vLLM renders extends the previous prompt plus
its sampled tokens (`fork_threshold_tokens=0`); otherwise it forks a row, and a step (a fixed number of rows)
trains part of a group. The decisive test runs the real OpenCode client through the real capture proxy against
`serve_policy.sh` and chains the trace with TRL's own code (tests/opencode_rollout.py).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from chain import envserver
from opencode_rollout import (
    CANONICAL,
    NO_OPENCODE,
    OPENCODE,
    chain,
    first_divergence,
    hub_template_stand_in,
    opencode_home,
    rollout_stack,
    run_opencode,
    tiny_model_with_hub_template,
)
from tiny_lfm2 import tiny_tokenizer
from trl.chat_template_utils import add_response_schema, lfm2_2_5_chat_template

import chat_template
import train_lora

ROOT = Path(__file__).resolve().parents[1]


def test_the_pinned_template_is_trls_lfm2_5_template_and_passes_its_own_check():
    assert chat_template.chat_template() == lfm2_2_5_chat_template
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = chat_template.chat_template()
    assert add_response_schema(tokenizer).response_template is not None  # TRL recognizes it


@pytest.mark.parametrize(
    ("opening", "why"),
    [("<think>", "the model repo's (recipe lineage: opens <think>)"),
     ("<think></think>", "the lineage's non-thinking patch, applied to the generation prompt only")],
)
def test_a_template_whose_generation_prompt_opens_think_is_refused_with_one_line(opening, why):
    prompt = '{{- "<|im_start|>assistant\\n" -}}\n{%- endif -%}'
    template = lfm2_2_5_chat_template.replace(prompt, prompt.replace("\\n", "\\n" + opening))
    assert template != lfm2_2_5_chat_template, why
    with pytest.raises(chat_template.ChatTemplateError, match=r"generation prompt ends .*every turn after the first"):
        chat_template.check(template)


def test_a_template_that_renders_tool_calls_back_differently_is_refused():
    template = lfm2_2_5_chat_template.replace('"\'" + arg_value + "\'"', '"\\"" + arg_value + "\\""')
    assert template != lfm2_2_5_chat_template
    with pytest.raises(chat_template.ChatTemplateError, match="would fork the rollout"):
        chat_template.check(template)


def test_the_trainer_tokenizer_carries_the_pinned_template_not_the_model_repos(tmp_path):
    model = tiny_model_with_hub_template(tmp_path / "model")
    tokenizer = train_lora.load_tokenizer(train_lora.Settings(adapter_repo="you/x", hf_token="", model=str(model)))
    assert tokenizer.chat_template == chat_template.chat_template() != hub_template_stand_in()


def test_serve_policy_hands_vllm_the_template_chat_template_py_writes(tmp_path):
    env = {"PATH": f"{ROOT / 'tests' / 'stubs' / 'bin'}:/usr/bin:/bin", "PYTHON": sys.executable,
           "LOG_DIR": str(tmp_path / "logs"), "DRY_RUN": "1"}
    out = subprocess.run(["bash", str(ROOT / "serve_policy.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    argv = shlex.split(next(line for line in out.stdout.splitlines() if line.startswith("  $ "))[4:])
    written = tmp_path / "logs" / "chat_template.jinja"
    assert argv[argv.index("--chat-template") + 1] == str(written)
    assert f"chat_template.py {written}" in out.stdout and not written.exists()  # a dry run writes nothing
    assert subprocess.run([sys.executable, str(ROOT / "chat_template.py"), str(written)]).returncode == 0
    assert written.read_text() == lfm2_2_5_chat_template


@pytest.fixture(scope="module")
def rollout(tmp_path_factory) -> dict:
    """One real OpenCode rollout: bash tool call -> its result -> final message; serve_policy.sh serves a model folder
    whose own template opens <think> (the model repo's, as the recipe's lineage describes it)."""
    envserver.require("a real OpenCode rollout", "" if OPENCODE else NO_OPENCODE)
    tmp = tmp_path_factory.mktemp("rollout")
    model = tiny_model_with_hub_template(tmp / "model")
    with rollout_stack(model, CANONICAL, tmp / "stack") as stack:
        return {"trace": run_opencode(stack, tmp / "work"), "home": opencode_home(tmp / "work")}


def test_a_real_opencode_rollout_with_a_tool_call_is_one_training_row(rollout):
    """Before the fix vLLM used the model folder's template and the second turn forked: 2 rows, fork 1 of 1
    transitions."""
    trace = rollout["trace"]
    agent_turns = len(trace.turns)
    rows, tally = chain(trace)
    assert agent_turns == 2, f"expected OpenCode's tool-call turn and its final turn, got {agent_turns}"
    assert tally["transitions"] == 1
    assert (tally["fork"], len(rows)) == (0, 1), (
        f"the rollout forked into {len(rows)} rows ({tally}); first divergence: "
        f"{first_divergence(trace, tiny_tokenizer())}")


def test_a_real_opencode_rollout_fetches_no_package_from_the_internet(rollout):
    """OpenCode 1.18.33 fetches its config folder's packages (@opencode-ai/plugin and four more) from npm's registry
    at every start; the suite's traffic stays on loopback (chain.sandbox.OFFLINE points the registry at a closed
    loopback port). npm's cache indexes every response it fetched, so an empty index is a run that fetched none."""
    fetched = [entry.read_text()[:300] for entry in rollout["home"].rglob("*")
               if entry.is_file() and "index-v5" in entry.parts]  # npm's cache index, where npm keeps it
    assert fetched == []


def test_the_model_card_says_a_step_trains_rows_and_is_one_group_only_when_no_rollout_forked():
    import model_cards
    import recipe

    batching = train_lora.conv_safe_batching()
    rows_per_step = batching["per_device_train_batch_size"] * batching["gradient_accumulation_steps"]
    card = dict(model_cards.recipe_rows("final", 1000))
    assert "per optimizer step" not in card["GRPO group"]  # a group is not what a step counts
    step = card["Optimizer step"]
    assert f"{rows_per_step} training rows" in step
    assert f"one GRPO group of {recipe.NUM_GENERATIONS} rollouts" in step and "rollout/samples_per_rollout" in step
