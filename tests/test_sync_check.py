"""The sync check's verdict (tests/engine/sync_check.py), on a real PEFT model whose served logprobs are made up: a
sync passes within the tolerance, or within RELATIVE of the distance a broken sync would leave; a sync that served
the previous policy or the base fails. The rehearsals run it against vLLM's engine; this pins the rule itself."""

from __future__ import annotations

import torch
from engine.sync_check import AGENT_TOLERANCE as TOLERANCE
from engine.sync_check import RELATIVE, SyncCheck, policy_logprobs
from peft import get_peft_model
from tiny_lfm2 import tiny_model

import train_lora


def peft_model():
    return get_peft_model(tiny_model(seed=0)[0], train_lora.lora_config())


def move(model, scale: float, seed: int) -> None:
    """A trained-looking step: every lora_B set at random (PEFT starts them at zero: the base)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


class Served:
    """What the engine answers: the model it was last given, plus an error of `error` at one token."""

    def __init__(self) -> None:
        self.model, self.error, self.base = None, 0.0, False

    def __call__(self, ids: list[int]) -> list[float]:
        if self.base:
            with self.model.disable_adapter():
                values = policy_logprobs(self.model, ids)
        else:
            values = policy_logprobs(self.model, ids)
        values[len(values) // 2] += self.error
        return values.tolist()


def test_a_sync_passes_within_the_tolerance_and_fails_one_that_served_the_previous_policy_or_the_base():
    model, served = peft_model(), Served()
    check = SyncCheck(served, model.config.vocab_size, TOLERANCE)
    served.model, served.error = model, 0.9 * TOLERANCE
    assert check.check(model, 0).ok  # the cold sync: the base, served within bf16
    served.error = 1.1 * TOLERANCE
    assert not check.check(model, 0).ok  # nothing moved, so only the tolerance holds
    move(model, 0.05, seed=1)
    served.base, served.error = True, 0.0  # the engine still serves the base: the sync sent nothing (or the base)
    record = check.check(model, 1)
    assert record.moved > TOLERANCE and not record.ok, record
    served.base = False
    assert check.check(model, 2).ok  # the policy, served exactly


def test_after_a_large_move_a_sync_passes_within_a_quarter_of_it_and_one_that_sent_nothing_still_fails():
    model, served = peft_model(), Served()
    exact = SyncCheck(lambda ids: policy_logprobs(model, ids).tolist(), model.config.vocab_size, TOLERANCE)
    check = SyncCheck(served, model.config.vocab_size, TOLERANCE)
    served.model = model
    exact.check(model, 0)
    check.check(model, 0)
    move(model, 1.0, seed=2)
    record = exact.check(model, 1)
    # bf16's error grows with the move (0.85 after a move of 9.1 was a real sync): past the tolerance, within a quarter
    served.error = 0.8 * RELATIVE * min(record.moved, record.from_base)
    assert served.error > TOLERANCE, record
    assert check.check(model, 1).ok
    move(model, 1.0, seed=3)
    served.base, served.error = True, 0.0
    assert not check.check(model, 2).ok


def test_a_resumed_starts_cold_sync_far_from_the_base_passes_within_a_quarter_of_that_distance():
    """A relaunched job's first check (nothing checked before it in this process) syncs its checkpoint's policy: a
    sync that sent the base would serve it `from_base` away, so bf16's larger error after that move still passes."""
    model, served = peft_model(), Served()
    move(model, 1.0, seed=4)
    check = SyncCheck(served, model.config.vocab_size, TOLERANCE)
    served.model, served.error = model, 0.0
    record = check.check(model, 1)
    assert record.moved is None, record
    served.error = 0.8 * RELATIVE * record.from_base
    assert served.error > TOLERANCE, record
    assert SyncCheck(served, model.config.vocab_size, TOLERANCE).check(model, 1).ok
    served.base, served.error = True, 0.0
    assert not SyncCheck(served, model.config.vocab_size, TOLERANCE).check(model, 1).ok
