"""The encoding seam (models/encodings): the registry, nope/learned/rope/alibi as their formulas, and
the semantics of fire, t5_bias, abacus digit places and randomized ids."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

import tasks
from models import ENCODINGS, DecoderLM, ModelConfig, PositionalScheme, generate, training_ids
from models.encodings import ENCODINGS as REGISTRY
from models.encodings import Abacus, PositionalEncoding, register
from models.encodings.abacus import MAX_OFFSET
from models.encodings.fire import EPS, fire_input
from models.encodings.t5_bias import t5_bucket
from models.positions import generation_modes, inference_ids
from trial.config import PositionalSpec, TrialConfig


def make(encoding: str, **kw) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(vocab_size=13, max_position=64, d_model=32, n_heads=4, encoding=encoding, **kw)).eval()


def pairs(Tq=6, Tk=9, B=2, seed=0, top=60):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, top, (B, Tq), generator=g), torch.randint(0, top, (B, Tk), generator=g)


# --- the registry ---------------------------------------------------------------------------

def test_the_schema_and_the_scheme_read_the_registry():
    assert ENCODINGS == tuple(REGISTRY) == ("nope", "learned", "rope", "alibi", "fire", "t5_bias")
    for name in ENCODINGS:
        assert PositionalSpec(encoding=name).encoding == name
    with pytest.raises(ValidationError, match="encoding"):
        PositionalSpec(encoding="sinusoid")


def test_a_registered_encoding_trains_without_touching_the_decoder():
    """Adding an encoding is one module: a toy score bias registered here builds, takes the masked
    (non-fused) path, and its parameter learns in one step."""

    @register
    class Toy(PositionalEncoding):
        name = "toy_distance"
        adds_score_bias = True

        def __init__(self, cfg):
            super().__init__(cfg)
            self.scale = torch.nn.Parameter(torch.full((cfg.n_heads,), 0.5))

        def score_bias(self, q_ids, k_ids, dtype):
            d = (q_ids[:, :, None] - k_ids[:, None, :]).abs().to(dtype)
            return -self.scale.to(dtype)[None, :, None, None] * d[:, None]

    try:
        model = make("toy_distance").train()
        tokens = torch.randint(0, 13, (4, 10))
        ids = torch.arange(10).expand(4, 10)
        before = model.pos_emb.scale.detach().clone()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        logits, _, _ = model(tokens[:, :-1], ids[:, :-1])
        F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:]).backward()
        opt.step()
        assert not torch.equal(model.pos_emb.scale, before)
        assert "pos_emb.scale" in model.state_dict()
        # the bias enters: a scale of zero gives other logits, and a bias over all-visible keys
        # equals the same bias with an explicit mask (the fused causal path was not taken)
        model.eval()
        a = model(tokens, ids)[0]
        assert torch.allclose(a, model(tokens, ids, visible=torch.ones(4, 10, 10, dtype=torch.bool))[0], atol=1e-5)
        with torch.no_grad():
            model.pos_emb.scale.zero_()
        assert not torch.allclose(a, model(tokens, ids)[0], atol=1e-4)
    finally:
        del REGISTRY["toy_distance"]


# --- nope, learned, rope and alibi are their formulas ---------------------------------------

def test_old_encodings_are_their_formulas():
    q, k = pairs()
    for name in ENCODINGS:
        enc = make(name).pos_emb
        hooks = (enc.input_embedding(q), enc.rotary(q, 8, torch.float32), enc.score_bias(q, k, torch.float32))
        if name == "nope":
            assert hooks == (None, None, None) and not enc.adds_score_bias
        elif name == "learned":
            assert torch.equal(hooks[0], enc.weight[q]) and hooks[1:] == (None, None) and enc.bounded_ids
        elif name == "rope":
            cos, sin = hooks[1]
            angles = q[:, None, :, None].float() * 10000.0 ** (-torch.arange(0, 8, 2).float() / 8)
            assert torch.allclose(cos, angles.cos()) and torch.allclose(sin, angles.sin())
            assert hooks[0] is None and hooks[2] is None and not enc.adds_score_bias
        elif name == "alibi":
            slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / 4) for h in range(4)])
            expected = -slopes[None, :, None, None] * (q[:, None, :, None] - k[:, None, None, :]).abs().float()
            assert torch.allclose(hooks[2], expected) and hooks[:2] == (None, None) and enc.adds_score_bias


def test_old_encodings_keep_their_parameter_names():
    """Checkpoints of nope/learned/rope/alibi keep their parameter names and random stream (the
    weights themselves: the smoke study's results.csv, tests/test_records.py)."""
    for name in ("nope", "learned", "rope", "alibi"):
        keys = [key for key in make(name).state_dict() if key.startswith("pos_emb")]
        assert keys == (["pos_emb.weight"] if name == "learned" else []), name


# --- t5_bias --------------------------------------------------------------------------------

def test_t5_buckets_are_exact_then_log_spaced_then_clamped():
    n = torch.arange(-5, 400)
    b = t5_bucket(n)
    assert (b[n <= 0] == 0).all()  # one-sided: keys ahead of the query share bucket 0
    assert torch.equal(b[(n >= 0) & (n < 16)], n[(n >= 0) & (n < 16)])  # exact below num_buckets / 2
    # 16 + floor(16 log(n/16) / log(128/16)), worked by hand: 20 -> 17, 32 -> 21, 64 -> 26, 127 -> 31
    for dist, bucket in {16: 16, 20: 17, 32: 21, 64: 26, 127: 31, 128: 31, 10_000: 31}.items():
        assert int(t5_bucket(torch.tensor(dist))) == bucket, dist
    assert (b[1:] >= b[:-1]).all() and int(b.max()) == 31


def test_two_sided_t5_buckets_are_t5_encoders():
    """T5's bidirectional bucketing (HF's _relative_position_bucket, bidirectional=True), worked by hand:
    16 buckets a side, 8 exact, then 8 + floor(8 log(d/8) / log(128/8)); keys ahead of the query
    (n = id_q - id_k < 0) take buckets 16-31."""
    bucket = lambda n: int(t5_bucket(torch.tensor(n), two_sided=True))  # noqa: E731
    expected = {0: 0, 1: 1, 7: 7, 8: 8, 16: 10, 32: 12, 127: 15, 10_000: 15,
                -1: 17, -7: 23, -8: 24, -16: 26, -127: 31, -10_000: 31}
    assert {n: bucket(n) for n in expected} == expected
    n = torch.arange(-400, 400)
    b = t5_bucket(n, two_sided=True)
    assert int(b.min()) == 0 and int(b.max()) == 31 and len(set(b[n < 0].tolist()) & set(b[n >= 0].tolist())) == 0


def test_t5_bias_buckets_follow_the_config():
    one, two = make("t5_bias").pos_emb, make("t5_bias", t5_buckets="two_sided").pos_emb
    ahead = lambda enc, d: enc.score_bias(torch.tensor([[5]]), torch.tensor([[5 + d]]), torch.float32)  # noqa: E731
    assert torch.equal(ahead(one, 1), ahead(one, 3))  # one-sided: every key ahead is in bucket 0
    assert not torch.equal(ahead(two, 1), ahead(two, 3))


def test_t5_bias_is_a_scalar_per_head_per_bucket_of_the_distance():
    enc = make("t5_bias").pos_emb
    q, k = pairs(top=300)
    bias = enc.score_bias(q, k, torch.float32)
    assert bias.shape == (2, 4, 6, 9)
    table = enc.bias.weight  # [buckets, heads]
    assert torch.equal(bias, table[t5_bucket(q[:, :, None] - k[:, None, :])].permute(0, 3, 1, 2))
    # depends on the distance only through its bucket: 100 and 110 share one, 2 and 3 do not
    one = lambda d: enc.score_bias(torch.tensor([[d + 5]]), torch.tensor([[5]]), torch.float32)  # noqa: E731
    assert torch.equal(one(100), one(110)) and not torch.equal(one(2), one(3))
    assert torch.equal(one(-3), one(0))


# --- fire -----------------------------------------------------------------------------------

def fire_with(threshold: float) -> PositionalEncoding:
    enc = make("fire").pos_emb
    enc.init_L.fill_(threshold)
    return enc


def test_fire_reads_the_distance_normalised_by_the_query_position():
    enc = fire_with(8.0)
    q, k = pairs(top=40)
    c, L = enc.c.detach(), 8.0
    i, j = q[:, :, None].float(), k[:, None, :].float()
    ratio = torch.log(c * (i - j).abs() + 1) / (torch.log(c * torch.clamp(i, min=L) + 1) + EPS)
    assert torch.allclose(fire_input(q, k, enc.c, enc.threshold), ratio)
    bias = enc.score_bias(q, k, torch.float32)
    assert bias.shape == (2, 4, 6, 9)
    assert torch.allclose(bias, enc.mlp(ratio[..., None]).permute(0, 3, 1, 2), atol=1e-6)


def test_fire_bias_depends_on_distance_and_query_only_through_the_ratio():
    enc = fire_with(8.0)
    at = lambda i, j: enc.score_bias(torch.tensor([[i]]), torch.tensor([[j]]), torch.float32)[0, :, 0, 0]  # noqa: E731
    zero = at(0, 0)
    for i in (3, 20, 55):  # zero distance: f(0) wherever the query is
        assert torch.allclose(at(i, i), zero)
    # beyond L the key at id 0 is at ratio 1 for every query: one bias (progressive interpolation)
    assert torch.allclose(at(20, 0), at(55, 0), atol=1e-6) and torch.allclose(at(9, 0), at(50, 0), atol=1e-6)
    # below L the normaliser is psi(L): relative, shift-invariant; beyond it, not
    assert torch.allclose(at(5, 2), at(7, 4), atol=1e-6)
    assert not torch.allclose(at(20, 17), at(40, 37), atol=1e-4)


def test_fire_is_monotone_with_a_monotone_mlp():
    enc = fire_with(8.0)
    with torch.no_grad():  # f(x) = sum of relu(x): increasing in the ratio
        enc.mlp[0].weight.fill_(1.0), enc.mlp[0].bias.zero_(), enc.mlp[2].weight.fill_(1.0), enc.mlp[2].bias.zero_()
    at = lambda i, j: float(enc.score_bias(torch.tensor([[i]]), torch.tensor([[j]]), torch.float32)[0, 0, 0, 0].detach())  # noqa: E731
    by_distance = [at(30, 30 - d) for d in range(31)]
    assert all(b < a for b, a in zip(by_distance, by_distance[1:]))  # farther, larger ratio
    by_query = [at(i, i - 5) for i in range(9, 40)]  # a fixed distance reads smaller as i grows
    assert all(a < b for b, a in zip(by_query, by_query[1:]))


# --- randomized ids -------------------------------------------------------------------------

def test_randomized_ids_are_a_sorted_sample_of_distinct_ids():
    B, T, max_pos = 200, 12, 50
    rng = np.random.default_rng(0)
    seq_len = rng.integers(3, T + 1, size=B)
    ids = training_ids("randomized", np.zeros((B, T), np.int64), seq_len, max_pos, rng)
    valid = np.arange(T)[None] < seq_len[:, None]
    steps = np.diff(ids, axis=1)
    assert ((steps > 0) | ~valid[:, 1:]).all()  # strictly increasing: sorted and distinct
    assert (steps[valid[:, 1:]] > 1).mean() > 0.5  # a sample with gaps, not a shifted run 0..n-1
    assert ids.min() >= 0 and ids.max() < max_pos
    assert ids[:, 0].max() > 10 and np.where(valid, ids, 0).max() == max_pos - 1  # the whole range
    again = training_ids("randomized", np.zeros((B, T), np.int64), seq_len, max_pos, np.random.default_rng(0))
    assert not np.array_equal(ids, again)  # the rng moved on: one draw per call, seeded
    first = training_ids("randomized", np.zeros((B, T), np.int64), seq_len, max_pos, np.random.default_rng(1))
    assert np.array_equal(first, training_ids("randomized", np.zeros((B, T), np.int64), seq_len, max_pos,
                                              np.random.default_rng(1)))
    bos = training_ids("randomized", np.zeros((B, T), np.int64), seq_len, max_pos, rng, fixed_prefix=1)
    assert (bos[:, 0] == 0).all() and (bos[:, 1] >= 1).all()
    with pytest.raises(ValueError, match="max_position"):
        training_ids("randomized", np.zeros((1, 60), np.int64), np.array([60]), max_pos, rng)


def test_randomized_ids_are_drawn_at_test_too_and_generated_tokens_take_their_tail():
    scheme = PositionalScheme("rope", "randomized", max_position=40)
    coupled = np.zeros((3, 10), np.int64)
    ids = scheme.inference_ids(coupled, np.random.default_rng(5))
    assert (np.diff(ids, axis=1) > 0).all() and ids.max() < 40 and not (ids == np.arange(10)).all()
    assert np.array_equal(scheme.inference_ids(coupled), inference_ids("randomized", coupled, 40))  # seeded default
    assert scheme.generation_modes == generation_modes("randomized") == ["randomized"]
    model = make("rope")
    prompt = torch.randint(0, 13, (3, 6))
    given = torch.from_numpy(ids)
    out, out_ids = generate(model, prompt, given[:, :6], 4, "randomized", oracle_ids=given[:, 6:])
    assert torch.equal(out_ids, given[:, 6:])
    with pytest.raises(ValueError, match="oracle_ids"):
        generate(model, prompt, given[:, :6], 4, "randomized")


def rotated_by_hand(x: torch.Tensor, ids: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE as complex numbers: channel pair (2i, 2i+1) times exp(j id base^(-2i/D)). x [B, H, T, D]."""
    D = x.shape[-1]
    z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double())
    angle = ids.double()[:, None, :, None] * base ** (-torch.arange(0, D, 2).double() / D)
    out = z * torch.polar(torch.ones_like(angle), angle)
    return torch.stack([out.real, out.imag], -1).flatten(-2).float()


def encoder_by_hand(model: DecoderLM, tokens, ids, visible) -> torch.Tensor:
    """A 1-layer encoder's logits written out from the formulas, the ids entering only as RoPE's
    angles or ALiBi's -slope_h |id_q - id_k| (slopes 2^(-8h/H))."""
    B, T = tokens.shape
    block, H = model.blocks[0], model.cfg.n_heads
    x = model.tok_emb(tokens)
    q, k, v = block.attn.qkv(block.ln1(x)).view(B, T, 3, H, -1).permute(2, 0, 3, 1, 4)
    if model.cfg.encoding == "rope":
        q, k = rotated_by_hand(q, ids), rotated_by_hand(k, ids)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if model.cfg.encoding == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * h / H) for h in range(1, H + 1)])
        scores = scores - slopes[None, :, None, None] * (ids[:, None, :, None] - ids[:, None, None, :]).abs()
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
    x = x + block.attn.proj(a)
    x = x + block.mlp(block.ln2(x))
    return model.lm_head(model.ln_f(x))


