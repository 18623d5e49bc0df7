"""Loss, in-distribution validation and the evaluation points.

- `token_loss`: the training objective (answer/scratchpad tokens only, plus the PPC head).
- `validate`: teacher-forced on a held-out in-distribution set with inference ids. Its `val_exact`
  (every target token right, and under PPC every predicted id right) equals greedy-generation exact
  match, at the cost of one forward pass, so it is the cheap objective a sweep selects on.
- `evaluate_points`: greedy generation with a KV cache on every (length, k_test) evaluation point,
  one tidy record per point and id mode; PPC is reported with its own ids and with the oracle's.

An encoder (`model.output: encoder`, or causal: `full_answer`) writes every answer token at its
placeholder in one pass, its evaluation too (`Tensors.inputs` and `Tensors.targets`).

Every rank evaluates its own shard and the counts are summed, so evaluation also runs (and must run
on every rank) under ZeRO-3, whose forward passes are collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from models import DecoderLM, PositionalScheme, generate
from tasks import PAD_ID, Batch, Task


@dataclass
class Tensors:
    """A task batch on the device, with the ids the model sees."""

    tokens: torch.Tensor
    ids: torch.Tensor
    loss_mask: torch.Tensor
    answer_mask: torch.Tensor
    places: torch.Tensor | None = None  # Abacus: each token's digit place

    @classmethod
    def from_batch(cls, batch: Batch, ids: np.ndarray, device: torch.device) -> Tensors:
        def t(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        places = None if batch.digit_places is None else t(batch.digit_places)
        return cls(t(batch.tokens), t(ids), t(batch.loss_mask), t(batch.answer_mask), places)

    def inputs(self, encoder: bool = False) -> dict:
        """What the model reads. Autoregressive: every position but the last, each predicting the
        next. Encoder: the whole sequence, every target replaced by a placeholder (`<pad>`, otherwise
        never attended), its keys the prompt and the answer's placeholders only: a target beside the
        answer (`<eos>`, a scratchpad) is hidden, as the Chomsky suite's inputs have none.
        Both carry each row's prompt length (its first target's column), from which a `loops:
        per_length` model counts its passes."""
        if not encoder:
            places = None if self.places is None else self.places[:, :-1]
            return {"tokens": self.tokens[:, :-1], "position_ids": self.ids[:, :-1], "digit_places": places,
                    "prompt_len": self.prompt_len()}
        keys = (self.tokens != PAD_ID) & ~(self.loss_mask & ~self.answer_mask)
        T = self.tokens.shape[1]
        return {"tokens": self.tokens.masked_fill(self.loss_mask, PAD_ID), "position_ids": self.ids,
                "digit_places": self.places, "visible": keys[:, None, :].expand(-1, T, -1),
                "prompt_len": self.prompt_len()}

    def prompt_len(self) -> torch.Tensor:
        """Each row's prompt length [B]: the column of its first target token."""
        return self.loss_mask.int().argmax(1)

    def targets(self, encoder: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, mask): what the logits of `inputs(encoder)` are scored against, and where."""
        if encoder:
            return self.tokens, self.answer_mask
        return self.tokens[:, 1:], self.loss_mask[:, 1:]

    def by_length(self, groups: int) -> list[Tensors]:
        """The rows in `groups` groups of similar length (shortest first), each cut to its longest
        row: padding past a row's end is neither attended (causal, or hidden from an encoder) nor
        scored, so each row's outputs are the same, on less padding to compute."""
        T = self.tokens.shape[1]
        at = torch.arange(1, T + 1, device=self.tokens.device)
        lengths = torch.where(self.tokens != PAD_ID, at, 0).amax(1)  # a row's last token + 1
        split = [rows for rows in torch.tensor_split(torch.argsort(lengths, stable=True), groups) if len(rows)]
        widths = torch.stack([lengths[rows].max() for rows in split]).tolist()  # one read back, not one a group
        return [Tensors(*(None if t is None else t[rows, :width] for t in
                          (self.tokens, self.ids, self.loss_mask, self.answer_mask, self.places)))
                for rows, width in zip(split, widths)]


def with_places(task: Task, batch: Batch, scheme: PositionalScheme) -> Batch:
    """The batch with its digit places where the model takes them (positional.abacus)."""
    if scheme.abacus:
        batch.digit_places = task.digit_places(batch)
    return batch


