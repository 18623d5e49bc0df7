"""Semantics of the field's tasks: multiplication (Cho et al.'s N x M layout), reverse, duplicate
and sort (the Chomsky-hierarchy suite). The registry-wide checks (padding, maxima, the dependency rule
of each target, locality) are in test_tasks.py; here is what each task means and its coupled ids."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from test_tasks import check_padding, dependency_offsets, next_token, rng, rows, run_cli

from tasks import TaskParamError, get_task
from tasks.priming import training_set

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


# --- index hints (Zhou et al. 2023; 2024) ----------------------------------------------------------


def test_index_hints_write_the_published_format_exactly():
    """A fixed seed's samples, token by token: Zhou et al. 2024's reversed format with index hints
    (576 + 361 -> a6b7c5+a1b6c3=a7b3c9 there; here the sum's carry place too), the hints' run starting
    anywhere among hint_symbols; most significant digit first, the hints follow the places; multiplication."""
    def first(task, **cell):
        batch = task.sample(2, rng(0), **cell)
        (tokens, ids, *_), = list(rows(task, batch))[:1]
        return " ".join(tokens), ids, batch.answers[0], batch.meta[0]["hint_start"]

    lsb = get_task("addition", train_length=3, index_hints=True, hint_symbols=6, operand_order="lsb_first")
    assert first(lsb, length=3) == ("b 8 c 6 d 5 + b 1 c 8 d 6 = b 9 c 4 d 2 e 1 <eos>",
                                    [1, 1, 2, 2, 3, 3, 0, 1, 1, 2, 2, 3, 3, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5], "1249", 1)
    msb = get_task("addition", train_length=3, index_hints=True, hint_symbols=6)
    assert first(msb, length=3) == ("d 5 c 6 b 8 + d 6 c 8 b 1 = b 9 c 4 d 2 e 1 <eos>",
                                    [3, 3, 2, 2, 1, 1, 0, 3, 3, 2, 2, 1, 1, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5], "1249", 1)
    product = get_task("multiplication", train_length=3, index_hints=True, hint_symbols=7)
    assert first(product, length=3, k=2) == ("c 5 b 6 a 8 * b 9 a 6 = a 8 b 2 c 5 d 4 e 5 <eos>",
                                             [3, 3, 2, 2, 1, 1, 0, 2, 2, 1, 1, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6],
                                             "54528", 0)
    unpadded = get_task("addition", train_length=3, index_hints=True, hint_symbols=26, operand_order="lsb_first",
                        operands="unpadded")
    # 003 + 65: each number has its own places
    assert first(unpadded)[0] == "g 3 h 0 i 0 + g 5 h 6 = g 8 h 6 i 0 j 0 <eos>"
    assert lsb.vocab.tokens == ["<pad>", "<eos>", *"0123456789", "+", "=", *"abcdef"]
    assert get_task("addition", index_hints=True).hint_symbols == 102  # Zhou et al. 2024's set
    assert get_task("addition", index_hints=True).vocab.tokens[-3:] == ["cv", "cw", "cx"]  # a..z, aa..cx


HINTED = [("addition", {}), ("addition", {"operand_order": "lsb_first", "bos": True}),
          ("addition", {"operands": "unpadded", "operand_order": "lsb_first"}),
          ("addition", {"operands": "independent"}), ("multiplication", {}),
          ("multiplication", {"train_k": 3, "operand_order": "lsb_first", "bos": True})]


@pytest.mark.parametrize("name,params", HINTED)
def test_index_hints_mark_each_digit_with_its_places_symbol_and_change_nothing_else(name, params):
    """Every digit follows one hint and every hint precedes a digit; the digits of a place (a, b and
    the answer) share a hint, consecutive places have consecutive symbols from a start drawn per sample
    (every start that fits is drawn); a hint has its digit's id and is a target where its digit is;
    without the hints, the sample is the one drawn without them."""
    plain = get_task(name, train_length=6, **params)
    task = get_task(name, train_length=6, index_hints=True, hint_symbols=20, **params)
    symbols = [t for t in task.vocab.tokens if t.isalpha()]
    assert len(symbols) == 20 and task.vocab.tokens[: len(plain.vocab.tokens) - plain.bos] == \
        plain.vocab.tokens[: len(plain.vocab.tokens) - plain.bos]  # the other tokens keep their ids
    k = 2 if task.uses_k else None
    starts = set()
    for length in (None, 9):
        hinted, base = task.sample(200, rng(8), length=length, k=k), plain.sample(200, rng(8), length=length, k=k)
        check_padding(task, hinted)
        places = task.digit_places(hinted)
        for b, ((tokens, ids, loss, ans, prompt), unhinted) in enumerate(zip(rows(task, hinted), rows(plain, base))):
            keep = [i for i, t in enumerate(tokens) if t not in symbols]
            assert [[column[i] for i in keep] for column in (tokens, ids, loss, ans)] == list(unhinted[:4])
            assert hinted.answers[b] == base.answers[b] and prompt == len(tokens) - sum(loss)
            start = hinted.meta[b]["hint_start"]
            place = lambda i: ids[i] - task.fixed_prefix  # noqa: E731  (a digit's place: its coupled id)
            for i, t in enumerate(tokens):
                if t in symbols:
                    assert tokens[i + 1].isdigit() and ids[i] == ids[i + 1] and loss[i] == loss[i + 1]
                    assert not ans[i] and places[b, i] == 0  # not an answer token, not a digit (Abacus)
                    assert symbols.index(t) == start + place(i + 1) - 1
                elif t.isdigit():
                    assert tokens[i - 1] in symbols
            top = max(place(i) for i, t in enumerate(tokens) if t.isdigit())
            assert start + top <= 20  # the run fits the symbols
            starts.add(start)
    # every start up to those only short samples fit is drawn (training's longest have 7 or 8 places)
    assert starts == set(range(max(starts) + 1)) and max(starts) >= 20 - 7


@pytest.mark.parametrize("name,params,length", [("addition", {}, 5), ("addition", {"operand_order": "lsb_first",
                                                "bos": True}, 4), ("multiplication", {}, 5),
                                               ("multiplication", {"operand_order": "lsb_first"}, 4)])
def test_index_hints_are_written_by_the_model_and_each_answer_digit_still_follows_the_rule(name, params, length):
    """A reference that reads only the sequence so far (the next hint is the symbol after the last one,
    the first the operands' units' hint; a digit, the task's rule on the digits) reproduces every
    target, and meta["deps"] name what fixes it: changing a digit outside them never changes it."""
    task = get_task(name, train_length=6, index_hints=True, hint_symbols=16, **params)
    symbols = [t for t in task.vocab.tokens if t.isalpha()]
    lsb = params.get("operand_order") == "lsb_first"

    def reference(prefix: list[str]) -> str:
        prefix = prefix[1:] if prefix[0] == "<bos>" else prefix
        digit = next_token(name, [t for t in prefix if t not in symbols], lsb)
        if prefix[-1] in symbols or digit == "<eos>":
            return digit
        if prefix[-1] != "=":  # after an answer digit, the next place's hint
            return symbols[symbols.index(prefix[-2]) + 1]
        op = next(i for i, t in enumerate(prefix) if t in "+*")
        return prefix[0] if lsb else prefix[op - 2]  # the units' hint of the first operand

    batch = task.sample(16, rng(17), length=length, k=2 if task.uses_k else None)
    check_deps(task, batch, reference, every_sample=False)
    for b, (tokens, *_) in enumerate(rows(task, batch)):
        targets, deps = np.flatnonzero(batch.loss_mask[b]), batch.meta[b]["deps"]
        for t, dep in zip(targets, deps):
            if tokens[t] in symbols:  # a hint reads the hint of its place before it (one, or the operands')
                assert dep and all(tokens[d] == tokens[t] or symbols.index(tokens[d]) == symbols.index(tokens[t]) - 1
                                   for d in dep)


def test_an_answer_with_hints_is_right_when_its_digits_are():
    """The answer tokens are the answer's digits: a wrong hint leaves the answer right (answer_acc,
    answer_token_acc) and the sequence wrong (exact_match, val_exact score every target); a wrong
    digit makes the answer wrong, as trial/evaluate.py counts them."""
    task = get_task("addition", train_length=5, index_hints=True, hint_symbols=12, operand_order="lsb_first")
    batch = task.sample(64, rng(5), length=8)
    symbols = {t for t in task.vocab.tokens if t.isalpha()}
    for b, ((tokens, _ids, loss, ans, _prompt), answer) in enumerate(zip(rows(task, batch), batch.answers)):
        assert int(batch.meta[b]["a"]) + int(batch.meta[b]["b"]) == int(answer)
        assert "".join(t for t, a in zip(tokens, ans) if a) == answer[::-1]  # the digits, least significant first
        assert sum(loss) == 2 * len(answer) + 1  # a hint and a digit a place, then <eos>
        assert all(t in symbols for t, lo, a in zip(tokens, loss, ans) if lo and not a and t != "<eos>")

    def scored(out: np.ndarray) -> tuple[bool, bool]:  # (answer right, exact) for row 0, as evaluate_point
        right = out == batch.tokens[0]
        return bool((right | ~batch.answer_mask[0]).all()), bool((right | ~batch.loss_mask[0]).all())

    hint_col = int(np.flatnonzero(batch.loss_mask[0] & ~batch.answer_mask[0])[0])
    digit_col = int(np.flatnonzero(batch.answer_mask[0])[0])
    wrong_hint, wrong_digit = batch.tokens[0].copy(), batch.tokens[0].copy()
    wrong_hint[hint_col] = task.vocab["a"] if task.vocab.tokens[wrong_hint[hint_col]] != "a" else task.vocab["b"]
    wrong_digit[digit_col] = task.vocab[str((int(task.vocab.tokens[wrong_digit[digit_col]]) + 1) % 10)]
    assert scored(batch.tokens[0]) == (True, True)
    assert scored(wrong_hint) == (True, False) and scored(wrong_digit) == (False, False)


@pytest.mark.parametrize("params", [{}, {"operand_order": "lsb_first", "bos": True}])
def test_index_hints_keep_the_coupling_local(params):
    """A hint shares its digit's id: the predicting token finds what each target depends on at -1, 0
    or +1 at any length (a digit reads its hint's place at 0 and the place below at -1; the answer's
    first hint reads the operands' units' hints at +1 from `=`), and the ids and lengths are declared."""
    task = get_task("addition", train_length=6, index_hints=True, hint_symbols=64, **params)
    assert task.local_coupling
    trained = set().union(*(dependency_offsets(task, n, None) for n in range(3, 7)))
    assert trained == {-1, 0, 1}
    for length in (12, 24, 48):
        assert dependency_offsets(task, length, None) <= trained
    plain = get_task("addition", train_length=6, **params)
    for name, t, p, k in (("addition", task, plain, None),
                          ("multiplication", get_task("multiplication", index_hints=True, hint_symbols=64, **params),
                           get_task("multiplication", **params), 2)):
        cell = t.sample(64, rng(3), length=9, k=k)
        assert cell.position_ids.max() == t.max_position_id(9, k) == p.max_position_id(9, k)
        assert cell.seq_len.max() == t.max_seq_len(9, k) == 2 * p.max_seq_len(9, k) - 3 - t.fixed_prefix, name


def test_too_few_hint_symbols_are_refused_naming_the_parameter():
    cases = [
        (lambda: get_task("addition", train_length=5, index_hints=True, hint_symbols=5), "hint_symbols", "train_length 5"),
        (lambda: get_task("addition", train_length=5, index_hints=True, hint_symbols=6).check(6, None), "hint_symbols",
         "length 6 writes 7 digit places"),
        (lambda: get_task("multiplication", train_length=5, index_hints=True, hint_symbols=8).sample(2, rng(), length=7,
                                                                                                      k=2), "hint_symbols",
         "length 7 writes 9"),
        (lambda: get_task("addition", hint_symbols=30), "hint_symbols", "only index_hints: true"),
        (lambda: get_task("addition", index_hints="yes"), "index_hints", "true or false"),
        (lambda: get_task("addition", index_hints=True, hint_symbols=0), "hint_symbols", "smaller than 1"),
    ]
    for build, param, words in cases:
        with pytest.raises(TaskParamError) as err:
            build()
        assert err.value.param == param and str(err.value).startswith(f"{param}:") and words in str(err.value)
    from trial.config import TrialConfig

    with pytest.raises(ValueError, match=r"eval \(hint_symbols\): hint_symbols: length 12 writes 13"):
        TrialConfig.model_validate({"task": {"name": "addition", "params": {"index_hints": True, "hint_symbols": 12}},
                                    "eval": {"lengths": [5, 12]}})


def test_cli_samples_index_hints():
    out = run_cli("sample", "addition", "--param", "index_hints=true", "--param", "hint_symbols=8",
                  "--param", "operand_order=lsb_first", "--length", "4", "--seed", "2")
    assert out.returncode == 0, out.stderr
    tokens = json.loads(out.stdout)["tokens"]
    assert all(t.isalpha() for t in tokens[0:8:2]) and tokens[1].isdigit() and len(tokens) == 6 * 4 + 5
    bad = run_cli("sample", "addition", "--param", "index_hints=true", "--param", "hint_symbols=8", "--length", "9")
    assert bad.returncode == 2 and bad.stderr.startswith("error: hint_symbols:")


# --- train set priming (Jelassi et al. 2023) -------------------------------------------------------


@pytest.mark.parametrize("name,params", [("addition", {"operands": "unpadded", "operand_order": "lsb_first"}),
                                         ("multiplication", {"index_hints": True, "hint_symbols": 24}),
                                         ("sparse_parity", {"train_k": 3}), ("reverse", {})])
def test_a_primed_training_set_holds_exactly_the_primed_samples_and_is_otherwise_the_unprimed_one(name, params):
    """`training_set`: the last priming_samples of the set are drawn at priming_length, as evaluation
    points are; the rest are the unprimed set's draws, sample for sample; every other draw (training
    batches, validation, evaluation points) is the unprimed task's."""
    plain = get_task(name, train_length=5, **params)
    task = get_task(name, train_length=5, priming_samples=30, priming_length=12, **params)
    primed_set, plain_set = training_set(task, 600, rng(4)), training_set(plain, 600, rng(4))
    check_padding(task, primed_set)
    assert [m["length"] for m in primed_set.meta[570:]] == [12] * 30
    assert all(m["length"] <= 5 for m in primed_set.meta[:570])
    same = lambda batch: [r[:4] for r in list(rows(task, batch))[:570]]  # noqa: E731
    assert same(primed_set) == same(plain_set) and primed_set.answers[:570] == plain_set.answers[:570]
    assert [r[0] for r in rows(plain, plain_set)] == [r[0] for r in rows(plain, plain.sample(600, rng(4)))]
    k = 3 if task.uses_k else None
    for draw in (lambda t: t.sample(64, rng(9)), lambda t: t.validation_sample(64, rng(9)),
                 *(lambda t, n=n: t.sample(64, rng(9), length=n, k=k) for n in (5, 12, 20))):
        a, b = draw(task), draw(plain)
        assert np.array_equal(a.tokens, b.tokens) and a.answers == b.answers
    assert task.longest_train_length == 12 and plain.longest_train_length == 5


