"""The training loop with real DeepSpeed engines (gloo on CPU), its config and evaluation."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from trial.config import TrialConfig
from trial.host import kernels
from trial.loop import train_loop_per_worker
from trial.metrics import is_timing
from trial.yaml_io import describe_errors

ROOT = Path(__file__).resolve().parents[1]


def config(**overrides) -> dict:
    base = {
        "task": {"name": "sparse_parity", "params": {"train_length": 12, "min_length": 2, "train_k": 2}},
        "positional": {"encoding": "learned", "ids": "random_shift", "max_position": 32},
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 4},
        "optim": {"lr": 3e-3, "steps": 8, "batch_size": 16, "warmup_steps": 2},
        "eval": {"lengths": [8, 16], "ks": [1, 2], "samples_per_point": 16, "val_samples": 32, "every_steps": 4},
        "seed": 3,
    }
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return base


class Recorder:
    checkpointing = False

    def __init__(self):
        self.reports = []

    def report(self, metrics, checkpoint_dir=None):
        self.reports.append(metrics)

    from contextlib import nullcontext

    def restore_dir(self):
        return self.nullcontext()


def test_zero_stages_take_the_same_steps():
    """ZeRO partitions optimizer state, gradients and parameters but must not change the math."""
    losses = {}
    for stage in (0, 1, 2, 3):
        rec = Recorder()
        out = train_loop_per_worker(config(deepspeed={"zero_stage": stage}), rec)
        losses[stage] = [r["val_loss"] for r in rec.reports]
        assert out["metrics"]["step"] == 8 and len(out["records"]) == 4
    for stage in (1, 2, 3):
        assert losses[stage] == pytest.approx(losses[0], rel=1e-4), f"ZeRO-{stage} diverged from ZeRO-0"
    assert losses[0][-1] < losses[0][0]  # the steps did train


def test_bf16_step_runs_and_trains():
    rec = Recorder()
    train_loop_per_worker(config(deepspeed={"zero_stage": 2, "bf16": True}, optim={"steps": 12}), rec)
    assert rec.reports[-1]["val_loss"] < rec.reports[0]["val_loss"]


def test_bf16_mixed_runs_the_engines_matmuls_in_bf16_and_keeps_fp32_weights():
    """`bf16: mixed` is torch.autocast around the engine's forwards: their Linear layers compute in bf16
    from fp32 weights, the evaluation points (the module called directly) stay fp32, and it trains."""
    seen = []

    def linear_dtypes(module, args, output):
        if isinstance(module, torch.nn.Linear):
            seen.append((output.dtype, module.weight.dtype, torch.is_autocast_enabled("cpu")))

    with torch.nn.modules.module.register_module_forward_hook(linear_dtypes):
        rec = Recorder()
        out = train_loop_per_worker(config(deepspeed={"bf16": "mixed"}, optim={"steps": 12}), rec)
    assert rec.reports[-1]["val_loss"] < rec.reports[0]["val_loss"]
    assert {w for _, w, _ in seen} == {torch.float32}  # the weights are never cast
    assert {o for o, _, on in seen if on} == {torch.bfloat16} and {o for o, _, on in seen if not on} == {torch.float32}
    assert seen[-1][2] is False  # the last forwards are the evaluation points', in fp32
    fp32 = train_loop_per_worker(config(optim={"steps": 12}))
    assert out["metrics"]["val_loss"] != fp32["metrics"]["val_loss"]
    assert out["metrics"]["val_loss"] == pytest.approx(fp32["metrics"]["val_loss"], rel=0.05)


def test_same_config_and_seed_same_metrics():
    a = train_loop_per_worker(config())
    b = train_loop_per_worker(config())
    c = train_loop_per_worker(config(seed=4))
    strip = lambda m: {k: v for k, v in m.items() if not is_timing(k)}  # noqa: E731
    assert strip(a["metrics"]) == strip(b["metrics"]) and a["records"] == b["records"]
    assert a["metrics"]["val_loss"] != c["metrics"]["val_loss"]
    assert a["metrics"]["host/kernels"] == kernels(torch.device("cpu"))


def test_the_kernel_path_is_the_one_pytorch_dispatches_to():
    """One seed gives the same metrics on one kernel path, another draw on another (docs/trial.md):
    the record names the path PyTorch took, which ATEN_CPU_CAPABILITY forces to another here."""
    here = kernels(torch.device("cpu"))
    assert here.startswith(f"cpu {torch.backends.cpu.get_cpu_capability()} ") and torch.__version__ in here
    forced = subprocess.run([sys.executable, "-c", "import torch; from trial.host import kernels; "
                             "print(kernels(torch.device('cpu')))"], env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert forced.stdout.startswith("cpu DEFAULT "), forced.stdout + forced.stderr[-2000:]


def test_data_workers_make_the_same_batches_as_the_training_process():
    """Batches made ahead in worker processes are the ones the loop would make itself, in order: the
    same steps, to the bit (an Abacus trial too, whose batches carry digit places)."""
    for cfg in (config(optim={"steps": 6}), config(
            task={"name": "addition", "params": {"train_length": 4, "operand_order": "lsb_first"}},
            positional={"encoding": "nope", "ids": "sequential", "abacus": True, "max_position": 32},
            eval={"lengths": [4, 6], "ks": None}, optim={"steps": 6})):
        inline = train_loop_per_worker(cfg)
        ahead = train_loop_per_worker({**cfg, "deepspeed": {"data_workers": 2}})
        strip = lambda m: {k: v for k, v in m.items() if not is_timing(k)}  # noqa: E731
        assert strip(ahead["metrics"]) == strip(inline["metrics"]) and ahead["records"] == inline["records"]


def test_a_fixed_training_set_gives_every_step_and_rank_the_same_samples():
    """`task.train_set_size`: the samples of every step come from one set drawn from the data seed
    (on every rank); the ids are still drawn per step (random shift); without it, fresh samples."""
    from tasks import get_task
    from trial.batches import StepBatches

    task = get_task("addition", train_length=5, bos=True, operands="independent")
    cfg = TrialConfig.model_validate(config(task={"name": "addition", "params": {"train_length": 5}},
                                            positional={"encoding": "learned", "ids": "coupled", "max_position": 32},
                                            eval={"lengths": [5, 8], "ks": None}))

    def samples(rank, size, seed=3):
        out, ids = set(), set()
        steps = StepBatches(task, cfg.positional.scheme, 16, seed, rank, 1, 40, size)
        for item in map(steps.__getitem__, range(len(steps))):
            for row, row_ids in zip(item["tokens"].tolist(), item["ids"].tolist()):
                out.add(tuple(t for t in row if t))
                ids.add(tuple(row_ids))
        return out, ids

    fixed, fixed_ids = samples(0, 7)
    assert len(fixed) == 7 and samples(1, 7)[0] == fixed  # 640 draws, 7 distinct samples, any rank
    assert len(fixed_ids) > 7  # the coupled ids' random start is drawn per step, not with the set
    assert samples(0, 7, seed=4)[0] != fixed
    assert len(samples(0, None)[0]) > 600
    out = train_loop_per_worker(config(task={"name": "addition", "params": {"train_length": 4}, "train_set_size": 50},
                                       positional={"encoding": "learned", "ids": "coupled", "max_position": 32},
                                       eval={"lengths": [4, 6], "ks": None}))
    assert out["metrics"]["step"] == 8


def test_ppc_reports_predicted_and_oracle_ids():
    cfg = config(
        task={"name": "parity_scratchpad"},
        positional={"encoding": "learned", "ids": "predicted", "max_position": 32},
    )
    out = train_loop_per_worker(cfg)
    modes = {(r["length"], r["k"]): [] for r in out["records"]}
    for r in out["records"]:
        modes[(r["length"], r["k"])].append(r["ids"])
        assert 0.0 <= r["answer_acc"] <= 1.0 and r["n"] == 16
    assert all(sorted(m) == ["coupled", "predicted"] for m in modes.values())
    assert all("id_match" in r for r in out["records"] if r["ids"] == "predicted")


@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_small_model_learns_sparse_parity():
    """k <= 2 planted bits: at least 95% in-distribution, from the shipped example config."""
    cfg = TrialConfig.model_validate(
        __import__("yaml").safe_load((ROOT / "search_spaces/trials/sparse_parity.yaml").read_text())
    )
    out = train_loop_per_worker(cfg)
    assert out["metrics"]["val_exact"] >= 0.95
    assert out["metrics"]["acc_in_dist"] >= 0.95
    inside = [r for r in out["records"] if r["in_distribution"]]
    assert inside and all(r["answer_acc"] >= 0.9 for r in inside)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"eval": {"ks": [1, 20]}}, "eval.ks"),
        ({"eval": {"lengths": [8, 40]}}, "eval.lengths"),
        ({"positional": {"encoding": "sinusoid"}}, "positional.encoding"),
        ({"positional": {"ids": "magic"}}, "positional.ids"),
        ({"positional": {"ids": "coupled", "position_target": "pointer"}}, "positional.position_target"),
        ({"task": {"name": "sorting"}}, "task.name"),
        ({"task": {"params": {"train_length": 2, "train_k": 3}}}, "task.params.train_k"),
        ({"task": {"params": {"train_length": 40}}}, "task.params.train_length"),
        ({"model": {"d_model": 30}}, "model.n_heads"),
        ({"optim": {"lr": -1}}, "optim.lr"),
        ({"model": {"output": "encoder"}, "positional": {"ids": "predicted"}}, "model.output"),
        ({"model": {"output": "decoder"}}, "model.output"),
    ],
)
def test_bad_configs_name_the_field(change, field):
    with pytest.raises(ValidationError) as err:
        TrialConfig.model_validate(config(**change))
    text = describe_errors(err.value)
    assert any(line.startswith(field + ":") for line in text.splitlines()), text


def test_cli_prints_the_evaluation_table(tmp_path, capsys):
    """`python -m study.train`'s main in this process (the interpreter's start is not what it tests)."""
    import yaml
    from test_study import cli_in_process

    from study import train as train_cli

    path = tmp_path / "trial.yaml"
    path.write_text(yaml.safe_dump(config()))
    code, out, err = cli_in_process(train_cli.main, [str(path), "--out", str(tmp_path / "eval.csv")], capsys)
    assert code == 0, err
    assert "answer_acc" in out and "exact_match" in out
    import pandas as pd

    table = pd.read_csv(tmp_path / "eval.csv")
    assert sorted(set(zip(table.length, table.k))) == [(8, 1), (8, 2), (16, 1), (16, 2)]

    path.write_text(yaml.safe_dump(config(eval={"ks": [1, 20]})))
    code, _, err = cli_in_process(train_cli.main, [str(path)], capsys)
    assert code == 2 and "eval.ks" in err


class Interrupted(Exception):
    pass


class FolderSession:
    """Keeps the latest DeepSpeed checkpoint in a folder; can die after N reports (a crash)."""

    checkpointing = True

    def __init__(self, folder, die_after=None, restore=False):
        self.folder, self.die_after, self.restore = folder, die_after, restore
        self.reports = []

    def report(self, metrics, checkpoint_dir=None):
        import shutil

        self.reports.append(metrics)
        shutil.copytree(checkpoint_dir, self.folder, dirs_exist_ok=True)
        if self.die_after and len(self.reports) >= self.die_after:
            raise Interrupted

    from contextlib import contextmanager

    @contextmanager
    def restore_dir(self):
        yield str(self.folder) if self.restore else None


@pytest.mark.parametrize("stage", [0, 2])
def test_resuming_from_a_checkpoint_reproduces_the_uninterrupted_run(tmp_path, stage):
    cfg = config(optim={"steps": 12}, eval={"every_steps": 4}, deepspeed={"zero_stage": stage})
    whole = train_loop_per_worker(cfg, FolderSession(tmp_path / "whole"))
    with pytest.raises(Interrupted):
        train_loop_per_worker(cfg, FolderSession(tmp_path / "crash", die_after=1))  # dies at step 4
    resumed_session = FolderSession(tmp_path / "crash", restore=True)
    resumed = train_loop_per_worker(cfg, resumed_session)
    assert [r["step"] for r in resumed_session.reports] == [8, 12]  # it did not start over
    drop = lambda m: {k: v for k, v in m.items() if not is_timing(k)}  # noqa: E731
    assert drop(resumed["metrics"]) == drop(whole["metrics"])
    assert resumed["records"] == whole["records"]


@pytest.mark.parametrize("task", ["copy", "addition"])
def test_tasks_without_k_train_and_evaluate(task):
    cfg = config(task={"name": task, "params": {"train_length": 4, "min_length": 1}},
                 positional={"encoding": "learned", "ids": "coupled", "max_position": 32},
                 eval={"lengths": [4, 6], "ks": None})
    out = train_loop_per_worker(cfg)
    assert [(r["length"], r["k"], r["ids"]) for r in out["records"]] == [(4, None, "coupled"), (6, None, "coupled")]
    assert [r["in_distribution"] for r in out["records"]] == [True, False]


def test_an_encoder_reads_the_prompt_and_placeholders_never_the_answer_nor_the_end_token():
    """An encoder's input holds a placeholder where each target was, and its keys are the prompt
    and the answer's placeholders: the answer, the `<eos>` after it and padding change nothing."""
    import numpy as np
    import torch

    from models import DecoderLM, ModelConfig
    from tasks import PAD_ID, get_task
    from trial.evaluate import Tensors

    task = get_task("reverse", train_length=6, min_length=2)
    batch = task.sample(8, np.random.default_rng(0))
    assert len(set(batch.seq_len.tolist())) > 1  # some rows are padded
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=len(task.vocab), max_position=32, d_model=32, output="encoder")).eval()
    x = Tensors.from_batch(batch, batch.position_ids, torch.device("cpu"))
    inputs = x.inputs(encoder=True)
    assert (inputs["tokens"][x.loss_mask] == PAD_ID).all() and (inputs["tokens"][~x.loss_mask] == x.tokens[~x.loss_mask]).all()
    logits = model(**inputs)[0]
    hidden = ~(x.answer_mask | (x.tokens != PAD_ID) & ~x.loss_mask)  # `<eos>` and padding
    assert hidden.any()
    other = Tensors(x.tokens.masked_fill(x.loss_mask, 2), x.ids.masked_fill(hidden, 5), x.loss_mask, x.answer_mask)
    again = model(**other.inputs(encoder=True))[0]
    assert torch.allclose(logits[~hidden], again[~hidden], atol=1e-6)
    target, mask = x.targets(encoder=True)
    assert torch.equal(mask, x.answer_mask) and torch.equal(target, x.tokens)
    # the keys the mask leaves are what an encoder reads: unmasked, a changed hidden id is seen
    seen = model(**{**other.inputs(encoder=True), "visible": None})[0]
    assert not torch.allclose(logits[~hidden], seen[~hidden], atol=1e-4)


