"""One trial: build task, model and DeepSpeed engine, train, validate, evaluate the evaluation points.

`train_loop_per_worker(config)` is the only training loop. It runs unchanged in-process
(`python -m study.train CONFIG.yaml`, world size 1), under Ray Train local mode, and on N Ray Train
workers (ZeRO shards over them); what differs is the `Session` it reports to (trial/session.py).

Data are a pure function of (seed, rank, step), so a run resumed from a checkpoint sees the same
batches it would have seen, and the same config and seed give the same metrics.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time

import numpy as np
import torch

from trial.analyses import table_key
from trial.batches import StepBatches, training_batches
from trial.config import TrialConfig
from trial.evaluate import (
    attention_margin,
    evaluate_points,
    held_out_batches,
    token_loss,
    trained_id_distance,
    validate,
    with_places,
)
from trial.host import host_rates, kernels
from trial.session import LocalSession, Session, import_deepspeed, setup_distributed
from trial.staging import checkpoint_staging, remove_abandoned

CONFIG_FILE = "trial_config.json"


class StageClock:
    """A trial's start-up, stage by stage (`startup/{stage}_s`), from entering the loop to the end
    of its first training step (`startup/total_s`). `startup/first_step_at` is that moment's wall
    time: the driver adds the time from scheduling the trial to it (study/record/mlflow/recorder.py)."""

    def __init__(self):
        self.t = time.time()
        self.laps: dict[str, float] = {}
        self.reported = False

    def lap(self, stage: str) -> None:
        now = time.time()
        self.laps[stage] = now - self.t
        self.t = now

    def metrics(self) -> dict[str, float]:
        """The stages, in the first report after the first step only (they do not change)."""
        if "first_step" not in self.laps or self.reported:
            return {}
        self.reported = True
        return {**{f"startup/{k}_s": v for k, v in self.laps.items()},
                "startup/total_s": sum(self.laps.values()), "startup/first_step_at": self.t}


class Diverged(FloatingPointError):
    """The training loss became NaN or infinite: every later step is wasted, so the trial stops."""


def load_trained(checkpoint_dir: str):
    """(TrialConfig, task, DecoderLM with the checkpoint's weights) from a trial checkpoint: a
    folder, or a URI in the study's bucket (copied to a temporary folder first)."""
    from trial import storage

    if storage.is_uri(checkpoint_dir):  # everything is in memory when it returns, so the copy can go
        with tempfile.TemporaryDirectory(prefix="checkpoint-") as local:
            return load_trained(storage.download_dir(checkpoint_dir, local))
    cfg = load_trial_config_json(os.path.join(checkpoint_dir, CONFIG_FILE))
    task = cfg.task_instance
    model = cfg.build_model(len(task.vocab))
    if cfg.deepspeed.zero_stage == 3:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with storage.weights_only_loads():  # DeepSpeed's reader asks for weights_only=False
            state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag="checkpoint")
    else:
        path = os.path.join(checkpoint_dir, "checkpoint", "mp_rank_00_model_states.pt")
        state = torch.load(path, map_location="cpu", weights_only=True)["module"]
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return cfg, task, model.eval()


def load_trial_config_json(path: str) -> TrialConfig:
    with open(path) as f:
        return TrialConfig.model_validate_json(f.read())


def deepspeed_config(cfg: TrialConfig, world_size: int) -> dict:
    o = cfg.optim
    if o.batch_size % world_size:
        raise ValueError(f"optim.batch_size: {o.batch_size} is not divisible by {world_size} workers")
    return {
        "train_batch_size": o.batch_size,
        "train_micro_batch_size_per_gpu": o.batch_size // world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": o.lr, "betas": list(o.betas), "weight_decay": o.weight_decay, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": o.steps,
                "warmup_num_steps": max(1, o.warmup_steps),
                "warmup_type": "linear",
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": o.min_lr_ratio,
            },
        },
        "gradient_clipping": o.grad_clip,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        "bf16": {"enabled": cfg.deepspeed.bf16 is True},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    } | ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}} if cfg.deepspeed.bf16 == "mixed" else {})