def token_loss(
    model, module: DecoderLM, x: Tensors, position_loss_weight: float, groups: int = 1
) -> tuple[torch.Tensor, dict[str, float], tuple[torch.Tensor, torch.Tensor | None] | None]:
    """Cross-entropy on target tokens (the next token's, or an encoder's at its placeholders);
    under PPC plus the weighted loss of the next-id head.

    `model` is what is called (a DeepSpeed engine or the module itself); `module` the DecoderLM.
    Returns the loss, its parts, and the logits (for accuracy without a second pass). With `groups`
    > 1 (`optim.length_groups`, no position head) the batch is run in groups of similar length
    (`Tensors.by_length`) and the loss is the same mean over all its target tokens; no logits.
    """
    encoder = is_encoder(module)
    if groups > 1:
        total = x.targets(encoder)[1].sum()
        lm_loss = 0.0
        for g in x.by_length(groups):
            logits, _, _ = model(**g.inputs(encoder))
            target, mask = g.targets(encoder)
            lm_loss = lm_loss + F.cross_entropy(logits[mask].float(), target[mask], reduction="sum")
        loss = lm_loss / total
        value = loss.item()
        return loss, {"lm_loss": value, "loss": value}, None
    logits, pos_logits, _ = model(**x.inputs(encoder))
    target, mask = x.targets(encoder)
    lm_loss = F.cross_entropy(logits[mask].float(), target[mask])
    named = {"lm_loss": lm_loss}
    loss = lm_loss
    if pos_logits is not None:
        named["pos_loss"] = module.position_loss(pos_logits, x.ids[:, :-1], x.ids[:, 1:], mask)
        loss = loss + position_loss_weight * named["pos_loss"]
    named["loss"] = loss
    # one read back from the device a step, not one per part (each waits for the device to finish)
    parts = dict(zip(named, torch.stack([v.detach().float() for v in named.values()]).tolist()))
    return loss, parts, (logits, pos_logits)


def is_encoder(module: DecoderLM) -> bool:
    """Whether the model reads every output at once (model.output: encoder or full_answer)."""
    return module.cfg.output != "autoregressive"


def _all_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def validate(
    model, module: DecoderLM, batches: list[Batch], scheme: PositionalScheme, position_loss_weight: float, device
) -> dict[str, float]:
    """Teacher-forced metrics on held-out training-distribution batches (this rank's shard)."""
    was_training = module.training
    module.eval()
    loss_sum = tok_right = tok_n = seq_right = ans_right = n = 0.0
    for batch in batches:
        x = Tensors.from_batch(batch, scheme.inference_ids(batch.position_ids), device)
        loss, _, (logits, pos_logits) = token_loss(model, module, x, position_loss_weight)
        target, mask = x.targets(is_encoder(module))
        ans = x.answer_mask if is_encoder(module) else x.answer_mask[:, 1:]
        right = logits.argmax(-1) == target
        if pos_logits is not None:  # PPC: the id it would feed back must be right too
            right_ids = module.decode_position(pos_logits, x.ids[:, :-1], x.ids[:, :-1]) == x.ids[:, 1:]
            seq_ok = ((right & right_ids) | ~mask).all(1)
        else:
            seq_ok = (right | ~mask).all(1)
        loss_sum += loss.item() * len(batch)
        tok_right += (right & mask).sum().item()
        tok_n += mask.sum().item()
        seq_right += seq_ok.sum().item()
        ans_right += (right | ~ans).all(1).sum().item()
        n += len(batch)
    module.train(was_training)
    loss_sum, tok_right, tok_n, seq_right, ans_right, n = _all_sum(
        [loss_sum, tok_right, tok_n, seq_right, ans_right, n], device
    )
    return {
        "val_loss": loss_sum / n,
        "val_token_acc": tok_right / tok_n,
        "val_exact": seq_right / n,
        "val_answer_acc": ans_right / n,
    }


