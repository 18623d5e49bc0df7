"""One command line for a cluster: `--set KEY=VALUE` on `study/run.py` and `python -m study.train`
(validated as the file is), and `--dry-run --cluster` planning from the cluster config (its node
types' CPUs, GPUs and max_workers), not from this machine. docs/cluster.md's command, run as written."""

from __future__ import annotations

import re
import shlex
import subprocess

import pandas as pd
import pytest
import yaml
from test_study import BIN, ENV, ROOT

from study.plan import cluster_concurrency, node_fits, plan_lines
from study.run import main as run_main
from study.spec.schema import load_spec

SCHEMES = str(ROOT / "search_spaces" / "experiments" / "schemes_by_task.yaml")
AWS = yaml.safe_load((ROOT / "cluster" / "aws.yaml").read_text())


def documented_commands() -> list[list[str]]:
    """The commands of docs/cluster.md's section on GPU workers, as a shell would split them."""
    text = (ROOT / "docs" / "cluster.md").read_text().split("## A shipped study on GPU workers", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1).replace("\\\n", " ")
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


def test_the_documented_gpu_command_plans_gpu_workers_from_the_cluster():
    dry, submit = documented_commands()
    study_args = dry[dry.index("study/run.py") + 1:]
    run_args = submit[submit.index("study/run.py") + 1:]
    assert submit[:4] == ["RAY_AUTH_MODE=token", "ray", "job", "submit"] and "--" in submit
    # the job runs what the dry run planned
    assert [a for a in study_args if a not in ("--dry-run", "--cluster", "cluster/aws.yaml")] == run_args
    out = subprocess.run([str(BIN / "python"), "study/run.py", *study_args], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "per trial: 1 worker(s) x 1 CPU + 1 GPU" in out.stdout
    assert "workers land on gpu_1_spot (1 GPU, 8 CPU; 1 worker(s) per node)" in out.stdout
    assert "concurrent trials: 64 (what cluster/aws.yaml holds)" in out.stdout  # not this machine's cores
    assert "tasks addition, multiplication, reverse, duplicate, sort, parity, sparse_parity, 63 cell(s)" in out.stdout


def test_the_cluster_holds_trials_by_its_node_types_and_max_workers():
    cpu, gpu = load_spec(SCHEMES), load_spec(SCHEMES, overrides=["resources.gpus_per_worker=1"])
    assert node_fits(cpu, AWS)[0].name == "ray.head.default"  # a CPU worker fits the head
    assert [f.name for f in node_fits(gpu, AWS)] == ["gpu_1_spot", "gpu_1_ondemand", "gpu_8_spot", "gpu_8_ondemand"]
    # 8-GPU nodes first (2 + 2 of them, 8 trials each), then 32 1-GPU nodes: 36 worker nodes in all
    assert cluster_concurrency(gpu, AWS) == 4 * 8 + 32
    two_gpus = load_spec(SCHEMES, overrides=["resources.gpus_per_worker=2"])
    assert cluster_concurrency(two_gpus, AWS) == 4 * 4  # only the 8-GPU nodes hold a 2-GPU worker
    assert cluster_concurrency(gpu, {**AWS, "max_workers": 3}) == 3 * 8
    assert "concurrent trials: 2 (this machine's CPUs)" in "\n".join(plan_lines(cpu, 2, "this machine's CPUs"))


def test_the_plan_names_the_precision_every_trial_takes():
    lines = {v: "\n".join(plan_lines(load_spec(SCHEMES, overrides=[f"resources.bf16={v}"]), 2))
             for v in ("false", "true", "mixed")}
    assert "ZeRO-0;" in lines["false"] and "ZeRO-0, bf16;" in lines["true"] and "ZeRO-0, bf16 mixed;" in lines["mixed"]
    mixed = load_spec(SCHEMES, overrides=["resources.bf16=mixed"])
    assert mixed.trial_config(mixed.cells()[0], {}, 0)["deepspeed"]["bf16"] == "mixed"


def test_set_changes_any_spec_field_before_validation():
    spec = load_spec(str(ROOT / "search_spaces" / "default.yaml"), overrides=[
        "name=default_gpu", "base.optim.steps=100", "resources.gpus_per_worker=1", "search.params.optim.lr="
        "{loguniform: [0.001, 0.01]}", "grid.task.params.train_k=[2, 3]", "replicas=2", "claims=[]"])
    assert (spec.name, spec.base["optim"]["steps"], spec.resources.gpus_per_worker, spec.replicas) == \
        ("default_gpu", 100, 1, 2)
    assert spec.grid["task.params.train_k"] == [2, 3] and spec.search.params["optim.lr"].loguniform == (0.001, 0.01)
    assert spec.base["optim"]["batch_size"] == 64  # the rest of the group is kept
    with pytest.raises(ValueError, match=r"claims\.0\.cell: .* picks no cell; .*--set claims=\[\]"):
        load_spec(str(ROOT / "search_spaces" / "default.yaml"), overrides=["grid.task.params.train_k=[3, 4]"])


@pytest.mark.parametrize("item, named", [
    ("resources.gpus=1", "resources.gpus: Extra inputs are not permitted"),
    ("resources.gpus_per_worker=many", "resources.gpus_per_worker: Input should be a valid number"),
    ("base.optim.steps.x=1", "--set base.optim.steps.x: base.optim.steps is 1500, not a mapping"),
    ("replicas", "--set replicas: expected KEY=VALUE"),
    ("base.optim.steps=-5", "optim.steps"),
])
def test_a_bad_set_exits_2_naming_the_field(item, named, capsys, tmp_path):
    code = run_main(["--dry-run", "--storage", str(tmp_path / "studies"), "--set", item])
    err = capsys.readouterr().err
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "studies").exists()