def test_priming_params_are_refused_naming_the_parameter():
    cases = [
        (lambda: get_task("addition", priming_length=12), "priming_length", "with priming_samples > 0, and only then"),
        (lambda: get_task("addition", priming_samples=5), "priming_length", "with priming_samples > 0"),
        (lambda: get_task("addition", train_length=5, priming_samples=5, priming_length=5), "priming_length",
         "not longer than train_length 5"),
        (lambda: get_task("addition", priming_samples=-1), "priming_samples", "smaller than 0"),
        (lambda: get_task("addition", priming_samples=True, priming_length=9), "priming_samples", "an integer"),
        (lambda: training_set(get_task("addition", priming_samples=5, priming_length=20), 5, rng()),
         "priming_samples", "fill the training set of 5"),
        (lambda: training_set(get_task("addition", index_hints=True, hint_symbols=8, priming_samples=5,
                                       priming_length=12), 50, rng()), "hint_symbols", "length 12 writes 13"),
        (lambda: training_set(get_task("variable_assignment", priming_samples=5, priming_length=60), 50, rng()),
         "priming_length", "need distinct variables"),
        (lambda: get_task("lm", priming_samples=5, priming_length=400), "priming_samples", "prime with held-out text"),
    ]
    for build, param, words in cases:
        with pytest.raises(TaskParamError) as err:
            build()
        assert err.value.param == param and str(err.value).startswith(f"{param}:") and words in str(err.value)