@torch.no_grad()
def evaluate_point(
    module: DecoderLM, task: Task, scheme: PositionalScheme, length: int, k: int | None,
    samples: int, batch_size: int, rng: np.random.Generator, device,
) -> list[dict]:
    """Greedy generation at one (length, k) evaluation point; one record per generation id mode."""
    was_training = module.training
    module.eval()
    modes = scheme.generation_modes
    # answer right, exact, ids right, samples, answer tokens right, answer tokens
    counts = {m: np.zeros(6) for m in modes}
    done = 0
    while done < samples:
        batch = with_places(task, task.sample(min(batch_size, samples - done), rng, length=length, k=k), scheme)
        done += len(batch)
        P = int(batch.prompt_len[0])
        assert (batch.prompt_len == P).all() and (batch.seq_len == batch.seq_len[0]).all()
        G = int(batch.seq_len[0]) - P
        x = Tensors.from_batch(batch, scheme.inference_ids(batch.position_ids, rng), device)
        tokens, ids = x.tokens, x.ids
        oracle = ids[:, P:]  # the task's ids (coupled, predicted) or the drawn ones (randomized)
        target, ans = tokens[:, P:], x.answer_mask[:, P:]
        for mode in modes:
            if is_encoder(module):  # every output at once; there is no end token to get right
                out, out_ids = module(**x.inputs(encoder=True))[0][:, P:].argmax(-1), oracle
                right = (out == target) | ~ans
            else:
                out, out_ids = generate(
                    module, tokens[:, :P], ids[:, :P], G, mode,
                    oracle_ids=oracle if mode in ("coupled", "randomized") else None, digit_places=x.places,
                )
                right = out == target
            counts[mode] += [
                (right | ~ans).all(1).sum().item(),
                right.all(1).sum().item(),
                (out_ids == oracle).all(1).sum().item(),
                len(batch),
                (right & ans).sum().item(),
                ans.sum().item(),
            ]
    module.train(was_training)
    records = []
    for mode in modes:
        ans_right, exact, ids_right, n, tokens_right, tokens = _all_sum(list(counts[mode]), device)
        rec = {"length": length, "k": k, "ids": mode, "answer_acc": ans_right / n, "exact_match": exact / n,
               "answer_token_acc": tokens_right / tokens if tokens else float("nan"), "n": int(n)}
        if mode == "predicted":
            rec["id_match"] = ids_right / n
        records.append(rec)
    return records


@torch.no_grad()
def evaluate_loss_point(
    module: DecoderLM, task: Task, scheme: PositionalScheme, length: int, samples: int, batch_size: int,
    rng: np.random.Generator, device,
) -> list[dict]:
    """Teacher-forced loss on held-out windows of one length (language modeling): the mean over all
    positions, and over positions past the train length, where extrapolation shows."""
    was_training = module.training
    module.eval()
    sums = np.zeros(6)  # loss sum, tokens, right, tail loss sum, tail tokens, windows
    done = 0
    while done < samples:
        batch = task.sample(min(batch_size, samples - done), rng, length=length)
        done += len(batch)
        x = Tensors.from_batch(batch, scheme.inference_ids(batch.position_ids), device)
        logits, _, _ = module(**x.inputs())
        mask = x.loss_mask[:, 1:]
        loss = F.cross_entropy(logits.float().transpose(1, 2), x.tokens[:, 1:], reduction="none")
        tail = mask & (torch.arange(1, x.tokens.shape[1], device=device) >= task.train_length)
        sums += [loss[mask].sum().item(), mask.sum().item(),
                 ((logits.argmax(-1) == x.tokens[:, 1:]) & mask).sum().item(),
                 loss[tail].sum().item(), tail.sum().item(), len(batch)]
    module.train(was_training)
    loss_sum, n, right, tail_sum, tail_n, windows = _all_sum(list(sums), device)  # over all ranks
    return [{
        "length": length, "k": None, "ids": scheme.own_ids, "loss": loss_sum / n,
        "loss_beyond_train": tail_sum / tail_n if tail_n else float("nan"),
        "answer_acc": right / n, "exact_match": float("nan"), "n": int(windows),
    }]


