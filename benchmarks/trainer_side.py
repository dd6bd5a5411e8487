"""Trainer-side benchmark: adapter size, stock vs merge-free weight sync, merge drift, and one GRPO step.

Checks the recipe's trainer-side claims on one GPU without the Hub: random weights in the LFM2-2.6B shape
(FACTS.md, or the real config.json with --config), LoRA from train_lora.lora_config(), TRL 1.15's own merge,
stream, packer and loss code. Prints one markdown table (benchmarks/LOG.md holds the H200 run):

    python benchmarks/trainer_side.py --tiny                       # CPU, seconds (tests/test_benchmark_tiny.py)
    python benchmarks/trainer_side.py --json trainer_side.json     # one H200, LFM2-2.6B shape
    python benchmarks/trainer_side.py --config config.json         # the real LFM2.5-2.6B config instead
    python benchmarks/trainer_side.py --nccl --json nccl.json      # two GPUs: the sync over NCCL, GPU 0 -> GPU 1
    python benchmarks/trainer_side.py --tiny --nccl                # the same with two CPU processes over gloo

--nccl measures the transport the way TRL 1.15 drives it, without vLLM: rank 0 merges, streams every base weight
in TRL's order packed into byte buckets like vLLM's packed_nccl_broadcast_producer (two in flight), and unmerges;
rank 1 unpacks by the shared manifest into a same-shape bf16 model and later sends it back for a bit-exact check.
Its phases are synchronized perf_counter spans; a sync ends when both ranks meet after the receiver's last copy.

Timings are medians (and p90) of repeated runs after warm-up, with CUDA events on a GPU (synchronized
perf_counter on CPU). Each section records its own failure in the table instead of ending the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Lfm2Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig  # noqa: E402
from trl.experimental.async_grpo.async_grpo_trainer import (  # noqa: E402
    AsyncGRPOTrainer,
    DataCollatorForRollout,
    FixedCountBatcher,
    TokenBudgetBatcher,
    _iter_vllm_named_params,
)
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

import recipe  # noqa: E402
import train_weight_sync  # noqa: E402
from tests.tiny_lfm2 import lora_param_count  # noqa: E402
from train_lora import conv_safe_batching, lora_config  # noqa: E402

# LFM2-2.6B as read off its public ONNX export (FACTS.md); --config replaces it with a real config.json.
LFM2_2_6B = dict(
    vocab_size=65536,
    hidden_size=2048,
    intermediate_size=10752,
    num_attention_heads=32,
    num_key_value_heads=8,
    layer_types=["full_attention" if i in (2, 5, 9, 13, 17, 21, 24, 27) else "conv" for i in range(30)],
    block_auto_adjust_ff_dim=False,
    tie_word_embeddings=True,
    max_position_embeddings=128000,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=["conv", "full_attention", "conv", "full_attention"],
    block_auto_adjust_ff_dim=False,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
# Trained-like adapter: B ~ N(0, B_STD) against PEFT's kaiming-uniform A gives a delta of about 1% of W's scale
# (initializer_range 0.02). B = 0 (a fresh adapter) would make every merge a no-op and hide all drift.
B_STD = 1e-3
RECIPE_ADAPTER_MB = 170  # The recipe text's "~170 MB adapter".
RECIPE_SYNC_MS = 136  # The recipe text's "136 ms/step" merged-weight sync.
RECIPE_STEP_S = (35, 50)  # The recipe text's seconds per optimizer step once the rollout queue saturates.
ISSUE_STOCK_TRAINER_MS = 37.9  # Issue 8's earlier H200 measurement of the stock path's trainer side.
MERGE_FREE_GOAL_MS = 8  # Issue 8's target for the merge-free trainer side.


# --- Measuring -----------------------------------------------------------------------------------------------------
class Table:
    """Rows of (item, metric, measured, anchor, note), printed as one markdown table and saved as JSON."""

    def __init__(self) -> None:
        self.rows: list[dict[str, str]] = []

    def add(self, item: str, metric: str, measured: str, anchor: str = "", note: str = "") -> None:
        self.rows.append(dict(item=item, metric=metric, measured=measured, anchor=anchor, note=note))
        print(f"  [{item}] {metric}: {measured}  {anchor}  {note}", flush=True)

    def markdown(self) -> str:
        lines = ["| # | metric | measured | anchor | note |", "|---|---|---|---|---|"]
        lines += [f"| {r['item']} | {r['metric']} | {r['measured']} | {r['anchor']} | {r['note']} |" for r in self.rows]
        return "\n".join(lines)


def human(nbytes: float, unit: str = "B") -> str:
    """1234567 -> '1.23 MB' (decimal units, as the recipe states sizes)."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {prefix}{unit}"
    return f"{nbytes:.0f} {unit}"


def peak_gib(device: torch.device) -> str:
    return f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else "n/a on CPU"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Milliseconds per call of `fn`: CUDA events on a GPU, synchronized perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def gpu_only_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median GPU time of `fn` with all of its work queued behind a ~50 ms spin: its cost if the CPU keeps up."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(100_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def median_p90(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device memory bandwidth in bytes/s from a large copy, counting bytes read plus bytes written."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = time_ms(lambda: dst.copy_(src), device, repeats=10, warmup=3)
    return 2 * nbytes / (statistics.median(times) / 1e3)


