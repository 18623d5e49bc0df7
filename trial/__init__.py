"""What one trial does: its config, the training loop, evaluation, and where it reports.

- config: the trial config (task / positional scheme / model / optim / DeepSpeed / eval), validated
  before anything starts; analyses: the seam of the analyses run after training; limits:
  the strictness and size bounds every config class shares; yaml_io: strict YAML reading and
  one-line-per-field error messages; metrics: the catalogue of what a trial reports.
- loop: `train_loop_per_worker`, the only training loop (in-process, Ray Train local, N workers);
  evaluate: loss, validation and the evaluation points; session: the seam to whoever runs the loop.
- storage: folders and buckets, for a trial's checkpoints and a study's records (the bottom layer, so
  both levels use one implementation).

May import: tasks, models. Imported by: analysis, study. Never imports Ray (study/experiment/ray_trial.py is the glue).
"""
