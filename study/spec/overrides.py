"""`--set KEY=VALUE` on the command line (`study/run.py`, `python -m study.train`): a value put into
a spec or trial config before it is validated, so a bad path or value is refused as the file's
would be, naming the field.

KEY is a dotted path (`resources.gpus_per_worker`, `base.optim.steps`, `name`); under a mapping
whose keys are dotted paths themselves (a study's `grid` and `search.params`) the rest of KEY is one
key (`grid.task.params.train_k=[2, 4]`). VALUE is read as YAML (`1`, `0.5`, `true`, `rope`,
`[2, 4]`, `{encoding: rope}`); an empty VALUE is null.
"""

from __future__ import annotations

import copy
from typing import Any

from trial.yaml_io import InputFileError, load_yaml_text

SPEC_PATH_KEYS = ("grid", "search.params")  # a study spec's mappings keyed by dotted paths


def parse(item: str) -> tuple[str, Any]:
    """`KEY=VALUE` -> (KEY, VALUE read as YAML); a ValueError naming the flag otherwise."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or not all(part.strip() for part in key.split(".")):
        raise ValueError(f"--set {item}: expected KEY=VALUE, KEY a dotted path (e.g. resources.gpus_per_worker=1)")
    try:  # the file's loader: its depth, alias and duplicate-key checks
        value = load_yaml_text(raw, f"--set {key}")
    except InputFileError as e:
        raise ValueError(f"{str(e)[:300]}") from None
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**63:
        raise ValueError(f"--set {key}: {str(value)[:20]}... is a {len(str(abs(value)))}-digit number, beyond "
                         "any field's bound")
    return key, value


def apply(data: Any, items: list[str], path_keys: tuple[str, ...] = ()) -> dict:
    """`data` (a mapping read from YAML) with each `KEY=VALUE` of `items` set, in order; `path_keys`
    are the mappings whose keys are dotted paths. The input is not changed."""
    if not items:
        return data
    if not isinstance(data, dict):
        raise ValueError(f"--set: the file holds a {type(data).__name__}, not a mapping")
    out = copy.deepcopy(data)
    for item in items:
        key, value = parse(item)
        parts = key.split(".")
        for prefix in sorted(path_keys, key=len, reverse=True):  # grid.task.name: `task.name` is one key
            if key.startswith(prefix + ".") and len(parts) > len(prefix.split(".")):
                parts = [*prefix.split("."), key[len(prefix) + 1:]]
                break
        node = out
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:  # absent, or `key:` with nothing (null): a new mapping
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ValueError(f"--set {key}: {'.'.join(parts[:i + 1])} is {node!r}, not a mapping to set "
                                 f"{parts[i + 1]} in")
        node[parts[-1]] = value
    return out
