"""Guards on the science of position coupling: id-local attention, and the known results at CI size.

A regression in coupled ids, loss masking, id-local attention, PPC's predicted ids or generation
makes a model that extrapolates stop extrapolating; these tests train real (DeepSpeed, gloo)
models for a few seconds each and check the length generalization itself. The laptop-scale
figures (2x and 3x the train length, 3 seeds) come from the coupling_* experiment specs' claims
(docs/results.md), not from here.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from models import ENCODINGS, DecoderLM, ModelConfig, generate
from trial.loop import train_loop_per_worker


def model(**kw) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(vocab_size=11, max_position=64, d_model=32, n_layers=2, n_heads=4, **kw)).eval()


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_id_window_hides_keys_whose_id_is_far(encoding):
    """With every head id-local, a token far away in id space cannot change a query's output,
    even through other layers; with some heads global it can."""
    tokens = torch.randint(2, 11, (1, 12))
    ids = torch.arange(12)[None] * 3  # neighbours 3 ids apart: outside a window of 2
    ids[0, 11] = ids[0, 5] + 1  # the last query's only neighbour (besides itself) is token 5
    changed = tokens.clone()
    changed[0, 2] = (tokens[0, 2] - 1) % 9 + 2  # a token far from the last query
    near = tokens.clone()
    near[0, 5] = (tokens[0, 5] - 1) % 9 + 2
    local = model(encoding=encoding, id_window=2)
    out = lambda m, t: m(t, ids)[0][0, -1]  # noqa: E731
    with torch.no_grad():
        assert torch.allclose(out(local, tokens), out(local, changed), atol=1e-6)
        assert not torch.allclose(out(local, tokens), out(local, near), atol=1e-4)
        mixed = model(encoding=encoding, id_window=2, id_window_heads=2)
        assert not torch.allclose(out(mixed, tokens), out(mixed, changed), atol=1e-4)


@pytest.mark.parametrize("heads", [None, 2])
def test_id_window_generation_with_kv_cache_equals_uncached(heads):
    m = model(encoding="learned", id_window=1, id_window_heads=heads, position_head=True)
    prompt = torch.randint(2, 11, (3, 9))
    ids = torch.arange(9).repeat(3, 1)
    cached = generate(m, prompt, ids, 6, "predicted", use_cache=True)
    uncached = generate(m, prompt, ids, 6, "predicted", use_cache=False)
    assert torch.equal(cached[0], uncached[0]) and torch.equal(cached[1], uncached[1])


def trial(task: dict, positional: dict, lengths: list[int], steps: int, seed: int, **model) -> dict:
    return {
        "task": task,
        "positional": positional,
        "model": {"d_model": 64, "n_heads": 4, **model},
        "optim": {"lr": 3e-3, "steps": steps, "batch_size": 64, "warmup_steps": 50},
        "eval": {"lengths": lengths, "samples_per_point": 128, "val_samples": 128, "every_steps": steps},
        "seed": seed,
    }


def exact_at(out: dict, length: int, ids: str) -> float:
    [rec] = [r for r in out["records"] if r["length"] == length and r["ids"] == ids]
    return rec["exact_match"]


@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_addition_with_coupling_generalizes_to_twice_the_train_length():
    """Coupled addition with id_window (our prior) at CI size: 1-4 digit operands in training, 8 at
    test, every digit of the sum right. (Where the others stand on the same budget is the claims of
    search_spaces/experiments/coupling_addition.yaml, at 2x.)"""
    addition = {"name": "addition", "params": {"train_length": 4, "min_length": 1}}
    coupled = train_loop_per_worker(trial(
        addition, {"encoding": "learned", "ids": "coupled", "max_position": 24, "id_window": 1},
        [4, 8], steps=2000, seed=11, n_layers=1))
    assert exact_at(coupled, 4, "coupled") >= 0.95
    assert exact_at(coupled, 8, "coupled") >= 0.9


# The measured negative of docs/coupling.md (full-attention coupled addition fits and fails at 2x and 3x at laptop
# scale) is the claim coupled_addition_full_attention of coupling_addition.yaml, judged on its study's
# record, not a CI-sized copy of it here.


@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_ppc_on_parity_predicts_its_own_ids_beyond_the_train_length():
    """PPC: at 2x the train length the model's own predicted ids are the coupled ones, and the
    scratchpad is right with them."""
    out = train_loop_per_worker(trial(
        {"name": "parity", "params": {"train_length": 8, "min_length": 1}},
        {"encoding": "learned", "ids": "predicted", "max_position": 24, "id_window": 1},
        [8, 16], steps=800, seed=5, n_layers=2))
    [pred] = [r for r in out["records"] if r["length"] == 16 and r["ids"] == "predicted"]
    assert pred["id_match"] >= 0.95 and pred["exact_match"] >= 0.9
    assert np.isclose(out["metrics"]["exact_beyond"], pred["exact_match"])


@pytest.mark.slow  # a model trained, or real processes raced: the whole suite's
def test_ppc_pointer_head_finds_the_next_marked_bit_past_the_train_length():
    """T2 (the paper's Figure 2) at CI size: on sparse parity with a scratchpad the next id is "the
    next marked bit after mine", a gap that grows with the length. The pointer head (scan), trained
    on <= 10 bits, predicts its own ids at 2x and 3x and the scratchpad is right with them (seeds
    3, 4, 5 at 3x, one torch thread: id_match 0.94 / 1.00 / 0.98, exact 0.91 / 0.98 / 0.97; the
    figures move by a sample or two with the thread count, which changes float reduction order).
    An id-class position head (a class per id), same budget, does not find them at 3x (id_match
    0.13-0.18), where its classes were rarely targets."""
    task = {"name": "parity_scratchpad", "params": {"train_length": 10, "min_length": 4, "train_k": 3}}
    positional = {"encoding": "learned", "ids": "predicted", "max_position": 40}
    pointer = train_loop_per_worker(trial(task, {**positional, "position_target": "pointer"},
                                          [10, 20, 30], steps=1000, seed=3, n_layers=2))
    for length in (20, 30):
        [pred] = [r for r in pointer["records"] if r["length"] == length and r["ids"] == "predicted"]
        assert pred["id_match"] >= 0.9 and pred["exact_match"] >= 0.85, pred
    classes = train_loop_per_worker(trial(task, positional, [30], steps=1000, seed=3, n_layers=2))
    [pred] = [r for r in classes["records"] if r["ids"] == "predicted"]
    assert pred["id_match"] <= 0.8, pred


TRIALS = sorted((Path(__file__).resolve().parents[1] / "search_spaces" / "trials").glob("*.yaml"))


def header(path: Path) -> str:
    """The comment a trial config opens with: what it claims to be."""
    lines = path.read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    return " ".join(line.lstrip("# ") for line in lines[:end])


def trained_ids(cfg, steps: int = 16) -> set[int]:
    """Every position id the training loop gives a real token in its first `steps` batches (the
    loop's own draws: task.sample, then the scheme's training ids)."""
    from models.positions import training_ids

    task, pos, seen = cfg.task_instance, cfg.positional, set()
    for step in range(1, steps + 1):
        batch = task.sample(cfg.optim.batch_size, np.random.default_rng([cfg.seed, 0, step]))
        ids = training_ids(pos.ids, batch.position_ids, batch.seq_len, pos.max_position,
                           np.random.default_rng([cfg.seed, 0, step, 1]), pos.shift, pos.pose_chunks,
                           task.fixed_prefix)
        seen |= set(ids[np.arange(ids.shape[1])[None, :] < batch.seq_len[:, None]].tolist())
    return seen


@pytest.mark.parametrize("path", TRIALS, ids=lambda p: p.stem)
def test_shipped_trial_config_measures_what_it_claims(path):
    """The science contract of each single-trial config: it measures extrapolation (an in-distribution
    length and lengths of at least 2x the train length, every 'Nx' its comment names), the ids of its
    longest test length were trained (the shift or PoSE reaches them), it is PPC exactly when it says
    so, full attention when it says so, and with id-local heads every dependency of a target is within
    the window at the longest test length (else those heads could not see it)."""
    import yaml

    import analysis  # noqa: F401  (a config with an analysis section: lm_stdlib's loss_gap)
    from trial.config import TrialConfig

    cfg = TrialConfig.model_validate(yaml.safe_load(path.read_text()))
    task, pos, claims = cfg.task_instance, cfg.positional, header(path)
    n = task.train_length
    lengths = cfg.eval.lengths
    assert min(lengths) <= n, "no in-distribution length to compare with"
    assert max(lengths) >= 2 * n, f"the longest test length {max(lengths)} is not 2x train_length {n}"
    for times in map(int, re.findall(r"\b(\d+)x\b", claims)):
        assert times * n in lengths, f"the comment claims {times}x train_length ({times * n}): {lengths}"

    # every id an evaluation point gives a token (prompt and targets) is one training gave a real token
    from models.positions import inference_ids

    tested = set()
    for length, k in cfg.eval_points():
        batch = task.sample(16, np.random.default_rng(length), length=length, k=k)
        ids = inference_ids(pos.ids, batch.position_ids)
        tested |= set(ids[np.arange(ids.shape[1])[None, :] < batch.seq_len[:, None]].tolist())
    need = max(cfg.ids_needed(length, k) for length, k in cfg.eval_points())
    assert max(tested) <= need < pos.max_position
    if pos.encoding != "nope":  # NoPE reads no ids
        untrained = sorted(tested - trained_ids(cfg))
        assert not untrained, f"test ids {untrained[:5]}... never trained (positional.shift, ids, max_position)"
    if pos.abacus:  # the digit places a test reads were trained: the offset reaches them
        longest = max(int(task.digit_places(task.sample(16, np.random.default_rng(n), length=n)).max())
                      for n, _ in cfg.eval_points())
        assert longest <= task.train_length + 1 + pos.abacus_max_offset, (longest, "abacus_max_offset")

    ppc = path.stem.endswith("_ppc") or bool(re.search(r"\bPPC\b|Predictive Position Coupling", claims))
    assert (pos.ids == "predicted") == ppc, (pos.ids, "the name or comment says PPC" if ppc else "not PPC")
    if pos.ids == "predicted":
        assert cfg.build_model(len(task.vocab)).pos_head is not None
    if "full_attention" in path.stem or re.search(r"full attention", claims, re.I):
        assert pos.id_window is None, "claims full attention"
    for window in re.findall(r"\bid_window: (\d+)", claims):
        assert pos.id_window == int(window), f"the comment says id_window: {window}"
    if match := re.search(r"position_target: (\w+)", claims):
        assert pos.position_target == match[1]

    if pos.id_window is not None:  # with test ids (the task's coupled ids for coupled and PPC)
        length, k = max(cfg.eval_points(), key=lambda c: (c[0], c[1] or 0))
        batch = task.sample(32, np.random.default_rng(0), length=length, k=k)
        ids = inference_ids(pos.ids, batch.position_ids)
        far = [(b, int(t), d) for b in range(len(batch))
               for t, deps in zip(np.flatnonzero(batch.loss_mask[b]), batch.meta[b]["deps"])
               for d in deps if abs(int(ids[b, d]) - int(ids[b, t - 1])) > pos.id_window]
        assert not far, f"dependencies outside id_window {pos.id_window} at length {length}: {far[:3]}"
