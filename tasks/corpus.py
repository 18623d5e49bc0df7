"""Text corpora for the `lm` task: load documents, split them by document, hold them as byte ids.

A corpus is a list of documents (name, UTF-8 bytes) in a deterministic order, capped at
`max_bytes` of document text, split into train/validation *by document* by a stable hash of
(split_seed, its name), so the split never depends on the order, the machine or PYTHONHASHSEED.
Each split is one uint16 array of token ids (byte b -> id b + BYTE_OFFSET). Sources (`corpus`):
"stdlib", a folder, a `.jsonl` file, or "hf:<name|path>". Loaded corpora are cached per process.
The split, each source's parameters and the cache: docs/tasks.md, "Text corpora".
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .base import TaskParamError

EOS_ID = 1
# Largest `max_bytes`: the text is held in memory as bytes and again as uint16 ids (3 GiB at the
# bound, in every process that loads it); the shipped paper_lm_sparsity spec uses 5e8.
MAX_CORPUS_BYTES = 2**30
# A JSON string escapes a byte as at most 6 characters (\uXXXX): a line holding max_bytes of text fits
# in 6 x max_bytes plus this much for the rest of its record; a longer line is refused, not read whole.
JSONL_LINE_SLACK = 2**16
BYTE_OFFSET = 2  # ids 0 and 1 are <pad> and <eos>; byte b is id b + 2
STDLIB_EXCLUDE_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter", "lib2to3", "__pycache__"}
)


@dataclass(frozen=True)
class SplitCorpus:
    """Both splits of one corpus: token arrays and the names of the documents in each."""

    source: str
    train_tokens: np.ndarray  # uint16 ids, documents joined by <eos>
    val_tokens: np.ndarray
    train_docs: tuple[str, ...]
    val_docs: tuple[str, ...]
    total_bytes: int  # document bytes kept (<= max_bytes), separators not counted


_DOCS_CACHE: dict[tuple, tuple[tuple[str, bytes], ...]] = {}
_SPLIT_CACHE: dict[tuple, SplitCorpus] = {}


def clear_cache() -> None:
    _DOCS_CACHE.clear()
    _SPLIT_CACHE.clear()


# --- document sources ----------------------------------------------------------------------


def _stdlib_files() -> Iterator[tuple[str, Path]]:
    """(relative path, path) of stdlib `.py` files, sorted by relative path, excluded dirs pruned."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDE_DIRS]
        for fname in filenames:
            if fname.endswith(".py"):
                path = Path(dirpath) / fname
                found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    return iter(found)


def _folder_files(folder: Path, pattern: str) -> Iterator[tuple[str, Path]]:
    files = sorted((p.relative_to(folder).as_posix(), p) for p in folder.glob(pattern) if p.is_file())
    return iter(files)


def _read_prefix(path: Path, room: int) -> bytes:
    """The first `room` bytes of the file's text normalised through UTF-8 (replace), reading at most
    room + 4 bytes: every raw byte becomes at least one normalised byte, and a character cut at the
    end of the read (at most 3 bytes of one) lies past `room`, so the prefix equals the whole file's."""
    with open(path, "rb") as f:
        return f.read(room + 4).decode("utf-8", errors="replace").encode("utf-8")[:room]


def _read_files(files: Iterable[tuple[str, Path]]) -> Iterator[tuple[str, Callable[[int], bytes]]]:
    """Lazily: _capped reads each file only up to the room left under max_bytes."""
    for name, path in files:
        yield name, lambda room, path=path: _read_prefix(path, room)


