"""Materialize the recipe's pinned SmolDataEnvs Harbor tasks; freeze task lists for other pools.

    # In every job (run_job.sh calls this): fetch exactly the listed tasks, verify, patch, write them out.
    python3 prepare_tasks.py [--out DIR] [--train-source DIR] [--test-source DIR] [--split train|test|all]
    # Only for another dataset revision or task pool (needs the Hub, or local snapshots of both datasets):
    .venv/bin/python prepare_tasks.py freeze [--train-source DIR] [--test-source DIR]

The recipe's own lists, data/train.json and data/test.json, are committed (the lineage's lists, see
data/README.md); `freeze` would select different tasks. It writes the same format: one row per task,
{name, source, notebook, difficulty, instruction_sha256}, byte-identical for the same inputs. Its rule:

- Each task is read from its own folder: difficulty = [metadata].difficulty_tier; source =
  [metadata].source_row_id (the jupyter-agent row the task was generated from, e.g.
  "0000/324/324293.ipynb_qa_2"; [metadata].source is accepted too); notebook = [metadata].notebook,
  else the source without its "_qa_<N>" suffix. (Read off the SmolDataEnvs task generator and the
  published task lists of this recipe's lineage; the dataset files themselves were not readable here.)
- Every task is ranked by sha256(f"{FREEZE_SEED}:{name}"), so the order is fixed, seeded, and the same
  in any Python version.
- Test = the first TEST_TASKS tasks of the test dataset in that ranking (all of them when it holds
  exactly TEST_TASKS, as the published 250-task held-out split does: the benchmark stays whole).
- Train = the first TRAIN_MEDIUM "medium" and TRAIN_HARD "hard" tasks of the train dataset in that
  ranking, skipping every task that shares a source or a notebook with test; train.json keeps the
  ranking order, which is the fixed training order.

The default action first checks both lists, whatever --split says (five string fields, plain folder
names, no name twice, exactly the recipe's counts, no name/source/notebook shared by train and test).
Then it takes each split from a local snapshot or downloads exactly the pinned revision (only the
listed `tasks/<name>/` folders), checks every instruction's SHA-256 and every tests/grader.py against
GRADER_SHA256 (a task graded differently is refused) for all splits first, then copies each task to
OUT/<split>/tasks/<name>/ and rewrites its task.toml so that [environment] has the task image,
TASK_CPUS and TASK_MEMORY_MB (the hf-sandbox backend needs docker_image; 1 GB tasks were OOM-killed),
keeping every other key. OUT/<split>/manifest.json records the dataset, revision, count
and the SHA-256 of every file written. Each split is built in a hidden sibling folder and renamed into
place only when all of it verified, so a failure leaves nothing partial (and an older good copy intact).
`openenv harbor serve --dataset OUT/train` reads the result.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

import recipe
from adapter_repo import describe
from recipe import ConfigError

HERE = Path(__file__).resolve().parent
DATA_DIR = HERE / "data"  # the committed task lists (data/README.md); --data and the trainer read them here
SPLITS = ("train", "test")
FIELDS = ("name", "source", "notebook", "difficulty", "instruction_sha256")
PROGRESS_EVERY = 100  # tasks between progress lines on stderr
FREEZE_COMMAND = ".venv/bin/python prepare_tasks.py freeze"
# The recipe's lists are committed (data/README.md): a missing or damaged list is restored, not re-frozen.
RESTORE = "restore the recipe's lists with `git checkout -- data`"
OTHER_POOLS = f"`{FREEZE_COMMAND}` is only for another dataset revision or task pool"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_QA_SUFFIX = re.compile(r"_qa_\d+$")


@dataclass(frozen=True)
class Counts:
    """How many tasks each list holds; the recipe's numbers unless a test or smoke run shrinks them."""

    medium: int = recipe.TRAIN_MEDIUM
    hard: int = recipe.TRAIN_HARD
    test: int = recipe.TEST_TASKS


