"""A small pre-norm decoder-only transformer that always takes explicit position ids.

The positional *encoding* (how an id enters the model) is an object of the registry
models/encodings: the model asks it for an input embedding, a rotation of queries and keys and a
score bias, and compares no names. *Which* id each token gets is decided outside
(models/positions.py), so every scheme is encoding x ids; `abacus` adds a learned embedding of each
digit's place in its number on top of any encoding. Predictive Position Coupling (PPC) adds a
position head that predicts the id of the next token (absolute, delta, pointer, pointer_softmax).
The reference's T5-style choices are fields here, off by default; `output: encoder` makes it the
Chomsky suite's encoder (bidirectional, every output read at once at a placeholder: trial/evaluate.py),
`full_answer` the same read-out under causal attention; `loops` runs the blocks N times, the input
added back before each pass (Fan et al. 2024's looped transformer). ModelConfig declares the model's
fields and defaults once: the trial config's `model` and `positional` fill it by name
(trial/config.py). Encodings: README; the position head, the reference's options, loops: docs/trial.md.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.encodings import ENCODINGS, Abacus, PositionalEncoding
from models.encodings.alibi import alibi_slopes  # noqa: F401  (importable from here too)
from models.encodings.rope import apply_rope, rope_cos_sin  # noqa: F401
from models.positions import Encoding, GenerationIds

PositionTarget = Literal["absolute", "delta", "pointer", "pointer_softmax"]
Output = Literal["autoregressive", "encoder", "full_answer"]
PER_LENGTH = "per_length"  # model.loops: the passes grow with each row's prompt (loop_passes)
MAX_BLOCKS = 1024  # blocks one forward may run: n_layers x fixed loops (the schema's n_layers bound)


def check_loops(loops, n_layers: int, factor, offset) -> None:
    """ValueError naming the field (loops, loop_factor, loop_offset) of a looped model's bad option."""
    if loops != PER_LENGTH and (isinstance(loops, bool) or not isinstance(loops, int) or loops < 1):
        raise ValueError(f"loops: {loops!r} is neither a number of passes >= 1 nor {PER_LENGTH!r}")
    if loops != PER_LENGTH and loops * n_layers > MAX_BLOCKS:
        raise ValueError(f"loops: {loops} passes x n_layers {n_layers} = {loops * n_layers} blocks a forward "
                         f"runs, beyond {MAX_BLOCKS}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"loop_factor: {factor!r} is not a number > 0")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"loop_offset: {offset!r} is not an integer")
    for name, value, default in (("loop_factor", factor, 1.0), ("loop_offset", offset, 0)):
        if loops != PER_LENGTH and value != default:
            raise ValueError(f"{name}: shapes the passes of loops: {PER_LENGTH}, not of loops: {loops}")


def loop_passes(prompt_len: int, factor: float, offset: int) -> int:
    """Passes of a `loops: per_length` model over a row whose prompt (the tokens before its first
    target: the input and its separator, a `<bos>` included) holds prompt_len tokens: ceil(factor x
    prompt_len) + offset, at least 1. Fan et al. 2024 run T(n) passes on a problem of size n (their
    code: n for parity, copy and addition, n the digits of an operand); parity's and copy's prompts
    here are n + 1 tokens (factor 1, offset -1 gives n), addition's 2n + 2 (factor 0.5: n + 1)."""
    return max(1, math.ceil(factor * prompt_len) + offset)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    max_position: int = 128
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None  # default 4 * d_model
    dropout: float = 0.0
    encoding: Encoding = "learned"
    position_head: bool = False  # PPC: predict the next token's position id
    position_target: PositionTarget = "absolute"
    rope_base: float = 10000.0
    # t5_bias: T5's decoder buckets (keys whose id is above the query's share bucket 0) or its encoder's
    t5_buckets: Literal["one_sided", "two_sided"] = "one_sided"
    # attention locality in id space: the first `id_window_heads` heads (all when None) see only
    # keys whose id is within id_window of the query's id; None = every head sees every key
    id_window: int | None = None
    id_window_heads: int | None = None
    # initial std of the position-embedding table and of the token embedding (the reference
    # implementation of position coupling initialises its embeddings N(0, 1))
    pos_init_std: float = 0.02
    tok_init_std: float = 0.02
    pos_frozen: bool = False  # the position-embedding table stays at its random init (not trained)
    norm: Literal["layer", "rms"] = "layer"
    # attention logits q.k / sqrt(head dim) (the usual) or q.k unscaled (T5, the reference's model)
    attn_scale: Literal["sqrt", "none"] = "sqrt"
    head_dim: int | None = None  # per head; default d_model // n_heads (T5's d_kv is independent of both)
    init: Literal["default", "t5"] = "default"  # t5: T5's fan-in projection init and no biases
    norm_position: Literal["pre", "pre_post"] = "pre"  # pre_post: also normalise after each residual add
    ffn: Literal["gelu", "gated_gelu"] = "gelu"
    tie_embeddings: bool = False  # readout = token table, its input scaled by d_model^-1/2 (T5)
    abacus: bool = False  # add the Abacus embedding of each digit's place (forward's digit_places)
    abacus_max_offset: int = 100  # training adds a random offset in [0, this] to every place
    abacus_offset: Literal["batch", "sample"] = "batch"  # one offset per batch, or one per sample
    abacus_norm: bool = False  # LayerNorm on the input embedding sum (the Abacus reference's model)
    abacus_init_std: float | None = None  # the place table's initial std (default: the model's 0.02)
    # autoregressive: causal attention, each token predicts the next; encoder: bidirectional
    # attention, every output read at once at a placeholder token (the Chomsky suite's transformer);
    # full_answer: the same read-out under causal attention (Fan et al. 2024's full-answer prediction)
    output: Output = "autoregressive"
    # looped transformer: the n_layers blocks run as one unit this many times (1: the plain model),
    # the input embedding added to the state before each pass, the final norm after each; or
    # "per_length": each row runs loop_passes(its prompt length, loop_factor, loop_offset) passes
    loops: int | Literal["per_length"] = 1
    loop_factor: float = 1.0
    loop_offset: int = 0

    def __post_init__(self) -> None:
        check_loops(self.loops, self.n_layers, self.loop_factor, self.loop_offset)

    @property
    def looped(self) -> bool:
        return self.loops != 1

    def passes(self, prompt_len: int) -> int:
        """Passes over a row whose prompt holds prompt_len tokens (fixed loops: that number)."""
        if self.loops == PER_LENGTH:
            return loop_passes(prompt_len, self.loop_factor, self.loop_offset)
        return self.loops

    @property
    def d_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def n_position_classes(self) -> int:
        """Classes of the absolute/delta position head (the pointer head has none: it scores keys)."""
        return self.max_position if self.position_target == "absolute" else 2 * self.max_position - 1


# A per-layer cache of (keys, values, key position ids); keys are stored already rotated for rope,
# and the key ids let a score bias (alibi, fire, t5_bias) see the cached keys' ids.
# With a pointer head one more entry follows the layers': (pointer keys, unused, key ids).
KVCache = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


MATH_ATTENTION_MAX_KEYS = 128


def attention_kernel(q: torch.Tensor, k: torch.Tensor):
    """PyTorch's math attention kernel where it trains faster: on CPU, in bf16, with a gradient (not
    under no_grad), at most MATH_ATTENTION_MAX_KEYS keys. There the flash kernel's backward costs
    1.3-6x the math kernel's forward and backward, and its gradients are no closer to fp64
    (docs/speed.md)."""
    on_cpu_bf16 = q.device.type == "cpu" and q.dtype == torch.bfloat16
    if on_cpu_bf16 and q.requires_grad and k.shape[-2] <= MATH_ATTENTION_MAX_KEYS:
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.head_dim or cfg.d_model % cfg.n_heads == 0, "d_model must be divisible by n_heads"
        self.cfg = cfg
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        inner, bias = cfg.n_heads * cfg.d_head, cfg.init != "t5"
        self.qkv = nn.Linear(cfg.d_model, 3 * inner, bias=bias)
        self.proj = nn.Linear(inner, cfg.d_model, bias=bias)
        # analyses set this to True to keep the last query's attention weights [B, H, Tk]
        self.record_last_query = False
        self.last_query_attention: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        key_ids: torch.Tensor,
        bias: torch.Tensor | None,
        causal: bool,
        cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """rope: this call's (cos, sin); key_ids: the ids of every key, cached ones first; bias: the
        additive attention bias (mask, id window, the encoding's score bias), the same for every layer."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        with attention_kernel(q, k):
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, is_causal=causal, dropout_p=self.cfg.dropout if self.training else 0.0,
                scale=None if self.cfg.attn_scale == "sqrt" else 1.0,
            )
        if self.record_last_query:
            scores = q[:, :, -1:] @ k.transpose(-1, -2)
            if self.cfg.attn_scale == "sqrt":
                scores = scores / math.sqrt(q.shape[-1])
            if bias is not None:
                scores = scores + bias[:, :, -1:]
            self.last_query_attention = scores.softmax(-1)[:, :, 0]
        return self.proj(y.transpose(1, 2).reshape(B, T, -1)), (k, v, key_ids)

    @torch.no_grad()
    def init_t5(self) -> None:
        """T5's init (Mesh TensorFlow): q ~ (d_model * d_head)^-1/2, k and v ~ d_model^-1/2, out ~
        (n_heads * d_head)^-1/2, so unscaled logits q.k start with a std near 1."""
        d, inner = self.cfg.d_model, self.n_heads * self.d_head
        q, k, v = self.qkv.weight.view(3, inner, d)
        nn.init.normal_(q, std=(d * self.d_head) ** -0.5)
        nn.init.normal_(k, std=d**-0.5)
        nn.init.normal_(v, std=d**-0.5)
        nn.init.normal_(self.proj.weight, std=inner**-0.5)


def make_norm(cfg: ModelConfig) -> nn.Module:
    return nn.LayerNorm(cfg.d_model) if cfg.norm == "layer" else nn.RMSNorm(cfg.d_model)


class GatedFeedForward(nn.Module):
    """T5 v1.1's gated-GELU feed-forward: out(gelu(x W0) * x W1)."""

    def __init__(self, cfg: ModelConfig, d_ff: int):
        super().__init__()
        bias = cfg.init != "t5"
        self.gate_and_up = nn.Linear(cfg.d_model, 2 * d_ff, bias=bias)
        self.out = nn.Linear(d_ff, cfg.d_model, bias=bias)

    def forward(self, x):
        gate, up = self.gate_and_up(x).chunk(2, dim=-1)
        return self.out(F.gelu(gate, approximate="tanh") * up)


def feed_forward(cfg: ModelConfig) -> nn.Module:
    d_ff, bias = cfg.d_ff or 4 * cfg.d_model, cfg.init != "t5"
    if cfg.ffn == "gated_gelu":
        return GatedFeedForward(cfg, d_ff)
    return nn.Sequential(nn.Linear(cfg.d_model, d_ff, bias=bias), nn.GELU(), nn.Linear(d_ff, cfg.d_model, bias=bias))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.ln2 = make_norm(cfg)
        self.mlp = feed_forward(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        # the reference's pre_post: x = norm(x + f(norm(x))), so the residual stream stays at unit RMS
        self.post = nn.ModuleList([make_norm(cfg), make_norm(cfg)]) if cfg.norm_position == "pre_post" else None

    def forward(self, x, rope, key_ids, bias, causal, cache):
        a, new_cache = self.attn(self.ln1(x), rope, key_ids, bias, causal, cache)
        x = x + self.drop(a)
        if self.post is not None:
            x = self.post[0](x)
        x = x + self.drop(self.mlp(self.ln2(x)))
        if self.post is not None:
            x = self.post[1](x)
        return x, new_cache

    @torch.no_grad()
    def init_t5(self) -> None:
        """T5's feed-forward init: in ~ d_model^-1/2, out ~ d_ff^-1/2."""
        self.attn.init_t5()
        linears = [m for m in self.mlp.modules() if isinstance(m, nn.Linear)]
        for layer in linears:
            nn.init.normal_(layer.weight, std=layer.in_features**-0.5)


class PointerHead(nn.Module):
    """PPC's pointer head: which earlier token carries the next token's id (or: the current id + 1).

    Returns scores [B, Tq, Tk + 1] over the keys and, last, "current id + 1"; masked keys are -inf.
    Two ways to read them (DecoderLM.position_loss / decode_position):

    - scan (`position_target: pointer`, stick-breaking): the scan visits "+1", then the keys ahead
      of the query's id nearest first, then the others nearest first. A key fires with probability
      sigmoid(score); the pointer stops at the first that fires (p_j = s_j * prod over earlier
      (1 - s_i)), and decoding takes the first key whose score is > 0. "The nearest marked bit after
      mine" is then found however many unmarked keys lie between: length-free by construction.
    - softmax (`position_target: pointer_softmax`): softmax of q.k + bias(id_k - id_q), the bias
      offset - softplus(slope) * |d|, one (offset, slope) ahead and one behind. Monotone in the
      distance on each side, but "nearest of a kind" then needs the content margin of the right
      kind to beat slope x gap, which fails at gaps far beyond the trained ones (README, T2).
    """

    def __init__(self, d_model: int, scan: bool):
        super().__init__()
        self.scan = scan
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.next = nn.Linear(d_model, 1)  # the score of "current id + 1"
        if not scan:
            self.slope = nn.Parameter(torch.full((2,), -2.0))  # softplus(-2) = 0.13 per id
            self.offset = nn.Parameter(torch.zeros(2))

    def forward(self, x, query_ids, key_ids, keys_cached, allowed):
        """x [B, Tq, C]; returns scores [B, Tq, Tk + 1] and the keys to cache [B, Tk, C]."""
        keys = self.k(x) if keys_cached is None else torch.cat([keys_cached, self.k(x)], dim=1)
        q = self.q(x)
        scores = (q @ keys.transpose(1, 2) / math.sqrt(q.shape[-1])).float()
        if not self.scan:
            d = key_ids[:, None, :] - query_ids[:, :, None]  # [B, Tq, Tk]
            slope, offset = F.softplus(self.slope).float(), self.offset.float()
            scores = scores + torch.where(d > 0, offset[0] - slope[0] * d, offset[1] + slope[1] * d)
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.cat([scores, self.next(x).float()], dim=-1), keys


def scan_rank(dist: torch.Tensor) -> torch.Tensor:
    """The scan's order [..., Tk + 1] from dist [..., Tk] = id_k - id_q: "+1" (0), then keys ahead by
    distance, then the rest by distance; equal ranks go by key index (stable sort, argmin)."""
    rank = torch.where(dist > 0, dist, (1 << 40) - dist)
    return torch.cat([rank, torch.zeros_like(rank[..., :1])], dim=-1)


def scan_log_probs(scores: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
    """Stick-breaking over the scan: log p_j = log sigmoid(s_j) + sum over earlier keys of
    log sigmoid(-s_i). scores [..., Tk + 1] (the last is "+1"), dist [..., Tk]."""
    order = scan_rank(dist).argsort(dim=-1, stable=True)
    s = scores.gather(-1, order)
    passed = F.logsigmoid(-s).cumsum(-1) - F.logsigmoid(-s)  # log prod over the earlier ones
    return torch.empty_like(s).scatter(-1, order, F.logsigmoid(s) + passed)


def scan_first_firing(scores: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
    """Greedy decoding of the scan: the first key (in scan order) whose score is > 0, each pass or
    fire decision taken at its most likely; the stick-breaking argmax where none fires."""
    rank = scan_rank(dist)
    first = torch.where(scores > 0, rank, torch.iinfo(rank.dtype).max).argmin(-1)
    return torch.where((scores > 0).any(-1), first, scan_log_probs(scores, dist).argmax(-1))


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # the encoding, registered as `pos_emb` (learned's table is `pos_emb.weight`, as in old
        # checkpoints) and second, so the draws of the encodings that were there before stay where they were
        self.pos_emb = ENCODINGS[cfg.encoding](cfg)
        self.abacus = Abacus(cfg.max_position, cfg.d_model, cfg.abacus_max_offset, cfg.abacus_offset) \
            if cfg.abacus else None
        self.input_norm = nn.LayerNorm(cfg.d_model) if cfg.abacus and cfg.abacus_norm else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.pos_head: nn.Module | None = None
        if cfg.position_head:
            self.pos_head = (PointerHead(cfg.d_model, scan=cfg.position_target == "pointer")
                             if cfg.position_target in ("pointer", "pointer_softmax")
                             else nn.Linear(cfg.d_model, cfg.n_position_classes))
        self.apply(self._init_weights)
        # rescaled after the common N(0, 0.02) draw: the same random stream for every setting
        with torch.no_grad():
            if cfg.tok_init_std != 0.02:
                self.tok_emb.weight.mul_(cfg.tok_init_std / 0.02)
            self.pos_emb.after_init(cfg)
            if self.abacus is not None and cfg.abacus_init_std is not None:
                self.abacus.emb.weight.mul_(cfg.abacus_init_std / 0.02)
            if cfg.init == "t5":  # more draws after the common ones: the default stream is unchanged
                for block in self.blocks:
                    block.init_t5()
                if not cfg.tie_embeddings:  # logits of std ~1, as the tied and scaled readout gives
                    nn.init.normal_(self.lm_head.weight, std=cfg.d_model**-0.5)

    @property
    def encoding(self):
        """The positional encoding object (models/encodings)."""
        return self.pos_emb

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, PositionalEncoding):  # its own parameters, at its turn
            module.init_weights()

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        visible: torch.Tensor | None = None,
        cache: KVCache | None = None,
        digit_places: torch.Tensor | None = None,
        use_cache: bool = False,
        prompt_len: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, KVCache | None]:
        """Logits [B, T, V], position logits (PPC only) and, with `use_cache` or a `cache` given, the
        updated KV cache (else None: a compiled training forward must not return views of its
        activations, which torch's compiled-graph cache replays wrongly in a later compile).

        Position logits are [B, T, P] over ids or offsets, or for the pointer head scores [B, T, Tk + 1]
        over the keys (cached ones first) and "current id + 1".

        visible: optional bool [B, Tq, Tk] (True = may attend), combined with causal masking; Tk
        counts cached keys too. It lets an analysis hide chosen context tokens from chosen queries,
        and an encoder (`output: encoder`) hide padding.

        digit_places: int [B, T] (abacus only), each token's place in its number (0: not a digit).

        prompt_len: int [B] (`loops: per_length` only), each row's prompt length, from which its
        passes are counted (ModelConfig.passes); the same on every call of one generation. A row
        that needs fewer passes than the batch's most keeps its state from its last one.

        A looped model (`loops`) keeps one cache entry per pass and layer (pass-major): every pass
        of a causal model is itself causal, so a cached key of pass p is what a full forward of pass
        p computes there, and decoding with the cache equals decoding without it.
        """
        B, T = tokens.shape
        enc = self.pos_emb
        enc.check_ids(position_ids)
        past = 0 if cache is None else cache[0][0].shape[2]
        x = self.tok_emb(tokens)
        added = enc.input_embedding(position_ids)
        if added is not None:
            x = x + added
        if self.abacus is not None:
            if digit_places is None:
                raise ValueError("abacus: the model needs digit_places (the task's Task.digit_places)")
            x = x + self.abacus(digit_places)
            if self.input_norm is not None:
                x = self.input_norm(x)
        x = self.drop(x)
        # Plain causal attention takes SDPA's fused is_causal path; anything else an additive mask.
        bidirectional = self.cfg.output == "encoder"
        causal = (not bidirectional and visible is None and past == 0 and not enc.adds_score_bias
                  and self.cfg.id_window is None)
        mask = None if causal else self._attention_mask(B, T, past, visible, x.device, x.dtype, not bidirectional)
        # what depends on the ids only is computed once here, not once per layer
        key_ids = position_ids if cache is None else torch.cat([cache[0][2], position_ids], dim=1)
        bias = self._id_bias(position_ids, key_ids, mask, x.dtype)
        rope = enc.rotary(position_ids, self.cfg.d_head, x.dtype)
        new_cache: KVCache = []
        passes, row_passes = self._passes(prompt_len)
        L = len(self.blocks)
        state = None  # the state after the last pass, normed (a looped model's passes start from 0)
        for p in range(passes):
            h = x if state is None else state + x  # input injection: the embedding added back each pass
            for i, block in enumerate(self.blocks):
                h, layer_cache = block(h, rope, key_ids, bias, causal, None if cache is None else cache[p * L + i])
                new_cache.append(layer_cache)
            h = self.ln_f(h)
            if row_passes is not None and state is not None:  # a row past its own passes keeps its state
                h = torch.where((row_passes > p)[:, None, None], h, state)
            state = h
        x = state
        pos_logits = None
        if isinstance(self.pos_head, PointerHead):
            allowed = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)[None]
            if visible is not None:
                allowed = allowed & visible
            cached = None if cache is None else cache[passes * L][0]
            pos_logits, keys = self.pos_head(x, position_ids, key_ids, cached, allowed)
            new_cache.append((keys, keys[..., :0], key_ids))
        elif self.pos_head is not None:
            pos_logits = self.pos_head(x)
        if self.cfg.tie_embeddings:
            x = x * self.cfg.d_model**-0.5
        return self.lm_head(x), pos_logits, new_cache if use_cache or cache is not None else None

    def _passes(self, prompt_len: torch.Tensor | None) -> tuple[int, torch.Tensor | None]:
        """(passes this forward runs, each row's own passes [B] where rows differ, else None)."""
        cfg = self.cfg
        if cfg.loops != PER_LENGTH:
            return cfg.loops, None
        if prompt_len is None:
            raise ValueError(f"loops: {PER_LENGTH} counts each row's passes from its prompt length; call the model "
                             "with prompt_len (trial/evaluate.py's Tensors.inputs and generate pass it)")
        rows = (torch.ceil(prompt_len.double() * cfg.loop_factor).long() + cfg.loop_offset).clamp(min=1)
        lo, hi = rows.aminmax()  # one read back: the loop's length is a Python number
        lo, hi = int(lo), int(hi)
        return hi, None if lo == hi else rows

    def _id_bias(self, position_ids, key_ids, mask, dtype) -> torch.Tensor | None:
        """mask + the id window's -inf (its heads) + the encoding's score bias: [B, H|1, Tq, Tk]."""
        bias = mask
        if self.cfg.id_window is not None:
            far = (position_ids[:, :, None] - key_ids[:, None, :]).abs() > self.cfg.id_window  # [B,Tq,Tk]
            H = self.cfg.n_heads
            heads = H if self.cfg.id_window_heads is None else self.cfg.id_window_heads
            local = torch.arange(H, device=far.device) < heads
            window = torch.zeros(far.shape[0], H, *far.shape[1:], dtype=dtype, device=far.device)
            window = window.masked_fill(far[:, None] & local[None, :, None, None], float("-inf"))
            bias = window if bias is None else bias + window
        score = self.pos_emb.score_bias(position_ids, key_ids, dtype)
        if score is not None:
            bias = score if bias is None else bias + score
        return bias

    @staticmethod
    def _attention_mask(B, T, past, visible, device, dtype, causal: bool = True) -> torch.Tensor | None:
        """Additive float mask [B, 1, T, past+T]: causal (unless the model is an encoder), and
        `visible` where given."""
        if visible is None and (T == 1 or not causal):
            return None  # one new query sees every cached key; an encoder's query sees every key
        allowed = torch.ones(T, past + T, dtype=torch.bool, device=device)
        if causal:
            allowed = allowed.tril(diagonal=past)
        allowed = allowed[None].expand(B, T, past + T)
        if visible is not None:
            allowed = allowed & visible
        mask = torch.zeros(B, 1, T, past + T, dtype=dtype, device=device)
        return mask.masked_fill(~allowed[:, None], float("-inf"))

    # --- Predictive Position Coupling: targets and decoding of the position head -------------
    def position_class(self, current_ids: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """The class the absolute/delta head at a token should predict, given the next token's id."""
        if self.cfg.position_target == "absolute":
            return next_ids
        return next_ids - current_ids + self.cfg.max_position - 1

    def position_loss(self, pos_logits: torch.Tensor, ids: torch.Tensor, next_ids: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the position head over the masked tokens (ids [B, T]: this forward's ids,
        no cache). The pointer head is right when it points at *any* key carrying the next id (or
        at "+1" when the next id is the current + 1): -log of the summed probability of those.
        A token whose next id nothing in its context carries is left out of the pointer's loss."""
        if not self.cfg.position_target.startswith("pointer"):
            return F.cross_entropy(pos_logits[mask].float(), self.position_class(ids, next_ids)[mask])
        T = ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()[None]
        match = torch.cat([(ids[:, None, :] == next_ids[:, :, None]) & causal,
                           (next_ids == ids + 1)[:, :, None]], dim=-1)  # [B, T, T + 1]
        if self.cfg.position_target == "pointer":
            log_p = scan_log_probs(pos_logits.float(), ids[:, None, :] - ids[:, :, None])
        else:
            log_p = pos_logits.float().log_softmax(-1)
        # a finite floor, not -inf: a row with no match must give a zero, not a NaN, gradient
        right = log_p.masked_fill(~match, -1e9).logsumexp(-1)
        keep = mask & match.any(-1)
        return -right[keep].mean()

    def decode_position(self, pos_logits: torch.Tensor, current_ids: torch.Tensor,
                        key_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The next token's id from the head's argmax (for the pointer head: the id of the key it
        points at, or current + 1; key_ids [B, Tk] are the ids of its keys)."""
        if self.cfg.position_target.startswith("pointer"):
            assert key_ids is not None, "the pointer head decodes with its keys' ids"
            Tk = key_ids.shape[1]
            keys = key_ids if pos_logits.dim() == 2 else key_ids[:, None, :].expand(*pos_logits.shape[:-1], Tk)
            if self.cfg.position_target == "pointer":
                cls = scan_first_firing(pos_logits, keys - current_ids[..., None])
            else:
                cls = pos_logits.argmax(-1)
            pointed = torch.gather(keys, -1, cls.clamp(max=Tk - 1)[..., None])[..., 0]
            return torch.where(cls == Tk, current_ids + 1, pointed).clamp(0, self.cfg.max_position - 1)
        cls = pos_logits.argmax(-1)
        if self.cfg.position_target == "absolute":
            return cls
        return (current_ids + cls - (self.cfg.max_position - 1)).clamp(0, self.cfg.max_position - 1)


@torch.no_grad()
def generate(
    model: DecoderLM,
    prompt: torch.Tensor,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    ids: GenerationIds,
    oracle_ids: torch.Tensor | None = None,
    use_cache: bool = True,
    digit_places: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched greedy decoding. Returns (new tokens [B, G], the ids they were fed with [B, G]).

    The id of each generated token: `sequential` continues from the last prompt id, `coupled` takes
    the task's oracle id (oracle_ids [B, G]), `randomized` the scheme's drawn ids (oracle_ids: the
    sorted sample's tail, PositionalScheme.inference_ids[:, P:]), `predicted` takes the position
    head's argmax at the previous step (PPC). All prompts in the batch have the same length (one
    evaluation point). digit_places [B, P + G] (abacus): the task's places of the whole sequence.
    A `loops: per_length` model runs the passes of a P-token prompt on every step (prompt_len).
    """
    if ids in ("coupled", "randomized") and oracle_ids is None:
        raise ValueError(f"ids={ids!r} needs oracle_ids")
    if ids == "predicted" and model.pos_head is None:
        raise ValueError("ids='predicted' needs a model with a position head")
    tokens, pos = prompt, prompt_ids
    P = prompt.shape[1]
    lens = torch.full((prompt.shape[0],), P, dtype=torch.long, device=prompt.device)

    def places(start: int, stop: int) -> torch.Tensor | None:  # the digit places of tokens [start, stop)
        return None if digit_places is None else digit_places[:, start:stop]

    logits, pos_logits, cache = model(tokens, pos, digit_places=places(0, P), use_cache=use_cache, prompt_len=lens)
    key_ids = prompt_ids  # the ids of every token so far (the pointer head's keys)
    out_tokens, out_ids = [], []
    for step in range(max_new_tokens):
        next_tok = logits[:, -1].argmax(-1)
        if ids == "sequential":
            next_id = pos[:, -1] + 1
        elif ids in ("coupled", "randomized"):
            next_id = oracle_ids[:, step]
        else:
            next_id = model.decode_position(pos_logits[:, -1], pos[:, -1], key_ids)
        if model.encoding.bounded_ids:
            next_id = next_id.clamp(max=model.cfg.max_position - 1)
        out_tokens.append(next_tok)
        out_ids.append(next_id)
        key_ids = torch.cat([key_ids, next_id[:, None]], dim=1)
        if step == max_new_tokens - 1:
            break
        if use_cache:
            at = P + step
            logits, pos_logits, cache = model(next_tok[:, None], next_id[:, None], cache=cache,
                                              digit_places=places(at, at + 1), prompt_len=lens)
            pos = next_id[:, None]
        else:
            tokens = torch.cat([tokens, next_tok[:, None]], dim=1)
            pos = torch.cat([pos, next_id[:, None]], dim=1)
            logits, pos_logits, _ = model(tokens, pos, digit_places=places(0, tokens.shape[1]), prompt_len=lens)
    return torch.stack(out_tokens, 1), torch.stack(out_ids, 1)
