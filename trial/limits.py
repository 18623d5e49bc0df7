"""What every config class shares: strictness (no unknown key, no NaN, frozen) and the size bounds.

Sizes beyond these bounds cannot be allocated on any one machine this platform targets; refusing
them at load time beats an out-of-memory kill (or a 2.5 TB allocation) after a cluster has started.
The bounds are per field; what they add up to, the memory one trial holds, is estimated and checked
against the memory the trial is given (`estimate`, `fits`: below).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, Literal

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from torch.overrides import TorchFunctionMode

from models import DecoderLM, ModelConfig

MAX_SEED = 2**32 - 1  # numpy's and Optuna's seeds are 32-bit
# Sizes beyond these cannot be allocated on any one machine this platform targets; refusing them
# at load time beats an out-of-memory kill (or a 2.5 TB allocation) after a cluster has started.
MAX_POSITION = 2**20
MAX_PARAMETERS = 10**10  # 160 GB of fp32 weights, gradients and AdamW moments
MAX_BATCH = 2**20  # sequences in one batch: beyond it the activations of any model here overflow memory
MAX_SAMPLES = 10**7  # sequences generated for one evaluation set (they are held in memory)
MAX_STEPS = 10**9
# (length, k) evaluation points of one trial (eval.lengths x eval.ks), listed when a config is
# validated: far above any study's, far below what listing them costs
MAX_EVAL_POINTS = 10_000


class Strict(BaseModel):
    # a NaN or inf anywhere in a config is a typo or an overflow, never a setting
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def refuse_non_finite(data: Any, path: str = "") -> Any:
    """Raise naming the first NaN or inf in a raw config, also where fields take any value
    (task params, study grids and base) that `allow_inf_nan` does not reach."""
    if isinstance(data, float) and not math.isfinite(data):
        raise ValueError(f"{path or 'value'}: {data} is not a finite number")
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        refuse_non_finite(value, f"{path}.{key}" if path else str(key))
    return data


def _distinct(values: list[int]) -> list[int]:
    seen: set[int] = set()
    repeated = sorted({v for v in values if v in seen or seen.add(v)})
    if repeated:  # two equal lengths would be one evaluation point run and reported twice
        shown = ", ".join(map(str, repeated[:5])) + (", ..." if len(repeated) > 5 else "")
        raise ValueError(f"{shown} given more than once: each value is one evaluation point")
    return values


Distinct = Annotated[list[int], AfterValidator(_distinct)]  # a list of values each given once
Bf16 = Annotated[bool | Literal["mixed"], Field(description=(
    "true: DeepSpeed's bf16 (weights, activations and evaluation in bf16, fp32 master weights); mixed: "
    "torch.autocast (DeepSpeed's torch_autocast), the matmuls of the engine's forwards (training, "
    "validation) in bf16, weights, optimizer and the evaluation points in fp32 (docs/speed.md, P1)"))]


# --- what a trial holds in memory -------------------------------------------------------------------
# The estimate counts the large pieces of one worker's memory, in fp32, from above (bf16 halves the
# activations; not counted): the process itself (PROCESS_BYTES) and
# - the model's state: weights, gradients and AdamW's two moments (16 bytes a parameter; ZeRO stage 1
#   splits the moments over the workers, stage 2 the gradients too, stage 3 the weights too), and the
#   best weights `eval.select` keeps;
# - the training step: a micro batch (optim.batch_size / workers) at the longest training sequence,
#   every layer's activations kept for the backward pass (the attention scores of each head, T x T, and
#   the projections' and feed-forward's outputs), the logits and their gradient;
# - an evaluation batch (eval.batch_size) at the longest sequence it is used at (validation, eval.lengths,
#   eval.track, eval.select.lengths): one layer's activations at a time, the logits, and generation's
#   KV cache of every layer;
# - what is held for the whole run: the validation set, the tracked lengths' and the selection's samples;
# - the analyses: what each says it holds while it runs (`Analysis.memory`, analysis/).
# The model's state and the held samples live for the whole run; of the others (a training step, an
# evaluation batch, an analysis) one lives at a time: the estimate is the first two and the largest of the
# others, and the largest piece counted names the field to lower.
FLOAT = 4  # bytes of an fp32 value
HELD_TOKEN = 24  # bytes a held sample keeps per token: ids and position ids (int64), masks, their tensors
GiB = 2**30
PROCESS_BYTES = GiB  # a trial process before its model: Python, torch, DeepSpeed, Ray's worker
# Where a trial's memory cannot be read from this machine (it runs on a cluster's node or GPU): the
# largest this platform targets, so a spec no machine could run is refused anywhere
MAX_NODE_BYTES = 2 * 2**40  # a CPU node's memory (2 TiB)
MAX_GPU_BYTES = 141 * 10**9  # one GPU's memory (an H200)


@dataclass(frozen=True)
class Piece:
    field: str  # the field to lower ("": none, the process itself)
    what: str  # what the bytes are, in words
    bytes: int
    whole_run: bool = False  # lives for the whole run (else one such piece lives at a time)


def activation_bytes(arch, batch: int, seq: int, layers: int, backward: bool) -> int:
    """Bytes of `layers` layers' activations for `batch` sequences of `seq` tokens (attention by
    scores: scores, probabilities and a bias per head)."""
    inner = arch.n_heads * arch.d_head
    ff = arch.d_ff or 4 * arch.d_model
    per_token = 5 * arch.d_model + 4 * inner + (4 if arch.ffn == "gated_gelu" else 3) * ff
    per_layer = batch * (seq * per_token + 3 * arch.n_heads * seq * seq) * FLOAT
    return per_layer * (layers if backward else 1)


def blocks_run(arch, seq: int) -> int:
    """Blocks a forward over sequences of up to `seq` tokens runs: n_layers, times the passes of a
    looped model (for `loops: per_length`, those of a prompt as long as the whole sequence: a bound)."""
    return arch.n_layers * arch.passes(seq)


def logits_bytes(arch, batch: int, seq: int, copies: int) -> int:
    width = arch.vocab_size + (arch.n_position_classes if arch.position_head else 0)
    return copies * batch * seq * width * FLOAT


def pieces(cfg, workers: int = 1) -> list[Piece]:
    """The pieces of one worker's memory for trial config `cfg` (trial/config.py's TrialConfig) run
    over `workers` workers."""
    task = cfg.task_instance
    arch = cfg.architecture(len(task.vocab))
    params, zero, e = cfg.n_parameters(), cfg.deepspeed.zero_stage, cfg.eval
    split = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}[zero]  # (bytes a parameter whole, split)
    state = params * (split[0] + split[1] / workers) + (params * FLOAT if e.select else 0)
    train_k = task.train_k if task.uses_k else None
    train_seq = task.max_seq_len(task.longest_train_length, train_k)  # primed samples included
    micro = max(1, cfg.optim.batch_size // workers)
    parts = [
        Piece("model", f"{params:,} parameters' weights, gradients and AdamW state (ZeRO-{zero})", int(state),
              True),
        Piece("optim.batch_size", f"a training step: {micro} sequences of {train_seq} tokens, every layer's "
              "activations kept for the backward pass" + (" (every pass's: model.loops)" if arch.looped else ""),
              activation_bytes(arch, micro, train_seq, blocks_run(arch, train_seq), True)
              + logits_bytes(arch, micro, train_seq, 3)),
    ]
    longest = [(train_seq, "validation at the train length")]
    longest += [(task.max_seq_len(n, k), f"eval.lengths {n}") for n, k in cfg.eval_points()]
    longest += [(task.max_seq_len(n, train_k), f"eval.track {n}") for n in e.track or []]
    longest += [(task.max_seq_len(n, train_k), f"eval.select.lengths {n}")
                for n in (e.select.lengths if e.select else [])]
    seq, where = max(longest)
    kv = 2 * blocks_run(arch, seq) * e.batch_size * seq * arch.n_heads * arch.d_head * FLOAT
    batch = kv + activation_bytes(arch, e.batch_size, seq, 1, False) + logits_bytes(arch, e.batch_size, seq, 2)
    parts.append(Piece("eval.batch_size", f"an evaluation batch: {e.batch_size} sequences of {seq} tokens "
                       f"({where}) with generation's KV cache", batch))
    held = -(-e.val_samples // workers) * train_seq
    held += sum(-(-e.track_samples // workers) * task.max_seq_len(n, train_k) for n in e.track or [])
    if e.select:
        held += -(-e.select.samples // workers) * max(task.max_seq_len(n, train_k) for n in e.select.lengths)
    parts.append(Piece("eval.val_samples", "the held-out samples kept for the whole run (validation, "
                       "eval.track, eval.select)", held * HELD_TOKEN, True))
    if cfg.task.train_set_size:  # trial/batches.py: each data worker process draws its own copy of the set
        copies = 1 + cfg.deepspeed.data_workers
        parts.append(Piece("task.train_set_size", f"the fixed training set: {cfg.task.train_set_size:,} samples of "
                           f"up to {train_seq} tokens, {copies} cop{'y' if copies == 1 else 'ies'} (the process and "
                           "each data worker)", cfg.task.train_set_size * train_seq * HELD_TOKEN * copies, True))
    for analysis in cfg.analyses.values():  # trial/analyses.py: each says what it holds
        parts += analysis.memory(cfg, arch)
    return parts


def estimate(cfg, workers: int = 1) -> tuple[int, list[Piece]]:
    """(peak bytes of one worker, the pieces counted in it, largest first): the whole run's pieces
    and the largest of the others."""
    parts = [Piece("", "the process itself (Python, torch, DeepSpeed)", PROCESS_BYTES, True),
             *pieces(cfg, workers)]
    one_at_a_time = [p for p in parts if not p.whole_run]
    counted = [p for p in parts if p.whole_run] + [max(one_at_a_time, key=lambda p: p.bytes)]
    counted.sort(key=lambda p: -p.bytes)
    return sum(p.bytes for p in counted), counted


def memory_given(gpus_per_worker: float = 0, workers: int = 1, on_this_machine: bool = True
                 ) -> tuple[int, str]:
    """(bytes one worker may use, whose memory that is): one GPU's (a share of it for a fraction of a
    GPU) for a GPU worker, else the machine's shared by the trial's workers; on a cluster, or for a GPU
    this machine does not have, the largest this platform targets."""
    if gpus_per_worker:
        import torch

        share = min(1.0, gpus_per_worker)
        of = "" if share == 1 else f"{share:g} of "
        if on_this_machine and torch.cuda.is_available():
            total = min(torch.cuda.get_device_properties(i).total_memory
                        for i in range(torch.cuda.device_count()))
            return int(total * share), f"{of}this machine's GPU"
        return int(MAX_GPU_BYTES * share), f"{of}the largest GPU targeted, MAX_GPU_BYTES"
    if on_this_machine:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total // workers, f"this machine's memory over {workers} worker(s)"
    return MAX_NODE_BYTES, "the largest node targeted, MAX_NODE_BYTES"


def fits(cfg, workers: int = 1, gpus_per_worker: float = 0, on_this_machine: bool = True) -> str | None:
    """Why trial config `cfg` cannot run over `workers` workers (its batch does not split over them, or
    its estimate is beyond memory_given's), naming the field to change; None if it can."""
    if cfg.optim.batch_size % workers:
        return (f"optim.batch_size: {cfg.optim.batch_size} is not divisible by resources.workers_per_trial "
                f"{workers}")
    total, counted = estimate(cfg, workers)
    limit, source = memory_given(gpus_per_worker, workers, on_this_machine)
    if total <= limit:
        return None
    top = next(p for p in counted if p.field)
    return (f"{top.field}: a trial would hold about {total / GiB:,.1f} GiB per worker, beyond the "
            f"{limit / GiB:,.1f} GiB it is given ({source}); the largest part is {top.what} "
            f"({top.bytes / GiB:,.1f} GiB) (the estimate: trial/limits.py)")


class _NoInitOnMeta(TorchFunctionMode):
    """Skips in-place ops on meta tensors, which hold no values: initialising them does nothing, and
    some inits (`normal_`) would import torch._dynamo through their Python reference, a second of
    CPU in every process that checks a spec."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else next(iter(kwargs.values()), None)  # torch.nn.init passes it by name
        if name.endswith("_") and not name.startswith("__") and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


@lru_cache(maxsize=1024)
def parameters_of_layers(one_layer: ModelConfig) -> tuple[int, int]:
    """(parameters of the 1-layer model, parameters of each further layer), from models of 1 and 2
    layers built on the meta device (no memory, but a build per config a spec validates: hence the cache)."""
    # a looped model's passes reuse its blocks: its parameters are those of the model run once
    unlooped = dataclasses.replace(one_layer, loops=1, loop_factor=1.0, loop_offset=0)
    with torch.device("meta"), _NoInitOnMeta():
        one, two = (sum(p.numel() for p in DecoderLM(dataclasses.replace(unlooped, n_layers=n)).parameters())
                    for n in (1, 2))
    return one, two - one