def dataset_of(split: str) -> tuple[str, str]:
    """(repo id, pinned revision) of a split's Harbor dataset."""
    if split == "train":
        return recipe.TRAIN_DATASET, recipe.TRAIN_REVISION
    return recipe.TEST_DATASET, recipe.TEST_REVISION


def progress(what: str, done: int, total: int) -> None:
    """One stderr line every PROGRESS_EVERY tasks and at the end, so 1,250 folders never look hung."""
    if done == total or done % PROGRESS_EVERY == 0:
        print(f"[prepare_tasks] {what}: {done}/{total}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- reading tasks -------------------------------------------------------------------------------
def read_toml(folder: Path) -> dict[str, Any]:
    """A task's parsed task.toml, or a one-line error naming the task."""
    path = folder / "task.toml"
    if not path.is_file():
        raise ConfigError(f"task {folder.name}: no task.toml in {folder}: the snapshot is incomplete, fetch it again")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"task {folder.name}: task.toml is not valid TOML ({exc}): download it again") from None


def task_row(folder: Path) -> dict[str, str]:
    """The list row of one task folder, by the rule in the module docstring."""
    name = folder.name
    meta = read_toml(folder).get("metadata", {})
    difficulty = str(meta.get("difficulty_tier", "")).strip().lower()
    source = str(meta.get("source_row_id") or meta.get("source") or "")
    notebook = str(meta.get("notebook") or _QA_SUFFIX.sub("", source))
    if not difficulty:
        raise ConfigError(f"task {name}: task.toml has no [metadata].difficulty_tier: not a SmolDataEnvs task")
    if not source or notebook == source:
        raise ConfigError(f"task {name}: task.toml has no [metadata].source_row_id like '<notebook>.ipynb_qa_N' "
                          "(or [metadata].notebook): cannot check train/test overlap")
    instruction = folder / "instruction.md"
    if not instruction.is_file():
        raise ConfigError(f"task {name}: no instruction.md in {folder}: the snapshot is incomplete")
    return {"name": name, "source": source, "notebook": notebook, "difficulty": difficulty,
            "instruction_sha256": sha256_file(instruction)}


def scan_snapshot(root: Path, what: str) -> list[dict[str, str]]:
    """Rows of every task under `root/tasks/`, sorted by name."""
    base = root / "tasks"
    if not base.is_dir():
        raise ConfigError(f"{root} has no tasks/ folder: pass a SmolDataEnvs Harbor snapshot (tasks/<name>/task.toml)")
    folders = sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
    rows = []
    for i, folder in enumerate(folders, 1):
        rows.append(task_row(folder))
        progress(f"read {what}", i, len(folders))
    return rows


# --- freeze --------------------------------------------------------------------------------------
def rank(name: str, seed: int) -> str:
    """Sort key of the fixed, seeded task order."""
    return hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()


def select_test(rows: list[dict[str, str]], counts: Counts, seed: int) -> list[dict[str, str]]:
    """The first `counts.test` test tasks in seeded order."""
    if len(rows) < counts.test:
        raise ConfigError(f"the test snapshot has {len(rows)} tasks, {counts.test} are needed: "
                          f"use the full {recipe.TEST_DATASET}@{recipe.TEST_REVISION}")
    return sorted(rows, key=lambda r: rank(r["name"], seed))[: counts.test]


def select_train(rows: list[dict[str, str]], test: list[dict[str, str]], counts: Counts,
                 seed: int) -> list[dict[str, str]]:
    """The first medium and hard train tasks in seeded order that share no source or notebook with test."""
    sources = {r["source"] for r in test}
    notebooks = {r["notebook"] for r in test}
    free = [r for r in rows if r["source"] not in sources and r["notebook"] not in notebooks]
    ranked = sorted(free, key=lambda r: rank(r["name"], seed))
    picked = []
    for tier, need in (("medium", counts.medium), ("hard", counts.hard)):
        pool = [r for r in ranked if r["difficulty"] == tier]
        if len(pool) < need:
            raise ConfigError(f"the train snapshot has {len(pool)} {tier} tasks free of test overlap, {need} are "
                              f"needed: use the full {recipe.TRAIN_DATASET}@{recipe.TRAIN_REVISION}")
        picked += pool[:need]
    return sorted(picked, key=lambda r: rank(r["name"], seed))


