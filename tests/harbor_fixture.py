"""Synthetic SmolDataEnvs Harbor snapshots in the real on-disk format, for tests.

The real datasets (FineEnvs/SmolDataEnvs-harbor-{train,test}) cannot be downloaded here. A
snapshot made by `make_snapshot` has the same layout and the same kind of files:

    <root>/tasks/<name>/instruction.md
    <root>/tasks/<name>/task.toml              [task], [metadata] (difficulty_tier, source_row_id, ...),
                                               [environment] (+ healthcheck running /opt/pull_bucket.py,
                                               [environment.env] HF_BUCKET / BUCKET_PREFIX),
                                               [verifier] (+ [verifier.env]), [agent] timeout_sec
    <root>/tasks/<name>/environment/Dockerfile
    <root>/tasks/<name>/environment/pull_bucket.py
    <root>/tasks/<name>/tests/test.sh          writes /logs/verifier/reward.txt
    <root>/tasks/<name>/tests/grader.py

Names follow the dataset's rule: source row "0000/324/324293.ipynb_qa_2" -> task "0000_324_324293_qa_2".
The task.toml is written as text (comments, escapes, nested tables) like the real generator writes it,
so a TOML round trip is exercised on the same shape of file. Tasks ship with 1 GB, as the released
ones did, so the 4 GB patch is visible.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple
from unittest import mock

BUCKET = "AdithyaSK/jupyter-agent-kaggle-all"
LIST_SEED = 20260101  # the seed the lists of these tests were always selected with

TASK_TOML = '''schema_version = "1.2"
artifacts = []

[task]
name = "smoldataenvs/{name}"
description = "{question}"
authors = []
keywords = ["data-agent", "data-analysis", "kaggle"]

[metadata]
source_dataset = "jupyter-agent/jupyter-agent-dataset"
source_row_id = "{source}"
kaggle_dataset_name = "{kaggle}"
difficulty_tier = "{difficulty}"
reward_mode_initial = "numeric"
package_tier = 1

[environment]
build_timeout_sec = 600.0
os = "linux"
cpus = 2
memory_mb = 1024
storage_mb = 10240
gpus = 0
allow_internet = true
mcp_servers = []

# Runs after the container starts and before the agent: pulls this task's files into /home/user/input.
[environment.healthcheck]
command = "python3 /opt/pull_bucket.py && [ -n \\"$(ls /home/user/input)\\" ]"
interval_sec = 2.0
timeout_sec = 180.0
start_period_sec = 5.0
retries = 30

[environment.env]
HF_BUCKET = "{bucket}"
BUCKET_PREFIX = "{prefix}"

[verifier]
timeout_sec = 120.0

[verifier.env]
EXPECTED_ANSWER = "{answer}"
REWARD_MODE = "numeric"
ATOL = "0.05"
RTOL = "0.01"

[agent]
timeout_sec = 600.0
'''

DOCKERFILE = """FROM docker.io/savatar101/env-data-agent-train:base
COPY pull_bucket.py /opt/pull_bucket.py
WORKDIR /workdir
"""

# The bucket puller the task image ships (the real chain's image has it at /opt/pull_bucket.py, setup.sh copies it).
PULL_BUCKET = (Path(__file__).resolve().parent / "chain" / "pull_bucket.py").read_text()

TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
if [ ! -s /workdir/answer.txt ]; then
  echo "0.0" > /logs/verifier/reward.txt
  exit 0
fi
python3 /tests/grader.py < /workdir/answer.txt > /logs/verifier/reward.txt
"""

GRADER = '''"""Exact match, then numeric tolerance, against EXPECTED_ANSWER (stand-in)."""
import os
import sys

answer, expected = sys.stdin.read().strip(), os.environ["EXPECTED_ANSWER"]
try:
    ok = abs(float(answer) - float(expected)) <= float(os.environ.get("ATOL", "0"))
except ValueError:
    ok = answer == expected
print("1.0" if ok else "0.0")
'''
# What prepare_tasks.py must be told to expect of these tasks (the real ones carry recipe.GRADER_SHA256).
GRADER_SHA256 = hashlib.sha256(GRADER.encode()).hexdigest()


def source_of(notebook: int, qa: int) -> str:
    """A jupyter-agent row id like the dataset's: '0000/324/324293.ipynb_qa_2'."""
    return f"{notebook // 1_000_000:04d}/{notebook // 1000 % 1000:03d}/{notebook}.ipynb_qa_{qa}"


def name_of(source: str) -> str:
    """The dataset's task folder name for a source row: '0000_324_324293_qa_2'."""
    return source.replace("/", "_").replace(".ipynb", "")