@pytest.mark.parametrize("encoding", ["rope", "alibi"])
def test_randomized_ids_drive_rope_and_alibi_in_an_encoder(encoding):
    """Ruoss et al. (2023) randomize every encoding, in an encoder: the trial's randomized ids (a
    sorted sample of [0, 256)) reach RoPE's rotation and ALiBi's distances as they are, gaps included,
    never as 0..T-1. The trial's encoder inputs on reversal against the formulas at those ids."""
    from trial.evaluate import Tensors

    task = tasks.get_task("reverse", train_length=8, min_length=2)
    batch = task.sample(4, np.random.default_rng(0), length=6)
    scheme = PositionalScheme(encoding, "randomized", max_position=256)
    ids = scheme.training_ids(batch.position_ids, batch.seq_len, np.random.default_rng(1), task.fixed_prefix)
    assert (np.diff(ids, axis=1) > 1).any() and ids.max() > 2 * ids.shape[1]  # gaps: not 0..T-1 shifted
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=len(task.vocab), max_position=256, d_model=32, n_heads=4,
                                  n_layers=1, encoding=encoding, output="encoder")).eval()
    with torch.no_grad():  # sharper attention than at init, so that where it looks shows in the logits
        model.blocks[0].attn.qkv.weight.mul_(10)
        model.blocks[0].attn.proj.weight.mul_(10)
    x = Tensors.from_batch(batch, ids, torch.device("cpu"))
    inputs = x.inputs(encoder=True)
    assert torch.equal(inputs["position_ids"], torch.from_numpy(ids))
    logits = model(**inputs)[0]
    expected = encoder_by_hand(model, inputs["tokens"], inputs["position_ids"], inputs["visible"])
    assert torch.allclose(logits, expected, atol=1e-5)
    # what the comparison tells apart: the same inputs at the ids' ranks 0..T-1
    ranks = torch.arange(ids.shape[1]).expand(*ids.shape)
    assert (encoder_by_hand(model, inputs["tokens"], ranks, inputs["visible"]) - expected).abs().max() > 1e-2
    # and it is relative: every id shifted by one offset changes nothing
    assert torch.allclose(model(**{**inputs, "position_ids": inputs["position_ids"] + 7})[0], logits, atol=1e-5)


