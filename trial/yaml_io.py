"""Reading YAML files strictly, and saying what is wrong with them (or with a config) one field a line.

- `load_yaml`: one document, one mapping, no key given twice, no nesting beyond MAX_YAML_DEPTH, and
  no alias bomb (`check_yaml_expansion` counts the values before anything is built); errors start
  with `file:line:column:`.
- `describe_errors`: a pydantic ValidationError as one line per problem, each naming its field.

Trial configs and study specs both read through here; study/preflight.py uses the alias check for the
other files a command line names.
"""

from __future__ import annotations

import re

import yaml

MAX_YAML_DEPTH = 50  # nesting a config may have; deeper is refused naming the key
MAX_SCAN_DEPTH = 200  # nesting beyond which the alias count stops (the loaders refuse it themselves)
MAX_YAML_EXPANSION = 100_000  # values a YAML file may hold once its aliases are expanded


class YamlBomb(ValueError):
    """A YAML file whose aliases expand to more values than MAX_YAML_EXPANSION."""


def check_yaml_expansion(path: str, limit: int = MAX_YAML_EXPANSION) -> None:
    """Raise YamlBomb (`file:line:column: ...`) if the aliases of the YAML at `path` expand to more
    than `limit` values. Reads events only: nothing is expanded or constructed, and a file that is
    not YAML is left to the loader to report."""
    sizes: dict[str, int] = {}  # anchor -> values under it, aliases expanded
    stack: list[list] = []  # open collections: [values so far, anchor]
    total, aliases = 0, False
    with open(path, "rb") as f:
        try:
            for event in yaml.parse(f, Loader=yaml.SafeLoader):
                if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                    if len(stack) >= MAX_SCAN_DEPTH:
                        return  # the loaders refuse this depth themselves, naming the key
                    stack.append([1, event.anchor])
                    continue
                if isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                    size, anchor = stack.pop()
                elif isinstance(event, yaml.ScalarEvent):
                    size, anchor = 1, event.anchor
                elif isinstance(event, yaml.AliasEvent):
                    size, anchor, aliases = sizes.get(event.anchor, 1), None, True
                else:
                    continue
                if anchor is not None:
                    sizes[anchor] = size
                if stack:
                    stack[-1][0] += size
                else:
                    total += size
                if aliases and (total + sum(s for s, _ in stack)) > limit:
                    mark = event.start_mark
                    raise YamlBomb(f"{path}:{mark.line + 1}:{mark.column + 1}: its aliases expand to more "
                                   f"than {limit} values (a YAML alias bomb?); write the values out instead")
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


def load_yaml(path: str, what: str) -> dict:
    """Read a file holding one YAML mapping (`what` says which kind, for the error). Aliases are not
    expanded without bound: an alias bomb is refused before anything is built."""
    try:
        check_yaml_expansion(path)
    except YamlBomb as e:
        raise InputFileError(str(e)) from None
    with open(path) as f:
        try:
            loader = _StrictLoader(f)
            try:
                data = loader.get_single_data()
            finally:
                loader.dispose()
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
            raise InputFileError(f"{where}: {'; '.join(filter(None, [e.context, e.problem]))}") from None
        except yaml.YAMLError as e:  # a character YAML may not hold
            raise InputFileError(f"{path}: {' '.join(str(e).split())}") from None
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