def list_json(rows: list[dict[str, str]]) -> str:
    """A task list as stable text: one row per line, keys in FIELDS order (the lineage's layout), trailing newline."""
    return "[\n" + ",\n".join("  " + json.dumps({k: r[k] for k in FIELDS}) for r in rows) + "\n]\n"


def download(api: Any, split: str, dest: Path, patterns: list[str]) -> Path:
    """Download the pinned revision of a split's dataset, only `patterns`, into `dest`."""
    repo_id, revision = dataset_of(split)
    print(f"[prepare_tasks] downloading {repo_id}@{revision} ({len(patterns)} patterns)", file=sys.stderr, flush=True)
    try:
        api.snapshot_download(repo_id, repo_type="dataset", revision=revision, local_dir=dest,
                              allow_patterns=patterns)
    except Exception as exc:  # network, auth, missing revision: one line, then stop
        raise ConfigError(f"download of {repo_id}@{revision} failed ({describe(exc)}): "
                          "check the network and HF_TOKEN, or pass a local snapshot") from None
    return dest


def freeze(sources: dict[str, Path | None], data_dir: Path, api: Any, counts: Counts = Counts(),
           seed: int = recipe.FREEZE_SEED) -> dict[str, list[dict[str, str]]]:
    """Select the train and test tasks and write data_dir/{train,test}.json."""
    rows = {}
    with tempfile.TemporaryDirectory(prefix="prepare_tasks-") as tmp:
        for split in SPLITS:
            root = sources.get(split)
            if root is None:
                root = download(api, split, Path(tmp) / split, ["tasks/*/task.toml", "tasks/*/instruction.md"])
            rows[split] = scan_snapshot(Path(root), split)
    test = select_test(rows["test"], counts, seed)
    lists = {"train": select_train(rows["train"], test, counts, seed), "test": test}
    check_lists(lists, counts)
    for split in SPLITS:
        recipe.write_atomic(data_dir / f"{split}.json", list_json(lists[split]))
    tiers = Counter(r["difficulty"] for r in lists["train"])
    print(f"wrote {data_dir / 'train.json'} ({len(lists['train'])} tasks: {tiers['medium']} medium, "
          f"{tiers['hard']} hard) and {data_dir / 'test.json'} ({len(test)} tasks)")
    return lists


# --- checking the lists --------------------------------------------------------------------------
def load_list(data_dir: Path, split: str) -> list[dict[str, str]]:
    """A committed task list; says how to create it when it is missing."""
    path = data_dir / f"{split}.json"
    if not path.is_file():
        raise ConfigError(f"{path} is missing: {RESTORE} ({OTHER_POOLS})")
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}): {RESTORE}") from None
    if not isinstance(rows, list):
        raise ConfigError(f"{path} must hold a JSON list of task rows: {RESTORE}")
    return rows


def check_rows(rows: list[Any], split: str) -> None:
    """Every row has the five string fields, a safe folder name and a SHA-256; no name twice."""
    where = f"data/{split}.json"
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or any(not isinstance(row.get(k), str) for k in FIELDS):
            raise ConfigError(f"{where} row {i} must have string fields {', '.join(FIELDS)}: {RESTORE}")
        if not _SAFE_NAME.match(row["name"]) or ".." in row["name"]:
            raise ConfigError(f"{where} row {i}: task name {row['name']!r} is not a plain folder name: "
                              f"{RESTORE}")
        if not _SHA256.match(row["instruction_sha256"]):
            raise ConfigError(f"{where}: task {row['name']} has no valid instruction_sha256: {RESTORE}")
    for name, n in Counter(r["name"] for r in rows).items():
        if n > 1:
            raise ConfigError(f"{where} lists task {name} {n} times: remove the duplicate or {RESTORE}")