# --- Model ---------------------------------------------------------------------------------------------------------
def model_config(args: argparse.Namespace, **overrides: Any) -> Lfm2Config:
    if args.config:
        config = Lfm2Config.from_dict(json.loads(Path(args.config).read_text()))
        for key, value in overrides.items():
            setattr(config, key, value)
        return config
    shape = dict(TINY if args.tiny else LFM2_2_6B)
    shape.update(overrides)
    shape["num_hidden_layers"] = len(shape["layer_types"])
    return Lfm2Config(**shape)


def lora_model(config: Lfm2Config, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """Random-weight Lfm2 in `dtype` with TRL's fused LM head and the recipe's LoRA, B drawn nonzero.

    Built the way AsyncGRPOTrainer builds it: base in the trainer dtype, fused head added before PEFT,
    adapters left in PEFT's default fp32.
    """
    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    add_fused_lm_head(model, temperature=recipe.TEMPERATURE, outputs=("log_probs", "entropy"))
    model = get_peft_model(model, lora_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, B_STD)
    return model


def wrapped_base_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [layer.get_base_layer().weight for layer in train_weight_sync.lora_layers_by_weight(model).values()]


# --- 1. Adapter size -----------------------------------------------------------------------------------------------
def adapter_size(table: Table, model: torch.nn.Module, config: Lfm2Config) -> None:
    n_lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    formula = lora_param_count(config)
    table.add(
        "1",
        "LoRA trainable params",
        f"{n_lora:,}",
        f"formula (FACTS.md, tests/tiny_lfm2.lora_param_count): {formula:,}",
        "matches" if n_lora == formula else "DIFFERS from the formula",
    )
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        fp32_bytes = (Path(tmp) / "adapter_model.safetensors").stat().st_size
        state = get_peft_model_state_dict(model)
        state = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in state.items()}
        save_file(state, str(Path(tmp) / "bf16.safetensors"))
        bf16_bytes = (Path(tmp) / "bf16.safetensors").stat().st_size
    table.add(
        "1",
        "saved adapter (fp32 / bf16)",
        f"{human(fp32_bytes)} / {human(bf16_bytes)}",
        f"recipe ~{RECIPE_ADAPTER_MB} MB; FACTS 4 B x params = {human(4 * formula)}",
        "adapter_model.safetensors as PEFT saves it (fp32, TRL's trainer dtype)",
    )


# --- 2. Weight sync: stock merge -> stream -> unmerge vs merge-free --------------------------------------------------
def stock_phases(model: torch.nn.Module, device: torch.device, sent: torch.dtype | None) -> dict[str, float]:
    """One TRL 1.15 merged sync's trainer side, phase by phase (ms). sent=None streams as TRL does (fp32 as-is)."""
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if device.type == "cuda" else None
    stamps = []

    def mark(i: int) -> None:
        if marks:
            marks[i].record()
        else:
            stamps.append(time.perf_counter())

    mark(0)
    model.merge_adapter()
    mark(1)
    try:
        for _, param in _iter_vllm_named_params(model):
            tensor = param.detach()
            if sent is not None:
                tensor = tensor.to(sent)
            del tensor
        mark(2)
    finally:
        model.unmerge_adapter()
    mark(3)
    if marks:
        marks[3].synchronize()
        ms = [marks[i].elapsed_time(marks[i + 1]) for i in range(3)]
    else:
        ms = [(stamps[i + 1] - stamps[i]) * 1e3 for i in range(3)]
    return dict(merge=ms[0], stream=ms[1], unmerge=ms[2], total=sum(ms))


