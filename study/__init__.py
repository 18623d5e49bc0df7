"""What a study does with many trials, and the commands a person runs. Five jobs, lowest first:

- ray_compat.py: every private Ray name the platform relies on, in one place;
- spec/: the study spec and the checks made before any cluster work (preflight);
- results/: the tables and figures over seeds, and which trial a cell selects;
- record/: the seam a study records through (a Recorder), the study's identity, MLflow's recorder;
- experiment/: the study as one Ray Tune experiment (Tuner, search, a trial as a Ray Train run,
  snapshots on events, the driver's lock, the terminal's lines);
- the commands, here: run.py (`python study/run.py`, the entry point; plan.py: what it will run),
  train.py, loss_gap.py, sparsity.py (model_source.py: which trained model an analysis measures),
  report.py (`python -m study.report`) and compare.py (`python -m study.compare A B`).

Each job may import the ones above it in this list (tests/test_architecture.py). May import: tasks,
models, trial, analysis.
"""