def check_counts(lists: dict[str, list[dict[str, str]]], counts: Counts) -> None:
    """Train holds exactly the recipe's medium/hard counts, test exactly TEST_TASKS."""
    tiers = Counter(r["difficulty"] for r in lists["train"])
    if tiers != Counter(medium=counts.medium, hard=counts.hard):
        other = len(lists["train"]) - tiers["medium"] - tiers["hard"]
        got = f"{tiers['medium']} medium, {tiers['hard']} hard" + (f" and {other} other" if other else "")
        raise ConfigError(f"data/train.json has {got}; the recipe needs {counts.medium} medium and {counts.hard} hard: "
                          f"{RESTORE}")
    if len(lists["test"]) != counts.test:
        raise ConfigError(f"data/test.json has {len(lists['test'])} tasks; the recipe needs {counts.test}: "
                          f"{RESTORE}")


def check_disjoint(lists: dict[str, list[dict[str, str]]]) -> None:
    """No train task shares a name, source or notebook with a test task."""
    for key in ("name", "source", "notebook"):
        test = {r[key]: r["name"] for r in lists["test"]}
        for row in lists["train"]:
            if row[key] in test:
                raise ConfigError(f"train task {row['name']} and test task {test[row[key]]} share {key} "
                                  f"{row[key]!r}: held-out results would be contaminated; {RESTORE}")


def check_lists(lists: dict[str, list[Any]], counts: Counts) -> None:
    """Every list check, in the order a user should fix them."""
    for split in SPLITS:
        check_rows(lists[split], split)
    check_counts(lists, counts)
    check_disjoint(lists)


def in_list_order(rows: list[dict[str, Any]], data_dir: Path, split: str,
                  key: str = "task_name") -> list[dict[str, Any]]:
    """`rows` (one per served task, named by `key`) in the order of data/<split>.json, the one home of the order.

    openenv serves a dataset's task folders sorted by name and TRL iterates its train dataset unshuffled, so
    without this the trained order would be alphabetical. The served tasks must be exactly the listed ones:
    anything else means the env server was given another folder than the one prepare_tasks.py wrote from the list.
    """
    listed = load_list(data_dir, split)
    check_rows(listed, split)
    position = {row["name"]: i for i, row in enumerate(listed)}
    served = Counter(row[key] for row in rows)
    extra = sorted(name for name in served if name not in position)
    missing = [name for name in position if name not in served]
    twice = sorted(name for name, n in served.items() if n > 1)
    if extra or missing or twice:
        what = "; ".join(f"{label} {len(names)} (e.g. {names[0]})" for label, names in (
            ("not in the list:", extra), ("listed but not served:", missing), ("served twice:", twice)) if names)
        raise ConfigError(f"the env server's {split} tasks are not data/{split}.json's ({what}): serve the folder "
                          f"`prepare_tasks.py --split {split}` wrote from that list")
    return sorted(rows, key=lambda row: position[row[key]])


# --- materialize ---------------------------------------------------------------------------------
def patched_toml(folder: Path) -> str:
    """task.toml with the recipe's image, CPUs and memory in [environment], every other key kept."""
    config = read_toml(folder)
    environment = config.get("environment")
    if not isinstance(environment, dict):
        raise ConfigError(f"task {folder.name}: task.toml has no [environment] table, so docker_image cannot be set: "
                          "the snapshot is not a SmolDataEnvs Harbor task; use the pinned dataset revision")
    environment.update(docker_image=recipe.TASK_IMAGE, cpus=recipe.TASK_CPUS, memory_mb=recipe.TASK_MEMORY_MB)
    return tomli_w.dumps(config)