def weight_sync_rows(table: Table, model: torch.nn.Module, device: torch.device, args: argparse.Namespace) -> None:
    sent = train_weight_sync.send_dtype()
    params = [p for _, p in _iter_vllm_named_params(model)]
    n_all = sum(p.numel() for p in params)
    n_wrapped = sum(w.numel() for w in wrapped_base_weights(model))
    base_bytes = params[0].element_size()
    bandwidth = copy_bandwidth(device, args.bandwidth_bytes)
    # The one pass that is needed: read every base weight once, write the sent copy once (the B@A inputs are tiny).
    floor_bytes = n_all * (base_bytes + sent.itemsize)
    floor_ms = floor_bytes / bandwidth * 1e3
    table.add(
        "2",
        "device copy bandwidth",
        human(bandwidth, "B/s"),
        "H200 datasheet 4.8 TB/s",
        f"{n_all:,} streamed params, {n_wrapped:,} of them LoRA-wrapped",
    )
    table.add("2", "floor: read base once + write bf16 once", f"{floor_ms:.2f} ms", f"{human(floor_bytes)} moved")

    for label, dtype in (("as TRL 1.15 sends (fp32, no cast)", None), ("cast to bf16 in the stream", sent)):
        phases = [stock_phases(model, device, dtype) for _ in range(args.warmup + args.repeats)][args.warmup :]
        med = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
        _, p90 = median_p90([p["total"] for p in phases])
        table.add(
            "2/8",
            f"stock merged sync, trainer side, {label}",
            f"{med['total']:.1f} ms (p90 {p90:.1f})",
            f"recipe {RECIPE_SYNC_MS} ms/step (incl. NCCL); issue 8: {ISSUE_STOCK_TRAINER_MS} ms",
            f"merge {med['merge']:.1f} + stream {med['stream']:.1f} + unmerge {med['unmerge']:.1f} ms; "
            f"{med['total'] / floor_ms:.1f}x floor",
        )

    largest = max(w.numel() for w in wrapped_base_weights(model))
    largest_any = max(p.numel() for p in params)

    def merge_free() -> None:
        for _, tensor in train_weight_sync.merge_free_named_tensors(model, sent):
            del tensor

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    times = time_ms(merge_free, device, args.repeats, args.warmup)
    peak_extra = human(torch.cuda.max_memory_allocated() - before) if device.type == "cuda" else "n/a on CPU"
    med, p90 = median_p90(times)
    synchronize(device)
    t0 = time.perf_counter()
    merge_free()
    issue_ms = (time.perf_counter() - t0) * 1e3  # CPU time to issue the work; near the total = CPU-bound
    synchronize(device)
    gpu_ms = f"GPU time queued ahead {gpu_only_ms(merge_free, device, 5):.2f} ms; " if device.type == "cuda" else ""
    table.add(
        "8",
        "merge-free sync, trainer side (bf16 stream)",
        f"{med:.2f} ms (p90 {p90:.2f})",
        f"goal <= {MERGE_FREE_GOAL_MS} ms",
        f"{med / floor_ms:.2f}x floor; CPU issue time {issue_ms:.1f} ms; {gpu_ms}peak extra memory {peak_extra} "
        f"(bound: two fp32 B @ A temps of the largest wrapped weight, {largest:,} elems, or the bf16 copy of the "
        f"largest weight, {largest_any:,} elems: {human(max(10 * largest, 2 * largest_any))})",
    )
    if device.type == "cuda":
        kernel_rows(table, model, device, args, bandwidth)
    table.add(
        "8",
        "bytes on the NCCL wire per sync",
        f"stock {human(n_all * base_bytes)}, merge-free {human(n_all * sent.itemsize)}",
        "",
        "stock sends the trainer's fp32 and vLLM casts on receipt; merge-free sends bf16",
    )
    exactness_rows(table, model, sent, device)


def kernel_rows(
    table: Table, model: torch.nn.Module, device: torch.device, args: argparse.Namespace, bandwidth: float
) -> None:
    """GPU time of each per-tensor step on a weight 8x the largest FFN weight, so launch overhead is negligible."""
    layers = train_weight_sync.lora_layers_by_weight(model).values()
    layer = max(layers, key=lambda m: m.get_base_layer().weight.numel())
    lora_a, lora_b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
    lora_b = lora_b.repeat(8, 1)
    weight = torch.randn(lora_b.shape[0], lora_a.shape[1], device=device)
    delta = lora_b @ lora_a
    out = torch.empty(weight.shape, dtype=train_weight_sync.send_dtype(), device=device)
    n = weight.numel()
    steps = {
        "B @ A (fp32 temp)": (lambda: torch.mm(lora_b, lora_a), 4 * n),
        "B @ A * 2 (PEFT's delta: a second fp32 pass)": (lambda: torch.mm(lora_b, lora_a) * 2.0, 12 * n),
        "torch.add (W, delta -> bf16)": (lambda: torch.add(weight, delta, out=out), 10 * n),
        "W.to(bf16) (copy reference)": (lambda: out.copy_(weight), 6 * n),
    }
    for label, (fn, nbytes) in steps.items():
        med = statistics.median(time_ms(fn, device, args.repeats, args.warmup))
        table.add(
            "8k",
            f"kernel: {label}, {n:,} elems",
            f"{med * 1e3:.0f} us",
            f"{human(nbytes / (med / 1e3), 'B/s')}",
            f"{nbytes / (med / 1e3) / bandwidth:.0%} of copy bandwidth",
        )


def exactness_rows(table: Table, model: torch.nn.Module, sent: torch.dtype, device: torch.device) -> None:
    """On this device: the merge-free stream vs stock merge -> cast -> unmerge, and the base untouched."""
    model.merge_adapter()
    try:
        stock = [(n, p.detach().to(sent)) for n, p in _iter_vllm_named_params(model)]
    finally:
        model.unmerge_adapter()
    base = [p.detach().clone() for _, p in _iter_vllm_named_params(model)]
    free = list(train_weight_sync.merge_free_named_tensors(model, sent))
    unchanged = all(torch.equal(b, p) for b, (_, p) in zip(base, _iter_vllm_named_params(model), strict=True))
    del base
    names_equal = [n for n, _ in free] == [n for n, _ in stock]
    bad_tensors = bad_elems = 0
    for (_, mine), (_, theirs) in zip(free, stock, strict=True):
        diff = int((mine.view(torch.int16) != theirs.view(torch.int16)).sum())
        bad_tensors += diff > 0
        bad_elems += diff
    del free
    table.add(
        "8",
        "merge-free == stock, bit for bit (this device)",
        "yes" if names_equal and bad_elems == 0 else f"NO: {bad_tensors} tensors / {bad_elems} elements differ",
        "",
        f"names/order equal: {names_equal}; base weights unchanged by merge-free: {unchanged}",
    )


