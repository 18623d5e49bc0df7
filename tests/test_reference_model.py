"""The reference implementation's model and protocol as trial options: T5's init, a free
head dim, norms after the residual add, the gated FFN, a tied readout, a data seed apart from the
model seed, extrapolation tracked while training, and the checkpoint selected on longer lengths."""

import math

import pytest
import torch

from models import DecoderLM, ModelConfig
from tests.test_train import Recorder, config
from trial.config import TrialConfig
from trial.loop import train_loop_per_worker

REFERENCE = dict(init="t5", head_dim=64, attn_scale="none", norm="rms", norm_position="pre_post",
                 ffn="gated_gelu", tie_embeddings=True, tok_init_std=1.0, pos_init_std=1.0)


def first_logits(model: DecoderLM, scale: bool) -> torch.Tensor:
    tokens, ids = torch.randint(0, 13, (8, 24)), torch.arange(24)[None].expand(8, 24)
    attn = model.blocks[0].attn
    x = model.blocks[0].ln1(model.tok_emb(tokens) + model.pos_emb(ids))
    q, k, _ = attn.qkv(x).view(8, 24, 3, attn.n_heads, attn.d_head).permute(2, 0, 3, 1, 4)
    return (q @ k.transpose(-1, -2)) / (math.sqrt(attn.d_head) if scale else 1.0)


def test_t5_init_starts_attention_logits_near_unit_std_and_has_no_biases():
    """docs/coupling.md's T5-model ablation rests on this: T5's init gives logits of std ~1, ours ~0.05."""
    torch.manual_seed(0)
    ours = DecoderLM(ModelConfig(vocab_size=13, d_model=128, n_heads=2, head_dim=64, tok_init_std=1.0,
                                 pos_init_std=1.0))
    t5 = DecoderLM(ModelConfig(vocab_size=13, d_model=128, n_heads=2, **{**REFERENCE, "tie_embeddings": False}))
    assert first_logits(ours, scale=True).std() < 0.1
    assert 0.7 < first_logits(t5, scale=False).std() < 1.4
    assert not [n for n, _ in t5.named_parameters() if n.endswith("bias") and not n.startswith("pos_head")]
    assert [n for n, _ in ours.named_parameters() if n.endswith("bias")]


def test_head_dim_is_free_of_d_model_and_heads():
    model = DecoderLM(ModelConfig(vocab_size=13, d_model=48, n_heads=2, head_dim=96, encoding="rope"))
    assert model.blocks[0].attn.qkv.weight.shape == (3 * 2 * 96, 48)
    assert model.blocks[0].attn.proj.weight.shape == (48, 2 * 96)
    logits, _, _ = model(torch.randint(0, 13, (2, 9)), torch.arange(9)[None].expand(2, 9))
    assert logits.shape == (2, 9, 13)
    # 48 / 5 heads is refused without a head dim, accepted with one
    with pytest.raises(ValueError, match="n_heads: 5 does not divide"):
        TrialConfig.model_validate(config(model={"d_model": 48, "n_heads": 5}))
    TrialConfig.model_validate(config(model={"d_model": 48, "n_heads": 5, "head_dim": 16}))


def test_pre_post_norm_keeps_the_residual_stream_at_unit_rms():
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=13, d_model=64, n_heads=2, n_layers=3, **REFERENCE))
    seen = []
    model.blocks[1].register_forward_hook(lambda m, a, out: seen.append(out[0]))
    model(torch.randint(0, 13, (4, 16)), torch.arange(16)[None].expand(4, 16))
    rms = seen[0].pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-3)


def test_tied_readout_shares_the_token_table_and_gated_ffn_gates():
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=13, d_model=64, n_heads=2, **REFERENCE))
    assert model.lm_head.weight is model.tok_emb.weight
    ffn = model.blocks[0].mlp
    x = torch.randn(3, 64)
    gate, up = ffn.gate_and_up(x).chunk(2, -1)
    assert torch.allclose(ffn(x), ffn.out(torch.nn.functional.gelu(gate, approximate="tanh") * up))
    with torch.no_grad():  # a zero gate closes the FFN whatever the other half says
        ffn.gate_and_up.weight[: ffn.out.in_features].zero_()
    assert ffn(x).abs().max() == 0


