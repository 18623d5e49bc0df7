"""Semantic tests for the `lm` task: byte tokenization, corpus loading and splitting, windows, errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tasks import TASKS, TaskParamError, get_task
from tasks import corpus as corpus_mod
from tasks.lm import LMTask, decode_text, encode_text

REPO = Path(__file__).resolve().parents[1]
EOS = 1


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def joined(texts: list[str]) -> np.ndarray:
    """What a split should hold: the documents' byte ids with <eos> between documents."""
    parts: list[int] = []
    for i, text in enumerate(texts):
        if i:
            parts.append(EOS)
        parts.extend(encode_text(text).tolist())
    return np.array(parts, dtype=np.int64)


def write_folder(root: Path) -> dict[str, str]:
    docs = {f"doc{i:02d}.txt": f"document {i}: " + "héllo ∑ 🙂 " * (i + 1) + "\n" for i in range(12)}
    docs["sub/deep.txt"] = "nested\x00file with a NUL byte\n"
    for name, text in docs.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "notes.md").write_text("# not a .txt file\n", encoding="utf-8")
    (root / "empty.txt").write_text("", encoding="utf-8")  # empty documents are skipped
    return docs


# --- tokenization --------------------------------------------------------------------------


def test_byte_vocab_and_round_trip():
    task = get_task("lm", corpus="stdlib", max_bytes=200_000, train_length=8)
    assert len(task.vocab) == 258 and task.vocab.tokens[:2] == ["<pad>", "<eos>"]
    assert task.vocab.decode(encode_text("A\n")) == ["b065", "b010"]
    for text in ["héllo ∑ 🙂\n", "", "\x00\t\r\n", "日本語テキスト", "a" * 1000 + "\U0010ffff"]:
        ids = encode_text(text)
        assert ids.dtype == np.int64 and len(ids) == len(text.encode("utf-8"))
        assert ids.min(initial=2) >= 2 and ids.max(initial=2) <= 257
        assert decode_text(ids) == text
    all_bytes = np.arange(2, 258)
    assert decode_text(all_bytes).encode("utf-8", errors="replace")  # decodes without raising
    assert decode_text(joined(["ab", "c"])) == "ab<eos>c"
    assert decode_text(np.concatenate([encode_text("x"), [0, 0]])) == "x"  # padding dropped
    # A window cut inside a multi-byte character decodes with a replacement, never raises.
    assert decode_text(encode_text("🙂")[:2]) == "\ufffd"


# --- corpora -------------------------------------------------------------------------------


def test_stdlib_corpus_loads_deterministically_and_splits_by_document():
    corpus_mod.clear_cache()
    t0 = time.perf_counter()
    task = get_task("lm")  # the default: stdlib, max_bytes 8_000_000
    load_s = time.perf_counter() - t0
    print(f"stdlib corpus: {task.split.total_bytes} bytes, {len(task.train_docs)} train / "
          f"{len(task.val_docs)} validation documents, loaded in {load_s:.3f} s")
    assert load_s < 5.0
    split = task.split
    assert 0 < split.total_bytes <= 8_000_000
    assert len(task.train_docs) > 100 and len(task.val_docs) > 10
    assert not set(task.train_docs) & set(task.val_docs)
    names = task.train_docs + task.val_docs
    assert all(n.endswith(".py") for n in names)
    assert not any(part in {"site-packages", "test", "tests", "idlelib", "tkinter", "lib2to3"}
                   for n in names for part in n.split("/")[:-1])
    # Sizes: every document byte once, one <eos> between consecutive documents of a split.
    n_bytes = len(task.train_tokens) + len(task.val_tokens) - (len(task.train_docs) - 1) - (len(task.val_docs) - 1)
    assert n_bytes == split.total_bytes
    assert (task.train_tokens == EOS).sum() == len(task.train_docs) - 1
    assert (task.val_tokens == EOS).sum() == len(task.val_docs) - 1
    # Cached: building again is cheap and shares the arrays.
    t0 = time.perf_counter()
    again = get_task("lm", train_length=64)
    assert time.perf_counter() - t0 < 0.05 and again.train_tokens is task.train_tokens
    # Deterministic: a fresh load (cache cleared) gives the same split and tokens.
    corpus_mod.clear_cache()
    fresh = get_task("lm")
    assert fresh.train_docs == task.train_docs and fresh.val_docs == task.val_docs
    assert np.array_equal(fresh.train_tokens, task.train_tokens)
    assert np.array_equal(fresh.val_tokens, task.val_tokens)
    # A smaller cap keeps a prefix of the same sorted document order, within the cap.
    small = get_task("lm", max_bytes=300_000, train_length=16)
    assert small.split.total_bytes == 300_000
    small_names = sorted(small.train_docs + small.val_docs)
    assert small_names == sorted(names)[: len(small_names)]
    assert set(small.val_docs) <= set(task.val_docs) | {max(small_names)}  # the cut last doc aside
    # A different split seed gives a different, still disjoint, split.
    other = get_task("lm", split_seed=1)
    assert other.val_docs != task.val_docs and not set(other.train_docs) & set(other.val_docs)


