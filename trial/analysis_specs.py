"""The settings of the analyses a trial runs after training, one class each.

A trial config's `loss_gap:` and `sparsity:` sections are these classes; the analyses
(analysis/loss_gap.py, analysis/sparsity.py) and their command lines (`python -m study.loss_gap`,
`python -m study.sparsity`) take the same class, so a default is stated once, here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from tasks import TaskParamError
from trial.limits import MAX_BATCH, MAX_POSITION, MAX_SAMPLES, Strict


class LossGapSpec(Strict):
    """After training a language model: how much of the short-to-long loss gap k tokens recover
    (analysis/loss_gap.py). long_context is L_bar, short_context is L."""

    long_context: int = Field(256, ge=2, le=MAX_POSITION)
    short_context: int = Field(32, ge=1)
    ks: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 2, 4, 8], min_length=1)
    method: Literal["greedy", "gain", "occlusion", "attention"] = "gain"
    targets: int = Field(64, ge=1, le=MAX_SAMPLES)
    rows_per_batch: int = Field(64, ge=1, le=MAX_BATCH, description="visibility patterns per forward pass")
    min_gap: float = Field(0.05, ge=0, description="tokens whose L_short - L_long is below this are too flat to count")
    sparse_k: int = Field(4, ge=1, description="a token is 'sparse' when k tokens recover half its gap")

    @model_validator(mode="after")
    def _fits(self) -> LossGapSpec:
        if not self.short_context < self.long_context:
            raise ValueError(f"short_context: {self.short_context} must be below long_context {self.long_context}")
        if max(self.ks) > self.long_context - self.short_context:
            raise ValueError(f"ks: each k must be in [1, long_context - short_context = "
                             f"{self.long_context - self.short_context}], got {self.ks}")
        if self.sparse_k not in self.ks:
            raise ValueError(f"sparse_k: {self.sparse_k} must be one of ks {self.ks}")
        return self


class SparsitySpec(Strict):
    """After training: the sparsity meter (analysis/sparsity.py), per target token the smallest k of
    earlier tokens that recovers `recover` of its loss gap, checked against the planted
    dependencies on synthetic tasks."""

    method: Literal["occlusion", "greedy", "gain", "attention"] = Field(
        "occlusion", description="how the k tokens are ranked (greedy and gain cannot find an xor's bits)")
    ablation: Literal["auto", "resample", "hide"] = Field(
        "auto", description="how a token is taken away: resample its value (synthetic tasks, the default "
        "there) or hide it from attention (the paper's truncation; text)")
    targets: int = Field(256, ge=1, le=MAX_SAMPLES)
    k_max: int = Field(8, ge=1, le=4096)
    recover: float = Field(0.9, gt=0, le=1, description="share of the gap k tokens must recover")
    min_gap: float = Field(0.1, ge=0, description="targets with a smaller gap are counted as flat")
    draws: int = Field(16, ge=1, le=4096, description="resample: redraws per visibility pattern")
    short_context: int | None = Field(
        None, ge=0, description="tokens before the target always kept (default: 0 resample, 1 hide, 32 text)")
    long_context: int = Field(256, ge=2, le=MAX_POSITION, description="text: context before each target")
    length: int | None = Field(None, ge=1, description="synthetic: measure at this length (default: training mix)")
    k: int | None = Field(None, ge=1, description="synthetic k-tasks: measure at this k")
    rows_per_batch: int = Field(256, ge=1, le=MAX_BATCH)

    def resolve(self, task) -> tuple[str, int]:
        """(ablation, short_context) after the defaults: resample where the task has value classes."""
        ablation = self.ablation
        if ablation == "auto":
            ablation = "resample" if task.value_classes() else "hide"
        if ablation == "resample" and not task.value_classes():
            raise ValueError(f"sparsity.ablation: resample needs value classes; task {task.name!r} has none "
                             "(use hide)")
        short = self.short_context
        if short is None:
            short = 32 if task.evaluation == "loss" else (0 if ablation == "resample" else 1)
        if ablation == "hide" and short < 1:
            raise ValueError("sparsity.short_context: hide needs >= 1 (the predicting token sees itself)")
        return ablation, short

    def check(self, task, max_pos: int, ids_needed) -> None:
        """That this section can measure `task` with ids below `max_pos` (`ids_needed(length, k)`: the
        largest id a cell needs), or a ValueError naming the field."""
        s = self
        _, short = s.resolve(task)  # raises naming sparsity.ablation / sparsity.short_context
        if task.evaluation == "loss":
            for name in ("length", "k"):
                if getattr(s, name) is not None:
                    raise ValueError(f"sparsity.{name}: for synthetic tasks only; text uses sparsity.long_context")
            if s.long_context >= max_pos:
                raise ValueError(f"sparsity.long_context: {s.long_context} needs ids beyond "
                                 f"positional.max_position {max_pos}")
            if short >= s.long_context:
                raise ValueError(f"sparsity.short_context: {short} must be below long_context {s.long_context}")
            if s.k_max > s.long_context - short:
                raise ValueError(f"sparsity.k_max: {s.k_max} is more than the {s.long_context - short} "
                                 "tokens before the short window")
            return
        if s.k is not None and not task.uses_k:
            raise ValueError(f"sparsity.k: task {task.name!r} has no k axis")
        if s.length is not None:
            try:
                task.check(s.length, s.k)
            except TaskParamError as e:
                raise ValueError(f"sparsity.{'length' if e.param == 'length' else 'k'}: {e.detail}") from None
            need = ids_needed(s.length, s.k)
            if need >= max_pos:
                raise ValueError(f"sparsity.length: {s.length} needs position id {need}, beyond "
                                 f"positional.max_position {max_pos}")
        elif s.k is not None:
            try:
                task.check(task.train_length, s.k)
            except TaskParamError as e:
                raise ValueError(f"sparsity.k: {e.detail}") from None