def test_train_takes_set_into_the_trial_config(tmp_path, capsys):
    from test_study import cli_in_process

    from study import train as train_cli

    config = str(ROOT / "search_spaces" / "trials" / "sparse_parity.yaml")
    code, _, err = cli_in_process(train_cli.main, [config, "--set", "optim.stepz=5"], capsys)
    assert code == 2 and err.strip() == "error: optim.stepz: Extra inputs are not permitted"
    out = tmp_path / "eval.csv"
    code, _, err = cli_in_process(train_cli.main, [config, "--steps", "2", "--set", "eval.lengths=[10, 30]", "--set",
                                                   "eval.ks=[1]", "--set", "eval.samples_per_point=8", "--out",
                                                   str(out)], capsys)
    assert code == 0, err[-2000:]
    table = pd.read_csv(out)
    assert sorted(table.length.unique()) == [10, 30] and set(table.k) == {1} and set(table.n) == {8}


# experiments that are ablations or surveys, not claims
NO_CLAIMS = {"coupling_full_attention", "coupling_full_attention_parity", "paper_lm_sparsity", "schemes_by_task",
             "schemes_by_task_abacus", "schemes_abacus_published"} | {p.stem for p in (ROOT / "search_spaces" / "experiments").glob("coupling_reference_*.yaml")}


def test_dry_run_prints_the_plan_of_every_shipped_spec(capsys, monkeypatch):
    """In-process (run.py's main): the plan needs no Ray, and 13 processes cost a minute of imports."""
    from study import run as run_cli

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    experiments = sorted((ROOT / "search_spaces" / "experiments").glob("*.yaml"))
    assert len(experiments) >= 20
    for spec in [*sorted((ROOT / "search_spaces").glob("*.yaml")), *experiments]:
        code = run_cli.main(["--space", str(spec), "--dry-run"])
        out, err = capsys.readouterr()
        assert code == 0, (spec.name, err)
        assert "cell 0:" in out and "per trial:" in out
        assert spec.parent.name != "experiments" or "claim " in out or spec.stem in NO_CLAIMS, spec.name
