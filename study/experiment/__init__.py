"""The study as one Ray Tune experiment: the Tuner and its restore (tuning.py), the per-cell Optuna
search, replicas and ASHA (search.py), a trial as a Ray Train run of trial/loop.py (ray_trial.py),
and the experiment's snapshots on events (snapshots.py).

May import: tasks, models, trial, analysis, study.ray_compat, study.spec, study.record. Imported by the
commands (study/run.py).
"""
