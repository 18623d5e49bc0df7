"""Analyses of a trained model, run after training when a trial config asks for them.

- loss_gap: how sparse is real text (the loss gap L_short - L_long and what k tokens recover);
- sparsity: the sparsity meter (how many earlier tokens each target's prediction needs).

Each module's `after_training(module, task, cfg, device) -> (metrics, extra records)` is registered
here by the name of its trial-config section. The training loop (trial/loop.py) is handed this
registry by whoever runs it (study/experiment/ray_trial.py, study/train.py) and never imports an analysis.

May import: tasks, models, trial. Imported by: study.
"""

from __future__ import annotations

from analysis import loss_gap, sparsity

ANALYSES = {"loss_gap": loss_gap.after_training, "sparsity": sparsity.after_training}