def make_task(root: Path, source: str, difficulty: str, *, instruction: str | None = None,
              environment: bool = True, name: str | None = None) -> Path:
    """Write one task folder under `root/tasks/`; `environment=False` drops the [environment] table."""
    name = name or name_of(source)
    folder = Path(root) / "tasks" / name
    (folder / "environment").mkdir(parents=True, exist_ok=True)
    (folder / "tests").mkdir(exist_ok=True)
    question = f"What is the mean of column x in table {name}?"
    text = instruction if instruction is not None else (
        "You have access to the following files:\n- table.csv\n"
        "All of the files are located only in the '/home/user/input' folder.\n\n"
        f"Answer the following question based on the provided files:\n{question}\n\n"
        "Write only the answer value to /workdir/answer.txt.\n"
    )
    (folder / "instruction.md").write_text(text)
    toml = TASK_TOML.format(name=name, question=question, source=source, kaggle=f"user/{name}",
                            difficulty=difficulty, bucket=BUCKET, prefix=f"user__{name}", answer="4.2")
    if not environment:
        head, rest = toml.split("[environment]\n", 1)
        toml = head + "[verifier]\n" + rest.split("[verifier]\n", 1)[1]
    (folder / "task.toml").write_text(toml)
    (folder / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (folder / "environment" / "pull_bucket.py").write_text(PULL_BUCKET)
    (folder / "tests" / "test.sh").write_text(TEST_SH)
    (folder / "tests" / "grader.py").write_text(GRADER)
    return folder


def make_snapshot(root: Path, n_medium: int, n_hard: int, n_easy: int = 0, *, first_notebook: int = 324_000,
                  questions_per_notebook: int = 2) -> Path:
    """A snapshot of `n_easy + n_medium + n_hard` tasks; returns `root`.

    Tasks come `questions_per_notebook` to a notebook, numbered from `first_notebook`, so two snapshots
    made with far-apart `first_notebook` share no notebook, and one made with the same number does.
    Difficulties are interleaved so that no tier sits in one block of names.
    """
    tiers = [d for d, n in (("easy", n_easy), ("medium", n_medium), ("hard", n_hard)) for _ in range(n)]
    random.Random(len(tiers)).shuffle(tiers)
    for i, difficulty in enumerate(tiers):
        notebook = first_notebook + i // questions_per_notebook
        make_task(root, source_of(notebook, i % questions_per_notebook + 1), difficulty)
    return Path(root)


def publish(hub: object, repo_id: str, snapshot: Path) -> None:
    """Upload a snapshot to a `tests.hub_double.LocalHub` dataset repo, as it sits on the Hub."""
    hub.create_repo(repo_id, repo_type="dataset", exist_ok=True)
    hub.upload_folder(repo_id=repo_id, folder_path=snapshot, repo_type="dataset")


def list_json(rows: list[dict[str, str]]) -> str:
    """A task list in data/*.json's layout: one row per line, keys in prepare_tasks.FIELDS order."""
    import prepare_tasks

    return "[\n" + ",\n".join("  " + json.dumps({k: r[k] for k in prepare_tasks.FIELDS}) for r in rows) + "\n]\n"


def snapshot_rows(root: Path) -> list[dict[str, str]]:
    """The list row of every task in a snapshot, sorted by name."""
    rows = []
    for folder in sorted(p for p in (Path(root) / "tasks").iterdir() if p.is_dir()):
        meta = tomllib.loads((folder / "task.toml").read_text())["metadata"]
        rows.append({"name": folder.name, "source": meta["source_row_id"],
                     "notebook": meta["source_row_id"].rsplit("_qa_", 1)[0], "difficulty": meta["difficulty_tier"],
                     "instruction_sha256": hashlib.sha256((folder / "instruction.md").read_bytes()).hexdigest()})
    return rows


class Counts(NamedTuple):
    """How many tasks the synthetic lists hold (the recipe's: TRAIN_MEDIUM, TRAIN_HARD, TEST_TASKS)."""

    medium: int
    hard: int
    test: int


@contextlib.contextmanager
def in_recipe(counts: Counts, grader_sha256: str) -> Iterator[None]:
    """prepare_tasks checks the lists' sizes and every task's grader against recipe.py: these, for the fixture's."""
    import recipe

    with mock.patch.multiple(recipe, TRAIN_MEDIUM=counts.medium, TRAIN_HARD=counts.hard, TEST_TASKS=counts.test,
                             GRADER_SHA256=grader_sha256):
        yield


def write_lists(sources: dict[str, Path], data_dir: Path, counts: Counts) -> dict[str, list[dict[str, str]]]:
    """Lists for synthetic snapshots (the recipe's are committed): in a seeded order, the first `counts.test` test
    tasks, and the first `counts.medium` medium and `counts.hard` hard train tasks sharing no source or notebook
    with them, in that order (so the list's order is not the served, alphabetical one)."""

    def ranked(rows: list[dict[str, str]]) -> list[dict[str, str]]:
        return sorted(rows, key=lambda r: hashlib.sha256(f"{LIST_SEED}:{r['name']}".encode()).hexdigest())

    test = ranked(snapshot_rows(sources["test"]))[: counts.test]
    taken = {r[key] for r in test for key in ("source", "notebook")}
    free = [r for r in ranked(snapshot_rows(sources["train"])) if not {r["source"], r["notebook"]} & taken]
    picked = {r["name"] for tier, n in (("medium", counts.medium), ("hard", counts.hard))
              for r in [r for r in free if r["difficulty"] == tier][:n]}
    lists = {"train": [r for r in free if r["name"] in picked], "test": test}
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    for split, rows in lists.items():
        (Path(data_dir) / f"{split}.json").write_text(list_json(rows))
    return lists


def materialized(root: Path, n_medium: int = 4, n_hard: int = 6, n_test: int = 3) -> Path:
    """Lists in root/data and prepared tasks in root/tasks/{train,test}, as a job would have them.

    For tests of whatever consumes prepared tasks (env server, eval); returns root/tasks.
    """
    import prepare_tasks

    root = Path(root)
    sources = {"train": make_snapshot(root / "snapshots" / "train", n_medium + 2, n_hard + 2, 2),
               "test": make_snapshot(root / "snapshots" / "test", n_test // 2, n_test - n_test // 2, 1,
                                     first_notebook=900_000)}
    counts = Counts(medium=n_medium, hard=n_hard, test=n_test)
    write_lists(sources, root / "data", counts)
    with in_recipe(counts, GRADER_SHA256):
        prepare_tasks.materialize(root / "tasks", prepare_tasks.SPLITS, sources, root / "data", api=None)
    return root / "tasks"
