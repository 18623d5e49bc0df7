"""The study as one Ray Tune experiment: the Tuner and its restore (tuning.py), the per-cell Optuna
search, replicas and ASHA (search.py), a trial as a Ray Train run of trial/loop.py (ray_trial.py),
the experiment's snapshots on events (snapshots.py), Tune's events handed to the study's recorder
(recording.py), the driver's lock on the study folder (lock.py) and the terminal's lines (progress.py).

May import: tasks, models, trial, analysis, study.ray_compat, study.spec, study.results, study.record.
Imported by the commands (study/run.py).
"""