def test_folder_corpus(tmp_path):
    docs = write_folder(tmp_path)
    task = get_task("lm", corpus=str(tmp_path), train_length=4, val_fraction=0.25)
    assert sorted(task.train_docs + task.val_docs) == sorted(docs)  # notes.md and empty.txt excluded
    assert task.val_docs and task.train_docs and not set(task.train_docs) & set(task.val_docs)
    assert list(task.train_docs) == sorted(task.train_docs)
    assert np.array_equal(task.train_tokens, joined([docs[n] for n in task.train_docs]))
    assert np.array_equal(task.val_tokens, joined([docs[n] for n in task.val_docs]))
    # The NUL byte inside a document is a byte token, not a separator.
    where = "train" if "sub/deep.txt" in task.train_docs else "val"
    tokens = task.train_tokens if where == "train" else task.val_tokens
    assert (tokens == 2).sum() == 1 and (tokens == EOS).sum() == len(getattr(task, f"{where}_docs")) - 1
    # One document cannot be split into train and validation.
    with pytest.raises(TaskParamError) as err:
        get_task("lm", corpus=str(tmp_path), glob="*.md", train_length=2)
    assert err.value.param == "corpus"


def test_folder_corpus_split_is_by_hash_of_name(tmp_path):
    docs = write_folder(tmp_path)
    a = get_task("lm", corpus=str(tmp_path), train_length=4, val_fraction=0.3, split_seed=7)
    expect_val = sorted(n for n in docs if corpus_mod.doc_hash(n, 7) < 0.3)
    if expect_val and len(expect_val) < len(docs):
        assert list(a.val_docs) == expect_val


def test_jsonl_corpus(tmp_path):
    texts = [f"record {i} ∑ {'x' * i}" for i in range(20)]
    path = tmp_path / "data.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "body": text}) + "\n")
            if i == 5:
                f.write("\n")  # blank lines are skipped
    task = get_task("lm", corpus=str(path), text_field="body", train_length=8, val_fraction=0.2)
    by_name = {}
    lineno = 0
    for i, text in enumerate(texts):
        lineno += 1
        by_name[f"line{lineno:09d}"] = text
        if i == 5:
            lineno += 1
    assert sorted(task.train_docs + task.val_docs) == sorted(by_name)
    assert not set(task.train_docs) & set(task.val_docs)
    assert np.array_equal(task.train_tokens, joined([by_name[n] for n in task.train_docs]))
    assert np.array_equal(task.val_tokens, joined([by_name[n] for n in task.val_docs]))
    assert (task.train_tokens == EOS).sum() == len(task.train_docs) - 1
    with pytest.raises(TaskParamError) as err:
        get_task("lm", corpus=str(path), train_length=8)  # default text_field "text" is missing
    assert err.value.param == "text_field"


def test_max_bytes_caps_other_sources(tmp_path):
    docs = write_folder(tmp_path)
    task = get_task("lm", corpus=str(tmp_path), train_length=4, max_bytes=300, val_fraction=0.3)
    assert task.split.total_bytes == 300
    names = sorted(task.train_docs + task.val_docs)
    assert names == sorted(docs)[: len(names)] and len(names) < len(docs)