def evaluate_points(
    module: DecoderLM, task: Task, scheme: PositionalScheme, points: list[tuple[int, int | None]],
    samples_per_point: int, batch_size: int, seed: int, rank: int, world_size: int, device,
) -> list[dict]:
    """Every point; each rank draws its own samples (seeded by point and rank) and counts are summed."""
    per_rank = -(-samples_per_point // world_size)
    records = []
    for length, k in points:
        rng = np.random.default_rng([seed, 7919, length, 0 if k is None else k, rank])  # k >= 1
        if task.evaluation == "loss":
            found = evaluate_loss_point(module, task, scheme, length, per_rank, batch_size, rng, device)
        else:
            found = evaluate_point(module, task, scheme, length, k, per_rank, batch_size, rng, device)
        for rec in found:
            rec["in_distribution"] = length <= task.train_length and (k is None or k <= task.train_k)
            records.append(rec)
    return records


def held_out_batches(task: Task, lengths: list[int], samples: int, batch_size: int,
                     rng: np.random.Generator, scheme: PositionalScheme) -> list[Batch]:
    """Samples of the given lengths (the task's training k), `samples` spread evenly over them: the
    selection set of `eval.select`, or one tracked length of `eval.track`."""
    per_length = -(-samples // len(lengths))
    return [with_places(task, task.sample(min(batch_size, per_length - i), rng, length=n), scheme)
            for n in lengths for i in range(0, per_length, batch_size)]


def trained_id_distance(batches: list[Batch], scheme: PositionalScheme) -> int:
    """The largest id distance within any of these (training-distribution) sequences."""
    spans = []
    for batch in batches:
        ids = scheme.inference_ids(batch.position_ids)
        valid = np.arange(ids.shape[1])[None] < batch.seq_len[:, None]
        spans.append((np.where(valid, ids, -1).max(1) - np.where(valid, ids, 1 << 40).min(1)).max())
    return int(max(spans))


@torch.no_grad()
def attention_margin(module: DecoderLM, batches: list[Batch], scheme: PositionalScheme, distance: int,
                     device) -> float:
    """For the tokens that predict a target: the best attention logit over keys within `distance` ids
    (the farthest trained) minus the best over keys beyond it, averaged over heads, layers and the
    queries that have such a key. Negative: some key at an untrained distance outscores every key at
    a trained one, which is how full-attention coupling fails at long lengths. NaN without far keys."""
    from models.decoder import apply_rope

    captured = []

    def keep(attn, args):
        captured.append((attn, args[0], args[1], args[3]))  # x, rope, bias (mask, window, ALiBi)

    was_training = module.training
    module.eval()
    hooks = [block.attn.register_forward_pre_hook(keep) for block in module.blocks]
    total, count = 0.0, 0
    try:
        for batch in batches:
            x = Tensors.from_batch(batch, scheme.inference_ids(batch.position_ids), device)
            captured.clear()
            inputs = x.inputs(is_encoder(module))
            module(**inputs)
            ids = inputs["position_ids"]
            T = ids.shape[1]
            dist = (ids[:, :, None] - ids[:, None, :]).abs()[:, None]  # [B, 1, Tq, Tk]
            # an encoder's queries see every key but those its mask (in the bias) hides
            causal = torch.ones(T, T, dtype=torch.bool, device=device)
            if module.cfg.output != "encoder":
                causal = causal.tril()
            queries = x.targets(is_encoder(module))[1][:, None, :, None]  # the tokens that predict a target
            for attn, h, rope, bias in captured:
                B = h.shape[0]
                q, k, _ = attn.qkv(h).view(B, T, 3, attn.n_heads, attn.d_head).permute(2, 0, 3, 1, 4)
                if rope is not None:
                    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
                scores = (q @ k.transpose(-1, -2)).float()
                if attn.cfg.attn_scale == "sqrt":
                    scores = scores / attn.d_head**0.5
                if bias is not None:
                    scores = scores + bias.float()
                scores = scores.masked_fill(~causal, float("-inf"))
                near = scores.masked_fill(dist > distance, float("-inf")).amax(-1)
                far = scores.masked_fill(dist <= distance, float("-inf")).amax(-1)
                counted = queries[..., 0] & torch.isfinite(far) & torch.isfinite(near)
                total += (near - far)[counted.expand_as(near)].sum().item()
                count += counted.expand_as(near).sum().item()
    finally:
        for hook in hooks:
            hook.remove()
        module.train(was_training)
    total, count = _all_sum([total, count], device)
    return total / count if count else float("nan")
