"""The Hub double against the real client: a call the real `HfApi` would refuse, or a result it would not
return, fails here instead of on the user's first job.

For every `HfApi` method a script calls (`api.<method>(` in any top-level script) and every method the double
has: its parameters are a subset of the installed `HfApi` method's (same names, kinds and defaults, no
`**kwargs`), every parameter the real one requires is there, and what it returns is an instance of the real
method's annotated return type. `run_job` is checked against huggingface_hub 2.4.0 (launch.py's environment);
`list_jobs` and `inspect_job`, which launch.py (2.x) and eval_watch.py (1.x, in the job) both call, have the same
signature in 2.4.0 as in the installed 1.33 (read off both wheels), so the installed one checks them.
"""

from __future__ import annotations

import builtins
import inspect
import re
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import CommitOperationAdd, HfApi, hf_api

import launch
from tests.hub_double import LocalHub

ROOT = Path(__file__).resolve().parents[1]
REPO = "alice/contract"
# `HfApi.run_job` in huggingface_hub 2.4.0 (hf_api.py), read off the wheel: every parameter is keyword-only.
RUN_JOB_2_4_0 = {
    "image": inspect.Parameter.empty, "command": inspect.Parameter.empty, "env": None, "secrets": None,
    "flavor": None, "timeout": None, "attempts": None, "name": None, "labels": None, "volumes": None,
    "expose": None, "expose_public": None, "ssh": False, "network_group": None, "network_aliases": None,
    "resource_group_id": None, "namespace": None, "token": None,
}


def called_methods() -> set[str]:
    """Every `api.<method>(` call in the top-level scripts."""
    return {m for path in ROOT.glob("*.py") for m in re.findall(r"\bapi\.(\w+)\(", path.read_text())}


def double_methods() -> set[str]:
    return {name for name, _ in inspect.getmembers(LocalHub, inspect.isfunction) if not name.startswith("_")} - {
        "head", "end_job"}  # the double's own: what the Hub or the platform does, not a client call


def params(function: object) -> dict[str, inspect.Parameter]:
    return {n: p for n, p in inspect.signature(function).parameters.items() if n != "self"}


def test_the_double_has_every_method_the_scripts_call():
    assert called_methods() - double_methods() == set()
    assert {"create_commit", "repo_info", "list_repo_files", "hf_hub_download", "run_job"} <= called_methods()


@pytest.mark.parametrize("method", sorted(double_methods() - {"run_job"}))
def test_the_double_accepts_only_what_the_real_client_accepts(method):
    real, double = params(getattr(HfApi, method)), params(getattr(LocalHub, method))
    assert not any(p.kind is p.VAR_KEYWORD for p in double.values()), "a catch-all hides calls the Hub refuses"
    for name, p in double.items():
        assert name in real, f"HfApi.{method} has no parameter {name!r}"
        assert (p.kind, p.default) == (real[name].kind, real[name].default), name
    required = {n for n, p in real.items() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    assert required <= set(double), f"the real {method} requires {required - set(double)}"


def test_run_job_matches_the_launchers_huggingface_hub():
    double = params(LocalHub.run_job)
    assert all(p.kind is p.KEYWORD_ONLY for p in double.values())
    assert {n: p.default for n, p in double.items()} == {n: RUN_JOB_2_4_0[n] for n in double}
    spec = launch.job_spec("train", "alice/code", "0" * 40, {}, {"HF_TOKEN": "x"})
    assert {*spec, "token"} <= set(double)
    assert "expose_public" not in params(HfApi.run_job)  # why launch.py refuses the 1.x installed here


def returned_types(method: str) -> tuple[type, ...]:
    """The classes named in the installed method's return annotation (Future and dry-run results left out)."""
    annotation = inspect.signature(getattr(HfApi, method)).return_annotation
    names = [n.strip().split("[")[0] for n in str(annotation).split("|")]
    found = tuple(t for n in names if isinstance(t := type(None) if n == "None" else vars(hf_api).get(
        n, getattr(builtins, n, None)), type))
    assert found, f"cannot resolve {annotation!r}"
    return found


def calls(hub: LocalHub, tmp_path: Path) -> dict[str, object]:
    """One real-shaped call of each double method, in an order that makes each one succeed."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.txt").write_text("a")
    out = {"create_repo": hub.create_repo(REPO, private=True, exist_ok=True)}
    out["create_commit"] = hub.create_commit(REPO, [CommitOperationAdd("x.json", b"{}")], commit_message="m")
    out["upload_file"] = hub.upload_file(path_or_fileobj=b"1", path_in_repo="y.txt", repo_id=REPO)
    out["upload_folder"] = hub.upload_folder(repo_id=REPO, folder_path=tmp_path / "folder", path_in_repo="f")
    out["repo_info"] = hub.repo_info(REPO)
    out["model_info"] = hub.model_info(REPO, revision="main")
    out["list_repo_files"] = hub.list_repo_files(REPO)
    out["file_exists"] = hub.file_exists(REPO, "x.json")
    out["repo_exists"] = hub.repo_exists(REPO)
    out["hf_hub_download"] = hub.hf_hub_download(REPO, "x.json", local_dir=tmp_path / "dl")
    out["snapshot_download"] = hub.snapshot_download(REPO, local_dir=tmp_path / "snap", allow_patterns=["f/*"])
    out["run_job"] = hub.run_job(image="i", command=["true"], token="t")
    out["list_jobs"] = hub.list_jobs(status=["RUNNING", "SCHEDULING"])
    out["inspect_job"] = hub.inspect_job(job_id=out["run_job"].id)
    out["whoami"] = hub.whoami()
    out["auth_check"] = hub.auth_check(REPO, write=True)
    return out


def test_the_double_returns_the_real_annotated_types(tmp_path):
    results = calls(LocalHub(tmp_path / "hub"), tmp_path)
    assert set(results) == double_methods()
    for method, result in results.items():
        assert isinstance(result, returned_types(method)), (method, type(result))
    commit = results["create_commit"]
    assert isinstance(commit, huggingface_hub.CommitInfo) and not hasattr(commit, "sha")
    assert re.fullmatch(r"[0-9a-f]{40}", commit.oid)
    assert results["repo_info"].sha == results["upload_folder"].oid  # the head is the last commit's id


def test_a_read_at_one_of_the_doubles_commits_sees_the_tree_that_commit_left(tmp_path):
    """As on the Hub, a commit id is a snapshot: a reader holding a lagging head reads that head's files, not the latest
    (the lag tests of eval_adapter and eval_watch rest on it); any other revision reads the latest tree."""
    hub = LocalHub(tmp_path / "hub")
    hub.create_repo(REPO)
    first = hub.upload_file(path_or_fileobj=b"1", path_in_repo="a.json", repo_id=REPO).oid
    hub.create_commit(REPO, [CommitOperationAdd("a.json", b"2"), CommitOperationAdd("b/c.json", b"3")],
                      commit_message="second")
    assert hub.list_repo_files(REPO, revision=first) == ["a.json"]
    assert not hub.file_exists(REPO, "b/c.json", revision=first) and hub.file_exists(REPO, "b/c.json")
    old = hub.hf_hub_download(REPO, "a.json", revision=first, local_dir=tmp_path / "old")
    new = hub.hf_hub_download(REPO, "a.json", revision="main", local_dir=tmp_path / "new")
    assert (Path(old).read_bytes(), Path(new).read_bytes()) == (b"1", b"2")
    assert hub.list_repo_files(REPO, revision=hub.head(REPO)) == hub.list_repo_files(REPO) == ["a.json", "b/c.json"]