def priming_config(lengths=(5, 10), **task) -> dict:
    params = {"train_length": 5, "priming_samples": 50, "priming_length": 10}
    return {"task": {"name": "addition", "train_set_size": 1000, **task, "params": {**params, **task.get("params", {})}},
            "positional": {"encoding": "learned", "ids": "sequential", "max_position": 64},
            "eval": {"lengths": list(lengths)}}


def test_each_training_step_draws_the_primed_share_and_the_evaluation_sets_do_not_change():
    """A trial's steps draw from the primed set: about priming_samples / train_set_size of their rows
    are primed (10-digit, 34 tokens), the others the unprimed set's rows of the same step; its
    validation, tracked and evaluation batches are the unprimed trial's."""
    from trial.batches import StepBatches
    from trial.config import TrialConfig
    from trial.evaluate import held_out_batches

    primed_cfg = TrialConfig.model_validate(priming_config())
    plain_cfg = TrialConfig.model_validate({**priming_config(), "task": {"name": "addition", "train_set_size": 1000,
                                                                        "params": {"train_length": 5}}})
    scheme = primed_cfg.positional.scheme

    def steps(cfg):
        return StepBatches(cfg.task_instance, scheme, 64, 3, 0, 1, 100, 1000)

    primed = rows_total = 0
    with_priming, without = steps(primed_cfg), steps(plain_cfg)
    for a, b in ((with_priming[i], without[i]) for i in range(len(with_priming))):
        sizes = (a["tokens"] != 0).sum(1)
        long = sizes == 34
        assert set(sizes[~long].tolist()) <= set(range(7, 20))  # 1-5 digits unpadded: 7 to 19 tokens
        unpadded = lambda item, i: [t for t in item["tokens"][i].tolist() if t]  # noqa: E731
        assert all(unpadded(a, i) == unpadded(b, i) for i in np.flatnonzero(~long))  # the same rows otherwise
        primed, rows_total = primed + int(long.sum()), rows_total + len(sizes)
    assert rows_total == 6400 and 6400 * 0.05 - 60 < primed < 6400 * 0.05 + 60  # 320 expected, sd 17
    with pytest.raises(TaskParamError, match="priming_samples: .*set task.train_set_size"):
        StepBatches(primed_cfg.task_instance, scheme, 64, 3, 0, 1, 2)[0]  # fresh samples: nothing to prime
    for draw in (lambda t: held_out_batches(t, [5, 10, 15], 96, 32, rng(2), scheme),
                 lambda t: [t.validation_sample(32, rng(2))]):
        for a, b in zip(draw(primed_cfg.task_instance), draw(plain_cfg.task_instance)):
            assert np.array_equal(a.tokens, b.tokens) and a.answers == b.answers
    from trial.limits import pieces

    step = next(p for p in pieces(primed_cfg) if p.field == "optim.batch_size")
    assert "64 sequences of 34 tokens" in step.what


