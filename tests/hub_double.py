"""A local stand-in for the subset of `huggingface_hub.HfApi` the bundle uses.

The Hub cannot be reached from the test machines. Production code takes an `api` object (an `HfApi` in
production); tests pass a `LocalHub`, which keeps each repo as a folder plus a head commit id. It speaks the
real client's language: each method takes a subset of the installed `HfApi` method's parameters (same names,
kinds and defaults, no `**kwargs`: a call the real client refuses fails here too), returns the real types
(`CommitInfo`, `ModelInfo`/`DatasetInfo`, `RepoUrl`), and fails with the exceptions the real client raises,
made by its own `hf_raise_for_status` from a real `httpx.Response` with the Hub's status and error code.
`tests/test_hub_contract.py` checks all of that against the installed huggingface_hub.

Two behaviours of the Hub reported from production (FACTS.md, "Hub commits") are modelled: a commit that overlaps
another commit on the same repo is refused with HTTP 409 (`COMMIT_IN_PROGRESS`), and with `stale_reads` set, the
head that `repo_info`/`model_info` answer lags behind a commit for that many reads, as the Hub's cache does.

History is modelled as far as reads go: a read at `revision` = one of this double's own commit ids sees the tree
that commit left (as on the Hub, where a commit id is an immutable snapshot), so a reader holding a lagging head reads
the older tree. Any other revision (None, a branch name, an id from elsewhere) reads the latest tree.

`run_job` mirrors huggingface_hub 2.4.0's `HfApi.run_job` (launch.py runs on >= 2.1.1; `expose_public` does not
exist in the 1.x installed here): its parameters are checked against `RUN_JOB_2_4_0` in the contract test. The jobs it
starts are listed by `list_jobs` and `inspect_job` (the same signatures in 1.33 and 2.4.0, read off both) until
`end_job` gives one a final stage, as the platform does when a job exits or is cancelled.
"""

from __future__ import annotations

import fnmatch
import hashlib
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path

import httpx
from huggingface_hub import CommitInfo, CommitOperationAdd, CommitOperationDelete, DatasetInfo, JobInfo, ModelInfo
from huggingface_hub.hf_api import RepoUrl
from huggingface_hub.utils import hf_raise_for_status

ENDPOINT = "https://huggingface.co"
OWNER = "alice"  # the user every token belongs to here
# What the Hub answers (HTTP 409) to a commit while another commit on the same repo is being applied.
COMMIT_IN_PROGRESS = "Another commit operation is in progress for this repository. Please try again later."


def raise_hub_error(status: int, url: str, message: str, error_code: str | None = None, method: str = "GET") -> None:
    """Raise what the real client raises when the Hub answers `url` with `status` (and `X-Error-Code`)."""
    headers = {"X-Error-Message": message, **({"X-Error-Code": error_code} if error_code else {})}
    hf_raise_for_status(httpx.Response(status, headers=headers, request=httpx.Request(method, url)))


