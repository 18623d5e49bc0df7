"""Synthetic length-generalization tasks with coupled position ids, plus byte-level LM (`lm`).

Use `get_task(name, **params)` to build a task, then `task.sample(batch_size, rng, length, k)`.
"""

from __future__ import annotations

from typing import Any

from .addition import AdditionTask
from .base import PAD_ID, Batch, Task, TaskParamError, Vocab
from .copy_task import CopyTask
from .lm import LMTask
from .multiplication import MultiplicationTask
from .parity import ParityTask
from .parity_scratchpad import ParityScratchpadTask
from .sort import SortTask
from .sparse_parity import SparseParityTask
from .strings import DuplicateTask, ReverseTask
from .variable_assignment import VariableAssignmentTask

TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (
        SparseParityTask,
        ParityTask,
        ParityScratchpadTask,
        VariableAssignmentTask,
        CopyTask,
        AdditionTask,
        MultiplicationTask,
        ReverseTask,
        DuplicateTask,
        SortTask,
        LMTask,
    )
}


def get_task(name: str, **params: Any) -> Task:
    """Build a registered task; unknown names raise TaskParamError(param="name")."""
    if name not in TASKS:
        raise TaskParamError("name", f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name](**params)


__all__ = ["PAD_ID", "TASKS", "Batch", "Task", "TaskParamError", "Vocab", "get_task"]
