"""Semantic tests for tasks/: answers are right, coupled ids point where they claim, errors name params."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks import TASKS, Batch, Task, TaskParamError, get_task

REPO = Path(__file__).resolve().parents[1]


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def rows(task: Task, batch: Batch):
    """Per sample: (tokens as str, position ids, loss mask, answer mask, prompt_len), unpadded."""
    for b in range(len(batch)):
        n = int(batch.seq_len[b])
        yield (
            task.vocab.decode(batch.tokens[b, :n]),
            batch.position_ids[b, :n].tolist(),
            batch.loss_mask[b, :n].tolist(),
            batch.answer_mask[b, :n].tolist(),
            int(batch.prompt_len[b]),
        )


def check_padding(task: Task, batch: Batch) -> None:
    """Shared invariants: shapes, right padding, masks consistent with prompt_len/seq_len."""
    B, T = batch.tokens.shape
    assert T == batch.seq_len.max()
    assert batch.tokens.dtype == np.int64 and batch.position_ids.dtype == np.int64
    cols = np.arange(T)[None, :]
    pad = cols >= batch.seq_len[:, None]
    assert np.all(batch.tokens[pad] == task.vocab.pad_id)
    assert np.all(batch.position_ids[pad] == 0)
    assert not np.any(batch.tokens[~pad] == task.vocab.pad_id)
    assert not np.any(batch.loss_mask[pad]) and not np.any(batch.answer_mask[pad])
    assert np.all(batch.loss_mask[batch.answer_mask])
    assert np.all(batch.loss_mask.argmax(axis=1) == batch.prompt_len)
    assert len(batch.answers) == len(batch.meta) == B
    json.dumps(batch.meta)


def parity_input(tokens: list[str], n: int) -> tuple[list[int], list[int]]:
    """(bits, marked positions) read back from the input tokens."""
    bit = {"0": 0, "1": 1, "A": 0, "B": 1}
    return [bit[t] for t in tokens[:n]], [i for i, t in enumerate(tokens[:n]) if t in "AB"]


# --- sparse parity -----------------------------------------------------------------------


def test_sparse_parity_cell_semantics():
    task = get_task("sparse_parity")
    n, k = 30, 4
    batch = task.sample(300, rng(), length=n, k=k)
    check_padding(task, batch)
    assert batch.tokens.shape == (300, n + 2)
    for (tokens, ids, loss, ans, prompt), meta, answer in zip(rows(task, batch), batch.meta, batch.answers):
        bits, marked = parity_input(tokens, n)
        assert marked == meta["marked"] and len(marked) == k
        assert all(t in "01" for i, t in enumerate(tokens[:n]) if i not in marked)
        assert tokens[n] == "=" and tokens[n + 1] == answer
        assert answer == str(sum(bits[i] for i in marked) % 2)
        assert loss == [False] * (n + 1) + [True] and ans == loss
        assert ids == list(range(1, n + 1)) + [n + 1, n + 1]
        assert prompt == n + 1
    assert set(batch.answers) == {"0", "1"}
    assert task.max_position_id(n, k) == n + 1 == batch.position_ids.max()


def test_sparse_parity_training_batch_mixes_lengths_and_k():
    task = get_task("sparse_parity", train_length=15, min_length=2, train_k=4, min_k=2)
    batch = task.sample(500, rng(1))
    check_padding(task, batch)
    lengths = batch.seq_len - 2
    assert lengths.min() == 2 and lengths.max() == 15
    ks = []
    for (tokens, ids, *_), n, meta, answer in zip(rows(task, batch), lengths, batch.meta, batch.answers):
        bits, marked = parity_input(tokens, n)
        assert 2 <= len(marked) <= min(4, n) and len(marked) == meta["k"]
        assert answer == str(sum(bits[i] for i in marked) % 2)
        assert ids[n] == ids[n + 1] == n + 1
        ks.append(len(marked))
    assert set(ks) == {2, 3, 4}


def test_sparse_parity_locality_window():
    task = get_task("sparse_parity", train_length=40, train_k=3, locality=5)
    batch = task.sample(400, rng(2), length=40, k=3)
    spans = [max(m["marked"]) - min(m["marked"]) for m in batch.meta]
    assert max(spans) < 5
    starts = {min(m["marked"]) for m in batch.meta}
    assert min(starts) < 5 and max(starts) > 30  # the window moves around
    # Window wider than the input: the whole input.
    wide = task.sample(50, rng(3), length=3, k=3)
    assert all(m["marked"] == [0, 1, 2] for m in wide.meta)


def test_sparse_parity_param_errors():
    with pytest.raises(TaskParamError) as err:
        get_task("sparse_parity", train_k=3, locality=2)
    assert err.value.param == "locality" and "locality" in str(err.value)
    with pytest.raises(TaskParamError) as err:
        get_task("sparse_parity", train_length=2, train_k=3)
    assert err.value.param == "train_k"
    with pytest.raises(TaskParamError) as err:
        get_task("sparse_parity", train_length=5, min_length=6)
    assert err.value.param == "min_length"
    with pytest.raises(TaskParamError) as err:
        get_task("sparse_parity", train_length=0)
    assert err.value.param == "train_length"
    with pytest.raises(TaskParamError) as err:
        get_task("sparse_parity", bogus=1)
    assert err.value.param == "bogus"
    task = get_task("sparse_parity")
    with pytest.raises(TaskParamError) as err:
        task.sample(4, rng(), length=2, k=3)
    assert err.value.param == "k" and str(err.value).startswith("k:")
    with pytest.raises(TaskParamError) as err:
        task.check(5, 0)
    assert err.value.param == "k"


# --- parity scratchpad -------------------------------------------------------------------


@pytest.mark.parametrize("length,k", [(25, 5), (None, None)])
def test_parity_scratchpad(length, k):
    task = get_task("parity_scratchpad", train_length=12, train_k=4)
    batch = task.sample(300, rng(4), length=length, k=k)
    check_padding(task, batch)
    for (tokens, ids, loss, ans, prompt), meta, answer in zip(rows(task, batch), batch.meta, batch.answers):
        n = meta["length"]
        bits, marked = parity_input(tokens, n)
        assert marked == meta["marked"] and len(marked) == meta["k"]
        running = list(np.cumsum([bits[i] for i in marked]) % 2)
        pad = tokens[n + 1 : -1]
        assert tokens[n] == "=" and tokens[-1] == "<eos>" and len(tokens) == n + len(marked) + 3
        assert pad == ["0"] + [str(r) for r in running] and answer == pad[-1]
        # s_{i-1} carries the id of the i-th marked bit (the bit the next step reads); s_k the id of `=`
        assert ids[n + 1 : -2] == [p + 1 for p in marked] and ids[-2] == n + 1
        assert all(tokens[ids[n + 1 + i] - 1] in "AB" for i in range(len(marked)))
        assert ids[n] == n + 1 and ids[-1] == n + 2 and ids[:n] == list(range(1, n + 1))
        assert prompt == n + 1 and loss == [False] * (n + 1) + [True] * (len(marked) + 2)
        assert [i for i, a in enumerate(ans) if a] == [len(tokens) - 2]


# --- parity (all bits) ---------------------------------------------------------------------


@pytest.mark.parametrize("length", [37, None])
def test_parity(length):
    task = get_task("parity", train_length=12)
    batch = task.sample(300, rng(14), length=length)
    check_padding(task, batch)
    for (tokens, ids, loss, ans, prompt), meta, answer in zip(rows(task, batch), batch.meta, batch.answers):
        n = meta["length"]
        bits = [int(t) for t in tokens[:n]]
        running = [str(x) for x in np.cumsum(bits) % 2]
        assert tokens[n] == "=" and tokens[n + 1 : -1] == running and tokens[-1] == "<eos>"
        assert answer == str(sum(bits) % 2) == running[-1]
        # b_i has id i; `=` shares id 1 with b_1; s_i has id i + 1; <eos> n + 2
        assert ids == list(range(1, n + 1)) + [1] + list(range(2, n + 3))
        assert prompt == n + 1 and loss == [False] * (n + 1) + [True] * (n + 1)
        assert [i for i, a in enumerate(ans) if a] == [2 * n]


# --- variable assignment -----------------------------------------------------------------


def parse_program(tokens: list[str], m: int) -> tuple[dict[str, str], dict[str, int], str]:
    """Statements -> (var -> rhs, var -> index of its rhs token), and the queried variable."""
    assignments, rhs_index = {}, {}
    for s in range(m):
        lhs, eq, rhs, semi = tokens[4 * s : 4 * s + 4]
        assert eq == "=" and semi == ";" and lhs not in assignments
        assignments[lhs] = rhs
        rhs_index[lhs] = 4 * s + 2
    assert tokens[4 * m] == "?"
    return assignments, rhs_index, tokens[4 * m + 1]


@pytest.mark.parametrize("length,k", [(20, 6), (None, None)])
def test_variable_assignment_scratchpad(length, k):
    task = get_task("variable_assignment", train_length=10, train_k=4)
    batch = task.sample(300, rng(5), length=length, k=k)
    check_padding(task, batch)
    depths = set()
    for (tokens, ids, loss, ans, prompt), meta, answer in zip(rows(task, batch), batch.meta, batch.answers):
        m, d = meta["statements"], meta["depth"]
        assignments, rhs_index, var = parse_program(tokens, m)
        followed, read_from = [], []
        while not var.isdigit():  # resolve by following the program itself
            read_from.append(rhs_index[var])
            var = assignments[var]
            followed.append(var)
        assert var == answer and followed[-1] == answer
        assert len(followed) == d and (d == k if k is not None else 1 <= d <= min(4, m))
        depths.add(d)
        query = tokens[4 * m + 1]
        assert tokens[prompt:] == [query] + followed + ["<eos>"]
        assert meta["chain"] == [query, *followed]
        # Each scratchpad variable has the id of the `x` of the statement assigning it (its value,
        # the next step, sits at id + 2); the digit has the id of the `y` it was read from.
        chain_ids, digit_id = ids[prompt:-2], ids[-2]
        assert [tokens[i - 1] for i in chain_ids] == [query] + followed[:-1]
        assert [i + 1 for i in chain_ids] == read_from and all(tokens[i] == "=" for i in chain_ids)
        assert digit_id - 1 == read_from[-1] and ids[-1] == digit_id + 1
        assert ids[:prompt] == list(range(1, 4 * m + 3))
        assert [i for i, a in enumerate(ans) if a] == [len(tokens) - 2]
        assert loss == [False] * prompt + [True] * (d + 2)
    if k is None:
        assert depths == {1, 2, 3, 4}


def test_variable_assignment_without_scratchpad():
    task = get_task("variable_assignment", scratchpad=False, train_length=8)
    batch = task.sample(200, rng(6), length=8, k=3)
    check_padding(task, batch)
    for (tokens, ids, _loss, ans, prompt), _meta, answer in zip(rows(task, batch), batch.meta, batch.answers):
        assignments, _, var = parse_program(tokens, 8)
        for _ in range(3):
            var = assignments[var]
        assert var.isdigit() and var == answer
        assert tokens[prompt:] == [answer, "<eos>"]
        assert ids == list(range(1, 4 * 8 + 5))
        assert ans == [False] * prompt + [True, False]
    assert task.max_position_id(8, 3) == 36 == batch.position_ids.max()


def test_variable_assignment_errors_and_names():
    task = get_task("variable_assignment")
    with pytest.raises(TaskParamError) as err:
        task.sample(2, rng(), length=3, k=5)
    assert err.value.param == "k" and "k" in str(err.value)
    with pytest.raises(TaskParamError) as err:
        task.check(60, 3)
    assert err.value.param == "length"
    with pytest.raises(TaskParamError) as err:
        get_task("variable_assignment", num_vars=5)  # default train_length 12
    assert err.value.param == "train_length"
    with pytest.raises(TaskParamError) as err:
        get_task("variable_assignment", scratchpad="yes")
    assert err.value.param == "scratchpad"
    many = get_task("variable_assignment", num_vars=80, train_length=70)
    batch = many.sample(4, rng(), length=70, k=10)
    assert all(t.startswith("v") for t in many.vocab.decode(batch.tokens[:, 0]))


# --- copy and addition -------------------------------------------------------------------


def test_copy():
    task = get_task("copy", train_length=12)
    for batch in (task.sample(200, rng(7), length=30), task.sample(200, rng(8))):
        check_padding(task, batch)
        for (tokens, ids, loss, ans, _prompt), answer in zip(rows(task, batch), batch.answers):
            n = (len(tokens) - 2) // 2
            assert tokens[n] == "=" and tokens[-1] == "<eos>"
            assert tokens[n + 1 : 2 * n + 1] == tokens[:n] and "".join(tokens[:n]) == answer
            assert ids == list(range(1, n + 1)) + [0] + list(range(1, n + 1)) + [n + 1]
            assert ans == [False] * (n + 1) + [True] * n + [False]
            assert loss == [False] * (n + 1) + [True] * (n + 1)


def test_addition():
    task = get_task("addition", train_length=6)
    for batch in (task.sample(300, rng(9), length=25), task.sample(300, rng(10))):
        check_padding(task, batch)
        for (tokens, ids, _loss, ans, prompt), answer, meta in zip(rows(task, batch), batch.answers, batch.meta):
            n = meta["length"]
            a, b = "".join(tokens[:n]), "".join(tokens[n + 1 : 2 * n + 1])
            assert tokens[n] == "+" and tokens[2 * n + 1] == "=" and tokens[-1] == "<eos>"
            out = tokens[2 * n + 2 : 3 * n + 3]
            assert int(a) + int(b) == int(answer) and len(answer) == n + 1
            assert "".join(reversed(out)) == answer
            # Digits of significance j share id j + 1; + and = get 0; <eos> n + 2.
            sig = list(range(n, 0, -1))
            assert ids == sig + [0] + sig + [0] + list(range(1, n + 2)) + [n + 2]
            assert ans == [False] * (2 * n + 2) + [True] * (n + 1) + [False]
            assert prompt == 2 * n + 2
    assert any(a[0] == "1" for a in batch.answers)  # carries into the top digit happen


# --- locality of the coupled ids (Golowich et al.'s Definition 4.1) ---------------------------


def dependency_offsets(task: Task, length: int, k: int | None, samples: int = 64) -> set[int]:
    """Every id offset from the token that predicts a target to a token the target depends on."""
    batch = task.sample(samples, rng(length), length=length, k=k)
    offsets = set()
    for b in range(len(batch)):
        ids = batch.position_ids[b]
        targets = np.flatnonzero(batch.loss_mask[b])
        deps = batch.meta[b]["deps"]
        assert len(deps) == len(targets)  # one dependency list per target token, in order
        for t, dep in zip(targets, deps):
            assert all(d < t for d in dep)  # causal: only earlier tokens
            offsets |= {int(ids[d] - ids[t - 1]) for d in dep}
    return offsets


LOCAL = [("addition", {}), ("parity", {}), ("copy", {}), ("parity_scratchpad", {"train_k": 4}),
         ("variable_assignment", {"train_k": 3}), ("reverse", {}), ("duplicate", {})]


@pytest.mark.parametrize("name,params", LOCAL)
def test_local_couplings_read_at_fixed_offsets_at_any_length(name, params):
    """The criterion itself: at 8x the train length the predicting token finds every dependency at
    an offset it already had in training, and the offsets are a small fixed set."""
    task = get_task(name, train_length=6, **params)
    assert task.local_coupling
    k = 3 if task.uses_k else None
    trained = set().union(*(dependency_offsets(task, n, k) for n in range(3, 7)))
    for length in (12, 24, 48):
        assert dependency_offsets(task, length, k) <= trained, (name, length)
    assert max(abs(o) for o in trained) <= 2
    expected = {"addition": {0, 1}, "parity": {0}, "copy": {1}, "parity_scratchpad": {0},
                "variable_assignment": {0, 2}, "reverse": {-1}, "duplicate": {1}}[name]
    assert trained == expected


@pytest.mark.parametrize("name,params", [("sparse_parity", {}), ("variable_assignment", {"scratchpad": False}),
                                         ("multiplication", {})])
def test_nonlocal_couplings_are_declared_and_grow_with_length(name, params):
    task = get_task(name, train_length=6, train_k=3, **params)
    assert not task.local_coupling
    short, long = dependency_offsets(task, 6, 3), dependency_offsets(task, 48, 3)
    assert max(abs(o) for o in long) > max(abs(o) for o in short)


# --- dependencies: meta["deps"] names the tokens that determine each target --------------------


def next_token(name: str, prefix: list[str], lsb_first: bool = False) -> str:
    """A reference of each task's rule: the token that follows `prefix` (the sequence so far, as
    written: teacher forcing), read off the sequence itself and never from meta. lsb_first: the
    operands of addition and multiplication are written least significant digit first."""
    if prefix[0] == "<bos>":
        return next_token(name, prefix[1:], lsb_first)
    order = 1 if lsb_first else -1  # read operands from their least significant digit
    t, eq = len(prefix), prefix.index("=")
    if name == "copy":  # x_0 .. x_{n-1} = x_0 .. x_{n-1} <eos>
        i = t - eq - 1
        return prefix[i] if i < eq else "<eos>"
    if name == "sparse_parity":  # the xor of the marked bits (A = 0, B = 1)
        return str(sum(tok == "B" for tok in prefix[:eq]) % 2)
    if name == "parity":  # b_1 .. b_n = s_1 .. s_n <eos>, s_i = s_{i-1} xor b_i
        i = t - eq
        if i > eq:
            return "<eos>"
        before = 0 if prefix[-1] == "=" else int(prefix[-1])
        return str(before ^ int(prefix[i - 1]))
    if name == "parity_scratchpad":  # bits = s_0 .. s_k <eos>, s_i = s_{i-1} xor (i-th marked bit)
        marks = [p for p in range(eq) if prefix[p] in ("A", "B")]
        i = t - eq - 1
        if i == 0:
            return "0"
        return str(int(prefix[-1]) ^ (prefix[marks[i - 1]] == "B")) if i <= len(marks) else "<eos>"
    if name == "addition":  # a + b = c_0 .. c_n <eos>, digits of the sum least significant first
        plus = prefix.index("+")
        a, b = prefix[:plus][::order], prefix[plus + 1:eq][::order]  # a[j]: the digit of 10^j
        j = t - eq - 1
        if j > len(a):
            return "<eos>"
        # the carry into place j, from place j-1's digits and the sum digit written there
        carry = j > 0 and int(a[j - 1]) + int(b[j - 1]) > int(prefix[-1])
        digit = lambda x: int(x[j]) if j < len(x) else 0  # noqa: E731
        return str((digit(a) + digit(b) + carry) % 10)
    if name == "reverse":  # x_0 .. x_{n-1} = x_{n-1} .. x_0 <eos>
        i = t - eq - 1
        return prefix[eq - 1 - i] if i < eq else "<eos>"
    if name == "duplicate":  # x_0 .. x_{n-1} = x_0 .. x_{n-1} x_0 .. x_{n-1} <eos> (no separator)
        i = t - eq - 1
        return prefix[i % eq] if i < 2 * eq else "<eos>"
    if name == "sort":  # x_0 .. x_{n-1} = the i-th smallest x at output i <eos>
        i = t - eq - 1
        return sorted(prefix[:eq], key=int)[i] if i < eq else "<eos>"
    if name == "multiplication":  # a * b = c_0 .. c_{N+M-1} <eos>, the product least significant first
        star = prefix.index("*")
        a, b = [int(x) for x in prefix[:star][::order]], [int(x) for x in prefix[star + 1:eq][::order]]
        c = [int(x) for x in prefix[eq + 1:]]  # c[j]: the product digit of 10^j written so far
        j = len(c)
        if j == len(a) + len(b):
            return "<eos>"
        w = len(str(9 * len(b) - 1))  # digits of the largest carry (below the sum of b's digits)
        def part(p):
            return sum(a[p - i] * b[i] for i in range(len(b)) if 0 <= p - i < len(a))

        # the w digits written below place j and their partial products fix the carry into it
        low = sum(10 ** (w - d) * (part(j - d) - (c[j - d] if j >= d else 0)) for d in range(1, w + 1))
        return str((part(j) - (-low // 10**w)) % 10)
    raise AssertionError(f"no reference for {name}")


# (task, params, cell length, whether each dependency changes its target in every sample: a carry
# dependency of addition changes it only where it decides the carry)
DEPS_CASES = [("sparse_parity", {}, 12, True), ("parity_scratchpad", {"train_k": 4}, 12, True),
              ("parity", {}, 8, True), ("copy", {}, 8, True), ("addition", {}, 5, False),
              ("addition", {"bos": True}, 4, False), ("reverse", {}, 8, True), ("duplicate", {}, 6, True),
              ("sort", {}, 5, False), ("multiplication", {}, 5, False),
              ("addition", {"operand_order": "lsb_first", "bos": True}, 5, False),
              ("multiplication", {"operand_order": "lsb_first"}, 5, False)]
# variable_assignment's deps say where each step's value is read (the `y` of `x = y ;`); which
# statement that is comes from a content lookup (every `x`, and the predicting token itself) that
# they leave to the position head by design (tasks/variable_assignment.py), so a single-token
# change outside them can change the target
NO_REFERENCE = {"variable_assignment"}


def test_every_generating_task_has_its_dependencies_checked():
    generating = {name for name, cls in TASKS.items() if cls.evaluation == "generate"}
    assert generating == {case[0] for case in DEPS_CASES} | NO_REFERENCE


@pytest.mark.parametrize("name,params,length,every_sample", DEPS_CASES,
                         ids=[f"{c[0]}{'-bos' if c[1].get('bos') else ''}{'-lsb' if c[1].get('operand_order') else ''}"
                              for c in DEPS_CASES])
def test_dependencies_are_the_tokens_that_determine_each_target(name, params, length, every_sample):
    """Per target: changing any earlier token outside meta["deps"] to another of its value class
    (0 <-> 1, A <-> B, digit <-> digit) leaves the reference's next token as it was, and changing a
    dependency changes it (for some replacement; in every sample where the rule is an xor or a copy)."""
    task = get_task(name, train_length=max(length, 6), **params)
    others = {tok: [o for o in group if o != tok] for group in task.value_classes() for tok in group}
    batch = task.sample(16, rng(17), length=length, k=3 if task.uses_k else None)
    lsb = params.get("operand_order") == "lsb_first"
    live: dict[tuple[int, int], list[bool]] = {}  # (target, dependency) -> per sample: it mattered
    for b, (tokens, *_) in enumerate(rows(task, batch)):
        targets, deps = np.flatnonzero(batch.loss_mask[b]), batch.meta[b]["deps"]
        assert len(deps) == len(targets)
        for i, (t, dep) in enumerate(zip(targets, deps)):
            assert next_token(name, tokens[:t], lsb) == tokens[t], (tokens, t)  # the reference is the rule
            for p in range(t):
                changes = [next_token(name, tokens[:p] + [o] + tokens[p + 1:t], lsb) != tokens[t]
                           for o in others.get(tokens[p], [])]
                if p in dep:
                    if changes:
                        live.setdefault((i, dep.index(p)), []).append(any(changes))
                else:
                    assert not any(changes), f"target {t} changes with token {p}, not a dep {dep}: {tokens}"
    assert live
    for (i, d), mattered in live.items():
        assert (all if every_sample else any)(mattered), (f"dependency {d} of target {i} is inert", mattered)


# --- cross-task contracts ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(TASKS))
def test_determinism_and_declared_maxima(name):
    task = get_task(name)
    a, b = task.sample(64, rng(11)), task.sample(64, rng(11))
    c = task.sample(64, rng(12))
    for field in ("tokens", "position_ids", "loss_mask", "answer_mask", "seq_len"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    assert a.answers == b.answers and a.meta == b.meta
    assert a.tokens.shape != c.tokens.shape or not np.array_equal(a.tokens, c.tokens)
    length, k = 9, (3 if task.uses_k else None)
    cell = task.sample(128, rng(13), length=length, k=k)
    assert cell.position_ids.max() == task.max_position_id(length, k)
    assert cell.seq_len.max() == task.max_seq_len(length, k)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tasks", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_cli_sample_is_deterministic_and_correct():
    args = ("sample", "sparse_parity", "--length", "40", "--k", "3", "--count", "200", "--seed", "1")
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    lines = first.stdout.splitlines()
    assert len(lines) == 200
    for line in lines:
        record = json.loads(line)
        tokens = record["tokens"]
        bits, marked = parity_input(tokens, 40)
        assert len(marked) == 3 and record["meta"]["marked"] == marked
        assert record["answer"] == tokens[-1] == str(sum(bits[i] for i in marked) % 2)
        assert record["position_ids"][-2:] == [41, 41] and record["loss_mask"] == [0] * 41 + [1]


def test_cli_errors_and_params():
    bad = run_cli("sample", "sparse_parity", "--length", "2", "--k", "3", "--count", "1", "--seed", "0")
    assert bad.returncode == 2 and bad.stderr.startswith("error: k:")
    unknown = run_cli("sample", "no_such_task", "--length", "2")
    assert unknown.returncode != 0 and "no_such_task" in unknown.stderr and "sparse_parity" in unknown.stderr
    param = run_cli("sample", "variable_assignment", "--length", "5", "--k", "2", "--param", "scratchpad=false")
    assert param.returncode == 0, param.stderr
    assert len(json.loads(param.stdout)["tokens"]) == 4 * 5 + 4
    listing = run_cli("list")
    assert listing.returncode == 0 and all(name in listing.stdout for name in TASKS)


@pytest.mark.parametrize("name", ["copy", "addition"])
def test_tasks_without_k_reject_a_k(name):
    with pytest.raises(TaskParamError) as err:
        get_task(name, train_k=3)
    assert err.value.param == "train_k"


# --- options from the reference implementation of position coupling ----------------------------


@pytest.mark.parametrize("name,params", LOCAL)
def test_bos_prepends_one_token_at_id_zero_and_keeps_the_coupling(name, params):
    """`bos: true`: a `<bos>` at position 0 with id 0, every other token and id as without it (ids
    one higher), the dependencies moved with them, so the coupling is as local as without it."""
    plain, bos = get_task(name, train_length=6, **params), get_task(name, train_length=6, bos=True, **params)
    assert bos.vocab.tokens[:-1] == plain.vocab.tokens and bos.vocab.tokens[-1] == "<bos>"
    k = 3 if plain.uses_k else None
    for length in (None, 9):
        a, b = plain.sample(32, rng(4), length=length, k=k), bos.sample(32, rng(4), length=length, k=k)
        check_padding(bos, b)
        assert (b.tokens[:, 0] == bos.vocab["<bos>"]).all() and (b.position_ids[:, 0] == 0).all()
        valid = np.arange(a.tokens.shape[1])[None, :] < a.seq_len[:, None]
        assert np.array_equal(b.tokens[:, 1:], a.tokens) and np.array_equal(b.seq_len, a.seq_len + 1)
        assert np.array_equal(b.position_ids[:, 1:], np.where(valid, a.position_ids + 1, 0))
        assert b.answers == a.answers and np.array_equal(b.loss_mask[:, 1:], a.loss_mask)
    assert bos.max_position_id(9, k) == plain.max_position_id(9, k) + 1
    assert bos.max_seq_len(9, k) == plain.max_seq_len(9, k) + 1
    assert dependency_offsets(bos, 24, k) == dependency_offsets(plain, 24, k)


@pytest.mark.parametrize("name,params", [("addition", {"operands": "independent", "bos": True}),
                                         ("multiplication", {"train_k": 3})])
def test_operands_written_least_significant_first_are_the_same_numbers_reversed(name, params):
    """operand_order lsb_first (Abacus's and Zhou et al.'s format): the same draws, each operand's
    digits in reverse, each operand starting at significance 0's id, the answer as it was."""
    msb_task = get_task(name, train_length=6, **params)
    lsb_task = get_task(name, train_length=6, operand_order="lsb_first", **params)
    msb, lsb = msb_task.sample(32, rng(5)), lsb_task.sample(32, rng(5))
    assert msb.answers == lsb.answers and np.array_equal(msb.loss_mask, lsb.loss_mask)
    digits = {str(d) for d in range(10)}
    for (m, *_), (s, ids, *_) in zip(rows(msb_task, msb), rows(lsb_task, lsb)):
        eq = m.index("=")
        assert s[eq:] == m[eq:]
        runs = lambda toks: "".join(t if t in digits else " " for t in toks[:eq]).split()  # noqa: E731
        assert runs(s) == [r[::-1] for r in runs(m)]
        first = [i for i in range(eq) if s[i] in digits and (i == 0 or s[i - 1] not in digits)]
        assert len(first) == 2 and ids[first[0]] == ids[first[1]] == ids[eq + 1]  # as the answer's c_0
    with pytest.raises(TaskParamError, match="operand_order"):
        get_task(name, operand_order="backwards")


