"""The loss-gap analysis: known answers on a hand-built model, masking that really hides tokens."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from analysis.loss_gap import LossGapSpec, TargetScorer, plot_gap, run_analysis, summarize_gap
from models import DecoderLM, ModelConfig
from trial.session import FolderSession


def gap_spec(**kw) -> LossGapSpec:
    """A LossGapSpec whose sparse_k is its first k (the analysis alone reports no sparse/dense split)."""
    return LossGapSpec(**({"sparse_k": kw["ks"][0]} if "ks" in kw else {}), **kw)

VOCAB = 11


class CopyFromFar(nn.Module):
    """Predicts the token at a fixed far position p when the last query may see it (else uniform):
    one token carries the whole long-context benefit."""

    def __init__(self, p: int):
        super().__init__()
        self.p = p

    def forward(self, tokens, position_ids, visible=None, cache=None):
        B, T = tokens.shape
        logits = torch.zeros(B, T, VOCAB)
        sees = visible[:, -1, self.p] if visible is not None else torch.ones(B, dtype=torch.bool)
        logits[:, -1] = torch.where(sees[:, None], 12.0 * F.one_hot(tokens[:, self.p], VOCAB).float(), 0.0)
        return logits, None, None


def windows(n, length, p, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, VOCAB, size=(n, length + 1))
    w[:, -1] = w[:, p]  # the target copies position p
    return w


@pytest.mark.parametrize("method", ["greedy", "gain"])
def test_one_far_token_recovers_the_whole_gap(method):
    cfg = gap_spec(long_context=24, short_context=6, ks=[1, 2, 3], method=method, targets=5)
    records, timing = run_analysis(CopyFromFar(p=4), windows(5, 24, p=4), cfg)
    assert len(records) == 5 * 3 and timing["seconds"] > 0
    assert np.allclose(records.L_short, math.log(VOCAB))  # the short window knows nothing
    assert (records.L_long < 1e-3).all()
    k1 = records[records.k == 1]
    assert (k1.positions.map(tuple) == (4,)).all() and (k1.distances.map(tuple) == (20,)).all()
    assert np.allclose(records.recovered, 1.0, atol=1e-6)  # k=1 already recovers everything
    summary = summarize_gap(records, cfg.min_gap)
    assert summary.recovered_median.tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert summary.tokens_counted.tolist() == [5, 5, 5] and summary.tokens_flat.tolist() == [0, 0, 0]


def test_flat_tokens_are_counted_apart():
    # the target is position 20, inside the short window: no gap to recover
    cfg = gap_spec(long_context=24, short_context=6, ks=[1], method="gain")
    records, _ = run_analysis(CopyFromFar(p=20), windows(3, 24, p=20), cfg)
    assert records.recovered.isna().all()
    summary = summarize_gap(records, cfg.min_gap)
    assert summary.tokens_counted.tolist() == [0] and summary.tokens_flat.tolist() == [3]
    assert summary.recovered_mean.isna().all()


def test_hidden_tokens_do_not_reach_the_target_through_other_positions():
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=VOCAB, max_position=64, d_model=32, n_layers=3, n_heads=4)).eval()
    scorer = TargetScorer(model)
    w = torch.as_tensor(windows(1, 24, p=4)[0])
    short = torch.zeros(1, 24, dtype=torch.bool)
    short[0, 18:] = True
    changed = w.clone()
    changed[:18] = (changed[:18] + 3) % VOCAB  # rewrite everything hidden
    assert torch.allclose(scorer.losses(w, short), scorer.losses(changed, short), atol=1e-5)
    full = torch.ones(1, 24, dtype=torch.bool)
    assert not torch.allclose(scorer.losses(w, full), scorer.losses(changed, full), atol=1e-4)


def test_attention_method_ranks_by_the_target_querys_attention():
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=VOCAB, max_position=64, d_model=32, n_layers=2, n_heads=4))
    cfg = gap_spec(long_context=24, short_context=6, ks=[1, 4], method="attention")
    records, _ = run_analysis(model, windows(4, 24, p=4), cfg)
    scorer = TargetScorer(model)
    mass = scorer.attention_mass(torch.as_tensor(windows(4, 24, p=4)[0]))[:18]
    assert records[(records.target == 0) & (records.k == 1)].positions.iloc[0] == [int(mass.argmax())]
    assert all(len(p) == 4 for p in records[records.k == 4].positions)
    with pytest.raises(ValueError, match="method"):
        run_analysis(CopyFromFar(4), windows(1, 24, p=4), cfg)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="short_context"):
        gap_spec(long_context=16, short_context=16)
    with pytest.raises(ValueError, match="ks"):
        gap_spec(long_context=16, short_context=8, ks=[9])


def test_gap_figure_plots_each_tokens_recovery_against_its_gap(tmp_path, monkeypatch):
    """One scatter per k; point i of k's scatter is (L_short - L_long, L_short - L_sparse(k)) of
    target i: what Figure 4 of the paper plots."""
    import matplotlib.figure

    cfg = gap_spec(long_context=24, short_context=6, ks=[1, 2], method="gain")
    records, _ = run_analysis(CopyFromFar(p=4), windows(3, 24, p=4), cfg)
    saved = []
    original = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **kw: saved.append(fig) or original(fig, *a, **kw))
    assert plot_gap(records, str(tmp_path / "gap.png")) == str(tmp_path / "gap.png")
    ax = saved[0].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["k=1", "k=2"]
    for k, scatter in zip([1, 2], ax.collections):
        rows = records[records.k == k]
        expected = np.stack([rows.L_short - rows.L_long, rows.L_short - rows.L_sparse], axis=1)
        np.testing.assert_allclose(scatter.get_offsets(), expected, rtol=1e-6)


# --- trained models and the command line ---------------------------------------------------------
@pytest.fixture(scope="module")
def trained_lm(tmp_path_factory):
    """A small byte LM trained briefly on the stdlib corpus, with its checkpoint folder."""
    from trial.loop import train_loop_per_worker

    folder = tmp_path_factory.mktemp("lm") / "ckpt"
    cfg = {
        "task": {"name": "lm", "params": {"train_length": 64, "max_bytes": 1_000_000}},
        "positional": {"encoding": "rope", "ids": "sequential", "max_position": 128},
        "model": {"d_model": 48, "n_layers": 2, "n_heads": 4},
        "optim": {"lr": 0.004, "steps": 400, "batch_size": 16, "warmup_steps": 20},
        "eval": {"lengths": [64], "samples_per_point": 8, "val_samples": 32, "every_steps": 250},
        "loss_gap": {"long_context": 64, "short_context": 2, "ks": [1, 4], "targets": 48, "sparse_k": 4},
        "seed": 0,
    }
    out = train_loop_per_worker(cfg, FolderSession(folder))
    return out, folder


def test_trained_lm_losses_are_ordered(trained_lm):
    """L_short >= L_short,sparse(k) on average, and more tokens recover more. (L_sparse >= L_long
    need not hold: the gain method chooses tokens by the target's own loss, and for this briefly
    trained model the k chosen tokens beat the whole context.)"""
    from trial.loop import load_trained

    out, folder = trained_lm
    m = out["metrics"]
    noise = 0.05
    assert m["loss_gap/L_short"] > m["loss_gap/L_long"] + 0.1  # 2 bytes of context vs 64: it uses context
    assert m["loss_gap/L_short"] >= m["loss_gap/L_sparse/k1"] - noise
    assert m["loss_gap/L_sparse/k1"] >= m["loss_gap/L_sparse/k4"] - noise  # more tokens, more recovered
    assert m["loss_gap/recovered_median/k4"] > 0.5
    assert m["loss_gap/tokens_sparse"] + m["loss_gap/tokens_dense"] + m["loss_gap/tokens_flat"] <= 48
    _, task, model = load_trained(str(folder))  # the checkpoint rebuilds the same model
    cfg = gap_spec(long_context=64, short_context=2, ks=[1, 4], targets=48)
    from analysis.loss_gap import sample_windows

    records, _ = run_analysis(model, sample_windows(task.val_tokens, 48, 65, 0), cfg)
    assert records.L_long.mean() == pytest.approx(m["loss_gap/L_long"], abs=1e-4)


@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_cli_on_a_checkpoint_and_on_a_hugging_face_model(trained_lm, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import pandas as pd

    root = Path(__file__).resolve().parents[1]
    _, folder = trained_lm
    run = lambda *a: subprocess.run([sys.executable, "-m", "study.loss_gap", *a], cwd=root,  # noqa: E731
                                    capture_output=True, text=True, timeout=600)
    out = run("--checkpoint", str(folder), "--long-context", "64", "--short-context", "8", "--ks", "1,2",
              "--targets", "6", "--out", str(tmp_path / "ours"))
    assert out.returncode == 0, out.stderr
    summary = pd.read_csv(tmp_path / "ours" / "summary.csv")
    assert summary.k.tolist() == [1, 2] and (tmp_path / "ours" / "gap_scatter.png").exists()
    bad = run("--checkpoint", str(folder), "--long-context", "500")
    assert bad.returncode == 2 and "max_position" in bad.stderr

    transformers = pytest.importorskip("transformers", reason="the Hugging Face path needs `transformers`")
    cfg = transformers.LlamaConfig(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny-llama")  # random, local: no download
    for method in ("gain", "attention"):
        out = run("--hf", str(tmp_path / "tiny-llama"), "--long-context", "48", "--short-context", "8",
                  "--ks", "1,4", "--targets", "4", "--method", method, "--out", str(tmp_path / method))
        assert out.returncode == 0, out.stderr
        tokens = pd.read_csv(tmp_path / method / "tokens.csv")
        assert len(tokens) == 8 and (tokens.L_long > 0).all()

    # the sparsity meter on the same models: text, so tokens are hidden (no value classes)
    meter = lambda *a: subprocess.run([sys.executable, "-m", "study.sparsity", *a], cwd=root,  # noqa: E731
                                      capture_output=True, text=True, timeout=600)
    for source, name in (("--checkpoint", str(folder)), ("--hf", str(tmp_path / "tiny-llama"))):
        out = meter(source, name, "--long-context", "48", "--short-context", "8", "--k-max", "4",
                    "--targets", "4", "--out", str(tmp_path / f"meter{source}"))
        assert out.returncode == 0, out.stderr
        assert "ablation=hide" in out.stdout and "per 1000 targets" in out.stdout
        table = pd.read_csv(tmp_path / f"meter{source}" / "targets.csv")
        assert len(table) == 4 and set(table.kind) == {"text"} and "planted" not in table
    bad = meter("--hf", str(tmp_path / "tiny-llama"), "--ablation", "resample")
    assert bad.returncode == 2 and "--ablation" in bad.stderr


def test_cli_on_a_recorded_trial_run_writes_its_measurement_back(trained_lm, tmp_path):
    """--mlflow-run: the model is the run's `checkpoint` tag, and the summary's metrics, the method's
    tag and the files go back to that run (a real MLflow, SQLite)."""
    from mlflow.tracking import MlflowClient

    from study.loss_gap import main

    _, folder = trained_lm
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("study"), tags={"checkpoint": str(folder)}).info.run_id
    assert main(["--mlflow-run", run_id, "--mlflow-uri", uri, "--long-context", "64", "--short-context", "8",
                 "--ks", "1,2", "--targets", "6", "--out", str(tmp_path / "out")]) == 0
    run = client.get_run(run_id)
    assert {f"loss_gap/recovered_{how}/k{k}" for how in ("median", "mean") for k in (1, 2)} == set(run.data.metrics)
    assert run.data.tags["loss_gap.method"] == "gain"
    assert {"loss_gap/summary.csv", "loss_gap/tokens.csv", "loss_gap/gap_scatter.png"} <= {
        f.path for f in client.list_artifacts(run_id, "loss_gap")}