def test_an_encoder_learns_reversal_and_is_scored_on_the_answer_alone():
    """The loop trains an encoder on its placeholders and evaluates it in one pass: it fits short
    reversals, and its exact match is its answer accuracy (there is no end token to get right)."""
    cfg = config(task={"name": "reverse", "params": {"train_length": 4, "min_length": 2}},
                 positional={"encoding": "learned", "ids": "sequential", "max_position": 32},
                 model={"d_model": 64, "output": "encoder"},
                 optim={"lr": 1e-3, "steps": 400, "batch_size": 64, "warmup_steps": 20},
                 eval={"lengths": [4, 8], "ks": None, "samples_per_point": 128, "every_steps": 400})
    out = train_loop_per_worker(cfg)
    assert out["metrics"]["val_exact"] >= 0.95
    inside, beyond = out["records"]
    assert inside["exact_match"] >= 0.95 and inside["ids"] == "sequential"
    assert all(r["exact_match"] == r["answer_acc"] for r in out["records"])
    assert beyond["exact_match"] <= beyond["answer_token_acc"] < 1


def test_language_model_is_evaluated_by_loss_per_length():
    cfg = config(task={"name": "lm", "params": {"train_length": 32, "max_bytes": 200_000}},
                 positional={"encoding": "rope", "ids": "pose", "max_position": 64},
                 eval={"lengths": [16, 64], "ks": None, "samples_per_point": 8, "val_samples": 16},
                 optim={"steps": 8, "batch_size": 8})
    out = train_loop_per_worker(cfg)
    short, long = out["records"]
    assert short["length"] == 16 and math.isnan(short["loss_beyond_train"])  # no position past 32
    assert long["length"] == 64 and 0 < long["loss_beyond_train"] < 10
    assert 0 < out["metrics"]["loss_in_dist"] < math.log(258) + 1  # near or below uniform over bytes
    assert out["metrics"]["val_loss"] > 0


