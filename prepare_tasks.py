"""Materialize the recipe's pinned SmolDataEnvs Harbor tasks: exactly those data/train.json and data/test.json list,
checked, into OUT/<split>/tasks/ with the task image, CPUs and memory patched in (docs/tasks.md has the details).

    python3 prepare_tasks.py [--out DIR] [--split train|test|all] [--train-source DIR] [--test-source DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

import tomli_w

import adapter_repo
import recipe
from recipe import ConfigError

DATA_DIR = Path(__file__).resolve().parent / "data"  # the committed task lists (data/README.md)
SPLITS = ("train", "test")
DATASETS = {"train": (recipe.TRAIN_DATASET, recipe.TRAIN_REVISION), "test": (recipe.TEST_DATASET, recipe.TEST_REVISION)}
FIELDS = ("name", "source", "notebook", "difficulty", "instruction_sha256")
PROGRESS_EVERY = 100  # tasks between progress lines on stderr, so 1,250 folders never look hung
RESTORE = "restore the recipe's lists with `git checkout -- data`"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def progress(what: str, done: int, total: int) -> None:
    if done == total or done % PROGRESS_EVERY == 0:
        print(f"[prepare_tasks] {what}: {done}/{total}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- checking the lists --------------------------------------------------------------------------
def load_list(data_dir: Path, split: str) -> list[dict[str, str]]:
    """A committed task list; says how to restore it when it is missing or damaged."""
    path = data_dir / f"{split}.json"
    if not path.is_file():
        raise ConfigError(f"{path} is missing: {RESTORE}")
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
            raise ConfigError(f"{where} row {i}: task name {row['name']!r} is not a plain folder name: {RESTORE}")
        if not _SHA256.match(row["instruction_sha256"]):
            raise ConfigError(f"{where}: task {row['name']} has no valid instruction_sha256: {RESTORE}")
    for name, n in Counter(r["name"] for r in rows).items():
        if n > 1:
            raise ConfigError(f"{where} lists task {name} {n} times: remove the duplicate or {RESTORE}")


def check_lists(lists: dict[str, list[Any]]) -> None:
    """Rows well-formed, the recipe's counts, and no train task sharing a name, source or notebook with a test task."""
    for split in SPLITS:
        check_rows(lists[split], split)
    medium, hard, test = recipe.TRAIN_MEDIUM, recipe.TRAIN_HARD, recipe.TEST_TASKS
    tiers = Counter(r["difficulty"] for r in lists["train"])
    if tiers != Counter(medium=medium, hard=hard):
        other = len(lists["train"]) - tiers["medium"] - tiers["hard"]
        got = f"{tiers['medium']} medium, {tiers['hard']} hard" + (f" and {other} other" if other else "")
        raise ConfigError(f"data/train.json has {got}; the recipe needs {medium} medium and {hard} hard: {RESTORE}")
    if len(lists["test"]) != test:
        raise ConfigError(f"data/test.json has {len(lists['test'])} tasks; the recipe needs {test}: {RESTORE}")
    for key in ("name", "source", "notebook"):
        test = {r[key]: r["name"] for r in lists["test"]}
        for row in lists["train"]:
            if row[key] in test:
                raise ConfigError(f"train task {row['name']} and test task {test[row[key]]} share {key} "
                                  f"{row[key]!r}: held-out results would be contaminated; {RESTORE}")


def in_list_order(rows: list[dict[str, Any]], data_dir: Path, split: str) -> list[dict[str, Any]]:
    """`rows` (one per served task) in the order of data/<split>.json, the one home of the order (openenv serves
    folders sorted by name, and TRL iterates its train dataset unshuffled); refuses tasks other than the listed."""
    position = {row["name"]: i for i, row in enumerate(load_list(data_dir, split))}
    served = {row["task_name"] for row in rows}
    extra, missing = sorted(served - position.keys()), [name for name in position if name not in served]
    if extra or missing:
        what = "; ".join(f"{label} {len(names)} (e.g. {names[0]})" for label, names in (
            ("not in the list:", extra), ("listed but not served:", missing)) if names)
        raise ConfigError(f"the env server's {split} tasks are not data/{split}.json's ({what}): serve the folder "
                          f"`prepare_tasks.py --split {split}` wrote from that list")
    return sorted(rows, key=lambda row: position[row["task_name"]])


# --- materialize ---------------------------------------------------------------------------------
def patched_toml(folder: Path) -> str:
    """task.toml with the recipe's image (the hf-sandbox backend needs docker_image), CPUs and memory (1 GB tasks
    were OOM-killed) in [environment], every other key kept."""
    try:
        config = tomllib.loads((folder / "task.toml").read_text())
        config["environment"].update(docker_image=recipe.TASK_IMAGE, cpus=recipe.TASK_CPUS,
                                     memory_mb=recipe.TASK_MEMORY_MB)
    except (OSError, tomllib.TOMLDecodeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"task {folder.name}: task.toml is missing, not valid TOML or has no [environment] table "
                          f"({type(exc).__name__}: {exc}): use the pinned dataset revision") from None
    return tomli_w.dumps(config)


