"""The tiny agent policy (tests/agent_policy.py) acts as an agent on OpenCode's real requests: on test_chain's task name
and a date drawn apart from the build's, through the real chat template, its first call is a tool call that vLLM's
own `lfm2` parser turns into OpenCode's `write` of /workdir/answer.txt; after the tool's result it ends with a
message (OpenCode stops); it titles the title call; and it writes the right answer with a probability in the range
GRPO needs (computed exactly, teacher-forced). The solve rate sampled from the real engine is a benchmark
(`agent_policy.py bench`), not a test."""

from __future__ import annotations

import json
import random

import agent_policy
import engine
import pytest
import torch
from test_vllm_cpu import vllm_cpu
from transformers import AutoModelForCausalLM, AutoTokenizer

TASK = "0000_324_324000_qa_1"  # the first task test_chain's fixture serves


@pytest.fixture(scope="module")
def policy():
    path = agent_policy.agent_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    date = agent_policy.random_date(random.Random("a date the build did not draw"))
    return path, model, tokenizer, agent_policy.fill(agent_policy.transcripts(), TASK, date)


def prompt(tokenizer, body: dict, *extra: dict) -> list[int]:
    """The prompt vLLM renders for a request (the same template; tool-call arguments as vLLM parses them)."""
    messages = [*body["messages"], *extra]
    messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    return list(tokenizer.apply_chat_template(messages, tools=body.get("tools") or None, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


@torch.no_grad()
def greedy(model, tokenizer, ids: list[int], limit: int = 64) -> tuple[str, bool]:
    """The greedy completion's text as vLLM's detokenizer hands it to the tool parser (special tokens kept, the
    end-of-turn token dropped) and whether it ended there."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=limit, do_sample=False)[0, len(ids):].tolist()
    ended = tokenizer.eos_token_id in out
    return tokenizer.decode(out[:out.index(tokenizer.eos_token_id)] if ended else out), ended


@torch.no_grad()
def probability(model, ids: list[int], completion: list[int]) -> float:
    logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids + completion])).logits[0].float(), -1)
    return float(sum(logprobs[len(ids) - 1 + i, t] for i, t in enumerate(completion)).exp())


def test_the_config_is_one_vllms_cpu_engine_serves(policy):
    path, model, _, _ = policy
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vLLM's CPU attention refuses 16
    # vLLM 0.31's CPU rotary kernel rotates a query of more than one head wrongly (engine.ENGINE_SHAPE)
    assert {k: config[k] for k in engine.ENGINE_SHAPE} == engine.ENGINE_SHAPE
    assert config["conv_dim"] == config["block_dim"] == config["hidden_size"]  # vLLM's lfm2.py reads both
    assert {"conv", "full_attention"} == set(config["layer_types"])
    assert config["max_position_embeddings"] >= 32768  # the recipe's --max-model-len


def test_it_writes_the_answer_with_opencodes_write_tool_then_stops(policy):
    path, model, tokenizer, requests = policy
    agent = requests["agent"]
    first, ended = greedy(model, tokenizer, prompt(tokenizer, agent))
    assert ended, first
    parsed = vllm_cpu({"tool_calls": {"model": str(path), "tools": agent["tools"], "outputs": [first]}})
    answer = parsed["tool_calls"]
    assert answer["skip_special_tokens"] is False  # the parser keeps <|tool_call_start|> in the engine's text
    (call,) = answer["parsed"][0]["tool_calls"]
    assert answer["parsed"][0]["tools_called"]
    write = next(t["function"] for t in agent["tools"] if t["function"]["name"] == "write")  # OpenCode's schema
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "write" and arguments["filePath"] == agent_policy.ANSWER_FILE
    assert set(arguments) == set(write["parameters"]["required"])
    # OpenCode runs the call and sends its result: the policy answers with a message, no call, so the agent stops.
    reply = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                                                                    "function": call["function"]}]}
    result = {**requests["tool_result"], "tool_call_id": "call_1"}
    second, ended = greedy(model, tokenizer, prompt(tokenizer, agent, reply, result))
    assert ended and second == agent_policy.FINAL
    title, ended = greedy(model, tokenizer, prompt(tokenizer, requests["title"]), limit=16)
    assert ended and title == agent_policy.TITLE


def test_it_writes_the_right_answer_some_of_the_time_and_wrong_ones_otherwise(policy):
    """Exact probabilities of whole replies under the model (fp32; the engine serves it in bf16)."""
    _, model, tokenizer, requests = policy
    agent = requests["agent"]
    ids = prompt(tokenizer, agent)

    def call(value: str) -> list[int]:
        text = f"<|tool_call_start|>[write(filePath='{agent_policy.ANSWER_FILE}', content='{value}')]<|tool_call_end|>"
        return tokenizer.encode(text + tokenizer.eos_token, add_special_tokens=False)

    right = probability(model, ids, call(agent_policy.RIGHT))
    wrong = sum(probability(model, ids, call(v)) for v in agent_policy.ANSWERS if v != agent_policy.RIGHT)
    print(f"agent policy: P(right call) {right:.3f}, P(a trained wrong call) {wrong:.3f}")
    assert 0.2 <= right <= 0.6  # a GRPO group of 8 mostly has contrast, and room to rise
    assert wrong >= 0.2
    reply = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "write", "arguments": json.dumps({"filePath": agent_policy.ANSWER_FILE, "content": "4.2"})}}]}
    after = prompt(tokenizer, agent, reply, {**requests["tool_result"], "tool_call_id": "call_1"})
    stop = tokenizer.encode(agent_policy.FINAL + tokenizer.eos_token, add_special_tokens=False)
    assert probability(model, after, stop) >= 0.95


def test_the_cache_is_reused_while_its_inputs_stand_and_rebuilt_when_one_changes(tmp_path, monkeypatch):
    built: list = []

    def build(out, **_):
        built.append(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "build.json").write_text(json.dumps({"stamp": agent_policy.stamp()}))

    monkeypatch.setattr(agent_policy, "build", build)
    cache = tmp_path / "agent"
    assert agent_policy.agent_model(cache) == cache and len(built) == 1  # missing: built
    assert (cache / "build.json").is_file() and not built[0].exists()  # built aside, then moved in place
    assert agent_policy.agent_model(cache) == cache and len(built) == 1  # current: reused
    changed = tmp_path / "transcripts.json"
    changed.write_text(agent_policy.TRANSCRIPTS.read_text().replace("Wrote file successfully.", "Wrote it."))
    monkeypatch.setattr(agent_policy, "TRANSCRIPTS", changed)
    assert agent_policy.agent_model(cache) == cache and len(built) == 2  # an input changed: rebuilt