def verify(rows: list[dict[str, str]], src: Path, split: str, where: str, grader_sha256: str) -> None:
    """Every listed task is in `src` (described as `where`), hashes as listed, runs the expected grader and has a
    patchable task.toml."""
    for i, row in enumerate(rows, 1):
        folder = src / "tasks" / row["name"]
        if not folder.is_dir():
            raise ConfigError(f"{split} task {row['name']} is missing from {where} (no tasks/{row['name']}/): "
                              f"use the pinned snapshot ({OTHER_POOLS})")
        instruction = folder / "instruction.md"
        found = sha256_file(instruction) if instruction.is_file() else "no instruction.md"
        if found != row["instruction_sha256"]:
            raise ConfigError(f"{split} task {row['name']}: instruction.md sha256 {found[:16]}… does not match "
                              f"data/{split}.json ({row['instruction_sha256'][:16]}…) in {where}: use the pinned "
                              f"revision ({OTHER_POOLS})")
        grader = folder / "tests" / "grader.py"
        found = sha256_file(grader) if grader.is_file() else "no tests/grader.py"
        if found != grader_sha256:
            raise ConfigError(f"{split} task {row['name']}: tests/grader.py sha256 {found[:16]}… is not the expected "
                              f"grader's ({grader_sha256[:16]}…, GRADER_SHA256 in recipe.py) in {where}: it would "
                              "score answers differently; use the pinned revision")
        patched_toml(folder)
        progress(f"verify {split}", i, len(rows))


