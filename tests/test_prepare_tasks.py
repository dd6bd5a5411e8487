"""prepare_tasks.py on synthetic SmolDataEnvs Harbor snapshots (real on-disk format, small counts).

Covers issue 2's acceptance list: materialize from local snapshots and from a Hub stand-in, the patched
task.toml read back with tomllib (and loaded by Harbor and OpenEnv), every bad input, and that a failure
leaves nothing partial behind.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from harbor.models.task.task import Task
from harbor_fixture import (
    GRADER_SHA256,
    Counts,
    in_recipe,
    list_json,
    make_snapshot,
    make_task,
    materialized,
    publish,
    write_lists,
)
from hub_double import LocalHub
from openenv.harbor.tasks import _task_dirs_from_directory

import prepare_tasks as pt
import recipe

ROOT = Path(__file__).resolve().parent.parent
COUNTS = Counts(medium=4, hard=6, test=3)
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
def work(tmp_path, snapshots, monkeypatch):
    """Writable copies of both snapshots and their lists in tmp_path/data, the lists main() reads."""
    sources = {s: shutil.copytree(p, tmp_path / f"snap-{s}") for s, p in snapshots.items()}
    monkeypatch.setattr(pt, "DATA_DIR", tmp_path / "data")
    write_lists(sources, tmp_path / "data", COUNTS)
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


def run_main(argv: list[str], capsys, api=None, grader_sha256: str = GRADER_SHA256) -> tuple[int, str]:
    """main() on the small lists; the fixture's tasks carry the fixture's grader."""
    with in_recipe(COUNTS, grader_sha256):
        rc = pt.main(argv, api=api)
    return rc, capsys.readouterr().err


def error_line(stderr: str) -> str:
    """The one error line; progress lines (prefixed) may precede it."""
    lines = [ln for ln in stderr.splitlines() if not ln.startswith("[prepare_tasks]")]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("prepare_tasks.py: ")
    return lines[0]


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text())


# --- CLI ---------------------------------------------------------------------------------------------
def test_help_documents_the_inputs():
    res = subprocess.run([sys.executable, "prepare_tasks.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    for text in ("--split", "--train-source", "--test-source", "--out", "data/train.json", recipe.TRAIN_REVISION,
                 recipe.TEST_REVISION):
        assert text in res.stdout


def test_missing_lists_are_restored_from_git(tmp_path):
    """A real process: exit status non-zero, one line that says how to restore the committed lists, nothing written."""
    out = tmp_path / "tasks"
    code = (f"import sys, pathlib, prepare_tasks as pt; pt.DATA_DIR = pathlib.Path({str(tmp_path / 'nodata')!r}); "
            f"sys.exit(pt.main(['--out', {str(out)!r}]))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    line = error_line(res.stderr)
    assert "train.json is missing: restore the recipe's lists with `git checkout -- data`" in line
    assert not out.exists()


# --- materialize ------------------------------------------------------------------------------------
def test_materialize_copies_verifies_and_patches(work, capsys):
    tmp_path, sources = work
    out = tmp_path / "tasks"
    rc, err = run_main(["--out", str(out), "--train-source", str(sources["train"]), "--test-source",
                        str(sources["test"])], capsys)
    assert rc == 0, err
    assert "[prepare_tasks] verify train: 10/10" in err and "[prepare_tasks] copy test: 3/3" in err
    assert leftovers(out) == ["test", "train"]
    for split in pt.SPLITS:
        rows = load(tmp_path / "data" / f"{split}.json")
        assert sorted(p.name for p in (out / split / "tasks").iterdir()) == sorted(r["name"] for r in rows)
        manifest = json.loads((out / split / "manifest.json").read_text())
        dataset, revision = pt.DATASETS[split]
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
    rc, err = run_main(["--out", str(out)], capsys, api=hub)
    assert rc == 0, err
    for split, download in zip(pt.SPLITS, hub.downloads, strict=True):
        rows = load(tmp_path / "data" / f"{split}.json")
        assert (download["repo_id"], download["revision"], download["repo_type"]) == (*pt.DATASETS[split], "dataset")
        assert download["allow_patterns"] == [f"tasks/{r['name']}/*" for r in rows]
        # The snapshot holds more tasks (easy ones, unpicked ones) than the list: none of them arrive.
        assert sorted(p.name for p in (out / split / "tasks").iterdir()) == sorted(r["name"] for r in rows)
        assert json.loads((out / split / "manifest.json").read_text())["origin"] == "hub"
    assert leftovers(out) == ["test", "train"]


def test_materialize_is_repeatable_and_one_split_at_a_time(work, capsys):
    tmp_path, sources = work
    out = tmp_path / "tasks"
    base = ["--out", str(out), "--train-source", str(sources["train"]),
            "--test-source", str(sources["test"])]
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
    return row["name"], "has no [environment] table"


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
    rc, err = run_main(["--out", str(out), "--train-source", str(sources["train"]),
                        "--test-source", str(sources["test"])], capsys)
    line = error_line(err)
    assert rc == 2 and name in line and expect in line
    assert "use the pinned" in line  # and says how to fix it
    assert not out.exists()  # not even the good split that verified first


def test_a_grader_other_than_the_recipes_is_refused_by_default(work, capsys):
    """By default the recipe's GRADER_SHA256 is expected: the fixture's own grader is refused."""
    tmp_path, sources = work
    first = load(tmp_path / "data" / "train.json")[0]["name"]
    out = tmp_path / "tasks"
    rc, err = run_main(["--out", str(out), "--train-source", str(sources["train"]),
                        "--test-source", str(sources["test"])], capsys,
                       grader_sha256=recipe.GRADER_SHA256)
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
        (tmp_path / "data" / f"{split}.json").write_text(list_json(rows[split]))
    out = tmp_path / "tasks"
    rc, err = run_main(["--out", str(out), "--train-source", str(sources["train"]),
                        "--test-source", str(sources["test"])], capsys)
    line = error_line(err)
    assert rc == 2 and name in line and expect in line and "`git checkout -- data`" in line
    assert not out.exists()


def test_failed_rerun_keeps_the_previous_good_copy(work, capsys):
    tmp_path, sources = work
    out = tmp_path / "tasks"
    argv = ["--out", str(out), "--train-source", str(sources["train"]),
            "--test-source", str(sources["test"])]
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
    rc, err = run_main(["--out", str(out), "--train-source", str(sources["train"]),
                        "--test-source", str(sources["test"])], capsys)
    assert rc == 2 and "was not written by prepare_tasks.py" in error_line(err)
    assert (out / "train" / "precious.txt").read_text() == "mine" and leftovers(out) == ["train"]


def test_download_failure_is_one_line_and_leaves_nothing(work, capsys):
    tmp_path, _ = work
    out = tmp_path / "tasks"
    rc, err = run_main(["--out", str(out)], capsys,
                       api=LocalHub(tmp_path / "empty-hub"))
    line = error_line(err)  # the entry points' shared one-line report, after the line naming the download
    assert rc == 1 and line.startswith("prepare_tasks.py: the Hub refused a request (HTTP 404")
    assert f"[prepare_tasks] downloading {recipe.TRAIN_DATASET}@{recipe.TRAIN_REVISION}" in err
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
    rc, err = pt.main(["--out", "/proc/x", "--split", "train"]), capsys.readouterr().err  # the committed lists
    assert rc == 2
    assert error_line(err) == ("prepare_tasks.py: --out /proc/x cannot be created (No such file or directory): "
                               "choose a folder you can write")