def test_a_run_restored_after_its_last_report_resends_it_without_work(tmp_path):
    cfg = config(optim={"steps": 8}, eval={"every_steps": 4})
    first = FolderSession(tmp_path / "ckpt")
    done = train_loop_per_worker(cfg, first)
    again = FolderSession(tmp_path / "ckpt", restore=True)
    resent = train_loop_per_worker(cfg, again)
    assert len(again.reports) == 1 and again.reports[0] == first.reports[-1]
    assert resent["records"] == done["records"]


@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_a_compiled_train_step_takes_the_same_steps_as_eager():
    """`deepspeed.compile: true` compiles the forward of the train step (DeepSpeed's engine.compile);
    validation and the evaluation points run eagerly. The compiled run trains the same model: the same
    validation losses (to float tolerance: inductor fuses and reorders) and the same grid. `auto`
    (the default) leaves CPU eager, where compiling does not pay (benchmarks P1)."""
    from trial.config import DeepSpeedSpec

    assert not DeepSpeedSpec().compiles("cpu") and DeepSpeedSpec().compiles("cuda")
    assert not DeepSpeedSpec(compile=False).compiles("cuda") and DeepSpeedSpec(compile=True).compiles("cpu")
    runs = {}
    for compiled in (False, True):
        rec = Recorder()
        out = train_loop_per_worker(config(deepspeed={"compile": compiled}), rec)
        runs[compiled] = ([r["val_loss"] for r in rec.reports], out, rec.reports[0]["startup/first_step_s"])
    (eager_losses, eager, eager_first), (compiled_losses, compiled, compiled_first) = runs[False], runs[True]
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-3)
    cells = lambda out: [r["answer_acc"] for r in out["records"]]  # noqa: E731
    assert cells(compiled) == pytest.approx(cells(eager), abs=0.07)  # a rare near-tie may flip
    # the graphs are built in the first step: seconds, where an eager step of this model takes ms
    assert compiled_first > eager_first + 1.0, (compiled_first, eager_first)
    # the reference's T5-style model compiles too, twice in one process (a warm trial process): the
    # training forward returns no views of its activations (a KV cache), which torch's compiled graph
    # once replayed with garbage shapes ("invalid shape dimension")
    t5 = {"d_model": 32, "n_layers": 1, "n_heads": 2, "head_dim": 16, "init": "t5", "norm": "rms",
          "ffn": "gated_gelu", "tie_embeddings": True}
    losses = []
    for _ in range(2):
        rec = Recorder()
        train_loop_per_worker(config(model=t5, deepspeed={"compile": True}), rec)
        losses.append([r["val_loss"] for r in rec.reports])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_the_model_is_built_from_every_architecture_field_of_the_trial_config():
    """models/decoder.py's ModelConfig declares the model's fields once; the trial config's `model`
    and `positional` groups fill it by name. A field the model gains but the trial config never
    sets, or a trial-config option that never reaches the model, fails here."""
    import dataclasses

    from models import ModelConfig
    from trial.config import MODEL_FIELD_NAMES

    cfg = TrialConfig.model_validate(config(
        task={"name": "addition", "params": {"train_length": 8}},
        model={"d_model": 48, "n_layers": 3, "n_heads": 3, "d_ff": 40, "dropout": 0.1, "embed_init_std": 0.5,
               "norm": "rms", "attn_scale": "none", "head_dim": 8, "init": "t5", "norm_position": "pre_post",
               "ffn": "gated_gelu", "tie_embeddings": True, "loops": "per_length", "loop_factor": 0.5, "loop_offset": 1},
        positional={"encoding": "learned", "ids": "predicted", "max_position": 40, "position_target": "delta",
                    "id_window": 3, "id_window_heads": 2, "init_std": 1.0, "frozen": True, "abacus": True,
                    "abacus_max_offset": 20, "abacus_offset": "sample", "abacus_norm": True, "abacus_init_std": 0.1},
        eval={"lengths": [8, 16], "ks": None}))
    arch = cfg.architecture(vocab_size=7)
    expected = {"vocab_size": 7, "position_head": True, "d_model": 48, "n_layers": 3, "n_heads": 3, "d_ff": 40,
                "dropout": 0.1, "tok_init_std": 0.5, "norm": "rms", "attn_scale": "none", "encoding": "learned",
                "max_position": 40, "position_target": "delta", "id_window": 3, "id_window_heads": 2,
                "pos_init_std": 1.0, "pos_frozen": True, "head_dim": 8, "init": "t5", "norm_position": "pre_post",
                "ffn": "gated_gelu", "tie_embeddings": True, "abacus": True, "abacus_max_offset": 20,
                "abacus_offset": "sample", "abacus_norm": True, "abacus_init_std": 0.1, "loops": "per_length",
                "loop_factor": 0.5, "loop_offset": 1}
    assert {k: getattr(arch, k) for k in expected} == expected
    defaults = ModelConfig(vocab_size=7)
    # an encoder has no position head, so its field is set in a config of its own
    encoder = TrialConfig.model_validate(config(model={"output": "encoder"}))
    assert encoder.architecture(vocab_size=7).output == "encoder" != ModelConfig(vocab_size=7).output
    # T5's buckets need T5's bias, so they are set in a config of their own too
    t5 = TrialConfig.model_validate(config(positional={"encoding": "t5_bias", "t5_buckets": "two_sided"}))
    assert t5.architecture(vocab_size=7).t5_buckets == "two_sided" != ModelConfig(vocab_size=7).t5_buckets
    # every field of the model is set from the trial config, but rope_base (not a trial option)
    assert {f.name for f in dataclasses.fields(ModelConfig)} - set(expected) == {"rope_base", "output", "t5_buckets"}
    assert all(getattr(defaults, k) != v for k, v in expected.items() if k not in ("encoding", "vocab_size"))  # the values moved
    assert set(MODEL_FIELD_NAMES.values()) <= set(expected)
    # the parameter bound counts exactly what is built (on the meta device, layer by layer)
    assert cfg.n_parameters() == sum(p.numel() for p in cfg.build_model(len(cfg.task_instance.vocab)).parameters())