def build_split(rows: list[dict[str, str]], src: Path, dest: Path, split: str, origin: str) -> None:
    """Copy and patch every listed task into `dest`, then write dest/manifest.json."""
    files: dict[str, dict[str, str]] = {}
    for i, row in enumerate(rows, 1):
        target = dest / "tasks" / row["name"]
        shutil.copytree(src / "tasks" / row["name"], target)
        (target / "task.toml").write_text(patched_toml(target))
        files[row["name"]] = {p.relative_to(target).as_posix(): sha256_file(p)
                              for p in sorted(target.rglob("*")) if p.is_file()}
        progress(f"copy {split}", i, len(rows))
    repo_id, revision = dataset_of(split)
    manifest = {"split": split, "dataset": repo_id, "revision": revision, "origin": origin, "count": len(rows),
                "docker_image": recipe.TASK_IMAGE, "cpus": recipe.TASK_CPUS, "memory_mb": recipe.TASK_MEMORY_MB,
                "files": files}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def replace_dir(staged: Path, target: Path) -> None:
    """Put `staged` where `target` is, removing the old copy only after the new one is in place."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
        staged.rename(target)
        shutil.rmtree(old)
    else:
        staged.rename(target)


def materialize(out: Path, splits: tuple[str, ...], sources: dict[str, Path | None], data_dir: Path, api: Any,
                counts: Counts = Counts(), grader_sha256: str = recipe.GRADER_SHA256) -> dict[str, Path]:
    """Write OUT/<split>/ for each split from the frozen lists; all or nothing: every split is verified before the
    first task is copied."""
    lists = {split: load_list(data_dir, split) for split in SPLITS}
    check_lists(lists, counts)
    for split in splits:
        target, src = out / split, sources.get(split)
        if target.exists() and not (target / "manifest.json").is_file():
            raise ConfigError(f"{target} exists and was not written by prepare_tasks.py: "
                              "choose another --out or remove it")
        if src is not None and not (src / "tasks").is_dir():
            raise ConfigError(f"--{split}-source {src} has no tasks/ folder: pass a SmolDataEnvs Harbor snapshot")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--out {out} cannot be created ({error.strerror}): choose a folder you can write") from None
    scratch = [out / f".{split}.{kind}-{os.getpid()}" for split in splits for kind in ("partial", "download")]
    try:
        verified = {}
        for split in splits:
            src, origin, where = sources.get(split), "local", str(sources.get(split))
            if src is None:
                src = download(api, split, out / f".{split}.download-{os.getpid()}",
                               [f"tasks/{r['name']}/*" for r in lists[split]])
                origin, where = "hub", "@".join(dataset_of(split))
            verify(lists[split], src, split, where, grader_sha256)
            verified[split] = src, origin
        for split, (src, origin) in verified.items():
            build_split(lists[split], src, out / f".{split}.partial-{os.getpid()}", split, origin)
        for split in splits:
            replace_dir(out / f".{split}.partial-{os.getpid()}", out / split)
    finally:
        for path in scratch:
            shutil.rmtree(path, ignore_errors=True)
        if created and not any(out.iterdir()):
            out.rmdir()
    for split in splits:
        print(f"materialized {len(lists[split])} {split} tasks in {out / split} (see {split}/manifest.json)")
    return {split: out / split for split in splits}


# --- command line --------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Both actions share one parser; `materialize` is the default action."""
    parser = argparse.ArgumentParser(
        description="\n\n".join(__doc__.split("\n\n")[:2]),
        epilog="actions:\n"
        "  materialize  (default) take the tasks listed in data/*.json from --*-source or the pinned Hub\n"
        "               revisions, check each instruction's and grader's SHA-256, copy them to\n"
        "               OUT/<split>/tasks/ with"
        f" [environment] docker_image={recipe.TASK_IMAGE}, cpus={recipe.TASK_CPUS},\n"
        f"               memory_mb={recipe.TASK_MEMORY_MB}, and write OUT/<split>/manifest.json\n"
        "  freeze       only for another dataset revision or task pool (the recipe's lists are committed):\n"
        "               select the tasks (seeded order, no train/test source or notebook overlap) and write\n"
        "               data/train.json and data/test.json; the rule is in this file's docstring",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=("materialize", "freeze"), default="materialize",
                        help="what to do (default: materialize)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("TASKS_DIR", "tasks")),
                        help="materialize: output folder, one subfolder per split (env TASKS_DIR, default: tasks)")
    parser.add_argument("--train-source", type=Path, help="local snapshot of the train dataset (default: the Hub, "
                        f"{recipe.TRAIN_DATASET}@{recipe.TRAIN_REVISION})")
    parser.add_argument("--test-source", type=Path, help="local snapshot of the test dataset (default: the Hub, "
                        f"{recipe.TEST_DATASET}@{recipe.TEST_REVISION})")
    parser.add_argument("--split", choices=("train", "test", "all"), default="all", help="materialize: which split")
    parser.add_argument("--data", type=Path, default=DATA_DIR,
                        help="folder of train.json and test.json (default: data/ beside this script)")
    counts = parser.add_argument_group("list sizes (recipe.py; smaller only for smoke tests)")
    counts.add_argument("--train-medium", type=int, default=recipe.TRAIN_MEDIUM, help="default: %(default)s")
    counts.add_argument("--train-hard", type=int, default=recipe.TRAIN_HARD, help="default: %(default)s")
    counts.add_argument("--test-tasks", type=int, default=recipe.TEST_TASKS, help="default: %(default)s")
    counts.add_argument("--grader-sha256", default=recipe.GRADER_SHA256,
                        help="materialize: SHA-256 every task's tests/grader.py must have (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, api: Any = None) -> int:
    """Run one action; a bad input ends in one line on stderr and exit status 2."""
    args = parse_args(argv)
    counts = Counts(medium=args.train_medium, hard=args.train_hard, test=args.test_tasks)
    sources = {"train": args.train_source, "test": args.test_source}
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    try:
        if args.action == "freeze":
            freeze(sources, args.data, api, counts)
        else:
            splits = SPLITS if args.split == "all" else (args.split,)
            materialize(args.out, splits, sources, args.data, api, counts, args.grader_sha256)
    except ConfigError as exc:
        print(f"prepare_tasks.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
