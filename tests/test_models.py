"""Semantics of the decoder, its positional encodings, id schemes and generation."""

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
    if encoding == "learned":
        assert diff > 1e-3
    else:
        assert diff < 1e-4, f"{encoding} is not shift-invariant: {diff}"


@pytest.mark.parametrize("encoding", ["learned", "rope", "alibi"])
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
@pytest.mark.parametrize("mode", ["sequential", "coupled", "predicted"])
def test_kv_cache_generation_equals_uncached(encoding, mode):
    model = make_model(encoding, position_head=True, position_target="delta" if encoding == "rope" else "absolute")
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
        chosen = model.decode_position(pos_logits[:, P - 1 : -1], full_ids[:, P - 1 : -1])
        assert torch.equal(chosen, ids_c)
        assert not torch.equal(ids_c, ids[:, -1:] + torch.arange(1, 10))  # not just sequential


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
    """Options from the reference implementation (issue 19): their defaults build the same weights
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