def _jsonl_records(path: Path, text_field: str, max_bytes: int) -> Iterator[tuple[str, bytes]]:
    longest = 6 * max_bytes + JSONL_LINE_SLACK
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(iter(lambda: f.readline(longest + 1), ""), 1):
            if len(line) > longest:
                raise TaskParamError("corpus", f"{path}:{lineno}: a line longer than {longest} characters "
                                     "(6 x max_bytes + JSONL_LINE_SLACK); a record is read whole")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskParamError("corpus", f"{path}:{lineno}: not JSON ({e.msg})") from None
            except RecursionError:
                raise TaskParamError("corpus", f"{path}:{lineno}: JSON nested too deeply to read") from None
            if not isinstance(record, dict) or text_field not in record:
                raise TaskParamError("text_field", f"{path}:{lineno}: no field {text_field!r}")
            text = record[text_field]
            if not isinstance(text, str):
                raise TaskParamError("text_field", f"{path}:{lineno}: field {text_field!r} is not a string")
            yield f"line{lineno:09d}", text.encode("utf-8", errors="replace")


def _hf_records(spec: str, hf_split: str, hf_config: str | None, text_field: str) -> Iterator[tuple[str, bytes]]:
    try:
        import datasets  # optional dependency
    except ImportError:
        raise TaskParamError(
            "corpus", f"hf:{spec} needs the optional package `datasets` (pip install datasets)"
        ) from None
    local = Path(spec).expanduser()
    try:
        if local.is_dir() and ((local / "state.json").exists() or (local / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(local))  # written by save_to_disk
            if isinstance(ds, datasets.DatasetDict):
                if hf_split not in ds:
                    raise TaskParamError("hf_split", f"{hf_split!r} not in {sorted(ds)}")
                ds = ds[hf_split]
        else:
            ds = datasets.load_dataset(spec, hf_config, split=hf_split)
    except TaskParamError:
        raise
    except Exception as e:  # noqa: BLE001 - any loading failure is a bad corpus parameter
        raise TaskParamError("corpus", f"hf:{spec}: cannot load ({type(e).__name__}: {e})") from None
    if text_field not in ds.column_names:
        raise TaskParamError("text_field", f"hf:{spec} has no column {text_field!r} ({ds.column_names})")
    i = 0
    for chunk in ds.select_columns([text_field]).iter(batch_size=1024):  # lazy: max_bytes stops it
        for text in chunk[text_field]:
            if text is not None:
                yield f"row{i:09d}", str(text).encode("utf-8", errors="replace")
            i += 1


Document = tuple[str, bytes | Callable[[int], bytes]]  # (name, text or a reader taking a byte count)


def _capped(docs: Iterable[Document], max_bytes: int) -> tuple[tuple[str, bytes], ...]:
    """Documents in order until max_bytes of text; the last one is cut to fit exactly. Nothing is
    pulled from `docs` once it is full, and a document given as a function is read only up to the
    room left (it takes that many bytes)."""
    kept: list[tuple[str, bytes]] = []
    total = 0
    docs = iter(docs)
    while total < max_bytes and (doc := next(docs, None)) is not None:
        name, data = doc
        room = max_bytes - total
        data = data(room) if callable(data) else data[:room]
        if data:
            kept.append((name, data))
            total += len(data)
    return tuple(kept)


def source_key(
    corpus: str,
    *,
    glob: str = "**/*.txt",
    text_field: str = "text",
    hf_split: str = "train",
    hf_config: str | None = None,
    max_bytes: int = 8_000_000,
) -> tuple:
    """What identifies a loaded corpus (local paths resolved, so the cwd cannot alias entries)."""
    if not isinstance(corpus, str) or not corpus:
        raise TaskParamError("corpus", f"expected 'stdlib', a folder, a .jsonl file or 'hf:<name>', got {corpus!r}")
    if corpus == "stdlib":
        return ("stdlib", max_bytes)
    if corpus.startswith("hf:"):
        spec = corpus[3:]
        if not spec:
            raise TaskParamError("corpus", "hf: needs a dataset name or a local path after the colon")
        local = Path(spec).expanduser()
        if local.exists():
            spec = str(local.resolve())
        return ("hf", spec, hf_split, hf_config, text_field, max_bytes)
    path = Path(corpus).expanduser()
    if not path.exists():
        raise TaskParamError("corpus", f"no such file or folder: {corpus}")
    path = path.resolve()
    if path.is_dir():
        return ("folder", str(path), glob, max_bytes)
    if path.suffix == ".jsonl":
        return ("jsonl", str(path), text_field, max_bytes)
    raise TaskParamError("corpus", f"{corpus} is neither a folder nor a .jsonl file")


def load_documents(corpus: str, **source: object) -> tuple[tuple[str, bytes], ...]:
    """The corpus's documents (name, bytes), deterministic order, at most max_bytes of text.

    `source` takes the keyword parameters of `source_key` (glob, text_field, hf_split,
    hf_config, max_bytes)."""
    key = source_key(corpus, **source)  # type: ignore[arg-type]
    if key in _DOCS_CACHE:
        return _DOCS_CACHE[key]
    kind, max_bytes = key[0], key[-1]
    if kind == "stdlib":
        docs = _capped(_read_files(_stdlib_files()), max_bytes)
    elif kind == "folder":
        docs = _capped(_read_files(_folder_files(Path(key[1]), key[2])), max_bytes)
    elif kind == "jsonl":
        docs = _capped(_jsonl_records(Path(key[1]), key[2], max_bytes), max_bytes)
    else:
        _, spec, hf_split, hf_config, text_field, _ = key
        docs = _capped(_hf_records(spec, hf_split, hf_config, text_field), max_bytes)
    if not docs:
        where = f" matching glob {key[2]!r}" if kind == "folder" else ""
        raise TaskParamError("corpus", f"{corpus}: no non-empty documents{where}")
    _DOCS_CACHE[key] = docs
    return docs


# --- splitting and encoding ----------------------------------------------------------------


def doc_hash(name: str, split_seed: int) -> float:
    """A stable number in [0, 1) per (seed, document name): sha1, not Python's salted hash()."""
    digest = hashlib.sha1(f"{split_seed}\x00{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def join_documents(docs: Sequence[bytes]) -> np.ndarray:
    """Token ids (uint16) of documents joined with <eos> between them."""
    ids = np.frombuffer(b"\x00".join(docs), dtype=np.uint8).astype(np.uint16) + BYTE_OFFSET
    # Separators by position, not by value (documents may contain NUL bytes themselves).
    separators = np.cumsum([len(d) + 1 for d in docs], dtype=np.int64)[:-1] - 1
    ids[separators] = EOS_ID
    return ids


def split_corpus(
    corpus: str,
    *,
    val_fraction: float = 0.1,
    split_seed: int = 0,
    **source: object,
) -> SplitCorpus:
    """Load (cached) and split by document. Neither split is ever empty: with few documents, the
    document with the smallest hash goes to validation (or the largest to train) if needed."""
    key = (source_key(corpus, **source), val_fraction, split_seed)  # type: ignore[arg-type]
    if key in _SPLIT_CACHE:
        return _SPLIT_CACHE[key]
    docs = load_documents(corpus, **source)  # type: ignore[arg-type]
    if len(docs) < 2:
        raise TaskParamError("corpus", f"{corpus}: {len(docs)} document(s); a train/validation split needs 2")
    hashes = np.array([doc_hash(name, split_seed) for name, _ in docs])
    is_val = hashes < val_fraction
    if not is_val.any():
        is_val[np.argmin(hashes)] = True
    if is_val.all():
        is_val[np.argmax(hashes)] = False
    train = [d for d, v in zip(docs, is_val) if not v]
    val = [d for d, v in zip(docs, is_val) if v]
    result = SplitCorpus(
        source=corpus,
        train_tokens=join_documents([data for _, data in train]),
        val_tokens=join_documents([data for _, data in val]),
        train_docs=tuple(name for name, _ in train),
        val_docs=tuple(name for name, _ in val),
        total_bytes=sum(len(data) for _, data in docs),
    )
    result.train_tokens.flags.writeable = False
    result.val_tokens.flags.writeable = False
    _SPLIT_CACHE[key] = result
    return result