# --- abacus ---------------------------------------------------------------------------------

def test_addition_says_which_token_is_which_digit():
    task = tasks.get_task("addition", train_length=4, bos=True)
    batch = task.sample(8, np.random.default_rng(0))
    places = task.digit_places(batch)
    for b in range(len(batch)):
        toks = task.vocab.decode(batch.tokens[b, : batch.seq_len[b]])
        plus, eq = toks.index("+"), toks.index("=")
        a, c = places[b, 1:plus], places[b, eq + 1 : batch.seq_len[b] - 1]
        assert list(a) == list(range(len(a), 0, -1))  # MSB first: the last digit is the 1st place
        assert list(c) == list(range(1, len(c) + 1))  # the sum is written least significant first
        assert places[b, 0] == places[b, plus] == places[b, eq] == places[b, batch.seq_len[b] - 1] == 0
    assert (places[np.arange(places.shape[1])[None] >= batch.seq_len[:, None]] == 0).all()
    assert tasks.get_task("parity", train_length=4).digit_places(batch) is None


def test_abacus_embeds_each_digit_by_its_place_with_a_training_offset():
    torch.manual_seed(0)
    abacus = Abacus(max_place=20, d_model=8)
    places = torch.tensor([[0, 3, 2, 1, 0, 1, 2, 3, 4, 0]])
    assert torch.equal(abacus.eval().indices(places), places)
    out = abacus(places)
    assert torch.equal(out[0, 1], out[0, 7]) and torch.equal(out[0, 3], out[0, 5])  # same place, same vector
    assert torch.equal(out[0, 0], out[0, 4]) and not torch.equal(out[0, 1], out[0, 2])
    abacus.train()
    offsets = set()
    for _ in range(200):
        shifted = abacus.indices(places)
        assert (shifted[places == 0] == 0).all()
        offset = (shifted - places)[places > 0]
        assert (offset == offset[0]).all() and 0 <= int(offset[0]) <= MAX_OFFSET  # one offset per batch
        offsets.add(int(offset[0]))
    assert len(offsets) > 50 and max(offsets) > 90
    with pytest.raises(ValueError, match="place"):
        abacus(torch.tensor([[21]]))


