"""The floors of the top-level modules: every import runs down (or level), none runs back up, none closes a circle.

Floors, from the ground up (LAYOUT is the one table; a README file table can be checked against it):
- 0, the recipe: `recipe.py` holds every knob and every rule more than one side needs (read_json/write_json, the
  checkpoint pattern, graded_reward). It imports no other module of the bundle, so any script can read it.
- 1, shared libraries: used by more than one entry point (or by a shell script and an entry point): the Hub layout,
  the session client, the sandbox lifecycle, the chat template, the cards, the dashboard. They import floor 0 and
  each other, never an entry point or one entry point's support.
- 2, support of one entry point: pieces split out of one script to keep it readable (or its import cheap); LAYOUT
  names that entry point, and only it and its other support modules may import them. Anything a second entry point
  needs moves down to floor 0 or 1 instead, so that the launcher (which must import without TRL or OpenEnv) never
  drags in the trainer's side.
- 3, entry points: what a user, a shell script or the job runs (`python3 X.py ...`). One may import another
  (eval_watch reuses eval_adapter's eval run; the launcher runs the smoke report and the task lists' checks), as
  long as no circle forms.

Imports are read with `ast` from every top-level *.py: module-level imports and the ones inside functions (a lazy
import still runs the same code, only later), `import x` and `from x import y` alike.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RECIPE, SHARED, SUPPORT, ENTRY = range(4)
# module -> (floor, the entry point a floor-2 module supports, else None)
LAYOUT: dict[str, tuple[int, str | None]] = {
    "recipe": (RECIPE, None),
    "adapter_repo": (SHARED, None),
    "chat_template": (SHARED, None),
    "dashboard": (SHARED, None),
    "harbor_sessions": (SHARED, None),
    "model_cards": (SHARED, None),
    "sandbox_lifecycle": (SHARED, None),
    "trajectories": (SHARED, None),
    "train_resume": (SUPPORT, "train_lora"),
    "train_rollouts": (SUPPORT, "train_lora"),
    "train_metrics": (SUPPORT, "train_lora"),
    "train_callbacks": (SUPPORT, "train_lora"),
    "train_weight_sync": (SUPPORT, "train_lora"),
    "capture_gateway": (ENTRY, None),
    "eval_adapter": (ENTRY, None),
    "eval_watch": (ENTRY, None),
    "export_adapter": (ENTRY, None),
    "image_check": (ENTRY, None),
    "launch": (ENTRY, None),
    "prepare_tasks": (ENTRY, None),
    "seam_patch": (ENTRY, None),
    "smoke_report": (ENTRY, None),
    "train_lora": (ENTRY, None),
}


def top_level_modules() -> set[str]:
    return {path.stem for path in ROOT.glob("*.py")}


def imports() -> dict[str, set[str]]:
    """Each top-level module's imports of other top-level modules, wherever in the file they are written."""
    modules = top_level_modules()
    found: dict[str, set[str]] = {}
    for name in sorted(modules):
        tree = ast.parse((ROOT / f"{name}.py").read_text(), filename=f"{name}.py")
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.add(node.module.split(".")[0])
        found[name] = (targets & modules) - {name}
    return found


def test_every_top_level_module_has_one_row_in_the_floor_table():
    assert sorted(top_level_modules() - LAYOUT.keys()) == [], "give each new module a floor in LAYOUT"
    assert sorted(LAYOUT.keys() - top_level_modules()) == [], "LAYOUT names a module that is gone"
    for name, (floor, owner) in LAYOUT.items():
        assert (owner is not None) == (floor == SUPPORT), name
        assert owner is None or LAYOUT[owner][0] == ENTRY, f"{name} supports {owner}, which is not an entry point"


def test_no_import_runs_up_a_floor_or_into_another_entry_points_support():
    wrong = []
    for importer, targets in imports().items():
        floor, owner = LAYOUT[importer]
        for target in sorted(targets):
            target_floor, target_owner = LAYOUT[target]
            if target_floor > floor:
                wrong.append(f"{importer} (floor {floor}) imports {target} (floor {target_floor})")
            elif target_owner is not None and target_owner not in (importer, owner):
                wrong.append(f"{importer} imports {target}, the support of {target_owner} only")
    assert wrong == [], "\n".join(wrong)


def test_the_imports_close_no_circle():
    graph = imports()
    circles: list[list[str]] = []
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            circles.append([*path[path.index(name):], name])
            return
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert circles == [], "\n".join(" -> ".join(circle) for circle in circles)


def test_a_support_module_is_named_for_the_entry_point_it_serves():
    """A reader of the flat folder sees which script a support module belongs to (train_lora -> train_*.py)."""
    misnamed = [f"{name}.py supports {owner}.py" for name, (floor, owner) in LAYOUT.items()
                if owner is not None and not name.startswith(owner.split("_")[0] + "_")]
    assert misnamed == [], misnamed


def readme_file_table() -> list[str]:
    """The names in the first column of the README's `## Files` table, as written (globs and folders included)."""
    section = (ROOT / "README.md").read_text().split("\n## Files\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, re.M)


def test_the_readme_file_table_names_every_top_level_file_and_folder_once():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    top = {path.split("/")[0] + ("/" if "/" in path else "") for path in tracked}
    top -= {"README.md", ".gitignore", ".ci/"}  # the page itself and the repository's own plumbing
    named = readme_file_table()
    assert len(named) == len(set(named)), sorted(n for n in named if named.count(n) > 1)
    covered = {entry for entry in top if any(fnmatch.fnmatchcase(entry, pattern) for pattern in named)}
    assert sorted(top - covered) == [], "name each in README.md's file table, one line each"
    assert [p for p in named if not any(fnmatch.fnmatchcase(entry, p) for entry in top)] == [], "gone from the repo"


def test_the_readme_file_table_gives_each_scripts_line_count():
    """Issue 45: a reader sizes the bundle from the table; a count that drifted from `wc -l` would mislead."""
    section = (ROOT / "README.md").read_text().split("\n## Files\n", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([\w.]+\.(?:py|sh))` \| (\d+) \|", section, re.M))
    scripts = sorted(p.name for p in ROOT.glob("*") if p.suffix in (".py", ".sh"))
    assert sorted(rows) == scripts, "give each top-level script a row with its line count"
    wrong = {name: (int(n), len((ROOT / name).read_text().splitlines())) for name, n in rows.items()
             if int(n) != len((ROOT / name).read_text().splitlines())}
    assert wrong == {}, f"README.md's file table: (written, wc -l) {wrong}"


def test_every_relative_link_in_the_markdown_files_resolves():
    """Issue 43 (14): every relative link (and its #anchor, GitHub's slug of a heading) in every tracked Markdown file
    names a file, folder or heading that exists."""
    def slug(heading: str) -> str:
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    def anchors(path: Path) -> set[str]:
        return {slug(m) for m in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}

    tracked = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    broken = []
    for name in tracked.stdout.split():
        page = ROOT / name
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold commands, not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or (anchor and (path.suffix != ".md" or anchor not in anchors(path))):
                broken.append(f"{name}: {target}")
    assert broken == []
