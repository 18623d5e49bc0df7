"""Semantics of the decoder, its positional encodings, id schemes and generation."""

import contextlib

import numpy as np
import pytest
import torch

from models import ENCODINGS, DecoderLM, ModelConfig, generate, training_ids


def make_model(encoding: str, **kw) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=13, max_position=64, d_model=32, n_heads=4, encoding=encoding, **kw))
    return model.eval()


def rand_inputs(B=3, T=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 13, (B, T), generator=g), torch.arange(T).expand(B, T).clone()


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_shifting_all_ids_changes_logits_only_for_learned(encoding):
    model = make_model(encoding)
    tokens, ids = rand_inputs()
    base, _, _ = model(tokens, ids)
    shifted, _, _ = model(tokens, ids + 17)
    diff = (base - shifted).abs().max().item()
    # fire too reads the query's id, but only through max(L, i): below its threshold L (512) it is
    # relative (tests/test_encodings.py has it beyond)
    if encoding == "learned":
        assert diff > 1e-3
    else:
        assert diff < 1e-4, f"{encoding} is not shift-invariant: {diff}"


@pytest.mark.parametrize("encoding", [e for e in ENCODINGS if e != "nope"])
def test_encodings_see_order_but_nope_only_sees_causality(encoding):
    # Swapping two earlier ids changes what the last token sees under every encoding but nope.
    model = make_model(encoding)
    tokens, ids = rand_inputs(B=1)
    perm = ids.clone()
    perm[0, [2, 5]] = perm[0, [5, 2]]
    a, _, _ = model(tokens, ids)
    b, _, _ = model(tokens, perm)
    assert (a[:, -1] - b[:, -1]).abs().max() > 1e-4
    nope = make_model("nope")
    a, _, _ = nope(tokens, ids)
    b, _, _ = nope(tokens, perm)
    assert torch.allclose(a, b)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("mode", ["sequential", "coupled", "predicted", "randomized"])
@pytest.mark.parametrize("target", ["absolute", "delta", "pointer", "pointer_softmax"])
def test_kv_cache_generation_equals_uncached(encoding, mode, target):
    model = make_model(encoding, position_head=True, position_target=target)
    if target == "pointer":  # untrained, its scan stops at "+1" (first, fires half the time): skip it
        torch.nn.init.constant_(model.pos_head.next.bias, -5.0)
    tokens, ids = rand_inputs(B=4, T=7)
    oracle = torch.randint(0, 40, (4, 9))
    out_c, ids_c = generate(model, tokens, ids, 9, mode, oracle_ids=oracle, use_cache=True)
    out_u, ids_u = generate(model, tokens, ids, 9, mode, oracle_ids=oracle, use_cache=False)
    assert torch.equal(out_c, out_u) and torch.equal(ids_c, ids_u)
    # greedy: each generated token is the argmax of a full forward over everything before it
    full_tokens = torch.cat([tokens, out_c], 1)
    full_ids = torch.cat([ids, ids_c], 1)
    logits, pos_logits, _ = model(full_tokens, full_ids)
    P = tokens.shape[1]
    assert torch.equal(logits[:, P - 1 : -1].argmax(-1), out_c)
    if mode == "coupled":
        assert torch.equal(ids_c, oracle)
    if mode == "predicted":
        # PPC: the id fed back for token t+1 is the position head's choice at token t
        chosen = model.decode_position(pos_logits[:, P - 1 : -1], full_ids[:, P - 1 : -1], full_ids)
        assert torch.equal(chosen, ids_c)
        assert not torch.equal(ids_c, ids[:, -1:] + torch.arange(1, 10))  # not just sequential


def test_pointer_head_decodes_the_id_of_the_key_it_points_at():
    """PPC's pointer head: its argmax is a key (the next id is that key's id) or the extra last
    column (the next id is the current id + 1)."""
    model = make_model("learned", position_head=True, position_target="pointer")
    key_ids = torch.tensor([[0, 5, 9, 12]])
    logits = torch.full((1, 3, 5), -1.0)
    logits[0, 0, 2] = 3.0  # points at the key of id 9
    logits[0, 1, 4] = 3.0  # "+1"
    logits[0, 2, 0] = 3.0  # points back at id 0
    current = torch.tensor([[5, 9, 12]])
    assert model.decode_position(logits, current, key_ids).tolist() == [[9, 10, 0]]
    # one step of generation: logits [B, Tk + 1], current [B]
    assert model.decode_position(logits[:, 1], current[:, 1], key_ids).tolist() == [10]


