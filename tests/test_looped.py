"""Looped transformers (`model.loops`; Fan et al. 2024, McLeish et al. 2024's recurrent block): the
n_layers blocks run as one unit N times, the input embedding added back before each pass, the final
norm after each; N fixed or counted per row from its prompt (`loops: per_length`). Also the
full-answer read-out they are trained with (`model.output: full_answer`)."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from models import DecoderLM, ModelConfig, generate
from models.decoder import loop_passes
from tasks import get_task
from trial.config import TrialConfig
from trial.evaluate import Tensors
from trial.limits import estimate
from trial.loop import train_loop_per_worker
from trial.yaml_io import describe_errors


def make(encoding="learned", seed=0, **kw) -> DecoderLM:
    torch.manual_seed(seed)
    cfg = {"vocab_size": 13, "max_position": 64, "d_model": 32, "n_heads": 4, "encoding": encoding, **kw}
    return DecoderLM(ModelConfig(**cfg)).eval()


def inputs(B=3, T=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 13, (B, T), generator=g), torch.arange(T).expand(B, T).clone()


def by_hand(model: DecoderLM, tokens, ids, passes: int, inject: bool = True) -> torch.Tensor:
    """The looped forward written out: h = 0; `passes` times h = ln_f(blocks(h + e)); logits of h.
    (learned ids, no score bias: the blocks take no rope and no mask, causal attention.)"""
    e = model.tok_emb(tokens) + model.pos_emb(ids)
    h = torch.zeros_like(e)
    for p in range(passes):
        h = h + e if inject or p == 0 else h
        for block in model.blocks:
            h, _ = block(h, None, ids, None, True, None)
        h = model.ln_f(h)
    return model.lm_head(h)


# --- the model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("loops", [3, "per_length"])
def test_a_looped_model_has_the_parameters_of_the_model_it_loops(loops):
    plain = make(n_layers=2)
    looped = make(n_layers=2, loops=loops)
    a, b = plain.state_dict(), looped.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)  # the same draws too
    assert sum(p.numel() for p in looped.parameters()) == sum(p.numel() for p in plain.parameters())
    cfg = {"task": {"name": "copy", "params": {"train_length": 6}}, "eval": {"lengths": [6]},
           "model": {"d_model": 32, "n_layers": 2}}
    looped_cfg = TrialConfig.model_validate({**cfg, "model": {**cfg["model"], "loops": loops}})
    built = looped_cfg.build_model(len(looped_cfg.task_instance.vocab))
    assert looped_cfg.n_parameters() == sum(p.numel() for p in built.parameters())
    assert looped_cfg.n_parameters() == TrialConfig.model_validate(cfg).n_parameters()


@pytest.mark.parametrize("n_layers", [1, 2])
def test_the_looped_forward_is_its_blocks_applied_n_times_with_the_input_added_back(n_layers):
    tokens, ids = inputs()
    looped = make(n_layers=n_layers, loops=4)
    expected = by_hand(looped, tokens, ids, 4)
    assert torch.allclose(looped(tokens, ids)[0], expected, atol=1e-5)
    # what the comparison can tell apart: one pass, and four without the input added back
    assert not torch.allclose(by_hand(looped, tokens, ids, 1), expected, atol=1e-3)
    assert not torch.allclose(by_hand(looped, tokens, ids, 4, inject=False), expected, atol=1e-3)
    # one pass is the plain model, bit for bit
    plain = make(n_layers=n_layers)
    assert torch.equal(plain(tokens, ids)[0], make(n_layers=n_layers, loops=1)(tokens, ids)[0])
    assert torch.allclose(plain(tokens, ids)[0], by_hand(plain, tokens, ids, 1), atol=1e-5)


def test_per_length_passes_grow_with_each_rows_prompt():
    """`loops: per_length`: ceil(factor x prompt length) + offset passes, at least 1, per row; a row
    of a batch gets what it gets alone, from the fixed-loops model of its own count."""
    assert [loop_passes(p, 1.0, -1) for p in (1, 2, 5, 9)] == [1, 1, 4, 8]  # parity, copy: n + 1 tokens -> n
    assert [loop_passes(p, 0.5, 0) for p in (4, 6, 7)] == [2, 3, 4]  # addition: 2n + 2 -> n + 1
    assert loop_passes(3, 1.0, -10) == 1
    cfg = ModelConfig(vocab_size=13, loops="per_length", loop_factor=1.0, loop_offset=-1)
    assert cfg.passes(7) == 6 and ModelConfig(vocab_size=13, loops=3).passes(7) == 3
    tokens, ids = inputs(B=3, T=12)
    prompt = torch.tensor([3, 5, 8])
    per_length = make(n_layers=1, loops="per_length", loop_offset=-1)
    out = per_length(tokens, ids, prompt_len=prompt)[0]
    for row, passes in enumerate([2, 4, 7]):
        alone = make(n_layers=1, loops=passes)(tokens[row:row + 1], ids[row:row + 1])[0]
        assert torch.allclose(out[row:row + 1], alone, atol=1e-5), (row, passes)
        other = make(n_layers=1, loops=passes + 1)(tokens[row:row + 1], ids[row:row + 1])[0]
        assert not torch.allclose(out[row:row + 1], other, atol=1e-3)
    with pytest.raises(ValueError, match="loops: per_length .*prompt_len"):
        per_length(tokens, ids)


@pytest.mark.parametrize("encoding", ["learned", "rope", "alibi", "nope"])
@pytest.mark.parametrize("loops", [3, "per_length"])
def test_a_looped_model_generates_with_its_cache_what_it_generates_without(encoding, loops):
    """The cache holds a key per pass and layer: decoding with it equals decoding without, and each
    generated token is the argmax of a full forward (with the prompt's passes) over what came before."""
    model = make(encoding, n_layers=2, loops=loops, **({"loop_factor": 0.5} if loops == "per_length" else {}))
    tokens, ids = inputs(B=4, T=7)
    out_c, ids_c = generate(model, tokens, ids, 6, "sequential", use_cache=True)
    out_u, ids_u = generate(model, tokens, ids, 6, "sequential", use_cache=False)
    assert torch.equal(out_c, out_u) and torch.equal(ids_c, ids_u)
    full = model(torch.cat([tokens, out_c], 1), torch.cat([ids, ids_c], 1), prompt_len=torch.full((4,), 7))[0]
    assert torch.equal(full[:, 6:-1].argmax(-1), out_c)
    lens = torch.full((4,), 7)
    _, _, cache = model(tokens, ids, use_cache=True, prompt_len=lens)
    assert len(cache) == 2 * model.cfg.passes(7) and model.cfg.passes(7) == (3 if loops == 3 else 4)
    # a step on the cache computes what the full forward computes at that token
    step = model(out_c[:, :2], ids_c[:, :2], cache=cache, prompt_len=lens)[0]
    assert torch.allclose(step, full[:, 7:9], atol=1e-5)


def test_a_looped_pointer_head_finds_its_cached_keys_after_every_pass():
    """PPC's pointer head caches its keys after the blocks' entries, of every pass."""
    model = make("rope", n_layers=2, loops=2, position_head=True, position_target="pointer_softmax")
    tokens, ids = inputs(B=4, T=7)
    out_c, ids_c = generate(model, tokens, ids, 6, "predicted", use_cache=True)
    out_u, ids_u = generate(model, tokens, ids, 6, "predicted", use_cache=False)
    assert torch.equal(out_c, out_u) and torch.equal(ids_c, ids_u)


def test_full_answer_reads_every_output_at_once_under_causal_attention():
    """`output: full_answer` (Fan et al.'s full-answer prediction): a token sees only those before it,
    where an encoder sees both ways; with the trial's placeholders both read the answer in one pass."""
    tokens, ids = inputs(B=2, T=8)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 13
    causal = make(output="full_answer", loops=2)
    assert torch.allclose(causal(tokens, ids)[0][:, :-1], causal(changed, ids)[0][:, :-1])
    assert torch.allclose(causal(tokens, ids)[0], make(loops=2)(tokens, ids)[0])  # the decoder's attention
    both = make(output="encoder", loops=2)
    assert (both(tokens, ids)[0][:, 0] - both(changed, ids)[0][:, 0]).abs().max() > 1e-4


def test_the_trial_passes_each_rows_prompt_length():
    task = get_task("parity", train_length=6, min_length=2)
    batch = task.sample(16, np.random.default_rng(0))
    assert len(set(batch.prompt_len.tolist())) > 1
    x = Tensors.from_batch(batch, batch.position_ids, torch.device("cpu"))
    for encoder in (False, True):
        assert x.inputs(encoder)["prompt_len"].tolist() == batch.prompt_len.tolist()


# --- the trial config --------------------------------------------------------------------------

def trial(**model) -> dict:
    return {"task": {"name": "parity", "params": {"train_length": 6, "min_length": 2}},
            "positional": {"encoding": "nope", "max_position": 32},
            "model": {"d_model": 32, "n_layers": 1, "n_heads": 4, **model},
            "optim": {"lr": 3e-3, "steps": 6, "batch_size": 16, "warmup_steps": 2},
            "eval": {"lengths": [6, 12], "samples_per_point": 16, "val_samples": 32, "every_steps": 3}, "seed": 1}


@pytest.mark.parametrize("model, field", [
    ({"loops": 0}, "model.loops"),
    ({"loops": "per_len"}, "model.loops"),
    ({"loops": 2.5}, "model.loops"),
    ({"loops": 700, "n_layers": 2}, "model.loops"),
    ({"loops": 3, "loop_factor": 2.0}, "model.loop_factor"),
    ({"loops": 3, "loop_offset": -1}, "model.loop_offset"),
    ({"loops": "per_length", "loop_factor": 0}, "model.loop_factor"),
    ({"loops": "per_length", "loop_offset": 5000}, "model.loop_offset"),
    ({"output": "decoder_only"}, "model.output"),
])
def test_bad_loop_options_name_their_field(model, field):
    with pytest.raises(ValidationError) as err:
        TrialConfig.model_validate(trial(**model))
    assert describe_errors(err.value).startswith(field), describe_errors(err.value)


def test_per_length_loops_need_a_prompt():
    lm = trial(loops="per_length")
    lm["task"] = {"name": "lm", "params": {"train_length": 16, "max_bytes": 100_000}}
    lm["eval"] = {"lengths": [16], "samples_per_point": 4}
    with pytest.raises(ValidationError, match="model.loops: per_length counts each row's passes from its prompt"):
        TrialConfig.model_validate(lm)
    TrialConfig.model_validate({**lm, "model": {**lm["model"], "loops": 2}})  # a fixed count needs none


def test_a_looped_trial_is_estimated_with_every_pass():
    one = estimate(TrialConfig.model_validate(trial()))[0]
    four = estimate(TrialConfig.model_validate(trial(loops=4)))[0]
    grows = estimate(TrialConfig.model_validate(trial(loops="per_length")))[0]
    assert one < four < grows  # per_length: a pass per token of the longest sequence, a bound


@pytest.mark.parametrize("output", ["autoregressive", "full_answer"])
def test_the_loop_trains_and_evaluates_a_per_length_looped_model(output):
    out = train_loop_per_worker(trial(loops="per_length", loop_offset=-1, output=output))
    assert out["metrics"]["step"] == 6 and [r["length"] for r in out["records"]] == [6, 12]
    assert all(0 <= r["exact_match"] <= 1 for r in out["records"])
