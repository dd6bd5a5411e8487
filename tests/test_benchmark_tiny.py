"""The trainer-side benchmark runs end to end on a tiny Lfm2 on CPU, so the H200 script cannot rot.

It drives the same code paths as the full-size run (TRL's merge, packer, batchers and loss; PEFT's
adapter save; train_weight_sync's stream), only smaller; on CPU the fused log-prob head is the test suite's
plain-torch stand-in (tests/trl_cpu_shims.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    """The benchmark script as a module. Imported by name, so that --nccl's spawned ranks can unpickle its worker,
    and run in this process, which has its heavy imports already (a fresh process spends 10 s of CPU on them)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import trainer_side

        yield trainer_side
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def run_benchmark(bench, out: Path, *flags: str) -> tuple[int, str, list[dict]]:
    """Runs trainer_side.main() on CPU with `flags`; returns its exit code, what it printed and the rows it wrote.
    The environment it changes (NCCL/gloo variables) is put back."""
    saved, printed = dict(os.environ), io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            code = bench.main([*flags, "--json", str(out)])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, printed.getvalue(), json.loads(out.read_text())["rows"] if out.exists() else []


@pytest.fixture(scope="module")
def tiny_run(bench, tmp_path_factory):
    return run_benchmark(bench, tmp_path_factory.mktemp("bench") / "rows.json", "--tiny")


def rows_for(rows, item):
    return [r for r in rows if r["item"] == item]


def test_tiny_benchmark_runs_every_section_without_failure(tiny_run):
    code, printed, rows = tiny_run
    assert code == 0, printed[-3000:]
    assert not [r for r in rows if r["metric"] == "FAILED"]
    assert {r["item"] for r in rows} >= {"1", "2", "2/8", "8", "3", "4", "5"}
    assert "| # | metric | measured | anchor | note |" in printed  # the one printed table


def test_tiny_benchmark_checks_its_claims(tiny_run):
    _, _, rows = tiny_run
    (params,) = [r for r in rows_for(rows, "1") if r["metric"] == "LoRA trainable params"]
    assert params["note"] == "matches"  # PEFT's count equals tiny_lfm2.lora_param_count (FACTS.md formula)
    exact = [r for r in rows_for(rows, "8") if r["metric"].startswith("merge-free == stock")]
    assert exact and all(r["measured"] == "yes" and "unchanged by merge-free: True" in r["note"] for r in exact)
    drift = {r["metric"]: r["measured"] for r in rows_for(rows, "3")}
    bf16 = next(v for k, v in drift.items() if "bfloat16" in k)
    assert float(bf16.split("relative (Frobenius) ")[1]) > 0  # in-place merge in bf16 moves the frozen weights
    steps = rows_for(rows, "4") + rows_for(rows, "5")
    assert any("TRL packing" in r["metric"] for r in steps) and any("conv-safe" in r["metric"] for r in steps)
    assert any(r["metric"] == "largest single-row micro-batch that fits" for r in steps)


# --- --nccl: the two-rank sync (gloo on CPU here, NCCL on two GPUs) ------------------------------------------------
@pytest.fixture(scope="module")
def nccl_run(bench, tmp_path_factory):
    return run_benchmark(bench, tmp_path_factory.mktemp("nccl") / "rows.json", "--tiny", "--nccl")


def test_tiny_nccl_sync_sweeps_buckets_and_lands_bit_exact(nccl_run):
    code, printed, rows = nccl_run
    assert code == 0, printed[-3000:]
    assert all(r["item"] == "9" for r in rows) and rows
    assert rows[0]["metric"].startswith("link peak") and rows[0]["measured"].endswith("B/s")
    syncs = [r for r in rows if "buckets" in r["metric"]]
    assert len(syncs) == 9  # 3 variants x 3 bucket sizes
    assert len({r["metric"].split(", ")[-1] for r in syncs}) == 3
    for r in syncs:
        assert "merge " in r["note"] and "transfer " in r["note"] and "unmerge " in r["note"]
        assert r["note"].endswith("bit for bit: yes"), r
    bucket_counts = [int(r["note"].split(" in ")[1].split(" buckets")[0]) for r in syncs if "bf16" in r["metric"]]
    assert max(bucket_counts) > 1 == min(bucket_counts)  # the sweep really changes how the stream is cut
    assert len([r for r in rows if r["metric"].startswith("best bucket size")]) == 3
    (check,) = [r for r in rows if r["metric"].startswith("receiver == trainer's merged weights")]
    assert check["measured"] == "yes" and check["anchor"] == "9/9 checked syncs"
    assert "| # | metric | measured | anchor | note |" in printed


def test_bit_check_catches_one_ulp_and_buckets_cut_like_vllm(bench):
    import torch

    expected = [torch.randn(3, 4).to(torch.bfloat16) for _ in range(3)]
    received = [t.clone() for t in expected]
    assert bench.bit_mismatches(expected, received) == (0, 0)
    received[1].view(torch.int16).view(-1)[2] += 1  # one ulp off in one element
    assert bench.bit_mismatches(expected, received) == (1, 1)
    assert bench.bit_mismatches(expected, [received[0], received[1][:2], received[2]]) == (1, 12)

    sizes = [10, 30, 5, 50, 1, 1]
    buckets = bench.bucket_ranges(sizes, 32)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    assert [list(b) for b in buckets] == [[0, 1], [2, 3], [4, 5]]  # a bucket closes once over 32 bytes
    assert bench.bucket_ranges(sizes, 10**9) == [range(0, 6)]
