"""The trained order is the task list's (data/train.json), not the env server's alphabetical serving order.

openenv 0.10.0 serves a dataset's task folders sorted by name (`openenv/harbor/tasks.py`: "Order is stable (sorted
by directory name)") and TRL 1.15 iterates the train dataset unshuffled, so whatever order train_lora.train_dataset
builds is the order tasks are trained in, from step 1 and from every resume position.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from openenv.harbor.tasks import HarborTaskProvider

import prepare_tasks
import recipe
import train_lora
from tests.harbor_fixture import materialized


class ServedTaskFactory:
    """The `prompt_rows()` half of OpenEnv's HarborSessionFactory over openenv's REAL task loader: one row per task
    the Task API lists for the split, {prompt, task_name, task_index}, in the order the server lists them."""

    def __init__(self, dataset: Path) -> None:
        self.provider = HarborTaskProvider([str(dataset)])

    def prompt_rows(self) -> list[dict[str, Any]]:
        return [{"prompt": [{"role": "user", "content": ref["instruction"]}], "task_name": ref["task_name"],
                 "task_index": ref["index"]} for ref in self.provider.list_tasks("")]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """Lists and tasks materialized by prepare_tasks.py itself, as a job has them (root/data, root/tasks)."""
    return materialized(tmp_path_factory.mktemp("order"), n_medium=5, n_hard=7).parent


def test_the_trained_order_is_the_lists_not_the_servers_alphabetical_one(prepared):
    listed = [row["name"] for row in prepare_tasks.load_list(prepared / "data", "train")]
    served = [row["task_name"] for row in ServedTaskFactory(prepared / "tasks" / "train").prompt_rows()]
    assert served == sorted(listed) != listed  # openenv serves sorted names; the list's order differs

    dataset = train_lora.train_dataset(lambda: ServedTaskFactory(prepared / "tasks" / "train"), prepared / "data")
    assert dataset["task_name"] == listed
    by_name = {row["task_name"]: row for row in ServedTaskFactory(prepared / "tasks" / "train").prompt_rows()}
    assert list(dataset) == [by_name[name] for name in listed]  # every row kept whole (create() needs its prompt)


def test_tasks_the_list_does_not_name_are_refused_before_training(prepared, tmp_path):
    """Serving another folder than prepare_tasks.py wrote (here: the test split as train) is one early line."""
    with pytest.raises(recipe.ConfigError, match=r"not data/train.json's \(not in the list: 3 .*listed but not "
                                                 r"served: 12 .*serve the folder `prepare_tasks.py --split train`"):
        train_lora.train_dataset(lambda: ServedTaskFactory(prepared / "tasks" / "test"), prepared / "data")
