"""What a learning run taught the agent policy, exactly: at OpenCode's first call, the probability that the tiny agent
policy (tests/agent_policy.py) writes each of its six answers, under the base and under adapters (fp32, PEFT, three
prompts with random task names and dates). Sampled rewards are noisy; this is the quantity GRPO moves.

    .venv/bin/python benchmarks/answer_probe.py W/model W/outputs/final     # W: a learning_run.py --workdir
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def answer_probabilities(model: object, tokenizer: object, prompts: list[tuple[str, str]]) -> dict[str, float]:
    """P(the whole write call with this answer | the first call's request), averaged over `prompts`."""
    import agent_policy as ap
    import torch

    data, out = ap.transcripts(), {}
    for answer in ap.ANSWERS:
        seen = []
        for task, date in prompts:
            convo = ap.conversations(data, task, date, answer)["agent"]
            ids, mask = ap.encode(tokenizer, {"messages": convo["messages"][:-2], "tools": convo["tools"]})
            x = torch.tensor([ids])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
            picked = logprobs[torch.arange(len(ids) - 1), x[0, 1:]][torch.tensor(mask[1:], dtype=torch.bool)]
            seen.append(picked.sum().exp().item())
        out[answer] = sum(seen) / len(seen)
    return out


def main(argv: list[str]) -> None:
    import agent_policy as ap
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, adapters = Path(argv[0]), argv[1:]
    tokenizer = AutoTokenizer.from_pretrained(base)
    rng = random.Random(1)
    prompts = [(ap.random_task(rng), ap.random_date(rng)) for _ in range(3)]
    load = lambda: AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)  # noqa: E731
    rows = {"base": answer_probabilities(load(), tokenizer, prompts)}
    for adapter in adapters:
        rows[adapter] = answer_probabilities(PeftModel.from_pretrained(load(), adapter), tokenizer, prompts)
    for name, probs in rows.items():
        total = sum(probs.values())
        shares = " ".join(f"{answer} {p / total:.2f}" for answer, p in probs.items())
        print(f"{name}: well-formed {total:.2f}; of those {shares}")


if __name__ == "__main__":
    main(sys.argv[1:])