def test_checking_every_shipped_spec_counts_each_cells_parameters_exactly_without_importing_dynamo():
    """A spec's check counts each config's parameters on the meta device with the initialisation
    skipped: the count of the model as built there, and no torch._dynamo import (a second of CPU
    in every process that checks a spec; torch imports it for some inits of meta tensors)."""
    code = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
import torch
from study.spec.schema import load_spec
specs = [load_spec(str(p)) for p in sorted(Path({str(ROOT)!r}, "search_spaces").glob("**/*.yaml")) if "trials" not in p.parts and "device" not in p.parts]
print("dynamo imported:", "torch._dynamo" in sys.modules)
for spec in specs:
    for cell in spec.cells():
        cfg = spec.checked_config(cell)
        with torch.device("meta"):
            built = sum(p.numel() for p in cfg.build_model(len(cfg.task_instance.vocab)).parameters())
        assert cfg.n_parameters() == built, (spec.name, cell.factors, cfg.n_parameters(), built)
print("counted")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "counted" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert "dynamo imported: False" in out.stdout, out.stdout


def test_the_trial_configs_defaults_are_the_models():
    """A model option left out of a trial config gets ModelConfig's default, not a second one."""
    from models import ModelConfig
    from trial.config import ModelSpec, PositionalSpec

    defaults = ModelConfig(vocab_size=7)
    cfg = TrialConfig.model_validate({"task": config()["task"], "eval": {"lengths": [8]}})
    arch = cfg.architecture(vocab_size=7)
    assert {k: v for k, v in vars(arch).items() if k != "position_head"} == \
        {k: v for k, v in vars(defaults).items() if k != "position_head"}
    assert ModelSpec().d_model == defaults.d_model and PositionalSpec().max_position == defaults.max_position