# --- 3. Drift of the frozen weights after repeated merge/unmerge ----------------------------------------------------
def drift_rows(table: Table, args: argparse.Namespace, device: torch.device) -> None:
    # Every wrapped shape of the full model, once: one attention layer and one conv layer (the FFN) suffice.
    config = model_config(args, layer_types=["full_attention", "conv"], num_hidden_layers=2, vocab_size=1024)
    for dtype in (torch.float32, torch.bfloat16):
        model = lora_model(config, device, dtype)
        weights = wrapped_base_weights(model)
        before = [w.detach().clone() for w in weights]
        for _ in range(args.drift_cycles):
            model.merge_adapter()
            model.unmerge_adapter()
        diffs = [w.detach().float() - b.float() for w, b in zip(weights, before, strict=True)]
        max_abs = max(float(d.abs().max()) for d in diffs)
        diff_sq = sum(float(d.pow(2).sum()) for d in diffs)
        del diffs
        ref_sq = sum(float(b.float().pow(2).sum()) for b in before)
        changed = sum(int((w != b).sum()) for w, b in zip(weights, before, strict=True))
        total = sum(b.numel() for b in before)
        table.add(
            "3",
            f"drift after {args.drift_cycles} merge/unmerge cycles, {str(dtype).removeprefix('torch.')} base",
            f"max abs {max_abs:.2e}, relative (Frobenius) {(diff_sq / ref_sq) ** 0.5:.2e}",
            "0 wanted: the frozen base must not move",
            f"{changed / total:.2%} of wrapped elements changed; merge-free sync never writes the base",
        )
        del model, weights, before


