"""prepare_tasks.py on synthetic SmolDataEnvs Harbor snapshots (real on-disk format, small counts).

Covers issue 2's acceptance list: freeze determinism and composition, materialize from local snapshots
and from a Hub stand-in, the patched task.toml read back with tomllib (and loaded by Harbor and
OpenEnv), every bad input, and that a failure leaves nothing partial behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from harbor.models.task.task import Task
from harbor_fixture import GRADER_SHA256, make_snapshot, make_task, materialized, name_of, publish, source_of
from hub_double import LocalHub
from openenv.harbor.tasks import _task_dirs_from_directory

import prepare_tasks as pt
import recipe

ROOT = Path(__file__).resolve().parent.parent
COUNTS = pt.Counts(medium=4, hard=6, test=3)
COUNTS_ONLY = ["--train-medium", "4", "--train-hard", "6", "--test-tasks", "3"]
SMALL = [*COUNTS_ONLY, "--grader-sha256", GRADER_SHA256]  # the fixture's tasks carry the fixture's grader
# The fixture's task.toml carries `allow_internet` like the generator's; Harbor 0.25 warns it is deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:The 'allow_internet' field is deprecated")
PATCHED = {"docker_image": recipe.TASK_IMAGE, "cpus": recipe.TASK_CPUS, "memory_mb": recipe.TASK_MEMORY_MB}


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    """Train (2 easy / 6 medium / 8 hard) and test (1 easy / 2 medium / 2 hard) snapshots, no shared notebook."""
    root = tmp_path_factory.mktemp("snapshots")
    train = make_snapshot(root / "train", n_medium=6, n_hard=8, n_easy=2, first_notebook=100_000)
    test = make_snapshot(root / "test", n_medium=2, n_hard=2, n_easy=1, first_notebook=900_000)
    return {"train": train, "test": test}


@pytest.fixture
def work(tmp_path, snapshots):
    """Writable copies of both snapshots and their frozen lists in tmp_path/data."""
    sources = {s: shutil.copytree(p, tmp_path / f"snap-{s}") for s, p in snapshots.items()}
    pt.freeze(sources, tmp_path / "data", api=None, counts=COUNTS)
    return tmp_path, sources


class RecordingHub(LocalHub):
    """LocalHub that remembers each snapshot_download call, to check what would be fetched."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.downloads: list[dict] = []

    def snapshot_download(self, repo_id, **kwargs):
        self.downloads.append({"repo_id": repo_id, **kwargs})
        return super().snapshot_download(repo_id, **kwargs)


def hub_with(tmp_path: Path, sources: dict[str, Path]) -> RecordingHub:
    hub = RecordingHub(tmp_path / "hub")
    publish(hub, recipe.TRAIN_DATASET, sources["train"])
    publish(hub, recipe.TEST_DATASET, sources["test"])
    return hub


def run_main(argv: list[str], capsys, api=None) -> tuple[int, str]:
    rc = pt.main(argv, api=api)
    return rc, capsys.readouterr().err


def error_line(stderr: str) -> str:
    """The one error line; progress lines (prefixed) may precede it."""
    lines = [ln for ln in stderr.splitlines() if not ln.startswith("[prepare_tasks]")]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("prepare_tasks.py: error: ")
    return lines[0]


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text())