@pytest.mark.parametrize("gap", [1, 7, 60, 500])
def test_pointer_scan_finds_the_nearest_key_of_a_kind_at_any_gap(gap):
    """Greedy decoding of the scan stops at the nearest key ahead that fires, however many keys that
    do not fire lie between (a softmax with a linear distance bias loses it at some gap)."""
    from models.decoder import scan_first_firing

    n = gap + 40
    fires = torch.zeros(n, dtype=torch.bool)
    fires[[0, 3 + gap, 3 + gap + 2, n - 1]] = True  # the query is key 3; key 0 is behind it
    scores = torch.where(fires, 2.0, -4.0)
    key_ids = torch.arange(n) + 1
    dist = (key_ids - key_ids[3])[None]
    with_next = torch.cat([scores, torch.tensor([-4.0])])[None]
    assert scan_first_firing(with_next, dist).item() == 3 + gap
    with_next[0, -1] = 1.0  # "+1" fires: it comes first
    assert scan_first_firing(with_next, dist).item() == n
    nothing_ahead = torch.where(torch.arange(n) > 3, -4.0, scores)
    assert scan_first_firing(torch.cat([nothing_ahead, torch.tensor([-4.0])])[None], dist).item() == 0


def test_pointer_scan_probabilities_are_stick_breaking():
    from models.decoder import scan_log_probs

    scores = torch.tensor([[0.5, -1.0, 2.0, float("-inf"), 0.0]])  # 4 keys and "+1"
    dist = torch.tensor([[-2, 3, 1, 5]])  # scan: "+1", key 2 (d=1), key 1 (d=3), key 3 (masked), key 0
    s = torch.sigmoid(scores[0])
    p = scan_log_probs(scores, dist).exp()[0]
    expected = [(1 - s[4]) * (1 - s[2]) * (1 - s[1]) * s[0], (1 - s[4]) * (1 - s[2]) * s[1],
                (1 - s[4]) * s[2], 0.0, s[4]]
    assert torch.allclose(p, torch.tensor(expected))


def test_pointer_loss_counts_every_key_that_carries_the_next_id():
    model = make_model("learned", position_head=True, position_target="pointer_softmax")
    ids = torch.tensor([[3, 4, 3, 7]])
    next_ids = torch.tensor([[4, 3, 8, 99]])  # token 3's next id is carried by no key: left out
    logits = torch.randn(1, 4, 5, requires_grad=True)
    allowed = torch.cat([torch.ones(4, 4, dtype=torch.bool).tril(), torch.ones(4, 1, dtype=torch.bool)], -1)
    masked = logits.masked_fill(~allowed[None], float("-inf"))  # causal keys and "+1", as the head gives
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss = model.position_loss(masked, ids, next_ids, mask)
    p = masked.softmax(-1)[0]
    # token 0 (id 3 -> 4): only "+1"; token 1 (id 4 -> 3): key 0; token 2 (id 3 -> 8): nothing
    # carries 8 and it is not 3 + 1, left out too
    expected = -(p[0, 4].log() + p[1, 0].log()) / 2
    assert torch.isclose(loss, expected)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2:].abs().sum() == 0


