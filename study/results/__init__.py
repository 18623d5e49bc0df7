"""A study's results as tables and figures: the report over seeds and its files (tables.py), which
search trial a cell selects (selection.py) and the figures (figures.py). Read from what the study
stored, so `python -m study.report` rebuilds them without rerunning anything.

May import: tasks, models, trial, analysis, study.ray_compat, study.spec. Imported by study.record,
study.experiment and the commands.
"""