def download(api: Any, split: str, dest: Path, patterns: list[str]) -> Path:
    """Download the pinned revision of a split's dataset, only `patterns`, into `dest` (a failure is run_cli's line)."""
    from huggingface_hub import HfApi

    repo_id, revision = DATASETS[split]
    print(f"[prepare_tasks] downloading {repo_id}@{revision} ({len(patterns)} patterns)", file=sys.stderr, flush=True)
    (api or HfApi()).snapshot_download(repo_id, repo_type="dataset", revision=revision, local_dir=dest,
                                       allow_patterns=patterns)
    return dest


def verify(rows: list[dict[str, str]], src: Path, split: str, where: str) -> None:
    """Every listed task is in `src` (described as `where`), hashes as listed, runs the recipe's grader (another would
    score answers differently) and has a patchable task.toml."""
    for i, row in enumerate(rows, 1):
        folder = src / "tasks" / row["name"]
        if not folder.is_dir():
            raise ConfigError(f"{split} task {row['name']} is missing from {where} (no tasks/{row['name']}/): "
                              "use the pinned snapshot")
        for name, want, home in (("instruction.md", row["instruction_sha256"], f"data/{split}.json"),
                                 ("tests/grader.py", recipe.GRADER_SHA256, "GRADER_SHA256 in recipe.py")):
            found = sha256_file(folder / name) if (folder / name).is_file() else f"no {name}"
            if found != want:
                raise ConfigError(f"{split} task {row['name']}: {name} sha256 {found[:16]}… does not match {home} "
                                  f"({want[:16]}…) in {where}: use the pinned revision")
        patched_toml(folder)
        progress(f"verify {split}", i, len(rows))


def build_split(rows: list[dict[str, str]], src: Path, dest: Path, split: str, origin: str) -> None:
    """Copy and patch every listed task into `dest`, then write dest/manifest.json (what it was made from)."""
    for i, row in enumerate(rows, 1):
        target = dest / "tasks" / row["name"]
        shutil.copytree(src / "tasks" / row["name"], target)
        (target / "task.toml").write_text(patched_toml(target))
        progress(f"copy {split}", i, len(rows))
    repo_id, revision = DATASETS[split]
    manifest = {"split": split, "dataset": repo_id, "revision": revision, "origin": origin, "count": len(rows),
                "docker_image": recipe.TASK_IMAGE, "cpus": recipe.TASK_CPUS, "memory_mb": recipe.TASK_MEMORY_MB}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def materialize(out: Path, splits: tuple[str, ...], sources: dict[str, Path | None], data_dir: Path,
                api: Any) -> dict[str, Path]:
    """Write OUT/<split>/ for each split from the lists, all or nothing: every split is verified before the first
    task is copied, and each is built in a hidden sibling folder renamed into place (an older good copy stays)."""
    lists = {split: load_list(data_dir, split) for split in SPLITS}
    check_lists(lists)
    for split in splits:
        if (out / split).exists() and not (out / split / "manifest.json").is_file():
            raise ConfigError(f"{out / split} exists and was not written by prepare_tasks.py: "
                              "choose another --out or remove it")
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
                origin, where = "hub", "@".join(DATASETS[split])
            verify(lists[split], src, split, where)
            verified[split] = src, origin
        for split, (src, origin) in verified.items():
            build_split(lists[split], src, out / f".{split}.partial-{os.getpid()}", split, origin)
        for split in splits:  # an older copy goes only once the new one is in place
            old = out / f".{split}.old-{os.getpid()}"
            if (out / split).exists():
                (out / split).rename(old)
            (out / f".{split}.partial-{os.getpid()}").rename(out / split)
            shutil.rmtree(old, ignore_errors=True)
    finally:
        for path in scratch:
            shutil.rmtree(path, ignore_errors=True)
        if created and not any(out.iterdir()):
            out.rmdir()
    for split in splits:
        print(f"materialized {len(lists[split])} {split} tasks in {out / split} (see {split}/manifest.json)")
    return {split: out / split for split in splits}


def main(argv: list[str] | None = None, api: Any = None) -> int:
    """Materialize; a failure ends in one line on stderr (exit status 2 for bad input), as in every script."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("TASKS_DIR", "tasks")),
                        help="output folder, one subfolder per split (env TASKS_DIR, default: tasks)")
    for split in SPLITS:
        parser.add_argument(f"--{split}-source", type=Path, help=f"local snapshot of the {split} dataset (default: "
                            f"the Hub, {'@'.join(DATASETS[split])})")
    parser.add_argument("--split", choices=(*SPLITS, "all"), default="all")
    args = parser.parse_args(argv)
    splits = SPLITS if args.split == "all" else (args.split,)
    sources = {split: getattr(args, f"{split}_source") for split in SPLITS}
    return adapter_repo.run_cli("prepare_tasks.py", lambda: materialize(args.out, splits, sources, DATA_DIR, api))


if __name__ == "__main__":
    sys.exit(main())