def test_hf_corpus_without_datasets_names_corpus(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(TaskParamError) as err:
        get_task("lm", corpus=f"hf:{tmp_path / 'anything'}", train_length=4)
    assert err.value.param == "corpus" and "datasets" in str(err.value)


def test_relative_paths_are_resolved_in_the_cache(tmp_path, monkeypatch):
    for sub in ("one", "two"):
        (tmp_path / sub / "data").mkdir(parents=True)
        for i in range(4):
            (tmp_path / sub / "data" / f"{i}.txt").write_text(f"{sub} {i}\n" * 5, encoding="utf-8")
    monkeypatch.chdir(tmp_path / "one")
    one = get_task("lm", corpus="data", train_length=4)
    monkeypatch.chdir(tmp_path / "two")
    two = get_task("lm", corpus="data", train_length=4)
    assert decode_text(one.train_tokens).startswith("one") and decode_text(two.train_tokens).startswith("two")


def test_hf_corpus_from_local_disk(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="`datasets` (optional dependency) is not installed")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")  # keep ~/.cache clean
    texts = [f"hf row {i} héllo" for i in range(30)]
    ds = datasets.Dataset.from_dict({"text": texts, "n": list(range(30))})
    ds.save_to_disk(str(tmp_path / "single"))
    task = get_task("lm", corpus=f"hf:{tmp_path / 'single'}", train_length=8, val_fraction=0.2)
    rows = {f"row{i:09d}": t for i, t in enumerate(texts)}
    assert sorted(task.train_docs + task.val_docs) == sorted(rows)
    assert np.array_equal(task.val_tokens, joined([rows[n] for n in task.val_docs]))
    # A DatasetDict on disk: hf_split picks the split.
    datasets.DatasetDict({"train": ds, "other": ds.select(range(5))}).save_to_disk(str(tmp_path / "dict"))
    five = get_task("lm", corpus=f"hf:{tmp_path / 'dict'}", hf_split="other", train_length=4, val_fraction=0.5)
    assert len(five.train_docs + five.val_docs) == 5
    with pytest.raises(TaskParamError) as err:
        get_task("lm", corpus=f"hf:{tmp_path / 'dict'}", hf_split="nope", train_length=4)
    assert err.value.param == "hf_split"
    # load_dataset on a local folder of data files (the packaged json builder; nothing downloaded).
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    via_load = get_task("lm", corpus=f"hf:{raw}", train_length=8, val_fraction=0.2)
    assert np.array_equal(via_load.train_tokens, task.train_tokens)
    with pytest.raises(TaskParamError) as err:
        get_task("lm", corpus=f"hf:{tmp_path / 'single'}", text_field="body", train_length=8)
    assert err.value.param == "text_field"


# --- windows -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_task() -> LMTask:
    return get_task("lm", corpus="stdlib", max_bytes=1_000_000, train_length=32)  # type: ignore[return-value]


def check_window_batch(task: LMTask, batch, n: int, source: np.ndarray, split: str) -> None:
    B = len(batch)
    assert batch.tokens.shape == (B, n) and batch.tokens.dtype == np.int64
    assert np.array_equal(batch.position_ids, np.broadcast_to(np.arange(n), (B, n)))
    expect_mask = np.broadcast_to(np.arange(n) >= 1, (B, n))
    assert np.array_equal(batch.loss_mask, expect_mask) and np.array_equal(batch.answer_mask, expect_mask)
    assert np.all(batch.prompt_len == 1) and np.all(batch.seq_len == n)
    assert not np.any(batch.tokens == task.vocab.pad_id)
    json.dumps(batch.meta)
    for b in range(B):
        meta = batch.meta[b]
        assert meta["split"] == split
        off = meta["offset"]
        assert 0 <= off <= len(source) - n
        assert np.array_equal(batch.tokens[b], source[off : off + n])


def test_training_windows_come_from_train_split(stdlib_task):
    task = stdlib_task
    a, b = task.sample(64, rng(3)), task.sample(64, rng(3))
    assert np.array_equal(a.tokens, b.tokens) and a.meta == b.meta
    c = task.sample(64, rng(4))
    assert not np.array_equal(a.tokens, c.tokens)
    check_window_batch(task, a, task.train_length, task.train_tokens, "train")
    offsets = [m["offset"] for m in task.sample(2000, rng(5)).meta]
    # Uniform over the train split: starts spread over the whole array.
    assert min(offsets) < 0.05 * len(task.train_tokens) and max(offsets) > 0.95 * len(task.train_tokens)


def test_eval_and_validation_windows_come_from_validation_split(stdlib_task):
    task = stdlib_task
    cell = task.sample(32, rng(6), length=300)
    check_window_batch(task, cell, 300, task.val_tokens, "validation")
    assert task.max_seq_len(300, None) == 300 == cell.seq_len.max()
    assert task.max_position_id(300, None) == 299 == cell.position_ids.max()
    val = task.validation_sample(32, rng(7))
    check_window_batch(task, val, task.train_length, task.val_tokens, "validation")
    again = task.validation_sample(32, rng(7))
    assert np.array_equal(val.tokens, again.tokens)
    # k is meaningless here and ignored like the other k-less tasks.
    assert np.array_equal(task.sample(4, rng(8), length=16, k=3).tokens, task.sample(4, rng(8), length=16).tokens)
    batch = task.sample(2, rng(9), length=20)
    for b, record in enumerate(task.to_records(batch)):
        assert len(record["tokens"]) == 20 and record["text"] == decode_text(batch.tokens[b])


def test_default_validation_sample_is_a_fresh_training_draw():
    task = get_task("sparse_parity")
    a, b = task.validation_sample(16, rng(1)), task.sample(16, rng(1))
    assert np.array_equal(a.tokens, b.tokens) and a.meta == b.meta


# --- errors --------------------------------------------------------------------------------


def param_of(**params) -> str:
    with pytest.raises(TaskParamError) as err:
        get_task("lm", **params)
    assert str(err.value).startswith(err.value.param + ":")
    return err.value.param


def test_bad_params_name_the_parameter(tmp_path, stdlib_task):
    assert param_of(corpus=str(tmp_path / "missing")) == "corpus"
    assert param_of(corpus=str(tmp_path)) == "corpus"  # empty folder
    (tmp_path / "x.csv").write_text("a,b\n")
    assert param_of(corpus=str(tmp_path / "x.csv")) == "corpus"
    assert param_of(corpus="hf:") == "corpus"
    assert param_of(corpus="") == "corpus"
    for bad in (0, 1, 1.5, -0.1, True, "0.1"):
        assert param_of(val_fraction=bad, max_bytes=100_000) == "val_fraction"
    assert param_of(train_length=1) == "train_length"
    assert param_of(train_length=10**9, max_bytes=100_000) == "train_length"  # longer than a split
    assert param_of(max_bytes=0) == "max_bytes"
    assert param_of(train_k=3) == "train_k"
    assert param_of(nonsense=1) == "nonsense"
    task = stdlib_task
    for length in (len(task.val_tokens) + 1, 1):
        with pytest.raises(TaskParamError) as err:
            task.sample(2, rng(), length=length)
        assert err.value.param == "length"
        with pytest.raises(TaskParamError) as err:
            task.check(length, None)
        assert err.value.param == "length"
    task.check(len(task.val_tokens), None)  # exactly the split: one possible window


def test_registered_and_cli():
    assert TASKS["lm"] is LMTask
    args = [sys.executable, "-m", "tasks", "sample", "lm", "--length", "64", "--count", "2", "--seed", "0"]
    first = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    second = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    records = [json.loads(line) for line in first.stdout.splitlines()]
    assert len(records) == 2
    for r in records:
        assert len(r["tokens"]) == 64 and all(t.startswith("b") or t == "<eos>" for t in r["tokens"])
        assert r["position_ids"] == list(range(64)) and r["loss_mask"] == [0] + [1] * 63
        assert r["meta"]["split"] == "validation"
        ids = [1 if t == "<eos>" else int(t[1:]) + 2 for t in r["tokens"]]
        assert r["text"] == decode_text(ids)
    bad = subprocess.run(args[:5] + ["--length", "1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: length:")