# --- 4/5. One GRPO optimizer step with TRL's packer and loss ---------------------------------------------------------
def synthetic_group(args: argparse.Namespace, turns: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    """A GRPO group of rollouts shaped like agent traces: prompt, then `turns` x (model output, tool result).

    Output tokens per turn ~ U(min, MAX_TOKENS) and tool results ~ U(64, 1024), each rollout cut at MAX_MODEL_LEN;
    only model outputs carry the completion mask, as in TRL's loop-owning traces.
    """
    rng = random.Random(seed)
    rewards = [1.0, 0.0] * (recipe.NUM_GENERATIONS // 2)
    mean = sum(rewards) / len(rewards)
    std = statistics.pstdev(rewards) or 1.0
    group = []
    for i in range(recipe.NUM_GENERATIONS):
        mask = [0] * args.prompt_tokens
        for _ in range(turns):
            mask += [1] * rng.randint(args.min_turn_tokens, args.max_turn_tokens)
            mask += [0] * rng.randint(args.min_tool_tokens, args.max_tool_tokens)
        mask = mask[: args.max_len]
        n = len(mask)
        group.append(
            dict(
                input_ids=[rng.randrange(vocab) for _ in range(n)],
                completion_mask=mask,
                old_log_probs=[-rng.random() * 2 if m else 0.0 for m in mask],
                advantage=(rewards[i] - mean) / std,
                group_id=0,
                metrics={},
            )
        )
    return group


def micro_batches(group: list[dict[str, Any]], mode: str, token_budget: int) -> list[list[list[dict[str, Any]]]]:
    """TRL's own planners: 'packed' = TokenBudgetBatcher (TRL's default budget), 'conv_safe' = train_lora's batching."""
    if mode == "conv_safe":
        per_row = conv_safe_batching()["per_device_train_batch_size"]
        return list(FixedCountBatcher(group, num_processes=1, microbatch_size=per_row))
    # TokenBudgetBatcher emits a micro-batch only when the next sample does not fit: a full-budget sentinel flushes it.
    sentinel = dict(group[0], input_ids=[0] * token_budget)
    return list(TokenBudgetBatcher([*group, sentinel], num_processes=1, token_budget=token_budget, metrics={}))


def loss_trainer(device: torch.device, accumulation: int) -> AsyncGRPOTrainer:
    """An AsyncGRPOTrainer carrying just what its compute_loss reads, so TRL's loss runs unmodified."""
    from accelerate import Accelerator

    fields = AsyncGRPOConfig.__dataclass_fields__
    trainer = object.__new__(AsyncGRPOTrainer)
    trainer.accelerator = Accelerator(cpu=device.type == "cpu")
    trainer.aux_loss_enabled = False
    trainer.epsilon_low = fields["epsilon"].default
    trainer.epsilon_high = fields["epsilon_high"].default or fields["epsilon"].default
    trainer.current_gradient_accumulation_steps = accumulation
    trainer._metrics = defaultdict(lambda: defaultdict(list))
    for counter in ("_step_forward_tokens", "_step_trained_tokens", "_step_seq_len_weighted", "_step_samples"):
        setattr(trainer, counter, 0.0)
    trainer._step_forward_s = 0.0
    return trainer


def grpo_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list, device: torch.device) -> None:
    """One optimizer step: TRL's collator (the packer) and compute_loss on every micro-batch, then AdamW."""
    trainer = loss_trainer(device, len(batches))
    collator = DataCollatorForRollout(pad_token_id=0, num_processes=1)
    for rows in batches:
        inputs = {k: v.to(device) for k, v in collator.torch_call([rows]).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = trainer.compute_loss(model, inputs)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_rows(table: Table, model: torch.nn.Module, device: torch.device, args: argparse.Namespace) -> None:
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe.LEARNING_RATE)
    vocab = model.config.vocab_size
    for turns in args.turns:
        group = synthetic_group(args, turns, vocab, seed=turns)
        tokens = sum(len(s["input_ids"]) for s in group)
        trained = sum(sum(s["completion_mask"]) for s in group)
        for mode in ("packed", "conv_safe"):
            item = "4" if mode == "packed" else "5"
            batches = micro_batches(group, mode, args.max_len)
            rows = sum(len(b) for b in batches)
            try:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                times = time_ms(lambda b=batches: grpo_step(model, optimizer, b, device), device, args.step_repeats, 1)
                peak = peak_gib(device)
                med, p90 = median_p90(times)
                share = f"{med / 1e3 / RECIPE_STEP_S[1]:.0%}-{med / 1e3 / RECIPE_STEP_S[0]:.0%} of the recipe's step"
                table.add(
                    item,
                    f"GRPO step, {turns} turns, {'TRL packing' if mode == 'packed' else 'conv-safe rows'}",
                    f"{med / 1e3:.2f} s (p90 {p90 / 1e3:.2f}), peak {peak}, {tokens / (med / 1e3):,.0f} tok/s",
                    f"recipe step {RECIPE_STEP_S[0]}-{RECIPE_STEP_S[1]} s: {share}",
                    f"{tokens:,} tokens ({trained:,} trained) in {len(batches)} micro-batches / {rows} rows",
                )
            except torch.OutOfMemoryError as error:
                table.add(item, f"GRPO step, {turns} turns, {mode}", "OOM", "", str(error).splitlines()[0][:120])
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    fit_rows(table, model, optimizer, device, args, vocab)


def fit_rows(table: Table, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
             args: argparse.Namespace, vocab: int) -> None:  # fmt: skip
    """The longest single row whose forward+backward fits: it bounds the tokens of one micro-batch."""
    largest, note = 0, "no OOM up to the largest row tried"
    for n in args.fit_lengths:
        sample = dict(input_ids=[i % vocab for i in range(n)], completion_mask=[1] * n, old_log_probs=[-1.0] * n,
                      advantage=1.0, group_id=0, metrics={})  # fmt: skip
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            grpo_step(model, optimizer, [[[sample]]], device)
            synchronize(device)
            note = f"last fit: {n:,} tokens, peak {peak_gib(device)}, {time.perf_counter() - t0:.1f} s"
            largest = n
        except torch.OutOfMemoryError:
            note += f"; {n:,} tokens: OOM"
            optimizer.zero_grad(set_to_none=True)
            break
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    table.add("4", "largest single-row micro-batch that fits", f"{largest:,} tokens", f"rows tried {args.fit_lengths}",
              note)  # fmt: skip


# --- 9. Two GPUs: merged-weight sync over NCCL, trainer GPU -> policy GPU -------------------------------------------
# NVLink multicast stays off (device README: it can take a shared host's GPUs out of service).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
IN_FLIGHT = 2  # vLLM's DEFAULT_PACKED_NUM_BUFFERS: bucket k+1 is packed while bucket k is on the wire.
# TRL 1.15's stock sync sends its fp32 params as they are and vLLM casts them on load; the bf16 variants send
# what vLLM keeps.
NCCL_VARIANTS = ("stock, fp32 as TRL 1.15 sends", "stock, cast to bf16", "merge-free bf16 stream")


def bucket_ranges(nbytes: list[int], bucket_bytes: int) -> list[range]:
    """Tensor indices per bucket, cut as vLLM's packed producer and consumer both cut them: once over the size."""
    buckets, start, size = [], 0, 0
    for i, n in enumerate(nbytes):
        size += n
        if size > bucket_bytes:
            buckets.append(range(start, i + 1))
            start, size = i + 1, 0
    if start < len(nbytes):
        buckets.append(range(start, len(nbytes)))
    return buckets


def send_packed(tensors: Iterator[torch.Tensor], buckets: list[range], src: int) -> None:
    """Producer: concatenate each bucket's tensors as bytes and broadcast it, IN_FLIGHT buckets at a time."""
    pending: list[tuple[Any, torch.Tensor]] = []
    for bucket in buckets:
        if len(pending) == IN_FLIGHT:
            pending.pop(0)[0].wait()
        packed = torch.cat([next(tensors).contiguous().view(torch.uint8).view(-1) for _ in bucket])
        pending.append((dist.broadcast(packed, src=src, async_op=True), packed))
    for work, _ in pending:
        work.wait()


def receive_packed(targets: list[torch.Tensor], manifest: list[tuple[str, list[int], torch.dtype]],
                   buckets: list[range], src: int) -> None:  # fmt: skip
    """Consumer: receive each bucket, split it by the shared manifest and copy every tensor into its target."""
    sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in manifest]
    device = targets[0].device

    def unpack(bucket: range, packed: torch.Tensor) -> None:
        for i, chunk in zip(bucket, packed.split([sizes[i] for i in bucket]), strict=True):
            targets[i].copy_(chunk.view(manifest[i][2]).view(manifest[i][1]))  # casts fp32 -> bf16 as vLLM's load

    pending: list[tuple[Any, range, torch.Tensor]] = []
    for bucket in buckets:
        packed = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8, device=device)
        pending.append((dist.broadcast(packed, src=src, async_op=True), bucket, packed))
        if len(pending) == IN_FLIGHT:
            work, done, data = pending.pop(0)
            work.wait()
            unpack(done, data)
    for work, done, data in pending:
        work.wait()
        unpack(done, data)


