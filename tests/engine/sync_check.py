"""The check that matters after a weight sync: the engine now serves the trainer's policy.

After each sync the engine's logprobs for a fixed token sequence (vLLM's prompt_logprobs) must equal the trainer's
policy's (its PEFT model, fp32, one forward pass) to within bf16 serving. Each check also records how far the policy
is from what a broken sync would have left served: `moved`, from the policy at the previous check (a sync that sent
nothing), and `from_base`, from the base model (a sync that sent the base weights). A sync passes within TOLERANCE,
or within RELATIVE of both margins (of `from_base` alone at a start's first check; bf16's error grows with the move);
a broken sync sits about 1x a margin away, so a sync is checked with power only where those margins exceed TOLERANCE.
tests/test_sync_check.py pins the rule.

    .venv/bin/python tests/engine/sync_check.py          # a real sync passes, and two broken syncs fail (a table)

starts an engine in training mode (tests/engine.Engine) on a tiny LFM2, gives a PEFT copy of it a LoRA, and syncs it
through TRL 1.15's own WeightTransferClient (vLLM's NCCL engine, on the gloo stand-in) three ways: the merge-free
stream (train_weight_sync, as the trainer sends it), a round that sends nothing, and one that sends the base.
`--json FILE` writes the three records. tests/test_rehearsal.py runs it on its engine (`--vllm-url`).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if __name__ == "__main__":
    sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]

# Max |logprob difference| over the sequence. bf16 serving against the fp32 trainer measured 0.004 on 100 tokens of
# the tiny model (transformers' own bf16 forward against fp32: 0.004 too); five times that leaves room for longer runs.
TOLERANCE = 0.02
# The same for the tiny agent policy (tests/agent_policy.py), which the real-chain rehearsal serves: trained, its logits
# are peaked (a probe token's logprob is about -12, down to -15), where bf16 errs more: transformers' own bf16 forward
# against fp32 differs by up to 0.062 on the probe (mean 0.019), the engine's cold sync by 0.054. A step at the
# rehearsal's learning rate mostly moves it by far more (the step tables show `moved`), but a step with a small gradient
# moved it 0.40-0.44, under the 0.5 this was: a run whose other two groups had no contrast then had no check with the
# power to fail (a test run failed so). Served vs policy after a move of 3.4 or less: 0.04-0.11; the gap grows with the
# move (0.25-0.32 after 12, 0.85 after 9.1), which RELATIVE covers. A sync that sent nothing or the base was 1.1-8.1
# away on the real chain.
AGENT_TOLERANCE = 0.2
RELATIVE = 0.25  # or within this share of the distance a broken sync would leave (moved, from_base)
PROBE_LEN = 256


def probe_ids(vocab_size: int, length: int = PROBE_LEN, seed: int = 0) -> list[int]:
    """The fixed sequence: BOS, then `length - 1` seeded tokens drawn from the vocabulary's ordinary ids."""
    generator = torch.Generator().manual_seed(seed)
    return [1, *torch.randint(12, vocab_size, (length - 1,), generator=generator).tolist()]


def policy_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The model's logprob of each of `ids` after the first (fp32, no grad)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:], device=logits.device)[:, None])[:, 0].cpu()


@dataclass
class SyncRecord:
    """One check: after the sync of `step` (0: the cold sync at a start)."""

    step: int
    served_vs_policy: float  # max |engine - trainer's policy|
    moved: float | None  # max |policy - policy at the previous check|: what a sync that sent nothing would show
    from_base: float  # max |policy - base model|: what a sync that sent the base would show
    ok: bool  # within the tolerance, or within RELATIVE of both margins (of from_base at a start's first check)