class LocalHub:
    """Repos as folders under `root`; `fail_uploads` makes the next N writes fail with HTTP `fail_status`;
    `stale_reads` makes the next N head reads after each commit answer the head before it.

    `token_role` is the client's token as the Hub knows it: "write", "read", or "fineGrained" (then it may write to
    the repos in `writable` only). As on the Hub, a token that may not write is refused (403) a commit, the creation
    of a repo and `auth_check(..., write=True)`, while `create_repo(exist_ok=True)` of an existing repo succeeds.
    (The 403 messages are this double's own; the Hub's wording was not read anywhere.)"""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.fail_uploads = 0
        self.fail_status = 503
        self.stale_reads = 0
        self.token_role = "write"
        self.writable: set[str] = set()
        self.commits: list[tuple[str, str, list[str]]] = []  # (repo_id, message, paths)
        self.jobs: list[dict[str, object]] = []  # run_job's arguments, as given
        self.stages: dict[str, str] = {}  # job id -> its stage (RUNNING until end_job)
        self._heads: dict[str, int] = {}
        self._stale: dict[str, tuple[str, int]] = {}  # repo -> (the head reads still answer, reads left)
        self._committing: set[str] = set()  # repos with a commit being applied
        self._trees: dict[str, dict[str, dict[str, str]]] = {}  # repo -> commit id -> {path: blob name}
        self._lock = threading.Lock()

    # -- repos -----------------------------------------------------------------
    def _repo(self, repo_id: str) -> Path:
        path = self.root / repo_id
        if not path.is_dir():
            raise_hub_error(404, f"{ENDPOINT}/api/models/{repo_id}", "Repository not found", "RepoNotFound")
        return path

    def _may_write(self, repo_id: str) -> bool:
        return self.token_role == "write" or (self.token_role == "fineGrained" and repo_id in self.writable)

    def create_repo(self, repo_id: str, *, private: bool | None = None, repo_type: str | None = None,
                    exist_ok: bool = False) -> RepoUrl:
        path = self.root / repo_id
        if path.exists() and not exist_ok:
            raise_hub_error(409, f"{ENDPOINT}/api/repos/create", "You already created this model repo", method="POST")
        if not path.exists() and not self._may_write(repo_id):
            raise_hub_error(403, f"{ENDPOINT}/api/repos/create", "You don't have the rights to create a model under "
                            f"the namespace {repo_id.split('/')[0]!r}", method="POST")
        path.mkdir(parents=True, exist_ok=True)
        self._heads.setdefault(repo_id, 0)
        self._trees.setdefault(repo_id, {}).setdefault(self.head(repo_id), self._snapshot(path))
        prefix = "datasets/" if repo_type == "dataset" else ""
        return RepoUrl(f"{ENDPOINT}/{prefix}{repo_id}")

    def repo_info(self, repo_id: str, *, revision: str | None = None,
                  repo_type: str | None = None) -> ModelInfo | DatasetInfo:
        self._repo(repo_id)
        info = DatasetInfo if repo_type == "dataset" else ModelInfo
        return info(id=repo_id, sha=self._read_head(repo_id), private=True)

    def repo_exists(self, repo_id: str, *, repo_type: str | None = None) -> bool:
        """HfApi.repo_exists: repo_info answers, or raises RepositoryNotFoundError (False)."""
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            self.repo_info(repo_id, repo_type=repo_type)
        except RepositoryNotFoundError:
            return False
        return True

    def model_info(self, repo_id: str, *, revision: str | None = None) -> ModelInfo:
        self._repo(repo_id)
        return ModelInfo(id=repo_id, sha=self._read_head(repo_id), private=True)

    def _read_head(self, repo_id: str) -> str:
        """The head as an API read answers it: the one before the last commit while the cache still lags."""
        with self._lock:
            sha, left = self._stale.pop(repo_id, ("", 0))
            if left > 0:
                self._stale[repo_id] = (sha, left - 1)
                return sha
            return self.head(repo_id)

    def head(self, repo_id: str) -> str:
        """The repo's head commit id: a 40-hex id that changes with every commit."""
        return hashlib.sha1(f"{repo_id}@{self._heads.get(repo_id, 0)}".encode()).hexdigest()

    # -- history -----------------------------------------------------------------
    def _snapshot(self, repo: Path) -> dict[str, str]:
        """{path: blob name} of the repo folder as it is now, each content stored once under root/.blobs."""
        blobs = self.root / ".blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        tree = {}
        for file in sorted(p for p in repo.rglob("*") if p.is_file()):
            name = hashlib.sha256(file.read_bytes()).hexdigest()
            if not (blobs / name).is_file():
                shutil.copyfile(file, blobs / name)
            tree[file.relative_to(repo).as_posix()] = name
        return tree

    def _files(self, repo_id: str, revision: str | None) -> dict[str, Path]:
        """{path: the file with its content} of the repo at `revision`: the tree that commit left if it is one of this
        double's past commits, else the latest tree."""
        repo = self._repo(repo_id)
        tree = self._trees.get(repo_id, {}).get(revision or "") if revision != self.head(repo_id) else None
        if tree is None:
            return {p.relative_to(repo).as_posix(): p for p in repo.rglob("*") if p.is_file()}
        return {path: self.root / ".blobs" / name for path, name in tree.items()}

    # -- reads -----------------------------------------------------------------
    def list_repo_files(self, repo_id: str, *, revision: str | None = None, repo_type: str | None = None) -> list[str]:
        return sorted(self._files(repo_id, revision))

    def file_exists(self, repo_id: str, filename: str, *, repo_type: str | None = None,
                    revision: str | None = None) -> bool:
        return filename in self._files(repo_id, revision)

    def hf_hub_download(self, repo_id: str, filename: str, *, repo_type: str | None = None,
                        revision: str | None = None, local_dir: str | Path | None = None) -> str:
        src = self._files(repo_id, revision).get(filename)
        if src is None:
            raise_hub_error(404, f"{ENDPOINT}/{repo_id}/resolve/{revision or 'main'}/{filename}", "Entry not found",
                            "EntryNotFound", method="HEAD")
        dest = Path(local_dir) / filename if local_dir else self.root / ".cache" / repo_id / filename
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        return str(dest)

    def snapshot_download(self, repo_id: str, *, repo_type: str | None = None, revision: str | None = None,
                          local_dir: str | Path | None = None, allow_patterns: list[str] | str | None = None) -> str:
        patterns = [allow_patterns] if isinstance(allow_patterns, str) else allow_patterns
        dest = Path(local_dir) if local_dir else self.root / ".cache" / repo_id
        for name in self.list_repo_files(repo_id, revision=revision):
            if patterns is None or any(fnmatch.fnmatch(name, p) for p in patterns):
                self.hf_hub_download(repo_id, name, revision=revision, local_dir=dest)
        return str(dest)

    # -- writes ----------------------------------------------------------------
    def auth_check(self, repo_id: str, *, repo_type: str | None = None, write: bool = False) -> None:
        """As the Hub's auth-check endpoint: 404 for a repo it cannot see, 403 when `write` and it may not write."""
        self._repo(repo_id)
        if write and not self._may_write(repo_id):
            raise_hub_error(403, f"{ENDPOINT}/api/models/{repo_id}/auth-check/write",
                            f"This token has no write access to {repo_id}")

    def _before_write(self, repo_id: str) -> None:
        if not self._may_write(repo_id):
            raise_hub_error(403, f"{ENDPOINT}/api/models/{repo_id}/commit/main",
                            f"This token has no write access to {repo_id}", method="POST")
        if self.fail_uploads > 0:
            self.fail_uploads -= 1
            raise_hub_error(self.fail_status, f"{ENDPOINT}/api/models/{repo_id}/commit/main",
                            f"injected by LocalHub (HTTP {self.fail_status})", method="POST")

    def create_commit(self, repo_id: str, operations: list[CommitOperationAdd | CommitOperationDelete], *,
                      commit_message: str, repo_type: str | None = None,
                      parent_commit: str | None = None) -> CommitInfo:
        """Apply operations atomically, as the Hub does: refused with 409 while another commit on the repo is being
        applied, and with `parent_commit`, refused with 412 if the head moved."""
        url = f"{ENDPOINT}/api/models/{repo_id}/commit/main"
        with self._lock:
            self._before_write(repo_id)
            repo = self._repo(repo_id)
            if repo_id in self._committing:
                raise_hub_error(409, url, COMMIT_IN_PROGRESS, method="POST")
            if parent_commit is not None and parent_commit != self.head(repo_id):
                raise_hub_error(412, url, "A commit has happened since. Please refresh and try again.", method="POST")
            self._committing.add(repo_id)
        try:
            paths = [self._apply(repo, op) for op in operations]
            tree = self._snapshot(repo)
            with self._lock:
                before = self.head(repo_id)
                self._heads[repo_id] = self._heads.get(repo_id, 0) + 1
                self._trees.setdefault(repo_id, {})[self.head(repo_id)] = tree
                self.commits.append((repo_id, commit_message, paths))
                if self.stale_reads:
                    self._stale[repo_id] = (before, self.stale_reads)
                oid = self.head(repo_id)
        finally:
            with self._lock:
                self._committing.discard(repo_id)
        return CommitInfo(commit_url=f"{ENDPOINT}/{repo_id}/commit/{oid}", commit_message=commit_message,
                          commit_description="", oid=oid, pr_url=None)

    @staticmethod
    def _apply(repo: Path, op: CommitOperationAdd | CommitOperationDelete) -> str:
        target = repo / op.path_in_repo
        if isinstance(op, CommitOperationDelete):
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
            return op.path_in_repo
        target.parent.mkdir(parents=True, exist_ok=True)
        data = op.path_or_fileobj
        if isinstance(data, bytes):
            target.write_bytes(data)
        elif isinstance(data, (str, Path)):
            shutil.copyfile(data, target)
        else:
            target.write_bytes(data.read())
        return op.path_in_repo

    def upload_file(self, *, path_or_fileobj: str | Path | bytes, path_in_repo: str, repo_id: str,
                    repo_type: str | None = None, commit_message: str | None = None,
                    parent_commit: str | None = None) -> CommitInfo:
        op = CommitOperationAdd(path_in_repo=path_in_repo, path_or_fileobj=path_or_fileobj)
        return self.create_commit(repo_id, [op], commit_message=commit_message or f"Upload {path_in_repo}",
                                  parent_commit=parent_commit)

    def upload_folder(self, *, repo_id: str, folder_path: str | Path, path_in_repo: str | None = None,
                      repo_type: str | None = None, commit_message: str | None = None, parent_commit: str | None = None,
                      allow_patterns: list[str] | str | None = None,
                      ignore_patterns: list[str] | str | None = None) -> CommitInfo:
        folder = Path(folder_path)
        allow = [allow_patterns] if isinstance(allow_patterns, str) else allow_patterns
        ignore = [ignore_patterns] if isinstance(ignore_patterns, str) else (ignore_patterns or [])
        ops = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            rel = path.relative_to(folder).as_posix()
            if allow is not None and not any(fnmatch.fnmatch(rel, p) for p in allow):
                continue
            if any(fnmatch.fnmatch(rel, p) for p in ignore):
                continue
            dest = f"{path_in_repo.strip('/')}/{rel}" if path_in_repo else rel
            ops.append(CommitOperationAdd(path_in_repo=dest, path_or_fileobj=str(path)))
        return self.create_commit(repo_id, ops, commit_message=commit_message or "Upload folder",
                                  parent_commit=parent_commit)

    # -- account ---------------------------------------------------------------
    def whoami(self, token: bool | str | None = None, *, cache: bool = False) -> dict:
        """The token's owner and its access token's role, as the real `whoami` answers for a user token (the jobs
        below run under it); a fine-grained token lists the repos it is scoped to write."""
        token = {"displayName": "test", "role": self.token_role}
        if self.token_role == "fineGrained":
            token["fineGrained"] = {"global": [], "scoped": [
                {"entity": {"type": "model", "name": repo}, "permissions": ["repo.content.read", "repo.write"]}
                for repo in sorted(self.writable)]}
        return {"type": "user", "name": OWNER, "auth": {"type": "access_token", "accessToken": token}}

    # -- jobs ------------------------------------------------------------------
    def run_job(self, *, image: str, command: list[str], env: dict[str, object] | None = None,
                secrets: dict[str, object] | None = None, flavor: str | None = None,
                timeout: int | float | str | None = None, name: str | None = None,
                expose_public: list[int] | None = None, token: bool | str | None = None) -> JobInfo:
        """Record the job (no Jobs here) and answer as the Jobs API does for a job that started."""
        given = {"image": image, "command": command, "env": env, "secrets": secrets, "flavor": flavor,
                 "timeout": timeout, "name": name, "expose_public": expose_public, "token": token}
        self.jobs.append({k: v for k, v in given.items() if v is not None})
        job_id = f"68a{len(self.jobs):021d}"
        self.stages[job_id] = "RUNNING"
        return self._job_info(job_id)

    def end_job(self, job_id: str, stage: str = "ERROR") -> None:
        """What the platform does when a job exits (COMPLETED, ERROR) or is cancelled (CANCELED)."""
        self.stages[job_id] = stage

    def _job_info(self, job_id: str) -> JobInfo:
        spec = self.jobs[int(job_id[3:]) - 1]
        return JobInfo(id=job_id, owner={"id": "u1", "name": OWNER, "type": "user"}, command=spec["command"],
                       environment=spec.get("env") or {}, flavor=spec.get("flavor"),
                       status={"stage": self.stages[job_id]}, endpoint=ENDPOINT)

    def list_jobs(self, *, status: list[str] | str | None = None, namespace: str | None = None) -> Iterable[JobInfo]:
        """The token owner's jobs, newest first, only those in `status` when given (the Hub filters by stage)."""
        stages = [status] if isinstance(status, str) else status
        return [self._job_info(job_id) for job_id in reversed(self.stages)
                if stages is None or self.stages[job_id] in {str(s).upper() for s in stages}]

    def inspect_job(self, *, job_id: str, namespace: str | None = None) -> JobInfo:
        if job_id not in self.stages:
            raise_hub_error(404, f"{ENDPOINT}/api/jobs/{OWNER}/{job_id}", "Job not found")
        return self._job_info(job_id)