def rendezvous(device: torch.device) -> None:
    """Both ranks meet here with all earlier work done: a one-element all-reduce, then a device sync."""
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag)
    synchronize(device)


def bit_mismatches(expected: list[torch.Tensor], received: list[torch.Tensor]) -> tuple[int, int]:
    """(tensors, elements) whose bits differ; a shape mismatch counts the whole tensor."""
    tensors = elements = 0
    for mine, theirs in zip(expected, received, strict=True):
        if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            diff = mine.numel()
        else:
            diff = int((mine.view(torch.int16) != theirs.view(torch.int16)).sum())
        tensors += diff > 0
        elements += diff
    return tensors, elements


def trainer_stream(model: torch.nn.Module, variant: str) -> Iterator[torch.Tensor]:
    """What the trainer puts on the wire, tensor by tensor, in TRL's order (the model is merged for stock)."""
    sent = train_weight_sync.send_dtype()
    if variant == NCCL_VARIANTS[2]:
        return (t for _, t in train_weight_sync.merge_free_named_tensors(model, sent))
    cast = variant == NCCL_VARIANTS[1]
    return (p.detach().to(sent) if cast else p.detach() for _, p in _iter_vllm_named_params(model))


def trainer_sync(model: torch.nn.Module, variant: str, buckets: list[range], device: torch.device) -> dict[str, float]:
    """One sync on rank 0, phase by phase (ms): merge, transfer until the receiver has copied everything, unmerge."""
    stock = variant != NCCL_VARIANTS[2]
    rendezvous(device)
    stamps = [time.perf_counter()]
    if stock:
        model.merge_adapter()
    synchronize(device)
    stamps.append(time.perf_counter())
    try:
        send_packed(trainer_stream(model, variant), buckets, src=0)
        rendezvous(device)  # the receiver joins only after its last copy: the weights are in place
        stamps.append(time.perf_counter())
    finally:
        if stock:
            model.unmerge_adapter()
    synchronize(device)
    stamps.append(time.perf_counter())
    ms = [(stamps[i + 1] - stamps[i]) * 1e3 for i in range(3)]
    return dict(merge=ms[0], transfer=ms[1], unmerge=ms[2], total=sum(ms))


def link_peak(device: torch.device, nbytes: int, repeats: int, warmup: int) -> list[float]:
    """Seconds per plain broadcast of `nbytes` rank 0 -> rank 1, each bracketed by rendezvous like a sync."""
    buffer = torch.ones(nbytes, dtype=torch.uint8, device=device)
    times = []
    for i in range(warmup + repeats):
        rendezvous(device)
        t0 = time.perf_counter()
        dist.broadcast(buffer, src=0)
        rendezvous(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def nccl_worker(rank: int, args: argparse.Namespace, port: int, result: str) -> None:
    """One process per GPU: rank 0 is the trainer (fp32 base + LoRA), rank 1 the bf16 policy copy vLLM would hold."""
    os.environ.update(NO_MULTICAST)
    if args.tiny:
        torch.set_num_threads(1)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        device_id=device if device.type == "cuda" else None,
    )
    try:
        if rank == 0:
            table = nccl_trainer(args, device)
            Path(result).write_text(json.dumps(dict(device=device_names(), rows=table.rows), indent=1))
        else:
            nccl_receiver(args, device)
    finally:
        dist.destroy_process_group()


def device_names() -> str:
    if not torch.cuda.is_available():
        return "2 CPU processes (gloo)"
    return " + ".join(torch.cuda.get_device_name(i) for i in range(2)) + " (NCCL)"


def manifests(model: torch.nn.Module) -> dict[str, list[tuple[str, list[int], torch.dtype]]]:
    """The receive manifest per variant, as TRL builds weight_update_info: names and shapes in TRL's order."""
    named = [(n, list(p.shape), p.dtype) for n, p in _iter_vllm_named_params(model)]
    sent = train_weight_sync.send_dtype()
    return {v: named if v == NCCL_VARIANTS[0] else [(n, s, sent) for n, s, _ in named] for v in NCCL_VARIANTS}