def test_default_model_draws_the_same_weights_as_before():
    """The new fields off: the same parameters, by name (old checkpoints load)."""
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=13, d_model=32, n_heads=4))
    names = [n for n, _ in model.named_parameters()]
    assert names[:6] == ["tok_emb.weight", "pos_emb.weight", "blocks.0.ln1.weight", "blocks.0.ln1.bias",
                         "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias"]
    assert "blocks.0.mlp.0.weight" in names and "blocks.0.mlp.2.weight" in names
    # the weights themselves: the smoke study's results.csv test (tests/test_records.py)


def test_data_seed_changes_the_data_and_not_the_init():
    runs = {}
    for data_seed in (None, 3, 4):
        rec = Recorder()
        overrides = {} if data_seed is None else {"data_seed": data_seed}
        train_loop_per_worker(config(optim={"steps": 4}, eval={"every_steps": 2}, **overrides), rec)
        runs[data_seed] = [r["val_loss"] for r in rec.reports]
    assert runs[None] == runs[3]  # data_seed 3 = the model seed 3 of config(): the same run
    assert runs[4] != runs[3]


def test_best_is_the_step_with_the_lowest_selection_loss_and_both_are_scored():
    rec = Recorder()
    cfg = config(optim={"steps": 12, "lr": 3e-2}, eval={"every_steps": 2, "select": {"lengths": [14, 16],
                 "samples": 24}, "track": [16], "track_samples": 16})
    out = train_loop_per_worker(cfg, rec)
    series = {r["step"]: r["select/loss"] for r in rec.reports}
    assert len(series) == 6 and all(f"track/len16/{m}" in rec.reports[0] for m in ("exact", "loss", "margin"))
    best_step = min(series, key=lambda s: (series[s], s))
    metrics = out["metrics"]
    assert metrics["best/step"] == best_step and metrics["best/select_loss"] == pytest.approx(series[best_step])
    checkpoints = [r["checkpoint"] for r in out["records"]]
    assert checkpoints.count("last") == checkpoints.count("best") == 4
    assert "best/exact_beyond" in metrics and "exact_beyond" in metrics


def test_selection_is_validated_before_training():
    with pytest.raises(ValueError, match="eval.select.lengths"):
        TrialConfig.model_validate(config(eval={"select": {"lengths": [40]}}))  # ids beyond max_position 32
    with pytest.raises(ValueError, match="eval.select: .*zero_stage"):
        TrialConfig.model_validate(config(eval={"select": {"lengths": [16]}}, deepspeed={"zero_stage": 3}))
    with pytest.raises(ValueError, match="eval.track"):
        TrialConfig.model_validate(config(eval={"track": [40]}))


def test_best_records_get_their_own_mlflow_keys_and_summary_rows():
    import pandas as pd

    from study.record.mlflow.trial_runs import extrapolation_metrics
    from study.results.tables import summarize_seeds
    from study.spec.schema import StudySpec

    records = [{"length": n, "k": None, "ids": "coupled", "answer_acc": acc, "exact_match": acc,
                "answer_token_acc": (1 + acc) / 2, "in_distribution": n == 8, "checkpoint": checkpoint}
               for checkpoint, acc in (("last", 0.25), ("best", 1.0)) for n in (8, 16)]
    keys = {m.key: m.value for m in extrapolation_metrics(records, now=0) if m.step == 16 or "at_len" in m.key}
    assert keys["exact_len/kall"] == 0.25 and keys["best/exact_len/kall"] == 1.0
    assert keys["token_acc_len/kall"] == 0.625 and keys["best/token_acc_len/kall"] == 1.0
    assert keys["acc_at_len16/kall"] == 0.25 and keys["best/acc_at_len16/kall"] == 1.0

    spec = StudySpec.model_validate({"name": "s", "task": {"name": "addition", "params": {"train_length": 8}},
                                     "base": {"eval": {"lengths": [8, 16]}, "positional": {"max_position": 64}},
                                     "search": "none", "replicas": 2, "scheduler": {"type": "none"}})
    cell = spec.cells()[0].label
    results = pd.DataFrame([{**r, "trial_id": f"t{seed}", "cell": cell, "seed": seed, "status": "TERMINATED",
                             "role": "search", "exact_match": r["exact_match"] if seed == 0 else 0.9}
                            for seed in (0, 1) for r in records])
    selected = pd.DataFrame([{"cell": cell, "trial_id": "t0"}])
    summary = summarize_seeds(spec, results, selected).set_index(["length", "checkpoint"])
    assert summary.loc[(16, "best"), "runs_solved"] == 0.5 and summary.loc[(16, "last"), "runs_solved"] == 0.0
