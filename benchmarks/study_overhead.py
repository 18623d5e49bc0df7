"""What running a cell as a study costs beside training it in process, measured side by side.

    python -m benchmarks.study_overhead [--spec SPEC] [--steps N] [--repeats R]

Each repeat trains the spec's first cell once in process (`python -m study.train` on its trial
config: the loop alone) and once as a study of that cell and one seed (`python study/run.py`: the
embedded Ray, a Tune trial, the MLflow record, the report and the claims), interleaved, and prints
the wall time of each and the difference: the study's overhead, in seconds and as a share of a
20-minute trial (docs/speed.md).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TRIAL_S = 20 * 60  # the trial the overhead is read against


def timed(command: list[str]) -> float:
    start = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(command[:4])}...: exit {done.returncode}\n{done.stderr[-2000:]}")
    return time.time() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.study_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--spec", default="search_spaces/experiments/coupling_addition.yaml", help="its first cell is run")
    p.add_argument("--steps", type=int, default=1000, help="training steps of the cell")
    p.add_argument("--repeats", type=int, default=2, help="runs of each, interleaved (the medians are compared)")
    args = p.parse_args(argv)
    from study.spec.schema import load_spec

    spec = load_spec(args.spec, overrides=[f"base.optim.steps={args.steps}", "replicas=1", "claims=[]",
                                           f"grid.{next(iter(spec_grid(args.spec)))}=[{first_value(args.spec)}]"])
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "trial.yaml"
        config.write_text(yaml.safe_dump(spec.trial_config(spec.cells()[0], {}, spec.seed)))
        space = Path(tmp) / "study.yaml"
        space.write_text(yaml.safe_dump({**spec.model_dump(mode="json"), "name": "overhead"}))
        loop, study = [], []
        for i in range(args.repeats):
            loop.append(timed([sys.executable, "-m", "study.train", str(config)]))
            study.append(timed([sys.executable, "study/run.py", "--space", str(space), "--storage", f"{tmp}/s{i}"]))
    a, b = statistics.median(loop), statistics.median(study)
    print(f"in process: {', '.join(f'{t:.1f}' for t in loop)} s; as a study: {', '.join(f'{t:.1f}' for t in study)} s")
    print(f"overhead: {b - a:.1f} s (medians), {(b - a) / TRIAL_S:.1%} of a {TRIAL_S // 60}-minute trial")
    return 0


def spec_grid(path: str) -> dict:
    return yaml.safe_load(Path(path).read_text()).get("grid") or {"seed": [0]}


def first_value(path: str) -> str:
    value = next(iter(spec_grid(path).values()))[0]
    return yaml.safe_dump(value, default_flow_style=True).strip()


if __name__ == "__main__":
    raise SystemExit(main())