# --- CLI ---------------------------------------------------------------------------------------------
def test_help_documents_both_actions():
    res = subprocess.run([sys.executable, "prepare_tasks.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    for text in ("freeze", "materialize", "--split", "--train-source", "--test-source", "--out",
                 "data/train.json", recipe.TASK_IMAGE, recipe.TRAIN_REVISION, recipe.TEST_REVISION):
        assert text in res.stdout


def test_missing_lists_are_restored_from_git_not_refrozen(tmp_path):
    """A real process: exit status non-zero, one line that says how to restore the committed lists, nothing written.

    Freezing again would pick other tasks than the recipe's, so it is named only for other revisions or pools."""
    out = tmp_path / "tasks"
    res = subprocess.run([sys.executable, "prepare_tasks.py", "--out", str(out), "--data", str(tmp_path / "nodata")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    line = error_line(res.stderr)
    assert "train.json is missing: restore the recipe's lists with `git checkout -- data`" in line
    assert "`.venv/bin/python prepare_tasks.py freeze` is only for another dataset revision or task pool" in line
    assert not out.exists()


# --- freeze -----------------------------------------------------------------------------------------
def test_freeze_composition(work):
    tmp_path, sources = work
    train, test = load(tmp_path / "data" / "train.json"), load(tmp_path / "data" / "test.json")
    assert [r["difficulty"] for r in train].count("medium") == 4
    assert [r["difficulty"] for r in train].count("hard") == 6 and len(train) == 10
    assert len(test) == 3
    for split, rows in (("train", train), ("test", test)):
        assert len({r["name"] for r in rows}) == len(rows)
        for row in rows:
            assert set(row) == set(pt.FIELDS)
            folder = sources[split] / "tasks" / row["name"]
            assert row["instruction_sha256"] == hashlib.sha256((folder / "instruction.md").read_bytes()).hexdigest()
            meta = tomllib.loads((folder / "task.toml").read_text())["metadata"]
            assert row["source"] == meta["source_row_id"] and name_of(row["source"]) == row["name"]
            assert row["notebook"] == row["source"].rsplit("_qa_", 1)[0] and row["notebook"].endswith(".ipynb")
            assert row["difficulty"] == meta["difficulty_tier"]
    # The fixed seeded order: listed in rank order, and no unlisted task of a tier outranks a listed one.
    ranks = [pt.rank(r["name"], recipe.FREEZE_SEED) for r in train]
    assert ranks == sorted(ranks)
    all_rows = pt.scan_snapshot(sources["train"], "train")
    for tier in ("medium", "hard"):
        chosen = {r["name"] for r in train if r["difficulty"] == tier}
        rest = [r["name"] for r in all_rows if r["difficulty"] == tier and r["name"] not in chosen]
        assert rest and max(pt.rank(n, recipe.FREEZE_SEED) for n in chosen) < min(
            pt.rank(n, recipe.FREEZE_SEED) for n in rest)
    assert not {r["notebook"] for r in train} & {r["notebook"] for r in test}


def test_freeze_is_byte_identical_for_the_same_inputs(work, snapshots):
    tmp_path, _ = work
    moved = {s: shutil.copytree(p, tmp_path / "elsewhere" / s) for s, p in snapshots.items()}
    pt.freeze(moved, tmp_path / "again", api=None, counts=COUNTS)
    for name in ("train.json", "test.json"):
        first = (tmp_path / "data" / name).read_bytes()
        assert first == (tmp_path / "again" / name).read_bytes()
        assert first.endswith(b"}\n]\n")
        for line in first.decode().splitlines()[1:-1]:
            row = json.loads(line.rstrip(","))
            assert tuple(row) == pt.FIELDS  # the committed lists' layout
    # The seed is what fixes the order: another seed picks or orders differently.
    other = pt.freeze(snapshots, tmp_path / "seed2", api=None, counts=COUNTS, seed=recipe.FREEZE_SEED + 1)
    assert [r["name"] for r in other["train"]] != [r["name"] for r in load(tmp_path / "data" / "train.json")]


def test_freeze_keeps_train_off_test_notebooks_and_sources(tmp_path, snapshots):
    train = shutil.copytree(snapshots["train"], tmp_path / "train")
    test = shutil.copytree(snapshots["test"], tmp_path / "test")
    shared = pt.scan_snapshot(train, "train")
    medium = [r for r in shared if r["difficulty"] == "medium"]
    # One test task from the notebook of a train medium task, one carrying a train hard task's exact source.
    notebook_id = int(medium[0]["notebook"].rsplit("/", 1)[1].split(".")[0])
    make_task(test, source_of(notebook_id, 9), "medium")
    hard = next(r for r in shared if r["difficulty"] == "hard")
    make_task(test, hard["source"], "hard", name="renamed_" + hard["name"])
    lists = pt.freeze({"train": train, "test": test}, tmp_path / "data", api=None,
                      counts=pt.Counts(medium=4, hard=6, test=7))
    assert medium[0]["notebook"] in {r["notebook"] for r in lists["test"]}
    assert hard["source"] in {r["source"] for r in lists["test"]}
    assert medium[0]["notebook"] not in {r["notebook"] for r in lists["train"]}
    assert hard["source"] not in {r["source"] for r in lists["train"]}
    assert len(lists["train"]) == 10


@pytest.mark.parametrize("flag, value, expect", [
    ("--train-medium", "7", "6 medium tasks free of test overlap, 7 are needed"),
    ("--train-hard", "9", "8 hard tasks free of test overlap, 9 are needed"),
    ("--test-tasks", "6", "the test snapshot has 5 tasks, 6 are needed"),
])
def test_freeze_refuses_too_few_tasks(tmp_path, snapshots, capsys, flag, value, expect):
    argv = ["freeze", "--train-source", str(snapshots["train"]), "--test-source", str(snapshots["test"]),
            "--data", str(tmp_path / "data"), *SMALL]
    argv[argv.index(flag) + 1] = value
    rc, err = run_main(argv, capsys)
    assert rc == 2 and expect in error_line(err)
    assert not (tmp_path / "data").exists()


def test_freeze_from_the_hub_reads_only_the_pinned_revisions(tmp_path, snapshots, work):
    hub = hub_with(tmp_path, snapshots)
    pt.freeze({"train": None, "test": None}, tmp_path / "hubdata", api=hub, counts=COUNTS)
    for name in ("train.json", "test.json"):
        assert (tmp_path / "hubdata" / name).read_bytes() == (tmp_path / "data" / name).read_bytes()
    assert [(d["repo_id"], d["revision"], d["repo_type"]) for d in hub.downloads] == [
        (recipe.TRAIN_DATASET, recipe.TRAIN_REVISION, "dataset"),
        (recipe.TEST_DATASET, recipe.TEST_REVISION, "dataset")]
    assert all(d["allow_patterns"] == ["tasks/*/task.toml", "tasks/*/instruction.md"] for d in hub.downloads)


def test_task_row_rule(tmp_path):
    folder = make_task(tmp_path, source_of(324293, 2), "Hard")
    row = pt.task_row(folder)
    assert row["name"] == "0000_324_324293_qa_2"
    assert (row["source"], row["notebook"], row["difficulty"]) == (
        "0000/324/324293.ipynb_qa_2", "0000/324/324293.ipynb", "hard")
    toml = folder / "task.toml"
    toml.write_text(toml.read_text().replace('source_row_id = "0000/324/324293.ipynb_qa_2"\n',
                                             'source = "row-7"\nnotebook = "nb/7.ipynb"\n'))
    assert (pt.task_row(folder)["source"], pt.task_row(folder)["notebook"]) == ("row-7", "nb/7.ipynb")
    toml.write_text(toml.read_text().replace('notebook = "nb/7.ipynb"\n', ""))
    with pytest.raises(pt.ConfigError, match="0000_324_324293_qa_2: task.toml has no .metadata..source_row_id"):
        pt.task_row(folder)


# --- materialize ------------------------------------------------------------------------------------
def test_materialize_copies_verifies_and_patches(work, capsys):
    tmp_path, sources = work
    out = tmp_path / "tasks"
    rc, err = run_main(["--out", str(out), "--data", str(tmp_path / "data"),
                        "--train-source", str(sources["train"]), "--test-source", str(sources["test"]), *SMALL], capsys)
    assert rc == 0, err
    assert "[prepare_tasks] verify train: 10/10" in err and "[prepare_tasks] copy test: 3/3" in err
    assert leftovers(out) == ["test", "train"]
    for split in pt.SPLITS:
        rows = load(tmp_path / "data" / f"{split}.json")
        assert sorted(p.name for p in (out / split / "tasks").iterdir()) == sorted(r["name"] for r in rows)
        manifest = json.loads((out / split / "manifest.json").read_text())
        dataset, revision = pt.dataset_of(split)
        assert (manifest["count"], manifest["dataset"], manifest["revision"], manifest["origin"]) == (
            len(rows), dataset, revision, "local")
        for row in rows:
            src, dst = sources[split] / "tasks" / row["name"], out / split / "tasks" / row["name"]
            before = tomllib.loads((src / "task.toml").read_text())
            after = tomllib.loads((dst / "task.toml").read_text())
            assert before["environment"]["memory_mb"] == 1024 and "docker_image" not in before["environment"]
            assert after["environment"] == {**before["environment"], **PATCHED}
            assert {k: v for k, v in after.items() if k != "environment"} == {
                k: v for k, v in before.items() if k != "environment"}
            files = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file())
            assert files == sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
            for rel in files:
                assert manifest["files"][row["name"]][rel] == hashlib.sha256((dst / rel).read_bytes()).hexdigest()
                if rel != "task.toml":
                    assert (dst / rel).read_bytes() == (src / rel).read_bytes()
    # The real consumers accept the result: Harbor parses each task, OpenEnv lists them all (validated).
    task = Task(out / "train" / "tasks" / load(tmp_path / "data" / "train.json")[0]["name"])
    assert (task.config.environment.docker_image, task.config.environment.cpus,
            task.config.environment.memory_mb) == (recipe.TASK_IMAGE, recipe.TASK_CPUS, recipe.TASK_MEMORY_MB)
    assert task.config.environment.healthcheck.command.startswith("python3 /opt/pull_bucket.py")
    assert len(_task_dirs_from_directory(out / "train", validate=True)) == 10


def test_materialize_from_the_hub_fetches_only_listed_folders(work, capsys):
    tmp_path, sources = work
    hub, out = hub_with(tmp_path, sources), tmp_path / "tasks"
    rc, err = run_main(["--out", str(out), "--data", str(tmp_path / "data"), *SMALL], capsys, api=hub)
    assert rc == 0, err
    for split, download in zip(pt.SPLITS, hub.downloads, strict=True):
        rows = load(tmp_path / "data" / f"{split}.json")
        assert (download["repo_id"], download["revision"], download["repo_type"]) == (*pt.dataset_of(split), "dataset")
        assert download["allow_patterns"] == [f"tasks/{r['name']}/*" for r in rows]
        # The snapshot holds more tasks (easy ones, unpicked ones) than the list: none of them arrive.
        assert sorted(p.name for p in (out / split / "tasks").iterdir()) == sorted(r["name"] for r in rows)
        assert json.loads((out / split / "manifest.json").read_text())["origin"] == "hub"
    assert leftovers(out) == ["test", "train"]


def test_materialize_is_repeatable_and_one_split_at_a_time(work, capsys):
    tmp_path, sources = work
    out = tmp_path / "tasks"
    base = ["--out", str(out), "--data", str(tmp_path / "data"), "--train-source", str(sources["train"]),
            "--test-source", str(sources["test"]), *SMALL]
    assert run_main([*base, "--split", "train"], capsys)[0] == 0
    assert leftovers(out) == ["train"]
    first = (out / "train" / "manifest.json").read_bytes()
    assert run_main(base, capsys)[0] == 0
    assert leftovers(out) == ["test", "train"]
    assert (out / "train" / "manifest.json").read_bytes() == first


def corrupt_instruction(sources, rows):
    path = sources["test"] / "tasks" / rows["test"][1]["name"] / "instruction.md"
    path.write_text(path.read_text() + "one more line\n")
    return rows["test"][1]["name"], "instruction.md sha256"


def drop_folder(sources, rows):
    shutil.rmtree(sources["train"] / "tasks" / rows["train"][-1]["name"])
    return rows["train"][-1]["name"], "is missing from"


def drop_environment(sources, rows):
    row = rows["train"][2]
    folder = sources["train"] / "tasks" / row["name"]
    instruction = (folder / "instruction.md").read_text()
    shutil.rmtree(folder)
    make_task(sources["train"], row["source"], row["difficulty"], instruction=instruction, environment=False)
    return row["name"], "task.toml has no [environment] table"


def swap_grader(sources, rows):
    path = sources["test"] / "tasks" / rows["test"][-1]["name"] / "tests" / "grader.py"
    path.write_text(path.read_text().replace("<= float", "< float"))
    return rows["test"][-1]["name"], "tests/grader.py sha256"


@pytest.mark.parametrize("break_source", [corrupt_instruction, drop_folder, drop_environment, swap_grader])
def test_bad_snapshot_fails_naming_the_task_and_leaves_nothing(work, capsys, break_source):
    tmp_path, sources = work
    rows = {s: load(tmp_path / "data" / f"{s}.json") for s in pt.SPLITS}
    name, expect = break_source(sources, rows)
    out = tmp_path / "tasks"
    rc, err = run_main(["--out", str(out), "--data", str(tmp_path / "data"), "--train-source", str(sources["train"]),
                        "--test-source", str(sources["test"]), *SMALL], capsys)
    line = error_line(err)
    assert rc == 2 and name in line and expect in line
    assert "use the pinned" in line  # and says how to fix it
    assert not out.exists()  # not even the good split that verified first


def test_a_grader_other_than_the_recipes_is_refused_by_default(work, capsys):
    """Without --grader-sha256 the recipe's GRADER_SHA256 is expected: the fixture's own grader is refused."""
    tmp_path, sources = work
    first = load(tmp_path / "data" / "train.json")[0]["name"]
    out = tmp_path / "tasks"
    rc, err = run_main(["--out", str(out), "--data", str(tmp_path / "data"), "--train-source", str(sources["train"]),
                        "--test-source", str(sources["test"]), *COUNTS_ONLY], capsys)
    line = error_line(err)
    assert rc == 2 and f"train task {first}: tests/grader.py sha256 {GRADER_SHA256[:16]}" in line
    assert recipe.GRADER_SHA256[:16] in line and "GRADER_SHA256" in line
    assert not out.exists()


def duplicate_name(rows):
    rows["train"][-1] = dict(rows["train"][0])
    return rows["train"][0]["name"], "lists task"


def wrong_count(rows):
    rows["test"].pop()
    return "data/test.json", "has 2 tasks; the recipe needs 3"


def wrong_tier(rows):
    next(r for r in rows["train"] if r["difficulty"] == "hard")["difficulty"] = "medium"
    return "data/train.json", "has 5 medium, 5 hard; the recipe needs 4 medium and 6 hard"


def shared_notebook(rows):
    rows["test"][0]["notebook"] = rows["train"][3]["notebook"]
    return rows["train"][3]["name"], "share notebook"


def shared_source(rows):
    rows["test"][2]["source"] = rows["train"][5]["source"]
    return rows["train"][5]["name"], "share source"


def unsafe_name(rows):
    rows["train"][1]["name"] = "../escape"
    return "'../escape'", "is not a plain folder name"


@pytest.mark.parametrize("break_list", [duplicate_name, wrong_count, wrong_tier, shared_notebook, shared_source,
                                        unsafe_name])
def test_bad_list_fails_before_anything_is_written(work, capsys, break_list):
    tmp_path, sources = work
    rows = {s: load(tmp_path / "data" / f"{s}.json") for s in pt.SPLITS}
    name, expect = break_list(rows)
    for split in pt.SPLITS:
        (tmp_path / "data" / f"{split}.json").write_text(pt.list_json(rows[split]))
    out = tmp_path / "tasks"
    rc, err = run_main(["--out", str(out), "--data", str(tmp_path / "data"), "--train-source", str(sources["train"]),
                        "--test-source", str(sources["test"]), *SMALL], capsys)
    line = error_line(err)
    assert rc == 2 and name in line and expect in line and "`git checkout -- data`" in line
    assert not out.exists()


def test_failed_rerun_keeps_the_previous_good_copy(work, capsys):
    tmp_path, sources = work
    out = tmp_path / "tasks"
    argv = ["--out", str(out), "--data", str(tmp_path / "data"), "--train-source", str(sources["train"]),
            "--test-source", str(sources["test"]), *SMALL]
    assert run_main(argv, capsys)[0] == 0
    before = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    corrupt_instruction(sources, {s: load(tmp_path / "data" / f"{s}.json") for s in pt.SPLITS})
    assert run_main(argv, capsys)[0] == 2
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert leftovers(out) == ["test", "train"]


def test_refuses_to_replace_a_folder_it_did_not_write(work, capsys):
    tmp_path, sources = work
    out = tmp_path / "tasks"
    (out / "train").mkdir(parents=True)
    (out / "train" / "precious.txt").write_text("mine")
    rc, err = run_main(["--out", str(out), "--data", str(tmp_path / "data"), "--train-source", str(sources["train"]),
                        "--test-source", str(sources["test"]), *SMALL], capsys)
    assert rc == 2 and "was not written by prepare_tasks.py" in error_line(err)
    assert (out / "train" / "precious.txt").read_text() == "mine" and leftovers(out) == ["train"]


def test_download_failure_is_one_line_and_leaves_nothing(work, capsys):
    tmp_path, _ = work
    out = tmp_path / "tasks"
    rc, err = run_main(["--out", str(out), "--data", str(tmp_path / "data"), *SMALL], capsys,
                       api=LocalHub(tmp_path / "empty-hub"))
    line = error_line(err)
    assert rc == 2 and f"download of {recipe.TRAIN_DATASET}@{recipe.TRAIN_REVISION} failed" in line
    assert not out.exists()


def test_materialized_fixture_gives_other_tests_a_prepared_dataset(tmp_path):
    out = materialized(tmp_path, n_medium=2, n_hard=3, n_test=2)
    assert len(load(tmp_path / "data" / "train.json")) == 5 and len(load(tmp_path / "data" / "test.json")) == 2
    for split, n in (("train", 5), ("test", 2)):
        dirs = _task_dirs_from_directory(out / split, validate=True)
        assert len(dirs) == n
        assert all(tomllib.loads((d / "task.toml").read_text())["environment"]["docker_image"] == recipe.TASK_IMAGE
                   for d in dirs)


def test_an_out_folder_that_cannot_be_made_is_one_line(capsys):
    """Issue 43 (13): `--out /proc/x` printed an 18-line traceback."""
    rc, err = run_main(["--out", "/proc/x", "--split", "train"], capsys)
    assert rc == 2
    assert error_line(err) == ("prepare_tasks.py: error: --out /proc/x cannot be created (No such file or directory): "
                               "choose a folder you can write")