def test_abacus_as_published_draws_an_offset_per_sample_up_to_its_bound_and_normalises_the_sum():
    """The options of the Abacus reference: an offset per sample (each update mixes many offsets), its
    largest value, LayerNorm on the input sum, the table's init std; the defaults draw and build the
    model they always did."""
    torch.manual_seed(0)
    places = torch.tensor([[0, 3, 2, 1, 0, 1]] * 64)
    per_sample = Abacus(max_place=20, d_model=8, max_offset=7, per="sample").train()
    offset = per_sample.indices(places) - places
    assert (offset[:, 1:4] == offset[:, 1:2]).all() and (offset[:, [0, 4]] == 0).all()  # one per sample
    assert len(set(offset[:, 1].tolist())) > 4 and int(offset.max()) <= 7 and per_sample.emb.num_embeddings == 28
    old = make("nope", abacus=True)
    torch.manual_seed(0)
    same = DecoderLM(dataclasses.replace(old.cfg, abacus_offset="sample", abacus_norm=False))
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), same.state_dict().values()))
    torch.manual_seed(0)
    published = DecoderLM(dataclasses.replace(old.cfg, abacus_norm=True, abacus_init_std=0.5))
    assert float(published.abacus.emb.weight.detach().std()) == pytest.approx(0.5, rel=0.1)
    tokens, ids = torch.randint(0, 13, (2, 6)), torch.arange(6).expand(2, 6)
    published.eval()
    x = {}
    published.input_norm.register_forward_hook(lambda m, i, o: x.setdefault("sum", o.detach()))
    published(tokens, ids, digit_places=places[:2])
    assert x["sum"].mean(-1).abs().max() < 1e-5 and float(x["sum"].std(-1, unbiased=False).mean()) == pytest.approx(1, rel=1e-3)
    with pytest.raises(ValidationError, match="abacus_norm"):
        TrialConfig.model_validate({"task": {"name": "addition"}, "eval": {"lengths": [4]},
                                    "positional": {"encoding": "nope", "abacus_norm": True}})