def test_addition_with_operand_lengths_drawn_independently():
    task = get_task("addition", train_length=6, operands="independent")
    batch = task.sample(400, rng(3))
    check_padding(task, batch)
    shorter = 0
    for (tokens, _ids, _loss, _ans, _prompt), answer, meta in zip(rows(task, batch), batch.answers, batch.meta):
        n = meta["length"]
        a, b = "".join(tokens[:n]), "".join(tokens[n + 1 : 2 * n + 1])
        assert int(a) + int(b) == int(answer) and len(answer) == n + 1
        shorter += a.startswith("00") or b.startswith("00")
    assert shorter > 50  # zero-padded operands are common
    # the padded width is the longer operand's length: E[max of two U[1, 6]] = 4.47, not 3.5
    assert np.mean([m["length"] for m in batch.meta]) > 4.2
    cell = task.sample(50, rng(3), length=10)  # evaluation points: both operands of the cell's length
    assert (cell.seq_len == 34).all()
    with pytest.raises(TaskParamError, match="operands"):
        get_task("addition", operands="ragged")


def test_addition_without_leading_zeros_draws_operands_as_the_reference_does():
    """leading_zeros: false: an operand of two or more digits never starts with 0 (the reference
    implementation of position coupling), in training and in evaluation points; leading_zeros: true is the default."""
    plain = get_task("addition", train_length=5, operands="independent", bos=True)
    assert get_task("addition", train_length=5, operands="independent", bos=True,
                    leading_zeros=True).sample(64, rng(2)).tokens.tolist() == plain.sample(64, rng(2)).tokens.tolist()
    task = get_task("addition", train_length=5, operands="independent", bos=True, leading_zeros=False)
    train = task.sample(2000, rng(3))
    longer = [m for m in train.meta if m["length"] >= 2]  # the longer operand is as long as the sample
    assert longer and not any(m["a"][0] == "0" and m["b"][0] == "0" for m in longer)
    assert sum(m["a"][0] == "0" and m["b"][0] == "0" for m in plain.sample(2000, rng(3)).meta if m["length"] >= 2) > 50
    cell = task.sample(500, rng(4), length=10)
    assert not any(m["a"][0] == "0" or m["b"][0] == "0" for m in cell.meta)
    assert all(int(m["a"]) + int(m["b"]) == int(a) for m, a in zip(cell.meta, cell.answers))
    with pytest.raises(TaskParamError, match="leading_zeros"):
        get_task("addition", leading_zeros="no")


