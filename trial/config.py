"""The trial config: one training run, validated before anything starts.

Groups kept apart as in position-coupling's configs: task / positional scheme / model /
optimisation / DeepSpeed / evaluation. Cross-field checks (k larger than the length, a test length
whose ids exceed `max_position`) raise errors that name the field, so a bad config fails before a
cluster is touched (files are read by trial/yaml_io.py).
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from itertools import product
from typing import Annotated, Any, Literal

from pydantic import Field, model_serializer, model_validator

import tasks
from models import DecoderLM, ModelConfig
from models.decoder import MAX_BLOCKS, PER_LENGTH, Output, PositionTarget, check_loops
from models.positions import Encoding, IdScheme, PositionalScheme
from tasks.priming import check_priming
from trial import metrics
from trial.analyses import REGISTERED, Analysis, analysis_sections
from trial.limits import (
    MAX_BATCH,
    MAX_EVAL_POINTS,
    MAX_PARAMETERS,
    MAX_POSITION,
    MAX_SAMPLES,
    MAX_SEED,
    MAX_STEPS,
    Bf16,
    Distinct,
    Strict,
    parameters_of_layers,
    refuse_non_finite,
)
from trial.yaml_io import accept_old_names, load_yaml

# ModelConfig's fields (models/decoder.py), and the three whose user-facing name in the trial config
# differs; every other field of `model` and the architecture fields of `positional` match by name
MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
MODEL_FIELD_NAMES = {"model.embed_init_std": "tok_init_std", "positional.init_std": "pos_init_std",
                     "positional.frozen": "pos_frozen"}


class TaskSpec(Strict):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)
    train_set_size: int | None = Field(None, ge=1, le=MAX_SAMPLES, description="train on a fixed set of this many "
                                       "samples (docs/trial.md); default: fresh samples every step")


class PositionalSpec(Strict):
    encoding: Encoding = ModelConfig.encoding
    ids: IdScheme = "sequential"
    max_position: int = Field(
        ModelConfig.max_position, ge=2, le=MAX_POSITION, description="ids are < max_position in training and test")
    shift: bool = Field(True, description="random offset of coupled/predicted ids in training")
    pose_chunks: int = Field(2, ge=1)
    position_loss_weight: float = Field(1.0, ge=0, description="PPC: weight of the position head loss")
    position_target: PositionTarget = Field(
        ModelConfig.position_target, description="PPC: the head predicts the next id as a class (absolute), an offset "
        "(delta), or by pointing at the earlier token that carries it: nearest first (pointer; "
        "length-free) or a softmax with a distance bias (pointer_softmax)")
    id_window: int | None = Field(
        ModelConfig.id_window, ge=0, description="attention locality: heads see only keys with |id_q - id_k| <= id_window")
    id_window_heads: int | None = Field(
        ModelConfig.id_window_heads, ge=1, description="how many heads are id-local (default: all); the rest see every key")
    t5_buckets: Literal["one_sided", "two_sided"] = Field(
        ModelConfig.t5_buckets, description="t5_bias: T5's decoder buckets (one_sided: keys whose id is above the "
        "query's share one) or its encoder's (two_sided), which coupled ids' keys ahead of the query need")
    init_std: float = Field(
        ModelConfig.pos_init_std, gt=0, le=100, description="learned encoding: initial std of the position-embedding table")
    frozen: bool = Field(ModelConfig.pos_frozen, description="learned encoding: keep the table at its random init")
    # a flag, not an encoding: Abacus adds digit places on top of an encoding (NoPE or FIRE in the paper)
    abacus: bool = Field(ModelConfig.abacus, description="add the Abacus embedding of digit places (McLeish 2024)")
    abacus_max_offset: int = Field(ModelConfig.abacus_max_offset, ge=0, le=MAX_POSITION,
                                   description="Abacus: training adds a random offset in [0, this] to every place")
    abacus_offset: Literal["batch", "sample"] = Field(ModelConfig.abacus_offset, description="one offset per batch or "
                                                      "per sample (models/encodings/abacus.py)")
    abacus_norm: bool = Field(ModelConfig.abacus_norm, description="Abacus: LayerNorm on the token + place sum")
    abacus_init_std: float | None = Field(ModelConfig.abacus_init_std, gt=0, le=100, description="Abacus table's std")

    @model_validator(mode="after")
    def _abacus_options_need_abacus(self) -> PositionalSpec:
        for name in ("abacus_max_offset", "abacus_offset", "abacus_norm", "abacus_init_std"):
            if not self.abacus and getattr(self, name) != getattr(ModelConfig, name):
                raise ValueError(f"{name}: shapes the Abacus embedding, which only abacus: true adds")
        return self

    @model_validator(mode="after")
    def _bucket_option_needs_t5_bias(self) -> PositionalSpec:
        if self.t5_buckets != ModelConfig.t5_buckets and self.encoding != "t5_bias":
            raise ValueError(f"t5_buckets: shapes T5's relative bias, which positional.encoding {self.encoding!r} "
                             "does not have (only t5_bias does)")
        return self

    @model_validator(mode="after")
    def _head_options_need_a_head(self) -> PositionalSpec:
        if self.position_target != "absolute" and not self.scheme.has_position_head:
            raise ValueError(f"position_target: {self.position_target!r} shapes PPC's position head, which only "
                             f"ids: predicted has (ids is {self.ids!r})")
        return self

    @property
    def scheme(self) -> PositionalScheme:
        """What the loop, the evaluation and the analyses ask about ids (models/positions.py)."""
        return PositionalScheme(self.encoding, self.ids, self.max_position, self.shift, self.pose_chunks, self.abacus)

    @property
    def label(self) -> str:
        return self.scheme.label


class ModelSpec(Strict):
    """The architecture's user-facing half. The model's fields, types and defaults are declared once,
    in models/decoder.py's ModelConfig; this adds the bounds a config is validated against, and
    TrialConfig.architecture fills ModelConfig from it and `positional` by name."""

    d_model: int = Field(ModelConfig.d_model, ge=8, le=2**16)
    n_layers: int = Field(ModelConfig.n_layers, ge=1, le=1024)
    n_heads: int = Field(ModelConfig.n_heads, ge=1)
    d_ff: int | None = Field(ModelConfig.d_ff, ge=1, le=2**20, description="default 4 * d_model")
    dropout: float = Field(ModelConfig.dropout, ge=0, lt=1)
    embed_init_std: float = Field(ModelConfig.tok_init_std, gt=0, le=100,
                                  description="initial std of the token embedding")
    norm: Literal["layer", "rms"] = Field(ModelConfig.norm, description="LayerNorm or RMSNorm")
    attn_scale: Literal["sqrt", "none"] = Field(
        ModelConfig.attn_scale, description="attention logits divided by sqrt(head dim), or unscaled as in T5")
    head_dim: int | None = Field(ModelConfig.head_dim, ge=1, le=2**14,
                                 description="per-head width; default d_model / n_heads (T5's d_kv is free)")
    init: Literal["default", "t5"] = Field(
        ModelConfig.init, description="projections N(0, 0.02) with biases, or T5's fan-in init without biases")
    norm_position: Literal["pre", "pre_post"] = Field(
        ModelConfig.norm_position, description="norm before each sublayer, or also after each residual add")
    ffn: Literal["gelu", "gated_gelu"] = Field(ModelConfig.ffn, description="feed-forward: GELU MLP or T5's gated GELU")
    tie_embeddings: bool = Field(ModelConfig.tie_embeddings,
                                 description="readout tied to the token table (input scaled by d_model^-1/2)")
    output: Output = Field(ModelConfig.output, description="autoregressive: causal, outputs fed back; encoder: "
                           "bidirectional, read at once; full_answer: causal, read at once (Fan et al. 2024)")
    loops: Annotated[int, Field(ge=1, le=MAX_BLOCKS)] | Literal["per_length"] = Field(ModelConfig.loops, description="the "
        "n_layers blocks run this many times, the input added back before each (Fan et al. 2024); per_length: per row")
    loop_factor: float = Field(ModelConfig.loop_factor, gt=0, le=64, description="per_length: passes per prompt token")
    loop_offset: int = Field(ModelConfig.loop_offset, ge=-MAX_BLOCKS, le=MAX_BLOCKS, description="per_length: passes added")

    @model_validator(mode="after")
    def _heads_divide_and_loops_fit(self) -> ModelSpec:
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"n_heads: {self.n_heads} does not divide d_model {self.d_model} (or set model.head_dim)")
        check_loops(self.loops, self.n_layers, self.loop_factor, self.loop_offset)  # models/decoder.py
        return self


Beta = Annotated[float, Field(ge=0, lt=1)]  # AdamW's moment decay rates


class OptimSpec(Strict):
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[Beta, Beta] = (0.9, 0.98)
    warmup_steps: int = Field(100, ge=0)
    steps: int = Field(1000, ge=1, le=MAX_STEPS)
    batch_size: int = Field(64, ge=1, le=MAX_BATCH, description="global batch, split over workers")
    grad_clip: float = Field(1.0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decay ends at lr x this")
    length_groups: int = Field(1, ge=1, le=64, description="a step's batch run in this many groups of similar "
                               "length, each padded to its own longest row: the batch's loss, on less padding")

    @model_validator(mode="after")
    def _warmup_ends(self) -> OptimSpec:
        if self.warmup_steps > self.steps:  # the learning rate would never reach its peak
            raise ValueError(f"warmup_steps: {self.warmup_steps} is more than steps {self.steps}")
        if self.length_groups > self.batch_size:
            raise ValueError(f"length_groups: {self.length_groups} is more than batch_size {self.batch_size}")
        return self


class DeepSpeedSpec(Strict):
    zero_stage: Literal[0, 1, 2, 3] = 0
    bf16: Bf16 = False
    compile: Literal["auto"] | bool = Field(
        "auto", description="torch.compile the training forward (DeepSpeed's engine.compile); evaluation "
        "and generation stay eager. auto: on with CUDA, off on CPU, where it does not pay (benchmarks P1)")
    data_workers: int = Field(0, ge=0, le=64, description="processes that make the training batches ahead of "
                              "the step (the same batches with any count); 0: the training process makes them")

    def compiles(self, device_type: str) -> bool:
        """Whether the train step is compiled on this device ("auto" resolved)."""
        return self.compile is True or (self.compile == "auto" and device_type == "cuda")


class SelectSpec(Strict):
    """The reference's checkpoint selection: the step whose teacher-forced metric on held-out samples of
    `lengths` (longer than training, for the reference) is best; the evaluation points are scored for it and the last."""

    lengths: list[int] = Field(min_length=1, max_length=64, description="the lengths the selection set is drawn at")
    metric: Literal["loss", "exact"] = Field("loss", description="lowest loss, or highest exact match")
    samples: int = Field(256, ge=1, le=MAX_SAMPLES, description="held-out samples, spread over the lengths")


class EvalSpec(Strict):
    lengths: Distinct = Field(min_length=1, description="test lengths (the task's length axis)")
    ks: Distinct | None = Field(None, min_length=1, description="k_test values; default: the task's train_k")
    samples_per_point: int = Field(128, ge=1, le=MAX_SAMPLES)
    batch_size: int = Field(128, ge=1, le=MAX_BATCH)
    val_samples: int = Field(256, ge=1, le=MAX_SAMPLES, description="held-out in-distribution validation set")
    every_steps: int = Field(100, ge=1, description="validate and report every N steps")
    track: list[int] | None = Field(
        None, min_length=1, max_length=16, description="lengths whose teacher-forced exact match, loss and "
        "attention margin are reported every every_steps (track/len{N}/...): extrapolation as it trains")
    track_samples: int = Field(128, ge=1, le=MAX_SAMPLES, description="held-out samples per tracked length")
    select: SelectSpec | None = Field(None, description="keep the best checkpoint by a metric on these lengths; "
                                      "the evaluation points are scored for `best` and `last` (default: last only)")

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        return accept_old_names(data, "eval")

    @model_validator(mode="after")
    def _points_are_bounded(self) -> EvalSpec:
        points = len(self.lengths) * len(self.ks or [None])  # before the product is built
        if points > MAX_EVAL_POINTS:
            raise ValueError(f"lengths: {len(self.lengths)} lengths x {len(self.ks or [None])} ks = {points} evaluation "
                             f"points, beyond the bound of {MAX_EVAL_POINTS} (MAX_EVAL_POINTS in trial/limits.py)")
        return self


class TrialConfig(Strict):
    task: TaskSpec
    positional: PositionalSpec = PositionalSpec()
    model: ModelSpec = ModelSpec()
    optim: OptimSpec = OptimSpec()
    deepspeed: DeepSpeedSpec = DeepSpeedSpec()
    eval: EvalSpec
    # the analyses' sections (`sparsity:`), each under its own key in the file (trial/analyses.py)
    analyses: dict[str, Analysis] = Field(default_factory=dict, exclude=True)
    seed: int = Field(0, ge=0, le=MAX_SEED, description="model init (and data, unless data_seed is set)")
    data_seed: int | None = Field(None, ge=0, le=MAX_SEED, description="training, validation and test "
                                  "data; default: seed (the reference crosses the two)")

    @model_validator(mode="before")
    @classmethod
    def _finite(cls, data: Any) -> Any:
        return analysis_sections(refuse_non_finite(data), set(cls.model_fields) - {"analyses"})

    @model_serializer(mode="wrap")
    def _sections_at_the_top(self, handler, info) -> dict:
        """Each analysis's section under its own key, as the file gives it."""
        out = handler(self)
        out.update({name: a.model_dump(mode=info.mode) for name, a in self.analyses.items()})
        return out

    def __getattr__(self, name: str) -> Any:
        if name in REGISTERED:  # cfg.sparsity: the section, None when not given
            return self.__dict__["analyses"].get(name)
        return super().__getattr__(name)

    @property
    def data_seed_or_seed(self) -> int:
        """The seed of every data stream (training, validation, evaluation points)."""
        return self.seed if self.data_seed is None else self.data_seed

    @cached_property
    def task_instance(self) -> tasks.Task:
        """The task, built once (validation already needed it; a corpus loads once)."""
        return tasks.get_task(self.task.name, **self.task.params)

    def __getstate__(self) -> dict:
        # a config sent to Ray Train's workers travels without its task: a corpus is loaded where it is used
        state = super().__getstate__()
        state["__dict__"] = {k: v for k, v in state["__dict__"].items() if k != "task_instance"}
        return state

    def architecture(self, vocab_size: int) -> ModelConfig:
        """The model's own config, every field taken by name from `model` and `positional` (three
        user-facing names differ: MODEL_FIELD_NAMES); `vocab_size` and `position_head` are derived."""
        values = {"vocab_size": vocab_size, "position_head": self.positional.scheme.has_position_head}
        for group in ("model", "positional"):
            for name, value in getattr(self, group):
                field = MODEL_FIELD_NAMES.get(f"{group}.{name}", name)
                if field in MODEL_FIELDS:
                    values[field] = value
        return ModelConfig(**values)

    def build_model(self, vocab_size: int) -> DecoderLM:
        return DecoderLM(self.architecture(vocab_size))

    def analyses_on(self) -> list[str]:
        """The analyses this trial runs after training: the names of its sections that are given."""
        return list(self.analyses)

    def eval_points(self) -> list[tuple[int, int | None]]:
        """The evaluation points (length, k_test): eval.lengths x eval.ks."""
        task = self.task_instance
        if not task.uses_k:
            return [(n, None) for n in self.eval.lengths]
        ks = self.eval.ks or [task.train_k]
        return list(product(self.eval.lengths, ks))

    def n_parameters(self) -> int:
        """Parameter count of `build_model`, exact, without allocating it (every config is checked
        against MAX_PARAMETERS, one per suggested trial: parameters_of_layers caches)."""
        arch = self.architecture(len(self.task_instance.vocab))
        first, per_layer = parameters_of_layers(dataclasses.replace(arch, n_layers=1))
        return first + (arch.n_layers - 1) * per_layer

    def ids_needed(self, length: int, k: int | None) -> int:
        """Largest position id the model sees at this evaluation point (+1 = the max_position it needs)."""
        return self.positional.scheme.largest_id(self.task_instance, length, k)

    @model_validator(mode="after")
    def _check_task_and_points(self) -> TrialConfig:
        try:
            task = self.task_instance
        except tasks.TaskParamError as e:
            field = "task.name" if e.param == "name" else f"task.params.{e.param}"
            raise ValueError(f"{field}: {e}") from None
        p = self.positional
        if p.id_window_heads is not None and p.id_window is None:
            raise ValueError("positional.id_window_heads: needs positional.id_window (the window those heads use)")
        if p.id_window_heads is not None and p.id_window_heads > self.model.n_heads:
            raise ValueError(f"positional.id_window_heads: {p.id_window_heads} is more than model.n_heads "
                             f"{self.model.n_heads}")
        if p.abacus and type(task).digit_places is tasks.Task.digit_places:
            raise ValueError(f"positional.abacus: task {task.name!r} does not say which token is which digit")
        if self.model.output != "autoregressive":  # it answers a prompt at once, feeding nothing back
            for refused, why in ((p.scheme.has_position_head, "PPC's head (ids: predicted) has no next id to predict"),
                                 (task.evaluation == "loss", f"task {task.name!r} is scored by its loss on text"),
                                 (self.analyses, f"the analyses ({', '.join(self.analyses)}) measure decoders")):
                if refused:
                    raise ValueError(f"model.output: {self.model.output} answers a prompt at once: {why}")
        if self.model.loops == PER_LENGTH and (task.evaluation == "loss" or self.analyses):
            raise ValueError(f"model.loops: {PER_LENGTH} counts each row's passes from its prompt, which " + (
                f"task {task.name!r}'s text has not" if task.evaluation == "loss" else "the analyses do not pass"))
        for refused, why in ((p.scheme.has_position_head, "PPC's position loss (ids: predicted) averages over the "
                              "tokens its head can score, which groups cannot weight; use 1"),
                             (p.abacus and p.abacus_offset == "batch", "Abacus's offset drawn once per batch "
                              "(positional.abacus_offset: batch) would be drawn once per group; use sample, or 1")):
            if refused and self.optim.length_groups > 1:
                raise ValueError(f"optim.length_groups: {why}")
        if self.eval.ks is not None and not task.uses_k:
            raise ValueError(f"eval.ks: task {task.name!r} has no k axis; drop eval.ks")
        params = self.n_parameters()
        if params > MAX_PARAMETERS:
            m = self.model
            raise ValueError(f"model: {params:.2g} parameters (model.d_model {m.d_model}, model.n_layers {m.n_layers}, "
                             f"model.d_ff {m.d_ff or 4 * m.d_model}, positional.max_position {p.max_position}); the "
                             f"bound is {MAX_PARAMETERS:.0e} ({MAX_PARAMETERS * 16 // 10**9} GB of fp32 weights, "
                             "gradients and AdamW state)")
        max_pos = self.positional.max_position
        try:  # train set priming (tasks/priming.py): its samples are the longest training sees
            check_priming(task, self.task.train_set_size)
        except tasks.TaskParamError as e:
            raise ValueError(f"task.params.{e.param}: {e}") from None
        need = self.ids_needed(task.longest_train_length, task.train_k if task.uses_k else None)
        if need >= max_pos:
            raise ValueError(f"task.params.{'priming_length' if task.priming_samples else 'train_length'}: training "
                             f"sequences need position id {need}, but positional.max_position is {max_pos}")
        for length, k in self.eval_points():
            try:
                task.check(length, k)
            except tasks.TaskParamError as e:
                field = {"k": "eval.ks", "length": "eval.lengths"}.get(e.param, f"eval ({e.param})")
                raise ValueError(f"{field}: {e}") from None
            need = self.ids_needed(length, k)
            if need >= max_pos:
                raise ValueError(
                    f"eval.lengths: test length {length} needs position id {need}, beyond "
                    f"positional.max_position {max_pos}; raise max_position or drop the length"
                )
        self._check_tracked_lengths(task, max_pos)
        for analysis in self.analyses.values():
            analysis.check(self)
        return self

    def _check_tracked_lengths(self, task: tasks.Task, max_pos: int) -> None:
        """eval.track and eval.select draw held-out samples at their lengths (the task's train k)."""
        k = task.train_k if task.uses_k else None
        for field, lengths in (("eval.track", self.eval.track), ("eval.select.lengths",
                                                                 self.eval.select and self.eval.select.lengths)):
            for length in lengths or []:
                try:
                    task.check(length, k)
                except tasks.TaskParamError as e:
                    raise ValueError(f"{field}: {e.detail}") from None
                need = self.ids_needed(length, k)
                if need >= max_pos:
                    raise ValueError(f"{field}: length {length} needs position id {need}, beyond "
                                     f"positional.max_position {max_pos}")
        if self.eval.select is not None:
            if task.evaluation == "loss":
                raise ValueError("eval.select: for tasks scored by generation; language modeling has no best step yet")
            if self.deepspeed.zero_stage == 3:  # the best weights are kept whole on every rank
                raise ValueError("eval.select: keeps a whole copy of the weights per rank; use deepspeed.zero_stage <= 2")


def selectable_metrics(cfg: TrialConfig) -> tuple[list[str], set[str]]:
    """What a study may select on for this trial (trial/metrics.py): (metrics in every report;
    patterns of metrics only in the last report, from the evaluation points' summary and the analyses).
    Metrics that would always be NaN (exact match of language modeling, beyond-train accuracy
    without a test length beyond it) are left out. Kept beside the config so that validating a spec
    does not import the training loop."""
    every = metrics.reported_every_time()
    task = cfg.task_instance
    points = cfg.eval_points()
    last = set()
    if any(n <= task.train_length and (k is None or k <= task.train_k) for n, k in points):
        last |= {"acc_in_dist", "exact_in_dist", "loss_in_dist"}
    if any(n > task.train_length for n, _ in points):
        last |= {"acc_beyond", "exact_beyond", "loss_beyond"}
    if task.evaluation == "loss":
        last -= {"exact_in_dist", "exact_beyond"}
    else:
        last -= {"loss_in_dist", "loss_beyond"}
    last |= {f"{name}/*" for name in cfg.analyses}  # each analysis reports `{name}/...`
    return every, last


def load_trial_config(path: str) -> TrialConfig:
    return TrialConfig.model_validate(load_yaml(path, "a trial config"))