def test_abacus_combines_with_an_encoding_and_generates_with_the_cache():
    model = make("fire", abacus=True)
    tokens = torch.randint(0, 13, (2, 10))
    ids = torch.arange(10).expand(2, 10)
    places = torch.tensor([[0, 2, 1, 0, 2, 1, 0, 1, 2, 3]] * 2)
    with pytest.raises(ValueError, match="digit_places"):
        model(tokens, ids)
    a = model(tokens, ids, digit_places=places)[0]
    assert not torch.allclose(a, model(tokens, ids, digit_places=places.flip(1))[0], atol=1e-4)
    cached = generate(model, tokens[:, :6], ids[:, :6], 4, "sequential", digit_places=places)
    uncached = generate(model, tokens[:, :6], ids[:, :6], 4, "sequential", digit_places=places, use_cache=False)
    assert torch.equal(cached[0], uncached[0])


def test_abacus_needs_a_task_with_digit_places():
    base = {"eval": {"lengths": [4]}, "positional": {"encoding": "nope", "abacus": True}}
    assert TrialConfig.model_validate({"task": {"name": "addition", "params": {"train_length": 3}}, **base})
    with pytest.raises(ValidationError, match="positional.abacus"):
        TrialConfig.model_validate({"task": {"name": "parity", "params": {"train_length": 3}}, **base})