def summarize(records: list[dict], cfg: TrialConfig) -> dict[str, float]:
    """Flat summary of the evaluation points for the primary id mode (PPC: its own predicted ids).

    Length extrapolation and k extrapolation are kept apart: `acc_beyond` averages the points past
    the train length with k_test <= K_train, `acc_k_beyond` the points with k_test > K_train (any
    length)."""
    primary = cfg.positional.scheme.own_ids
    rows = [r for r in records if r["ids"] == primary]
    task = cfg.task_instance
    k_train = getattr(task, "train_k", None)
    k_in = lambda r: r["k"] is None or k_train is None or r["k"] <= k_train  # noqa: E731
    inside = [r for r in rows if r["in_distribution"]]
    beyond = [r for r in rows if r["length"] > task.train_length and k_in(r)]
    k_beyond = [r for r in rows if not k_in(r)]
    mean = lambda rs, key: float(np.mean([r[key] for r in rs])) if rs else float("nan")  # noqa: E731
    summary = {
        "acc_in_dist": mean(inside, "answer_acc"),
        "acc_beyond": mean(beyond, "answer_acc"),
        "exact_in_dist": mean(inside, "exact_match"),
        "exact_beyond": mean(beyond, "exact_match"),
    }
    if k_beyond:  # only evaluation points with k_test > K_train have it
        summary["acc_k_beyond"] = mean(k_beyond, "answer_acc")
    if rows and "loss" in rows[0]:  # language modeling: loss at and beyond the train length
        summary.update(loss_in_dist=mean(inside, "loss"), loss_beyond=mean(beyond, "loss"))
    return summary