def sweep(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [(variant, int(mib * 2**20)) for variant in NCCL_VARIANTS for mib in args.bucket_mib]


def nccl_trainer(args: argparse.Namespace, device: torch.device) -> Table:
    """Rank 0: time every (variant, bucket size), then check the receiver's weights bit for bit after each."""
    table = Table()
    model = lora_model(model_config(args), device, getattr(torch, recipe.TRAINER_DTYPE))
    specs = manifests(model)
    dist.broadcast_object_list([specs], src=0)  # TRL hands vLLM this manifest over HTTP before the first sync
    sent = train_weight_sync.send_dtype()
    model.merge_adapter()
    try:  # what vLLM must hold after any sync: the merged weights, rounded to bf16
        expected = [p.detach().to(sent) for _, p in _iter_vllm_named_params(model)]
    finally:
        model.unmerge_adapter()

    peak = [args.link_bytes / s for s in link_peak(device, args.link_bytes, args.nccl_repeats, args.nccl_warmup)]
    peak_bps = statistics.median(peak)
    table.add("9", f"link peak: plain broadcast of {human(args.link_bytes)}, rank 0 -> rank 1",
              human(peak_bps, "B/s"), f"min {human(min(peak), 'B/s')}, max {human(max(peak), 'B/s')}",
              f"median of {args.nccl_repeats} after {args.nccl_warmup} warm-ups; NVLS off")  # fmt: skip

    checks, best = [], {}
    for variant, bucket_bytes in sweep(args):
        manifest = specs[variant]
        sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in manifest]
        buckets = bucket_ranges(sizes, bucket_bytes)
        total_runs = args.nccl_warmup + args.nccl_repeats
        runs = [trainer_sync(model, variant, buckets, device) for _ in range(total_runs)]
        runs = runs[args.nccl_warmup :]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        _, p90 = median_p90([r["total"] for r in runs])
        moved = sum(sizes)
        rate = moved / (med["transfer"] / 1e3)
        # The receiver zeroes its weights, takes one more sync, and sends them back: a real end-to-end check.
        trainer_sync(model, variant, buckets, device)
        back = [torch.empty(e.shape, dtype=e.dtype, device=device) for e in expected]
        receive_packed(back, specs[NCCL_VARIANTS[1]], bucket_ranges([2 * e.numel() for e in expected], 2**30), src=1)
        bad_tensors, bad_elems = bit_mismatches(expected, back)
        del back
        exact = "yes" if bad_elems == 0 else f"NO: {bad_tensors} tensors / {bad_elems} elements differ"
        checks.append(bad_elems == 0)
        mib = bucket_bytes / 2**20
        table.add(
            "9",
            f"{variant}, {mib:g} MiB buckets",
            f"{med['total']:.1f} ms (p90 {p90:.1f})",
            f"recipe {RECIPE_SYNC_MS} ms/step: {med['total'] / RECIPE_SYNC_MS:.2f}x",
            f"merge {med['merge']:.1f} + transfer {med['transfer']:.1f} + unmerge {med['unmerge']:.1f} ms; "
            f"{human(moved)} in {len(buckets)} buckets at {human(rate, 'B/s')} = {rate / peak_bps:.0%} of link peak; "
            f"receiver == merged bf16 bit for bit: {exact}",
        )
        if variant not in best or med["total"] < best[variant][1]:
            best[variant] = (mib, med["total"])
    for variant, (mib, ms) in best.items():
        table.add("9", f"best bucket size, {variant}", f"{mib:g} MiB", f"{ms:.1f} ms per sync", "lowest median total")
    table.add("9", "receiver == trainer's merged weights in bf16, bit for bit",
              "yes" if all(checks) else "NO", f"{sum(checks)}/{len(checks)} checked syncs",
              "receiver zeroed before each checked sync, then sent its weights back")  # fmt: skip
    return table


def nccl_receiver(args: argparse.Namespace, device: torch.device) -> None:
    """Rank 1: a same-shape bf16 model that takes every sync into its own parameters, as vLLM's load does."""
    with torch.device("meta"):
        receiver = AutoModelForCausalLM.from_config(model_config(args), dtype=torch.bfloat16)
    receiver.to_empty(device=device)
    received = [None]
    dist.broadcast_object_list(received, src=0)
    specs = received[0]
    params = dict(receiver.named_parameters())
    missing = [n for n, _, _ in specs[NCCL_VARIANTS[0]] if n not in params]
    if missing:
        raise RuntimeError(f"receiver has no parameter for {len(missing)} streamed names, e.g. {missing[:3]}")
    link_peak(device, args.link_bytes, args.nccl_repeats, args.nccl_warmup)
    for variant, bucket_bytes in sweep(args):
        manifest = specs[variant]
        targets = [params[name].data for name, _, _ in manifest]
        buckets = bucket_ranges([math.prod(s) * d.itemsize for _, s, d in manifest], bucket_bytes)
        for i in range(args.nccl_warmup + args.nccl_repeats + 1):
            if i == args.nccl_warmup + args.nccl_repeats:
                for target in targets:
                    target.zero_()
            rendezvous(device)
            receive_packed(targets, manifest, buckets, src=0)
            rendezvous(device)
        send_packed(iter(targets), bucket_ranges([2 * t.numel() for t in targets], 2**30), src=1)