def test_priming_without_a_fixed_training_set_is_refused_naming_the_field(tmp_path, capsys):
    from study.run import main as run_main
    from trial.config import TrialConfig

    refused = [({"train_set_size": None}, r"task\.params\.priming_samples: priming_samples: 50 primed samples go "
                                          r"into a fixed training set, .*set task\.train_set_size"),
               ({"train_set_size": 50}, r"task\.params\.priming_samples: .*50 primed samples fill the training set"),
               ({"params": {"priming_length": 25}}, r"task\.params\.priming_length: training sequences need position "
                                                     r"id 78, but positional\.max_position is 64"),
               ({"params": {"index_hints": True, "hint_symbols": 8}, "lengths": [5]},
                r"task\.params\.hint_symbols: .*length 10 writes 11 digit places")]
    for change, words in refused:
        with pytest.raises(ValueError, match=words):
            TrialConfig.model_validate(priming_config(**change))
    spec = str(Path(__file__).resolve().parents[1] / "search_spaces" / "experiments" / "schemes_priming.yaml")
    code = run_main(["--space", spec, "--dry-run", "--storage", str(tmp_path / "studies"), "--set",
                     "task.train_set_size=null"])
    err = capsys.readouterr().err
    assert code == 2 and "task.params.priming_samples: priming_samples: 50 primed samples go into a fixed" in err, err