def train_loop_per_worker(config: dict | TrialConfig, session: Session | None = None) -> dict:
    """Train and evaluate one trial. Returns {"metrics": final metrics, "records": evaluation records}.
    (Longer than the 60 lines a function here aims at: it is the one loop a researcher reads top to
    bottom, set-up, steps and reports, as nanoGPT's train.py.)

    The analyses the config has a section of run after training (trial/analyses.py); the loop
    imports none: a process that validates such a config has imported `analysis`."""
    clock = StageClock()
    cfg = config if isinstance(config, TrialConfig) else TrialConfig.model_validate(config)
    session = session or LocalSession()
    import_deepspeed()  # before the process group is set up, as DeepSpeed expects
    if session.checkpointing:
        remove_abandoned()  # what trials killed mid-report on this machine left

    clock.lap("imports")  # in a warm process (study/experiment/ray_trial.py) these are done already
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    rank, world, device = setup_distributed()
    clock.lap("distributed")
    task = cfg.task_instance
    clock.lap("task")
    model, engine = _model_and_engine(cfg, len(task.vocab), world, device, clock)
    pos, w = cfg.positional, cfg.positional.position_loss_weight
    micro = cfg.optim.batch_size // world
    val_batches = _validation_batches(cfg, task, rank, world)
    tracked, selection = _tracked_batches(cfg, task, rank, world)
    # what the attention margin calls "trained" (only eval.track reports a margin)
    distance = trained_id_distance(val_batches, pos.scheme) if tracked else None
    clock.lap("data")
    start, client_state = 0, {}
    with session.restore_dir() as ckpt:
        if ckpt is not None:
            from trial.storage import weights_only_loads

            with weights_only_loads():  # a checkpoint in storage is data, never code
                _, client_state = engine.load_checkpoint(ckpt, tag="checkpoint")
            start = int(client_state["step"])
    best = client_state.get("best")  # eval.select: {"step", "value", "state"} of the best step so far
    clock.lap("restore")
    if "final" in client_state:  # restored after the last report (the driver died before noting it): resend
        final = client_state["final"]
        _report(session, engine, final, start, cfg, final=True)
        return {"metrics": {k: v for k, v in final.items() if k != "eval_records"}, "records": final["eval_records"]}

    parts: dict = {}
    tokens_seen, train_s, eval_s = 0, 0.0, 0.0
    engine.train()

    def progress(step: int) -> dict:
        nonlocal eval_s, best
        t = time.time()
        out = {
            "step": step,
            **parts,
            "lr": float(engine.lr_scheduler.get_last_lr()[0]),
            "tokens_per_s": tokens_seen * world / max(train_s, 1e-9),
        }
        with _eager():
            out.update(validate(engine, model, val_batches, pos.scheme, w, device))
            for length, batches in tracked.items():
                found = validate(engine, model, batches, pos.scheme, w, device)
                out[f"track/len{length}/exact"], out[f"track/len{length}/loss"] = found["val_exact"], found["val_loss"]
                out[f"track/len{length}/margin"] = attention_margin(model, batches, pos.scheme, distance, device)
            if selection:
                best = _select(cfg, engine, model, selection, best, step, out, device)
        eval_s += time.time() - t
        return {**out, **clock.metrics(), "time/train_s": train_s, "time/eval_s": eval_s}

    steps = StepBatches(task, pos.scheme, micro, cfg.data_seed_or_seed, rank, start + 1, cfg.optim.steps,
                        cfg.task.train_set_size)
    t = time.time()
    for step, x, tokens in training_batches(steps, cfg.deepspeed.data_workers, device):
        loss, parts, _ = token_loss(engine, model, x, w, cfg.optim.length_groups)
        if not math.isfinite(parts["loss"]):  # parts hold floats already: no extra device sync
            lr = engine.lr_scheduler.get_last_lr()[0]
            raise Diverged(f"loss: {parts['loss']} at step {step} (rank {rank}, lr {lr:.3g}); "
                           "the trial stops")
        engine.backward(loss)
        engine.step()
        tokens_seen += tokens
        train_s += time.time() - t
        if step == start + 1:
            clock.lap("first_step")
        if step % cfg.eval.every_steps == 0 and step < cfg.optim.steps:
            _report(session, engine, progress(step), step, cfg, best=best)
        t = time.time()  # from here to the next step's end: its batch (when made here) and its step
    # the last report: validation, the evaluation points and the analyses (also when resumed at the end)
    metrics = progress(cfg.optim.steps)
    t = time.time()
    records, found, extra = _final_evaluation(engine.module, task, cfg, rank, world, device)
    metrics.update(found)
    if best is not None:  # the evaluation points again for the selected step: both are scored, as the reference does
        records, found = _with_best(engine.module, task, cfg, best, records, rank, world, device)
        metrics.update(found)
    metrics["time/eval_s"] += time.time() - t  # the evaluation points and the analyses: measuring is evaluating
    metrics.update(host_rates(device))  # what the trial's time is read against on another host
    metrics["host/kernels"] = kernels(device)  # what its numbers are read against on another host
    _report(session, engine, {**metrics, "eval_records": records, **extra}, cfg.optim.steps, cfg, final=True,
            best=best)
    return {"metrics": metrics, "records": records}


def _final_evaluation(module, task, cfg: TrialConfig, rank: int, world: int, device: torch.device):
    """The evaluation points' records, their summary plus the analyses' metrics, and the analyses'
    records. Every rank runs the analyses (ZeRO-3 forwards are collective)."""
    with _eager():
        records = evaluate_points(module, task, cfg.positional.scheme, cfg.eval_points(), cfg.eval.samples_per_point,
                                cfg.eval.batch_size, cfg.data_seed_or_seed, rank, world, device)
        found, extra = summarize(records, cfg), {}
        for name, analysis in cfg.analyses.items():
            metrics_of, tables = analysis.run(module, task, cfg, device)
            found.update(metrics_of)
            extra.update({table_key(name, table): rows for table, rows in tables.items()})
    return records, found, extra


