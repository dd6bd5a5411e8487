"""The committed data/train.json and data/test.json are the recipe's own task lists, row for row.

They come from the recipe's lineage (data/README.md says where). The digests below were taken of those
published lists: each row's five fields, tab-joined, one row per line, in list order. A changed, added,
dropped or reordered row changes the digest; a different JSON layout does not.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
from harbor_fixture import list_json

import prepare_tasks as pt

DATA = Path(__file__).resolve().parent.parent / "data"
DIGESTS = {
    "train": "898469b52dc0d3090a87ab7f7d38898fc561735702c483a721368629da92feb8",
    "test": "c591ac321ebb59c755b2e935329e2653a6a3197cb2ba67f6a6fb95e08ec1f670",
}
TIERS = {"train": {"medium": 400, "hard": 600}, "test": {"easy": 33, "medium": 118, "hard": 99}}


def rows(split: str) -> list[dict[str, str]]:
    return json.loads((DATA / f"{split}.json").read_text())


def content_digest(task_rows: list[dict[str, str]]) -> str:
    """SHA-256 of the rows' fields in order, independent of JSON layout."""
    text = "\n".join("\t".join(row[key] for key in pt.FIELDS) for row in task_rows)
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("split", pt.SPLITS)
def test_counts_tiers_and_content_are_the_recipes(split):
    task_rows = rows(split)
    assert all(set(row) == set(pt.FIELDS) for row in task_rows)
    assert len(task_rows) == sum(TIERS[split].values())
    assert Counter(row["difficulty"] for row in task_rows) == TIERS[split]
    assert content_digest(task_rows) == DIGESTS[split]


def test_train_and_test_share_no_name_source_or_notebook():
    train, test = rows("train"), rows("test")
    for key in ("name", "source", "notebook"):
        assert not {row[key] for row in train} & {row[key] for row in test}, key


def test_the_lists_pass_the_checks_every_job_and_launch_runs():
    pt.check_lists({split: rows(split) for split in pt.SPLITS})


@pytest.mark.parametrize("split", pt.SPLITS)
def test_the_tests_lists_have_the_committed_layout(split):
    """One format: what the tests' list writer makes of these rows is the committed file, byte for byte."""
    assert list_json(rows(split)) == (DATA / f"{split}.json").read_text()