@pytest.mark.parametrize("target", ["pointer", "pointer_softmax"])
@pytest.mark.parametrize("encoding", [e for e in ENCODINGS if e != "learned"])  # relative ones (fire: below L)
def test_pointer_scores_depend_on_id_differences_only(encoding, target):
    """The pointer's distribution over keys depends on ids only through id_k - id_q (the scan's
    order, the softmax's bias), so with a shift-invariant encoding a shifted sequence gets the same
    distribution: what it learned at short ids holds at any offset."""
    from models.decoder import scan_log_probs

    model = make_model(encoding, position_head=True, position_target=target)
    tokens, ids = rand_inputs()

    def pointer(ids):
        _, scores, _ = model(tokens, ids)
        if target == "pointer":
            return scan_log_probs(scores, ids[:, None, :] - ids[:, :, None])
        return scores.log_softmax(-1)

    assert torch.allclose(pointer(ids), pointer(ids + 23), atol=1e-4)
    # and it does depend on the ids: swapping two tokens' ids reorders the scan / moves the bias
    swapped = ids.clone()
    swapped[:, [2, 5]] = swapped[:, [5, 2]]
    assert not torch.allclose(pointer(ids), pointer(swapped), atol=1e-4)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_hidden_tokens_are_invisible(encoding):
    # Hide token 3 from every other query (in every layer): nothing else may depend on it.
    model = make_model(encoding)
    tokens, ids = rand_inputs(B=2, T=12)
    visible = torch.ones(2, 12, 12, dtype=torch.bool)
    visible[:, :, 3] = False
    visible[:, 3, 3] = True
    a, _, _ = model(tokens, ids, visible=visible)
    changed = tokens.clone()
    changed[:, 3] = (changed[:, 3] + 1) % 13
    b, _, _ = model(changed, ids, visible=visible)
    others = [t for t in range(12) if t != 3]
    assert torch.allclose(a[:, others], b[:, others], atol=1e-6)
    c, _, _ = model(changed, ids)  # without the mask the change is seen downstream
    assert not torch.allclose(a[:, -1], c[:, -1], atol=1e-4)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_an_encoder_attends_both_ways_and_a_decoder_only_back(encoding):
    """`output: encoder` is the Chomsky suite's bidirectional transformer: changing the last token
    changes what the first one computes; autoregressive, it cannot."""
    tokens, ids = rand_inputs(B=2, T=8)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 13
    for output, sees_later in (("encoder", True), ("autoregressive", False)):
        model = make_model(encoding, output=output)
        a, b = model(tokens, ids)[0], model(changed, ids)[0]
        assert (a[:, 0] - b[:, 0]).abs().max().item() > 1e-4 if sees_later else torch.allclose(a[:, :-1], b[:, :-1])


def test_learned_encoding_rejects_ids_beyond_table():
    model = make_model("learned")
    tokens, ids = rand_inputs()
    with pytest.raises(ValueError, match="max_position"):
        model(tokens, ids + 60)


def test_training_id_schemes():
    rng = np.random.default_rng(0)
    B, T, max_pos = 64, 12, 50
    seq_len = rng.integers(3, T + 1, size=B)
    coupled = np.tile(np.arange(1, T + 1), (B, 1))
    valid = np.arange(T)[None] < seq_len[:, None]

    seq = training_ids("sequential", coupled, seq_len, max_pos, rng)
    assert (seq == np.arange(T)).all()

    shifted = training_ids("random_shift", coupled, seq_len, max_pos, rng)
    assert (np.where(valid[:, 1:], np.diff(shifted, axis=1), 1) == 1).all()  # one offset per sample
    assert shifted.max() < max_pos and len(set(shifted[:, 0])) > 10

    pose = training_ids("pose", coupled, seq_len, max_pos, rng, pose_chunks=3)
    steps = np.where(valid[:, 1:], np.diff(pose, axis=1), 1)
    assert (steps >= 1).all() and pose.max() < max_pos
    assert (steps > 1).any(), "PoSE should skip ids between chunks"
    assert ((steps > 1).sum(axis=1) <= 2).all()  # at most chunks-1 jumps

    cp = training_ids("coupled", coupled, seq_len, max_pos, rng, shift=True)
    offsets = np.where(valid, cp - coupled, cp[:, :1] - coupled[:, :1])
    assert (offsets == offsets[:, :1]).all() and offsets.min() >= 0 and cp.max() < max_pos
    assert (training_ids("coupled", coupled, seq_len, max_pos, rng, shift=False) == coupled).all()


def test_bos_prefix_keeps_id_zero_and_the_rest_is_shifted_as_before():
    """fixed_prefix=1 (a `<bos>`): its id stays 0 in every scheme, the rest is shifted as a sequence
    of its own whose ids start at 1, so the `<bos>` is seen at every id distance."""
    rng = np.random.default_rng(1)
    B, T, max_pos = 256, 10, 40
    seq_len = rng.integers(3, T + 1, size=B)
    coupled = np.concatenate([np.zeros((B, 1), int), np.tile(np.arange(1, T), (B, 1))], axis=1)
    valid = np.arange(T)[None] < seq_len[:, None]
    for scheme in ("sequential", "random_shift", "pose", "coupled", "predicted"):
        ids = training_ids(scheme, coupled, seq_len, max_pos, rng, fixed_prefix=1)
        assert (ids[:, 0] == 0).all() and (ids[:, 1:] >= 1).all() and ids.max() < max_pos, scheme
        if scheme in ("random_shift", "coupled"):
            gaps = ids[:, 1] - ids[:, 0]
            assert gaps.min() == 1 and gaps.max() > max_pos - T - 3, scheme  # every distance to <bos>
            assert (np.where(valid[:, 2:], np.diff(ids[:, 1:], axis=1), 1) == 1).all()


