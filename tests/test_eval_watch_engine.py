"""eval_watch on vLLM's own engine (issue 40 item 5): each pushed checkpoint is hot-loaded into the real engine in LoRA
mode (serve_policy.sh with LORA=1: --enable-lora, --max-loras 1, runtime loading), one adapter after another, and the
base and adapter cells are scored through the real chain (`openenv harbor serve`, Harbor's Trial in the bubblewrap
sandbox, the real OpenCode, the task's verifier), on the fixture's prepared test task.

The tiny model is random, so every cell scores 0 (it writes no answer); what this proves is the hot-load path, read
off what the engine served while each adapter was loaded: under the adapter's name the engine's logprobs equal a PEFT
forward of that checkpoint (bf16), and differ from the base's by more than that; each checkpoint is loaded from its
own folder under its own name (an in-place reload from one path kept stale prefix-cache blocks: FACTS.md), and after
the second one the engine serves the second, not the first. test_eval_watch.py keeps the watcher's bookkeeping on
doubles (order, resume, two writers, smoke runs), where a real engine and chain would add minutes and nothing else.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import engine
import httpx
import pytest
import torch
from chain import envserver
from engine.sync_check import TOLERANCE, policy_logprobs, probe_ids
from hub_double import LocalHub

import eval_adapter as ea
import eval_watch as ew
import recipe
from adapter_repo import push_folder

envserver.require()
engine.require()

REPO = "you/LFM2.5-2.6B-opencode-lora-RL"
CHECKPOINTS = ("checkpoint-1", "final")


def save_adapter(model_dir: Path, path: Path, seed: int) -> Path:
    """A real PEFT adapter (train_lora's LoraConfig) on the engine's model, with trained-looking weights (PEFT starts
    lora_B at zero: an untrained adapter serves the base exactly)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    import train_lora

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           train_lora.lora_config())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    model.save_pretrained(path)
    return path


def peft_logprobs(model_dir: Path, adapter: Path | None, ids: list[int]) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return policy_logprobs(PeftModel.from_pretrained(model, adapter) if adapter else model, ids)


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """A repo with checkpoint-1 and a final adapter, watched to the end by eval_watch's Watcher on the real engine and
    chain; every load the watcher made, with what the engine served right after it."""
    from chain.bucket import Bucket
    from harbor_fixture import BUCKET, materialized

    root = tmp_path_factory.mktemp("watch-engine")
    model = engine.save_engine_model(root / "model", vocab_size=envserver.CHAIN_VOCAB)
    vllm = engine.Engine(model, root / "engine", lora=True)
    vllm.start(wait=False)
    tasks = materialized(root / "fixture", n_medium=1, n_hard=0, n_test=1)
    names = [p.name for p in (tasks / "test" / "tasks").iterdir()]
    bucket = Bucket(BUCKET, {f"user__{name}": {"table.csv": b"x\n4.0\n4.4\n"} for name in names})
    hub = LocalHub(root / "hub")
    hub.create_repo(REPO)
    for seed, name in enumerate(CHECKPOINTS, start=1):
        push_folder(hub, REPO, save_adapter(model, root / "adapters" / name, seed),
                    "" if name == "final" else name, marker=name != "final")
    ids = probe_ids(envserver.CHAIN_VOCAB)
    served: list[dict] = []
    lora = ea.LoraServer(vllm.url)
    real_serving = lora.serving

    @contextlib.contextmanager
    def serving_and_probe(name: str, path: Path) -> Iterator[None]:
        with real_serving(name, path):
            served.append({"name": name, "path": path, "adapter": engine.prompt_logprobs(vllm.url, ids, name),
                           "base": engine.prompt_logprobs(vllm.url, ids)})
            yield

    lora.serving = serving_and_probe
    server = envserver.EnvServer(root / "env", tasks / "test", vllm.url, bucket.url,
                                 max_output_tokens=envserver.RANDOM_MODEL_MAX_TOKENS)
    try:
        vllm.wait()
        server.start()  # it probes vLLM before it serves
        with pytest.MonkeyPatch.context() as env:
            env.setenv("ENV_URL", server.url)
            env.setenv("VLLM_URL", vllm.url)
            factory, tasks, _ = ea.servers(recipe.SANDBOX)
        watcher = ew.Watcher(hub, REPO, factory, lora, tasks, root / "work", n_tasks=1, concurrency=1, poll_s=0,
                             max_idle_s=0)
        ended = watcher.run()
        loaded = {card["id"]: card.get("parent") for card in httpx.get(f"{vllm.url}/v1/models").json()["data"]}
        yield {"ended": ended, "served": served, "model": model, "root": root, "hub": hub, "ids": ids,
               "loaded": loaded}
    finally:
        server.stop()
        vllm.stop()
        bucket.stop()


def test_the_watcher_scores_base_and_each_adapter_through_the_real_chain(watched):
    assert watched["ended"] == "final"
    summary = json.loads((watched["hub"].root / REPO / "eval" / "summary.json").read_text())
    assert summary["base"]["scored"] == 1 and summary["base"]["pass_at_1"] == 0.0  # a random model writes no answer
    rows = {row["checkpoint"]: row for row in summary["checkpoints"]}
    assert set(rows) == set(CHECKPOINTS), rows
    assert all(row["complete"] and row["scored"] == 1 and row["unscorable"] == 0 for row in rows.values()), rows
    assert watched["loaded"] == {recipe.SERVED_MODEL_NAME: None}  # every adapter unloaded after its cells


def test_each_hot_loaded_adapter_is_served_as_peft_computes_it(watched):
    served, model, ids = watched["served"], watched["model"], watched["ids"]
    assert [s["name"] for s in served] == [ea.served_name(name) for name in CHECKPOINTS]
    assert len({s["path"] for s in served}) == len(CHECKPOINTS)  # each from its own folder
    base = peft_logprobs(model, None, ids)
    for entry in served:
        adapter = peft_logprobs(model, entry["path"], ids)
        got, base_got = torch.tensor(entry["adapter"]), torch.tensor(entry["base"])
        assert (got - adapter).abs().max() <= TOLERANCE, (entry["name"], (got - adapter).abs().max())
        assert (base_got - base).abs().max() <= TOLERANCE  # the base name still serves the base beside it
        assert (adapter - base).abs().max() > 5 * TOLERANCE  # so the two checks above could tell them apart
    first, second = (torch.tensor(s["adapter"]) for s in served)
    assert (first - second).abs().max() > 5 * TOLERANCE  # the second load serves the second adapter, not the first