def test_generated_docs_tables_replace_their_own_block_only(tmp_path):
    from study.results.generated import write_generated

    page = tmp_path / "page.md"
    page.write_text("# Page\n\nprose before\n")
    write_generated(page, "a", "| old |", argv=["x.yaml"])
    write_generated(page, "b", "| other |", argv=[])
    write_generated(page, "a", "| new |", argv=["x.yaml", "--seeds", "3"])
    text = page.read_text()
    assert text.startswith("# Page\n\nprose before\n") and "| old |" not in text
    assert text.count("<!-- generated: a -->") == 1 and text.index("| new |") < text.index("| other |")
    assert "x.yaml --seeds 3`" in text


def test_per_position_accuracy_runs_on_an_abacus_model(tmp_path, capsys):
    """study/per_position.py hands an Abacus model its digit places, as the evaluation does
    (without them the model refuses to run)."""
    import yaml

    from study.per_position import main

    config = tmp_path / "abacus.yaml"
    config.write_text(yaml.safe_dump({
        "task": {"name": "addition", "params": {"train_length": 3, "min_length": 1, "operand_order": "lsb_first",
                                                "operands": "unpadded"}},
        "positional": {"encoding": "nope", "ids": "sequential", "max_position": 32, "abacus": True},
        "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
        "optim": {"steps": 4, "batch_size": 8, "warmup_steps": 1},
        "eval": {"lengths": [3, 5], "samples_per_point": 4, "val_samples": 4, "every_steps": 4}}))
    assert main([str(config), "--samples", "4"]) == 0
    out = capsys.readouterr().out
    assert "length 5: target position" in out and "  6  " in out  # 5 + 5 digits: a 6-digit answer
