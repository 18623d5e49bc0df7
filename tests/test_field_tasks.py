"""Semantics of the field's tasks: multiplication (Cho et al.'s N x M layout), reverse, duplicate
and sort (the Chomsky-hierarchy suite). The registry-wide checks (padding, maxima, the dependency rule
of each target, locality) are in test_tasks.py; here is what each task means and its coupled ids."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from test_tasks import check_padding, dependency_offsets, next_token, rng, rows, run_cli

from tasks import TaskParamError, get_task

NEW = ["multiplication", "reverse", "duplicate", "sort"]


def check_deps(task, batch, reference, every_sample: bool | None) -> None:
    """As test_tasks' dependency test, with any reference rule: the rule reproduces every target;
    changing a token outside a target's deps (within its value class) never changes the rule's
    next token; each dependency changes it in some sample (every sample, if `every_sample`; None:
    not checked)."""
    others = {tok: [o for o in group if o != tok] for group in task.value_classes() for tok in group}
    live: dict[tuple[int, int], list[bool]] = {}
    for b, (tokens, *_) in enumerate(rows(task, batch)):
        targets, deps = np.flatnonzero(batch.loss_mask[b]), batch.meta[b]["deps"]
        assert len(deps) == len(targets)
        for i, (t, dep) in enumerate(zip(targets, deps)):
            assert reference(tokens[:t]) == tokens[t], (tokens, t)
            for p in range(t):
                changes = [reference(tokens[:p] + [o] + tokens[p + 1:t]) != tokens[t] for o in others.get(tokens[p], [])]
                if p in dep:
                    if changes:
                        live.setdefault((i, dep.index(p)), []).append(any(changes))
                else:
                    assert not any(changes), f"target {t} changes with token {p}, not a dep {dep}: {tokens}"
    assert live
    if every_sample is None:
        return
    for key, mattered in live.items():
        assert (all if every_sample else any)(mattered), (key, mattered)


# --- reverse -----------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [23, None])
def test_reverse_outputs_the_input_reversed_with_the_ids_of_the_inputs_it_copies(length):
    task = get_task("reverse", train_length=9)
    batch = task.sample(200, rng(1), length=length)
    check_padding(task, batch)
    for (tokens, ids, loss, ans, prompt), answer in zip(rows(task, batch), batch.answers):
        n = (len(tokens) - 2) // 2
        assert tokens[n] == "=" and tokens[-1] == "<eos>" and set(tokens[:n]) <= {"0", "1"}
        assert tokens[n + 1 : 2 * n + 1] == tokens[:n][::-1] and "".join(tokens[:n][::-1]) == answer
        # inputs 1..n, `=` n+1, output i has x_{n-1-i}'s id n-i, <eos> 0
        assert ids == list(range(1, n + 2)) + list(range(n, -1, -1))
        assert all(ids[n + 1 + i] == ids[n - 1 - i] for i in range(n))
        assert prompt == n + 1 and loss == [False] * (n + 1) + [True] * (n + 1)
        assert ans == [False] * (n + 1) + [True] * n + [False]
    assert task.local_coupling


def test_reverse_with_many_symbols_separates_them_in_the_answer():
    task = get_task("reverse", alphabet=40)
    batch = task.sample(20, rng(2), length=12)
    for (tokens, *_), answer in zip(rows(task, batch), batch.answers):
        assert answer.split(" ") == tokens[:12][::-1]
    assert {t for toks, *_ in rows(task, batch) for t in toks[:12]} > {str(s) for s in range(10)}


# --- duplicate ---------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [17, None])
def test_duplicate_outputs_the_input_twice_and_copies_share_the_inputs_ids(length):
    task = get_task("duplicate", train_length=9)
    batch = task.sample(200, rng(3), length=length)
    check_padding(task, batch)
    for (tokens, ids, loss, ans, prompt), answer in zip(rows(task, batch), batch.answers):
        n = (len(tokens) - 2) // 3
        x = tokens[:n]
        assert tokens[n] == "=" and tokens[n + 1 :] == x + x + ["<eos>"] and answer == "".join(x + x)
        # the first copy's last symbol takes `=`'s id 0 (it precedes a copy); the rest their input's
        inputs = list(range(1, n + 1))
        assert ids == inputs + [0] + inputs[:-1] + [0] + inputs + [n + 1]
        assert prompt == n + 1 and loss == [False] * (n + 1) + [True] * (2 * n + 1)
        assert ans == [False] * (n + 1) + [True] * (2 * n) + [False]
    assert task.local_coupling


def test_duplicate_reads_the_second_copys_first_symbol_at_plus_one():
    """The wrap: x_0 again, predicted by the first copy's last symbol, is read at +1 like every
    other output (with x_{n-1}'s id there, it would be read at 1 - n)."""
    task = get_task("duplicate", train_length=6)
    for n in (1, 6, 30):
        batch = task.sample(4, rng(n), length=n)
        wrap = 2 * n + 1  # the column of the second copy's first symbol
        assert (batch.position_ids[:, wrap - 1] == 0).all() and (batch.position_ids[:, wrap] == 1).all()
        assert batch.meta[0]["deps"][n] == [0] and (batch.tokens[:, wrap] == batch.tokens[:, 0]).all()
        assert dependency_offsets(task, n, None) == {1}


# --- sort --------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [40, None])
def test_sort_outputs_a_sorted_permutation_of_the_input(length):
    task = get_task("sort", train_length=12)
    batch = task.sample(200, rng(6), length=length)
    check_padding(task, batch)
    seen = set()
    for (tokens, ids, _loss, ans, prompt), answer, meta in zip(rows(task, batch), batch.answers, batch.meta):
        n = meta["length"]
        x, y = tokens[:n], tokens[n + 1 : 2 * n + 1]
        assert tokens[n] == "=" and tokens[-1] == "<eos>" and len(tokens) == 2 * n + 2
        assert Counter(x) == Counter(y) and y == sorted(y, key=int) and "".join(y) == answer
        assert ids == list(range(1, 2 * n + 3))  # sequential: no coupling is claimed
        assert ans == [False] * (n + 1) + [True] * n + [False] and prompt == n + 1
        assert meta["deps"] == [list(range(n))] * n + [[]]
        seen |= set(x)
    assert seen == {"0", "1", "2", "3", "4"}  # the Chomsky suite's alphabet of 5


def test_sort_is_not_local_every_output_reads_the_whole_input():
    task = get_task("sort", train_length=6)
    assert not task.local_coupling
    short, long = dependency_offsets(task, 6, None), dependency_offsets(task, 48, None)
    assert max(map(abs, long)) > max(map(abs, short)) and len(long) > len(short)


# --- multiplication ----------------------------------------------------------------------------


def read_product(tokens: list[str]) -> tuple[str, str, list[str]]:
    """(a, b, product digits as written) read back from a sample's tokens."""
    star, eq = tokens.index("*"), tokens.index("=")
    return "".join(tokens[:star]), "".join(tokens[star + 1 : eq]), tokens[eq + 1 : -1]


@pytest.mark.parametrize("length,k", [(30, 2), (9, 1), (14, 12), (None, None)])
def test_multiplication_product_and_cho_et_al_coupled_ids(length, k):
    task = get_task("multiplication", train_length=8)
    batch = task.sample(300, rng(7), length=length, k=k)
    check_padding(task, batch)
    for (tokens, ids, loss, ans, prompt), answer, meta in zip(rows(task, batch), batch.answers, batch.meta):
        a, b, c = read_product(tokens)
        n, m = len(a), len(b)
        assert (n, m) == (meta["length"], meta["k"]) and (a, b) == (meta["a"], meta["b"])
        assert m == (k or 2) and (n == length if length else 2 <= n <= 8)
        assert int(a) * int(b) == int(answer) and len(answer) == len(c) == n + m
        assert "".join(reversed(c)) == answer and tokens[-1] == "<eos>"
        # significance j -> id j + 1 in a, b and the product; `*`, `=` 0; <eos> n + m + 1
        assert ids == list(range(n, 0, -1)) + [0] + list(range(m, 0, -1)) + [0] + list(range(1, n + m + 1)) + [n + m + 1]
        assert prompt == n + m + 2 and loss == [False] * prompt + [True] * (n + m + 1)
        assert ans == [False] * prompt + [True] * (n + m) + [False]
    assert any(answer[0] != "0" for answer in batch.answers)  # products reach the top digit


def test_multiplication_draws_m_only_from_min_k_to_train_k():
    fixed = get_task("multiplication", train_length=7)
    assert {m["k"] for m in fixed.sample(200, rng(8)).meta} == {2}  # N x 2, as the reference trains
    assert {m["length"] for m in fixed.sample(200, rng(8)).meta} == set(range(2, 8))
    ranged = get_task("multiplication", train_length=7, train_k=3, min_k=1)
    assert {m["k"] for m in ranged.sample(300, rng(9)).meta} == {1, 2, 3}
    assert get_task("multiplication", train_k=4).min_k == 4


# N x 12: the lowest of the 3 digits below a place changes its carry only where the carry out of
# that digit is below 9, rare when b has 12 digits: only the rule and the deps' sufficiency are checked
@pytest.mark.parametrize("length,k,samples,live", [(6, 1, 12, False), (6, 2, 16, False), (12, 12, 4, None)])
def test_multiplication_deps_are_what_fixes_each_product_digit(length, k, samples, live):
    """The reference rule reads the w product digits below a place (w = 1 for N x 1, 2 up to
    N x 11, 3 from N x 12) and the partial products they need: exactly meta["deps"]."""
    task = get_task("multiplication", train_length=length, train_k=k)
    batch = task.sample(samples, rng(10), length=length, k=k)
    w = {1: 1, 2: 2, 12: 3}[k]
    last = batch.meta[0]["deps"][-2]  # the top digit: c_{n+m-1} reads c_{n+m-1-w} .. c_{n+m-2}
    assert last[-w:] == [length + k + 2 + p for p in range(length + k - 1 - w, length + k - 1)]
    check_deps(task, batch, lambda prefix: next_token("multiplication", prefix), every_sample=live)


def test_multiplication_is_local_in_a_and_the_product_but_not_in_b():
    task = get_task("multiplication", train_length=6)
    assert not task.local_coupling
    for length in (6, 48):
        batch = task.sample(16, rng(length), length=length, k=2)
        near, far = set(), set()
        for b in range(len(batch)):
            ids, targets = batch.position_ids[b], np.flatnonzero(batch.loss_mask[b])
            for t, dep in zip(targets, batch.meta[b]["deps"]):
                for d in dep:
                    in_b = length < d <= length + 2
                    (far if in_b else near).add(int(ids[d] - ids[t - 1]))
        assert near == {-2, -1, 0, 1}  # a_{j-3}..a_j and c_{j-2}, c_{j-1}, whatever the length
        assert (min(far), max(far)) == (-length, 1)  # b_0 from c_0's predecessor (`=`) to the top's


def test_multiplication_with_bos():
    plain, bos = get_task("multiplication"), get_task("multiplication", bos=True)
    a, b = plain.sample(8, rng(11), length=6), bos.sample(8, rng(11), length=6)
    assert (b.position_ids[:, 0] == 0).all() and np.array_equal(b.position_ids[:, 1:], a.position_ids + 1)
    assert b.answers == a.answers and bos.max_position_id(6, 2) == plain.max_position_id(6, 2) + 1 == 10


@pytest.mark.parametrize("bos", [False, True])
def test_multiplication_digit_places_for_abacus(bos):
    """Each digit's place in its own number (1 = least significant), 0 on `*`, `=`, `<eos>`, `<bos>`
    and padding: a_{N-1}..a_0 -> N..1, b -> M..1, the product (least significant first) 1..N+M."""
    task = get_task("multiplication", train_length=6, bos=bos)
    batch = task.sample(50, rng(12))
    places = task.digit_places(batch)
    assert places.shape == batch.tokens.shape and places.dtype == np.int64
    for b, meta in enumerate(batch.meta):
        n, m = meta["length"], meta["k"]
        row = places[b].tolist()[int(bos):]
        expected = list(range(n, 0, -1)) + [0] + list(range(m, 0, -1)) + [0] + list(range(1, n + m + 1)) + [0]
        assert row[: len(expected)] == expected and not any(row[len(expected):])
        assert not bos or places[b, 0] == 0  # `<bos>`


# --- shared: errors, determinism, the CLI ---------------------------------------------------------


def test_parameter_errors_name_the_parameter():
    cases = [
        (lambda: get_task("multiplication", train_length=3, train_k=4), "train_k"),
        (lambda: get_task("multiplication", train_k=2, min_k=3), "min_k"),
        (lambda: get_task("multiplication", train_k=0), "train_k"),
        (lambda: get_task("multiplication").sample(2, rng(), length=3, k=4), "k"),
        (lambda: get_task("multiplication").sample(2, rng(), length=0, k=1), "length"),
        (lambda: get_task("reverse", train_k=2), "train_k"),
        (lambda: get_task("reverse").sample(2, rng(), length=0), "length"),
        (lambda: get_task("sort", alphabet=0), "alphabet"),
        (lambda: get_task("reverse", alphabet=True), "alphabet"),
        (lambda: get_task("sort", min_length=12, train_length=10), "min_length"),
    ]
    for build, param in cases:
        with pytest.raises(TaskParamError) as err:
            build()
        assert err.value.param == param and str(err.value).startswith(f"{param}:")


@pytest.mark.parametrize("name", NEW)
def test_same_seed_same_samples(name):
    task = get_task(name)
    k = 2 if task.uses_k else None
    for length in (None, 7):
        a, b, c = (task.sample(32, rng(seed), length=length, k=k) for seed in (3, 3, 4))
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.position_ids, b.position_ids)
        assert a.meta == b.meta and a.answers == b.answers
        assert a.answers != c.answers


def test_cli_lists_and_samples_the_new_tasks():
    listing = run_cli("list")
    assert listing.returncode == 0 and all(name in listing.stdout for name in NEW)
    out = run_cli("sample", "multiplication", "--length", "6", "--k", "2", "--count", "5", "--seed", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout == run_cli("sample", "multiplication", "--length", "6", "--k", "2", "--count", "5",
                                 "--seed", "3").stdout
    for line in out.stdout.splitlines():
        record = json.loads(line)
        assert int(record["meta"]["a"]) * int(record["meta"]["b"]) == int(record["answer"])
    bad = run_cli("sample", "multiplication", "--length", "2", "--k", "3")
    assert bad.returncode == 2 and bad.stderr.startswith("error: k:")
