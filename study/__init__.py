"""What a study does with many trials, and the commands a person runs.

- run: `python study/run.py`, the entry point (flags, preflight, the embedded default); preflight:
  checks of its flags and environment; spec: the study spec (grid, search, objective, resources);
  identity and lock: which study a record belongs to, one driver per study.
- tuning: the study as one Ray Tune experiment; search: per-cell Optuna search and ASHA; ray_trial: one
  Tune trial = one Ray Train run of trial/loop.py; snapshots: Tune's experiment state on the events a
  resume needs; ray_compat: every private Ray name the platform relies on, in one place.
- tracking: the MLflow record; progress: one line per event; report: tables and figures.
- train, loss_gap, sparsity: one trial, or one analysis of a trained model, from the command line
  (model_source: which trained model an analysis command measures).

May import: tasks, models, trial, analysis.
"""