class SyncCheck:
    """Checks the engine against the trainer's policy after every sync (`check`, or `attach` to a trainer)."""

    def __init__(self, served: Callable[[list[int]], list[float]], vocab_size: int,
                 tolerance: float = TOLERANCE) -> None:
        self.served, self.ids, self.tolerance = served, probe_ids(vocab_size), tolerance
        self.records: list[SyncRecord] = []
        self._last: torch.Tensor | None = None

    def check(self, model: torch.nn.Module, step: int) -> SyncRecord:
        """`model`: the trainer's PEFT model, as synced."""
        policy = policy_logprobs(model, self.ids)
        with model.disable_adapter():
            base = policy_logprobs(model, self.ids)
        served = torch.tensor(self.served(self.ids))
        gap = (served - policy).abs().max().item()
        moved = None if self._last is None else (policy - self._last).abs().max().item()
        from_base = (policy - base).abs().max().item()
        # bf16's error grows with the step's move (0.85 after a move of 9.1 on the chain); a sync that sent nothing
        # is `moved` away, one that sent the base `from_base` away: within RELATIVE of both still tells them apart.
        # A start's first check (a resumed job's checkpoint) has only `from_base` to be told apart from.
        margin = from_base if moved is None else min(moved, from_base)
        record = SyncRecord(step, gap, moved, from_base, gap <= max(self.tolerance, RELATIVE * margin))
        self._last = policy
        self.records.append(record)
        return record

    def attach(self, trainer: Any) -> None:
        """Check after every sync `trainer` makes: its weight-transfer client's `resume()` (TRL's last call of a
        sync) is followed by the check. The client is TRL's own; only this instance's method is wrapped."""
        client = trainer.weight_transfer
        resume = client.resume

        def resume_then_check() -> None:
            resume()
            self.check(trainer.accelerator.unwrap_model(trainer.model), trainer.state.global_step)

        client.resume = resume_then_check

    def failed(self) -> list[SyncRecord]:
        return [record for record in self.records if not record.ok]


def row(name: str, record: SyncRecord) -> str:
    moved = "-" if record.moved is None else f"{record.moved:.4f}"
    return (f"{name:<14} {record.served_vs_policy:>16.4f} {moved:>12} {record.from_base:>14.4f}  "
            f"{'pass' if record.ok else 'FAIL'}")


def demo(url: str, model_dir: Path) -> dict[str, SyncRecord]:
    """A real sync, then one that sends nothing, then one that sends the base, each followed by the check."""
    from accelerate import PartialState
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    import engine

    engine.importable()
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params
    from trl.experimental.async_grpo.vllm_client import VLLMClient
    from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

    import train_lora
    import train_weight_sync

    PartialState()  # TRL's client logs through accelerate
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           train_lora.lora_config())
    dtype = train_weight_sync.send_dtype()

    def train_a_little(seed: int) -> None:  # a trained adapter: PEFT starts lora_B at zero
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)

    client = WeightTransferClient(VLLMClient(url), train_weight_sync.send_manifest(model, dtype))
    client.init_weight_transfer()
    check = SyncCheck(functools.partial(engine.prompt_logprobs, url), model.config.vocab_size)
    records = {}
    streams: dict[str, Callable[[], Any]] = {
        "real": lambda: train_weight_sync.merge_free_named_tensors(model, dtype),
        "sends nothing": lambda: None,
        # TRL's names and order for a PEFT model, unmerged: the base weights under the manifest's names
        "sends the base": lambda: ((n, p.detach().to(dtype)) for n, p in _iter_vllm_named_params(model)),
    }
    for seed, (name, stream) in enumerate(streams.items(), start=1):
        train_a_little(seed)
        client.pause()
        sent = stream()
        if sent is not None:
            client.send_weights(sent)
        client.resume()
        records[name] = check.check(model, seed)
    client.destroy()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-url", help="an engine in training mode serving --model (default: start one)")
    parser.add_argument("--model", type=Path, help="the model the engine serves (with --vllm-url)")
    parser.add_argument("--json", type=Path, help="write the three records here")
    args = parser.parse_args(argv)
    if bool(args.vllm_url) != bool(args.model):
        parser.error("--vllm-url and --model go together")
    import engine

    work = runner = None
    if args.vllm_url is None:
        work = Path(tempfile.mkdtemp(prefix="sync-check-"))
        args.model = engine.save_engine_model(work / "model")
        runner = engine.Engine(args.model, work / "engine")
        args.vllm_url = runner.start()
    try:
        records = demo(args.vllm_url, args.model)
    finally:
        if runner is not None:
            runner.stop()
    if work is not None:
        shutil.rmtree(work)  # kept, with the engine's log, when the demo raised
    print(f"{'sync':<14} {'served vs policy':>16} {'moved':>12} {'from base':>14}  check (tolerance {TOLERANCE})")
    for name, record in records.items():
        print(row(name, record))
    if args.json:
        args.json.write_text(json.dumps({name: asdict(r) for name, r in records.items()}, indent=1))
    return 0 if records["real"].ok and not records["sends nothing"].ok and not records["sends the base"].ok else 1


if __name__ == "__main__":
    sys.exit(main())