def test_answer_token_acc_counts_answer_tokens_and_exact_match_whole_outputs(monkeypatch):
    """Generations right but for one answer token each: answer-token accuracy 1 - 1/(answer tokens
    of a sample), while no sample is exact or has its answer right (Ruoss et al. score the former)."""
    import numpy as np
    import torch

    from models.positions import PositionalScheme
    from tasks import get_task
    from trial import evaluate

    task = get_task("reverse", train_length=6, min_length=2)
    scheme = PositionalScheme("learned", "sequential", 32)
    truth = {}

    def one_token_wrong(module, prompt, prompt_ids, new, ids, oracle_ids=None, digit_places=None):
        target = truth["tokens"][:, prompt.shape[1]:].clone()
        first_answer = truth["answer"][:, prompt.shape[1]:].float().argmax(1)
        target[torch.arange(len(target)), first_answer] = (target[torch.arange(len(target)), first_answer] + 1) % 3
        return target, prompt_ids.new_zeros(target.shape)

    real_from_batch = evaluate.Tensors.from_batch

    def keep(batch, ids, device):
        x = real_from_batch(batch, ids, device)
        truth["tokens"], truth["answer"] = x.tokens, x.answer_mask
        return x

    monkeypatch.setattr(evaluate, "generate", one_token_wrong)
    monkeypatch.setattr(evaluate.Tensors, "from_batch", staticmethod(keep))
    from models import ModelConfig

    autoregressive = torch.nn.Module()
    autoregressive.cfg = ModelConfig(vocab_size=len(task.vocab))
    [rec] = evaluate.evaluate_point(autoregressive, task, scheme, 6, None, 8, 8, np.random.default_rng(0), "cpu")
    answer_tokens = truth["answer"].sum(1)
    assert (answer_tokens == answer_tokens[0]).all() and answer_tokens[0] > 1
    assert rec["exact_match"] == 0 and rec["answer_acc"] == 0
    assert rec["answer_token_acc"] == pytest.approx(1 - 1 / int(answer_tokens[0]))