def run_nccl(args: argparse.Namespace) -> int:
    """Spawn the two ranks; rank 0 writes the rows, which this process prints."""
    import socket

    import torch.multiprocessing as mp

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"--nccl needs 2 GPUs, found {torch.cuda.device_count()}: use --tiny --nccl for CPU")
    os.environ.update(NO_MULTICAST)
    if args.device != "cuda":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        result = args.json or str(Path(tmp) / "rows.json")
        mp.spawn(nccl_worker, args=(args, port, result), nprocs=2, join=True)
        rows = json.loads(Path(result).read_text())["rows"]
    table = Table()
    table.rows = rows
    print(table.markdown())
    failed = any(r["metric"] == "FAILED" or "bit for bit: NO" in r["note"] for r in rows)
    return 1 if failed or not any(r["measured"] == "yes" for r in rows if "bit for bit" in r["metric"]) else 0


# --- Main ----------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU, seconds (used by the tests)")
    parser.add_argument("--config", default=os.environ.get("BENCH_CONFIG"), help="a real LFM2 config.json")
    parser.add_argument("--device", default=os.environ.get("BENCH_DEVICE"), help="default: cuda if available")
    parser.add_argument("--json", default=os.environ.get("BENCH_JSON"), help="also write the rows here")
    parser.add_argument("--skip", nargs="*", default=[], choices=["size", "sync", "drift", "step"])
    parser.add_argument("--nccl", action="store_true", help="two-GPU sync over NCCL instead (gloo on CPU with --tiny)")
    parser.add_argument("--bucket-mib", type=float, nargs="+", help="--nccl bucket sizes to sweep")
    args = parser.parse_args(argv)
    tiny = args.tiny
    args.bucket_mib = args.bucket_mib or ([1 / 64, 1 / 16, 1] if tiny else [64, 256, 1024])
    args.link_bytes = 2**20 if tiny else 2**30
    args.nccl_repeats, args.nccl_warmup = (5, 1) if tiny else (10, 2)
    args.repeats = 5 if tiny else 20
    args.warmup = 1 if tiny else 3
    args.step_repeats = 1 if tiny else 2
    args.drift_cycles = 20 if tiny else 1000
    args.bandwidth_bytes = 2**20 if tiny else 2**32
    args.max_len = 256 if tiny else recipe.MAX_MODEL_LEN
    args.prompt_tokens = 16 if tiny else 1024
    args.min_turn_tokens, args.max_turn_tokens = (2, 8) if tiny else (256, recipe.MAX_TOKENS)
    args.min_tool_tokens, args.max_tool_tokens = (1, 4) if tiny else (64, 1024)
    args.turns = [2, recipe.MAX_TOOL_CALLING_ITERATIONS] if tiny else [4, recipe.MAX_TOOL_CALLING_ITERATIONS]
    args.fit_lengths = [128, 256] if tiny else [recipe.MAX_MODEL_LEN * k for k in (1, 2, 4, 8)]
    if args.device is None:
        args.device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    if tiny:
        torch.set_num_threads(1)  # Tiny tensors: extra OpenMP threads only spin against a busy CI machine.
    return args


def run_section(table: Table, item: str, fn: Callable[[], None]) -> None:
    """Run one section; a failure becomes a table row that says why, and the other sections still run."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the table must say what failed and why
        table.add(item, "FAILED", type(error).__name__, "", str(error).splitlines()[0][:160] if str(error) else "")


def sections(args: argparse.Namespace, table: Table, device: torch.device) -> Iterator[tuple[str, Callable[[], None]]]:
    config = model_config(args)
    model = lora_model(config, device, getattr(torch, recipe.TRAINER_DTYPE))
    if "size" not in args.skip:
        yield "1", lambda: adapter_size(table, model, config)
    if "sync" not in args.skip:
        yield "2/8", lambda: weight_sync_rows(table, model, device, args)
    if "drift" not in args.skip:
        yield "3", lambda: drift_rows(table, args, device)
    if "step" not in args.skip:
        yield "4/5", lambda: step_rows_on(table, model, device, args)


def step_rows_on(table: Table, model: torch.nn.Module, device: torch.device, args: argparse.Namespace) -> None:
    """Items 4/5. TRL's fused log-prob head is a Triton kernel: on CPU the test suite's plain-torch stand-in runs."""
    if device.type == "cuda":
        step_rows(table, model, device, args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from trl_cpu_shims import cpu_trainer_shims

    with cpu_trainer_shims():
        step_rows(table, model, device, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nccl:
        print(f"two-rank weight-sync benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
        return run_nccl(args)
    device = torch.device(args.device)
    table = Table()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"trainer-side benchmark on {name}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    for item, fn in sections(args, table, device):
        run_section(table, item, fn)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(device=name, rows=table.rows), indent=1))
    print(table.markdown())
    return 1 if any(r["metric"] == "FAILED" for r in table.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