def _tracked_batches(cfg: TrialConfig, task, rank: int, world: int) -> tuple[dict, list]:
    """eval.track's batches per length and eval.select's selection set, held out (their own streams)
    and sharded over ranks like validation."""
    e = cfg.eval
    scheme = cfg.positional.scheme
    tracked = {n: held_out_batches(task, [n], -(-e.track_samples // world), e.batch_size,
                                   np.random.default_rng([cfg.data_seed_or_seed, 104723, n, rank]), scheme)
               for n in e.track or []}
    selection = [] if e.select is None else held_out_batches(
        task, e.select.lengths, -(-e.select.samples // world), e.batch_size,
        np.random.default_rng([cfg.data_seed_or_seed, 104717, rank]), scheme)
    return tracked, selection


def _select(cfg: TrialConfig, engine, model, selection: list, best: dict | None, step: int, out: dict,
            device) -> dict | None:
    """Score this step on the selection set (`select/loss`, `select/exact`); keep a copy of the weights
    when it is the best so far (ties: the earlier step). Every rank holds the same weights (ZeRO <= 2)."""
    found = validate(engine, model, selection, cfg.positional.scheme, cfg.positional.position_loss_weight, device)
    out["select/loss"], out["select/exact"] = found["val_loss"], found["val_exact"]
    value = found["val_loss"] if cfg.eval.select.metric == "loss" else -found["val_exact"]
    if best is not None and not value < best["value"]:
        return best
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return {"step": step, "value": value, "state": state}


def _with_best(module, task, cfg: TrialConfig, best: dict, last_records: list[dict], rank: int, world: int,
               device) -> tuple[list[dict], dict]:
    """The evaluation points' records of both checkpoints (a `checkpoint` column: last, best) and the best one's
    summary as `best/...`; the module is left holding the best weights."""
    module.load_state_dict(best["state"])
    with _eager():
        records = evaluate_points(module, task, cfg.positional.scheme, cfg.eval_points(), cfg.eval.samples_per_point,
                                cfg.eval.batch_size, cfg.data_seed_or_seed, rank, world, device)
    found = {f"best/{k}": v for k, v in summarize(records, cfg).items()}
    found["best/step"] = best["step"]
    found[f"best/select_{cfg.eval.select.metric}"] = abs(best["value"])
    both = [{**r, "checkpoint": "last"} for r in last_records] + [{**r, "checkpoint": "best"} for r in records]
    return both, found


def _model_and_engine(cfg: TrialConfig, vocab_size: int, world: int, device: torch.device, clock: StageClock):
    """The model (seeded) and its DeepSpeed engine, its forward compiled where `deepspeed.compile`
    says so (the graphs are built in the first step, which the clock's `first_step` then holds)."""
    import deepspeed

    torch.manual_seed(cfg.seed)
    model = cfg.build_model(vocab_size)
    clock.lap("model")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=deepspeed_config(cfg, world))
    if cfg.deepspeed.compiles(device.type):
        torch.compiler.reset()  # graphs of a warm process's earlier trial guard on that trial's model
        engine.compile(compile_kwargs={"dynamic": None})  # None: a second sequence length marks it dynamic
    clock.lap("engine")
    return model, engine


def _eager():
    """Validation, the evaluation points and the analyses run eagerly even when the train step is
    compiled: their shapes change from call to call (batch sizes, lengths, a growing KV cache), so
    graphs for them would cost more compile time than they save."""
    return torch.compiler.set_stance("force_eager")


def _validation_batches(cfg: TrialConfig, task, rank: int, world: int) -> list:
    """The held-out in-distribution set: a different stream from training, sharded over ranks."""
    val_rng = np.random.default_rng([cfg.data_seed_or_seed, 104729, rank])
    n_val, bs = -(-cfg.eval.val_samples // world), cfg.eval.batch_size
    return [with_places(task, task.validation_sample(min(bs, n_val - i), val_rng), cfg.positional.scheme)
            for i in range(0, n_val, bs)]


def _report(session: Session, engine, metrics: dict, step: int, cfg: TrialConfig, final: bool = False,
            best: dict | None = None) -> None:
    """Report metrics; with a checkpointing session, save a DeepSpeed checkpoint alongside (all
    ranks). The last checkpoint also holds the final report, so a trial restored after it
    re-sends it instead of evaluating again."""
    if not session.checkpointing:
        session.report(metrics)
        return
    state = {"step": step}
    if best is not None:  # a restored trial selects among all its steps, not only those after the restore
        state["best"] = best
    if final:
        state["final"] = metrics
    with checkpoint_staging() as tmp:
        engine.save_checkpoint(tmp, tag="checkpoint", client_state=state)
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:  # what rebuilds the model (loss_gap)
            f.write(cfg.model_dump_json(indent=1))
        session.report(metrics, tmp)