def test_a_renamed_field_is_still_read_by_its_old_name_with_one_notice(capsys, tmp_path):
    """eval.samples_per_cell is eval.samples_per_point now: a spec written with the old name still
    runs, with a one-line notice (once a process); both names at once is refused, naming the field."""
    from study import run as run_cli
    from trial import yaml_io

    yaml_io.NOTICED.clear()
    old = config(eval={"samples_per_cell": 5})
    del old["eval"]["samples_per_point"]
    assert TrialConfig.model_validate(old).eval.samples_per_point == 5
    assert TrialConfig.model_validate(old).model_dump()["eval"]["samples_per_point"] == 5
    assert capsys.readouterr().err == ("notice: eval.samples_per_cell is now eval.samples_per_point "
                                       "(the old name still works)\n")
    with pytest.raises(ValidationError) as err:
        TrialConfig.model_validate(config(eval={"samples_per_cell": 5}))
    assert describe_errors(err.value).startswith("eval.samples_per_cell: the old name of samples_per_point")
    yaml_io.NOTICED.clear()
    spec = tmp_path / "old.yaml"  # a spec written before the rename
    spec.write_text((ROOT / "search_spaces" / "smoke.yaml").read_text().replace("samples_per_point", "samples_per_cell"))
    code = run_cli.main(["--space", str(spec), "--storage", str(tmp_path / "storage"), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 0 and err.count("notice: eval.samples_per_cell is now") == 1, err
