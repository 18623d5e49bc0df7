"""The study's record in MLflow, one Recorder (study/record/recorder.py): the recorder with its writer
backlog (recorder.py), the experiment and parent run found by the study's identity and the look-ups
of the commands that read a record back (experiment.py), and what a trial's results become in its
run (trial_runs.py).
"""
