"""Analyses of a trained model, run after training when a trial config has their section.

- loss_gap: how sparse is real text (the loss gap L_short - L_long and what k tokens recover);
- sparsity: the sparsity meter (how many earlier tokens each target's prediction needs);
- per_position: accuracy per answer position, beside the id distance its query sees;
- hf_model: a Hugging Face causal LM the analysis commands measure (`--hf`).

An analysis is one module with one `trial.analyses.Analysis` subclass (its section's settings, its
checks, memory, metrics, run and artifacts), registered below by one line: importing this package
is what lets a trial config take its section. docs/trial.md, "Adding an analysis".

May import: tasks, models, trial. Imported by: study.
"""

from __future__ import annotations

from analysis.loss_gap import LossGapSpec
from analysis.per_position import PerPositionSpec
from analysis.sparsity import SparsitySpec
from trial.analyses import register

register(LossGapSpec)
register(SparsitySpec)
register(PerPositionSpec)
