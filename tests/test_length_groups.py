"""`optim.length_groups`: a step's batch run in groups of similar length, each padded only to its own
longest row, is the same loss and gradient as the one padded batch, on less padding, for every
encoding and for the encoder; a trial in groups trains as the padded batch does."""

import pytest
import torch
from pydantic import ValidationError

from models import DecoderLM
from trial.batches import StepBatches
from trial.config import TrialConfig
from trial.evaluate import Tensors, token_loss
from trial.loop import train_loop_per_worker

ADDITION = {"name": "addition", "params": {"train_length": 6, "min_length": 1, "operand_order": "lsb_first",
                                           "operands": "unpadded"}}
CELLS = {
    "learned, random_shift": ({"encoding": "learned", "ids": "random_shift", "max_position": 64}, {}),
    "learned, randomized": ({"encoding": "learned", "ids": "randomized", "max_position": 128}, {}),
    "learned, coupled": ({"encoding": "learned", "ids": "coupled", "max_position": 64}, {}),
    "nope": ({"encoding": "nope", "ids": "sequential", "max_position": 64}, {}),
    "rope": ({"encoding": "rope", "ids": "sequential", "max_position": 64}, {}),
    "alibi": ({"encoding": "alibi", "ids": "sequential", "max_position": 64}, {}),
    "fire": ({"encoding": "fire", "ids": "sequential", "max_position": 64}, {}),
    "t5_bias": ({"encoding": "t5_bias", "ids": "sequential", "max_position": 64}, {}),
    # the offset is drawn in the forward, per sample: 0 here, so that both ways draw the same
    "abacus": ({"encoding": "nope", "ids": "sequential", "max_position": 64, "abacus": True,
                "abacus_offset": "sample", "abacus_max_offset": 0, "abacus_norm": True}, {}),
    "encoder, randomized": ({"encoding": "learned", "ids": "randomized", "max_position": 128},
                            {"output": "encoder"}),
}


def trial(positional: dict, model: dict | None = None, **overrides) -> dict:
    task = {"name": "reverse", "params": {"train_length": 8, "min_length": 2}} if model else ADDITION
    return {"task": task, "positional": positional, "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, **(model or {})},
            "optim": {"lr": 3e-3, "steps": 8, "batch_size": 32, "warmup_steps": 2, **overrides},
            "eval": {"lengths": [task["params"]["train_length"]], "samples_per_point": 16, "val_samples": 32,
                     "every_steps": 4},
            "seed": 5}


def loss_and_grads(cfg: TrialConfig, x: Tensors, groups: int):
    torch.manual_seed(cfg.seed)
    model = cfg.build_model(len(cfg.task_instance.vocab))
    loss, parts, _ = token_loss(model, model, x, 0.0, groups)
    loss.backward()
    return loss.item(), parts, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("cell", list(CELLS))
def test_length_groups_are_the_batchs_loss_and_gradient_on_less_padding(cell):
    cfg = TrialConfig.model_validate(trial(*CELLS[cell]))
    item = StepBatches(cfg.task_instance, cfg.positional.scheme, 32, 7, 0, 1, 1)[0]
    x = Tensors(item["tokens"], item["ids"], item["loss_mask"], item["answer_mask"], item.get("places"))
    whole, whole_parts, whole_grads = loss_and_grads(cfg, x, 1)
    grouped, parts, grads = loss_and_grads(cfg, x, 4)
    assert grouped == pytest.approx(whole, rel=1e-5) and parts["loss"] == pytest.approx(whole_parts["loss"], rel=1e-5)
    assert grads.keys() == whole_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, whole_grads[name], rtol=1e-4, atol=1e-6, msg=f"{cell}: {name}")
    groups = x.by_length(4)
    assert sorted(r for g in groups for r in g.tokens.tolist()) != []  # every row is in a group
    assert sum(g.tokens.shape[0] for g in groups) == x.tokens.shape[0]
    assert sum(g.tokens.numel() for g in groups) < 0.9 * x.tokens.numel()  # the padding they leave out


def test_a_trial_in_length_groups_trains_as_the_padded_batch_does():
    """Under a real DeepSpeed engine, a forward per group and one backward: the steps agree with the
    one padded batch's to float rounding, in fp32 and in bf16 mixed precision."""
    forwards = []

    def count(module, args, output):
        if isinstance(module, DecoderLM) and module.training:
            forwards[-1] += 1

    for deepspeed in ({"zero_stage": 0}, {"zero_stage": 2, "bf16": "mixed"}):
        runs = []
        for groups in (1, 4):
            forwards.append(0)
            with torch.nn.modules.module.register_module_forward_hook(count):
                runs.append(train_loop_per_worker({**trial(CELLS["learned, randomized"][0], length_groups=groups),
                                                   "deepspeed": deepspeed}))
        assert forwards[-2:] == [8, 32]  # 8 steps: a forward per group
        whole, grouped = (r["metrics"] for r in runs)
        assert grouped["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-2 if deepspeed.get("bf16") else 1e-4)
        assert grouped["loss"] == pytest.approx(whole["loss"], rel=1e-2 if deepspeed.get("bf16") else 1e-4)


@pytest.mark.parametrize(("change", "field"), [
    ({"positional": {"encoding": "learned", "ids": "predicted", "max_position": 64}, "length_groups": 2},
     "optim.length_groups"),
    ({"length_groups": 64}, "length_groups: 64 is more than batch_size 32"),
    ({"positional": {"encoding": "nope", "ids": "sequential", "max_position": 64, "abacus": True}, "length_groups": 2},
     "optim.length_groups: Abacus's offset drawn once per batch"),
])
def test_length_groups_refuse_what_they_cannot_compute(change, field):
    positional = change.pop("positional", CELLS["nope"][0])
    with pytest.raises(ValidationError, match=field):
        TrialConfig.model_validate(trial(positional, **change))