def test_new_model_options_default_to_the_old_model():
    """Options from the reference implementation of position coupling: their defaults build the same weights
    and logits; a larger embedding init scales those tables only; RMSNorm and unscaled attention
    change the function."""
    torch.manual_seed(0)
    old = DecoderLM(ModelConfig(vocab_size=13, max_position=64, d_model=32, n_heads=4))
    torch.manual_seed(0)
    wide = DecoderLM(ModelConfig(vocab_size=13, max_position=64, d_model=32, n_heads=4, pos_init_std=1.0,
                                 tok_init_std=0.5))
    for (name, a), (_, b) in zip(old.state_dict().items(), wide.state_dict().items()):
        if name == "pos_emb.weight":
            assert torch.allclose(b, a * 50)
        elif name == "tok_emb.weight":
            assert torch.allclose(b, a * 25)
        else:
            assert torch.equal(a, b), name
    tokens, ids = rand_inputs()
    base = old.eval()(tokens, ids)[0]
    for kw in ({"norm": "rms"}, {"attn_scale": "none"}):
        torch.manual_seed(0)
        other = DecoderLM(ModelConfig(vocab_size=13, max_position=64, d_model=32, n_heads=4, **kw)).eval()
        assert not torch.allclose(other(tokens, ids)[0], base), kw
        out_c, _ = generate(other, tokens, ids, 5, "sequential", use_cache=True)
        out_u, _ = generate(other, tokens, ids, 5, "sequential", use_cache=False)
        assert torch.equal(out_c, out_u), kw


def _backward_nodes(tensor: torch.Tensor) -> set[str]:
    seen, todo = set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node.name() not in seen | {"torch::autograd::AccumulateGrad"}:
            seen.add(node.name())
            todo += [next_fn for next_fn, _ in node.next_functions]
    return seen


@pytest.mark.parametrize("encoding", ["nope", "alibi"])  # a causal mask, and a score bias
def test_bf16_training_on_cpu_takes_the_math_attention_kernel_and_keeps_fp64s_gradients(encoding):
    """On CPU in bf16 at <= MATH_ATTENTION_MAX_KEYS keys the flash kernel's backward is 1.3-6x slower
    (benchmarks/suite.py, P8): the training forward records the math kernel's graph, whose gradients
    stay as close to fp64's as bf16 allows; fp32 and longer sequences keep the flash kernel."""
    from models import decoder

    def attention_grad(dtype, keys):
        torch.manual_seed(1)
        q, k, v = (torch.randn(2, 4, keys, 16, dtype=torch.float64) for _ in range(3))
        qc, kc, vc = (t.to(dtype).requires_grad_() for t in (q, k, v))
        with decoder.attention_kernel(qc, kc):
            out = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
        out.float().square().sum().backward()
        return out, qc.grad.double()

    def flash(node_names):
        return any("Flash" in n for n in node_names)

    out, grad = attention_grad(torch.bfloat16, 24)
    assert not flash(_backward_nodes(out))
    assert flash(_backward_nodes(attention_grad(torch.float32, 24)[0]))
    assert flash(_backward_nodes(attention_grad(torch.bfloat16, decoder.MATH_ATTENTION_MAX_KEYS + 1)[0]))
    _, exact = attention_grad(torch.float64, 24)
    assert (grad - exact).abs().max() / exact.abs().max() < 2e-2  # bf16 keeps 8 bits: 2^-8 per op

    model = make_model(encoding).train()
    tokens, ids = rand_inputs(B=2, T=12)
    with torch.autocast("cpu", torch.bfloat16):
        logits, _, _ = model(tokens, ids)
    assert not flash(_backward_nodes(logits))
    weight = torch.zeros(1, 1, 12, 8, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():  # evaluation keeps the flash kernel, whose forward is the faster one
        q = weight * 1  # as a projection's output is there
        assert isinstance(decoder.attention_kernel(q, q), contextlib.nullcontext)
