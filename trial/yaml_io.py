"""Reading YAML files strictly, and saying what is wrong with them (or with a config) one field a line.

- `load_yaml`: at most MAX_YAML_BYTES, one document, one mapping, no key given twice, no nesting
  beyond MAX_YAML_DEPTH (also through aliases), no recursive alias and no alias bomb
  (`check_yaml_expansion` reads the events before anything is built); errors start with
  `file:line:column:`.
- `describe_errors`: a pydantic ValidationError as one line per problem, each naming its field.

Trial configs and study specs both read through here; study/spec/preflight.py uses the alias check for the
other files a command line names.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from typing import Any

import yaml

MAX_YAML_DEPTH = 50  # nesting a config may have; deeper is refused naming the key
MAX_SCAN_DEPTH = 200  # nesting beyond which the alias count stops (the loaders refuse it themselves)
MAX_YAML_EXPANSION = 100_000  # values a YAML file may hold once its aliases are expanded
# bytes of a config file: PyYAML parses some 30-100 KB a second, so loading one stays within seconds
# (the shipped specs are under 3 KB; a grid of 1,000 written-out positional schemes under 100 KB)
MAX_YAML_BYTES = 2**18


class YamlBomb(ValueError):
    """A YAML file whose aliases expand to more than MAX_YAML_EXPANSION values, nest deeper than
    MAX_YAML_DEPTH, or refer to a collection they are inside (a recursive structure)."""


def _at(path: str, mark) -> str:
    return f"{path}:{mark.line + 1}:{mark.column + 1}"


def read_config_file(path: str) -> bytes:
    """The bytes of a config file, read once: a FIFO, device or folder is refused before it is
    opened (opening a FIFO would wait for a writer forever), and so is a file over MAX_YAML_BYTES."""
    mode = os.stat(path).st_mode  # follows a link to what it names; OSError where there is nothing
    if not stat.S_ISREG(mode):
        raise InputFileError(f"{path}: not a regular file (a FIFO, device or folder); give a YAML file")
    with open(path, "rb") as f:
        data = f.read(MAX_YAML_BYTES + 1)
    if len(data) > MAX_YAML_BYTES:
        raise InputFileError(f"{path}: more than {MAX_YAML_BYTES} bytes, the bound on a config file "
                             "(MAX_YAML_BYTES in trial/yaml_io.py)")
    return data


def check_yaml_expansion(path: str, limit: int = MAX_YAML_EXPANSION, data: bytes | str | None = None) -> None:
    """Raise YamlBomb (`file:line:column: ...`) if the aliases of the YAML at `path` expand to more
    than `limit` values, nest deeper than MAX_YAML_DEPTH, or are recursive (`a: &l {b: *l}`, which
    the loaders would build into a dict that contains itself: a RecursionError in whatever walks it).
    Reads events only: nothing is expanded or constructed, and a file that is not YAML is left to the
    loader to report."""
    sizes: dict[str, tuple[int, int]] = {}  # anchor -> (values, nesting) under it, aliases expanded
    stack: list[list] = []  # open collections: [values so far, anchor, deepest child nesting]
    total, aliases = 0, False
    source = data if data is not None else read_config_file(path)
    try:
        for event in yaml.parse(source, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                if len(stack) >= MAX_SCAN_DEPTH:
                    return  # the loaders refuse this depth themselves, naming the key
                stack.append([1, event.anchor, 0])
                continue
            mark = event.start_mark
            if isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                size, anchor, depth = stack.pop()
                depth += 1
            elif isinstance(event, yaml.ScalarEvent):
                size, anchor, depth = 1, event.anchor, 0
            elif isinstance(event, yaml.AliasEvent):
                name = event.anchor
                if any(open_anchor == name for _, open_anchor, _ in stack):
                    raise YamlBomb(f"{_at(path, mark)}: alias *{name} is inside the collection &{name} "
                                   "it names (a recursive YAML alias); write the values out instead")
                (size, depth), anchor, aliases = sizes.get(name, (1, 0)), None, True
                deep = len(stack) + depth
                if deep > MAX_YAML_DEPTH:  # a chain of aliases nests without bound
                    raise YamlBomb(f"{_at(path, mark)}: alias *{name} nests its values {deep} levels "
                                   f"deep, beyond the bound of {MAX_YAML_DEPTH} (MAX_YAML_DEPTH); write "
                                   "the values out instead")
            else:
                continue
            if anchor is not None:
                sizes[anchor] = (size, depth)
            if stack:
                stack[-1][0] += size
                stack[-1][2] = max(stack[-1][2], depth)
            else:
                total += size
            if aliases and (total + sum(s for s, _, _ in stack)) > limit:
                raise YamlBomb(f"{_at(path, mark)}: its aliases expand to more than {limit} values (a "
                               "YAML alias bomb?); write the values out instead")
    except yaml.YAMLError:
        return


class InputFileError(ValueError):
    """A file that is not one YAML mapping; the message starts with `file:line:column:`."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses what PyYAML lets through: a key given twice (PyYAML keeps the last
    silently) and nesting deeper than MAX_YAML_DEPTH (its recursive composer would end in a
    RecursionError). Errors name the dotted path of the key."""

    def __init__(self, stream):
        super().__init__(stream)
        self.path: list = []  # keys (and list positions) down to the node being composed

    def compose_node(self, parent, index):
        self.path.append(index.value if isinstance(index, yaml.ScalarNode) else index)
        try:
            if len(self.path) > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"{self._dotted()[:60]}...: nested deeper than {MAX_YAML_DEPTH} levels",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.path.pop()

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        first: dict = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{self._dotted(key)}: duplicate key (first on line {first[key].line + 1})",
                    key_node.start_mark)
            first[key] = key_node.start_mark
        return node

    def _dotted(self, *more) -> str:
        return ".".join(str(p) for p in [*self.path, *more] if p is not None) or "(top level)"


def load_yaml_text(text: bytes | str, where: str) -> Any:
    """One YAML value read strictly, as a config file is (no key twice, no nesting beyond
    MAX_YAML_DEPTH, no recursive alias, no alias bomb); errors start with `where` (a file, or a
    `--set KEY`) and its line and column."""
    try:
        check_yaml_expansion(where, data=text)
    except YamlBomb as e:
        raise InputFileError(str(e)) from None
    try:
        loader = _StrictLoader(text)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = _at(where, mark) if mark else where
        raise InputFileError(f"{at}: {'; '.join(filter(None, [e.context, e.problem]))}") from None
    except yaml.YAMLError as e:  # a character YAML may not hold
        raise InputFileError(f"{where}: {' '.join(str(e).split())}") from None
    except RecursionError:  # nesting PyYAML's own parser cannot follow (flow collections)
        raise InputFileError(f"{where}: nested deeper than {MAX_YAML_DEPTH} levels") from None
    except ValueError as e:  # a number longer than Python converts (4,300 digits)
        raise InputFileError(f"{where}: a value YAML cannot read ({' '.join(str(e).split())[:80]})") from None


def load_yaml(path: str, what: str) -> dict:
    """Read a file holding one YAML mapping (`what` says which kind, for the error), once: a FIFO
    or a folder is refused before it is opened. Aliases are not expanded without bound: an alias
    bomb is refused before anything is built."""
    raw = read_config_file(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(f"{path}: not UTF-8 text (byte {e.start})") from None
    data = load_yaml_text(text, path)
    if not isinstance(data, dict):
        raise InputFileError(f"{path}: {what} is a YAML mapping, not {type(data).__name__}")
    return data


def describe_errors(error: Exception) -> str:
    """One line per problem, each starting with the dotted field it is about."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        return str(error)
    lines = []
    for e in error.errors():
        field = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if field and re.match(r"[\w.]+: ", msg):  # our validators name the sub-field themselves
            lines.append(f"{field}.{msg}")
        else:
            lines.append(f"{field}: {msg}" if field else msg)
    return "\n".join(lines)


# fields renamed, by their dotted path: the old spelling is still read, with a one-line notice
RENAMED = {"eval.samples_per_cell": "eval.samples_per_point"}
NOTICED: set[str] = set()  # the old names a notice was printed for in this process


def accept_old_names(data: Any, group: str) -> Any:
    """`group`'s raw mapping with each renamed field under its new name; a notice on stderr, once a
    process, for each old name read."""
    if not isinstance(data, dict):
        return data
    for old_path, new_path in RENAMED.items():
        old, new = old_path.removeprefix(group + "."), new_path.removeprefix(group + ".")
        if not old_path.startswith(group + ".") or old not in data:
            continue
        if new in data:
            raise ValueError(f"{old}: the old name of {new}, which is given too; keep {new}")
        if old_path not in NOTICED:
            NOTICED.add(old_path)
            print(f"notice: {old_path} is now {new_path} (the old name still works)", file=sys.stderr)
        data = {new if k == old else k: v for k, v in data.items()}
    return data
