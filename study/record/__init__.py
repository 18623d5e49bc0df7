"""The study's record: MLflow (tracking.py, the Tune callback and its writer; trial_record.py, what a
trial's results become in MLflow), the study's identity and lock in storage (identity.py, lock.py),
the terminal's lines (progress.py), which search trial a cell selects (selection.py), and the tables
and figures over seeds (report.py, figures.py).

May import: tasks, models, trial, analysis, study.ray_compat, study.spec. Imported by study.experiment
and the commands.
"""