@pytest.mark.parametrize("order", ["msb_first", "lsb_first"])
def test_addition_with_unpadded_operands_writes_each_number_as_long_as_it_is(order):
    """operands: unpadded (the Abacus reference's draws): each operand as many digits as its own
    length, every (i, j) pair of lengths; every digit keeps its place as id and digit place, and what
    an output digit depends on is the digits of its own and the next lower place that exist."""
    task = get_task("addition", train_length=5, operands="unpadded", operand_order=order, bos=True)
    batch = task.sample(600, rng(4))
    check_padding(task, batch)
    places, pairs = task.digit_places(batch), set()
    for b, ((tokens, _ids, _loss, _ans, _prompt), answer, meta) in enumerate(zip(rows(task, batch), batch.answers,
                                                                                batch.meta)):
        plus, eq = tokens.index("+"), tokens.index("=")
        a, b_ = "".join(tokens[1:plus]), "".join(tokens[plus + 1:eq])
        if order == "lsb_first":
            a, b_ = a[::-1], b_[::-1]
        assert (a, b_) == (meta["a"], meta["b"]) and int(a) + int(b_) == int(answer)
        pairs.add((len(a), len(b_)))
        assert len(answer) == max(len(a), len(b_)) + 1
        digits = [i for i in range(1, eq) if i != plus]
        assert sorted(places[b, digits[:len(a)]]) == list(range(1, len(a) + 1))
        assert all(1 <= p < len(tokens) for dep in meta["deps"] for p in dep)
        for j, dep in enumerate(meta["deps"][:-1]):  # the sum's j-th digit: places j+1 (and j) only
            assert {int(places[b, p]) for p in dep if p < eq} <= {j, j + 1} - {0}
    assert pairs == {(i, j) for i in range(1, 6) for j in range(1, 6)}
    with pytest.raises(TaskParamError, match="bos"):
        get_task("addition", bos="yes")
