"""The study's record: the seam a study records through (recorder.py: the events, and the registry
of recorders), the study's identity in storage (identity.py), MLflow's recorder (mlflow/) and W&B's
(wandb_recorder.py).

May import: tasks, models, trial, analysis, study.ray_compat, study.spec, study.results. Imported by
study.experiment and the commands.
"""
