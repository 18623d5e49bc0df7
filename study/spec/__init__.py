"""The study spec: what a study is (schema.py: the YAML a user writes, validated into StudySpec, its
cells and each trial's config; overrides.py: `--set KEY=VALUE`, applied before it is validated) and
what is checked before any cluster work (preflight.py: flags, environment, storage and the tracking
store, each refused with exit 2 and one line naming the field).

May import: tasks, models, trial, study.ray_compat. Imported by the rest of study.
"""
