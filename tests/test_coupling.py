"""Guards on the science of position coupling: id-local attention, and the known results at CI size.

A regression in coupled ids, loss masking, id-local attention, PPC's predicted ids or generation
makes a model that extrapolates stop extrapolating; these tests train real (DeepSpeed, gloo)
models for a few seconds each and check the length generalization itself. The laptop-scale
figures (2x and 3x the train length, 3 seeds) come from the coupling_* study specs and
`python -m benchmarks.coupling`, not from here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import DecoderLM, ModelConfig, generate
from study.train import train_loop_per_worker


def model(**kw) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(vocab_size=11, max_position=64, d_model=32, n_layers=2, n_heads=4, **kw)).eval()


@pytest.mark.parametrize("encoding", ["learned", "rope"])
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
        "eval": {"lengths": lengths, "samples_per_cell": 128, "val_samples": 128, "every_steps": steps},
        "seed": seed,
    }


def exact_at(out: dict, length: int, ids: str) -> float:
    [rec] = [r for r in out["records"] if r["length"] == length and r["ids"] == ids]
    return rec["exact_match"]


def test_addition_with_coupling_generalizes_to_twice_the_train_length():
    """Cho et al. (2024) at CI size: 1-4 digit operands in training, 8 at test, every digit of the
    sum right; absolute ids with a random shift, same budget, do not get there."""
    addition = {"name": "addition", "params": {"train_length": 4, "min_length": 1}}
    coupled = train_loop_per_worker(trial(
        addition, {"encoding": "learned", "ids": "coupled", "max_position": 24, "id_window": 1},
        [4, 8], steps=2000, seed=11, n_layers=1))
    assert exact_at(coupled, 4, "coupled") >= 0.95
    assert exact_at(coupled, 8, "coupled") >= 0.9
    absolute = train_loop_per_worker(trial(
        addition, {"encoding": "learned", "ids": "random_shift", "max_position": 32},
        [4, 8], steps=2000, seed=11, n_layers=1))
    assert exact_at(absolute, 8, "sequential") <= 0.5


def test_full_attention_coupling_fits_but_does_not_extrapolate_at_ci_size():
    """Issue 19's measured negative, pinned: without id_window, coupled addition with the reference's
    <bos> at a fixed id 0 and independently drawn operand lengths fits its train lengths and fails
    at 2x (README "Coupling, measured": 0.00 at 2x and 3x at laptop scale for every such cell). If a
    change makes it extrapolate, that is news: update the README's table and this bound."""
    addition = {"name": "addition", "params": {"train_length": 4, "min_length": 1, "bos": True,
                                                "operands": "independent"}}
    out = train_loop_per_worker(trial(
        addition, {"encoding": "learned", "ids": "coupled", "max_position": 24}, [4, 8], steps=2000,
        seed=11, n_layers=1))
    assert exact_at(out, 4, "coupled") >= 0.9
    assert exact_at(out, 8, "coupled") <= 0.5


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


def test_ppc_pointer_head_finds_the_next_marked_bit_past_the_train_length():
    """T2 (the paper's Figure 2) at CI size: on sparse parity with a scratchpad the next id is "the
    next marked bit after mine", a gap that grows with the length. The pointer head (scan), trained
    on <= 10 bits, predicts its own ids at 2x and 3x and the scratchpad is right with them (on
    seeds 4 and 5: id_match >= 0.98, exact >= 0.97). The id-class head of the first design, same
    budget, does not find them at 3x (id_match 0.13-0.18), where its classes were rarely targets."""
    task = {"name": "parity_scratchpad", "params": {"train_length": 10, "min_length": 4, "train_k": 3}}
    positional = {"encoding": "learned", "ids": "predicted", "max_position": 40}
    pointer = train_loop_per_worker(trial(task, {**positional, "position_target": "pointer"},
                                          [10, 20, 30], steps=1000, seed=3, n_layers=2))
    for length in (20, 30):
        [pred] = [r for r in pointer["records"] if r["length"] == length and r["ids"] == "predicted"]
        assert pred["id_match"] >= 0.95 and pred["exact_match"] >= 0.9, pred
    classes = train_loop_per_worker(trial(task, positional, [30], steps=1000, seed=3, n_layers=2))
    [pred] = [r for r in classes["records"] if r["ids"] == "predicted"]
    assert pred["id_match"] <= 0.8, pred


def test_shipped_trial_configs_validate():
    import yaml
    from pathlib import Path

    from study.config import TrialConfig

    paths = sorted((Path(__file__).resolve().parents[1] / "search_spaces" / "trials").glob("*.yaml"))
    assert len(paths) >= 6
    for path in paths:
        TrialConfig.model_validate(yaml.safe_load(path.read_text()))
