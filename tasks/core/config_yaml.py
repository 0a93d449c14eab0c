"""Reading YAML as a config (a file, an override's value, a tune space): YAML 1.2's core rules, every mistake one line.

    value = load_yaml(text, "config: configs/tiny.yaml")

PyYAML reads YAML 1.1, where `010` is 8, `1:30` is 90, `0b11` is 3, `1e-3` is text (no dot), `on`/`yes` are
true and `2020-01-01` is a date: a config meant otherwise ran with what it did not say. Here plain scalars are
read by YAML 1.2's core schema (what JSON and current YAML tools read): decimal, 0o and 0x integers; floats with
or without a dot; true/false; null; everything else text. A key written twice in one mapping is refused (PyYAML
keeps the last, silently); merge keys (`<<: *base`) work, the mapping's own keys over the merged ones; keys are
text; nesting and aliases are bounded.
"""

from __future__ import annotations

import re

import yaml

from tasks.core.errors import UserError, printable

_INT, _FLOAT, _BOOL, _MERGE = (f"tag:yaml.org,2002:{t}" for t in ("int", "float", "bool", "merge"))
_NOT_CORE = {_INT, _FLOAT, _BOOL, "tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:value"}


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key, mark):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.problem_mark = key, mark


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's core schema for plain scalars, and a key written twice in a mapping refused."""

    yaml_implicit_resolvers = {first: [(tag, rx) for tag, rx in resolvers if tag not in _NOT_CORE]
                               for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def flatten_mapping(self, node):
        """The key-twice check on each mapping's own keys, before SafeLoader merges others' into it (`<<`; a
        mapping merged before it was built had them already), once a node."""
        checked = self.__dict__.setdefault("_checked", set())
        if id(node) not in checked:
            checked.add(id(node))
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node)
                try:
                    if key in seen:
                        raise DuplicateKey(key, key_node.start_mark)
                    seen.add(key)
                except TypeError:
                    pass                          # (an unhashable key: SafeLoader refuses it, with its line)
        super().flatten_mapping(node)

    def construct_core_int(self, node):
        text = self.construct_scalar(node)
        try:
            return int(text, 0) if text.lstrip("+-")[:2] in ("0o", "0x") else int(text, 10)   # ("010" is ten)
        except ValueError:
            raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not an integer",
                                                    node.start_mark) from None

    def construct_core_float(self, node):
        try:
            return self.construct_yaml_float(node)
        except ValueError:
            raise yaml.constructor.ConstructorError(None, None, f"{self.construct_scalar(node)!r} is not a number",
                                                    node.start_mark) from None


ConfigLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
ConfigLoader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                                   list("-+0123456789"))
ConfigLoader.add_implicit_resolver(
    _FLOAT, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))
ConfigLoader.add_constructor(_INT, ConfigLoader.construct_core_int)
ConfigLoader.add_constructor(_FLOAT, ConfigLoader.construct_core_float)


MAX_VALUES = 100_000     # values a config (or an override's value) may hold, each alias counted where it is used
MAX_DEPTH = 64           # levels of nesting


def load_yaml(text: str, where: str):
    """The YAML document, refused (one UserError line naming `where`) if it nests deeper than MAX_DEPTH, holds
    more than MAX_VALUES values once its aliases are expanded (an alias bomb takes GBs when validated) or a key
    that is not text. A YAML mistake is raised as yaml.YAMLError (the caller says where: `problem` words it)."""
    try:
        value = yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise UserError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    count, stack = 0, [(value, 1, "")]
    while stack:
        node, depth, at = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise UserError(f"{where}: holds more than {MAX_VALUES} values once its YAML aliases are expanded; a "
                            f"config is sections of settings")
        if depth > MAX_DEPTH:
            raise UserError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            for k, v in node.items():
                if not isinstance(k, str):
                    raise UserError(printable(f"{where}: key {'null' if k is None else repr(k)}"
                                              f"{f' in {at}' if at else ''} is {type(k).__name__}; keys are text "
                                              f"(quote it)"))
                stack.append((v, depth + 1, f"{at}.{k}" if at else k))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{at}[{i}]") for i, v in enumerate(node))
    return value


def problem(e: yaml.YAMLError) -> str:
    """A YAML mistake as one line's end: ` line 15: not valid YAML: found unexpected end of stream (while
    scanning a quoted scalar, from line 7)`; where it was found first, then what and where it began."""
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}" if mark else ""
    if isinstance(e, DuplicateKey):
        return printable(f"{where}: key {e.key!r} appears twice in one mapping")
    if "another document" in str(e):
        return f"{where}: a second YAML document starts here; expected one"
    what = getattr(e, "problem", None) or ""
    if "could not determine a constructor for the tag" in what:
        what = f"{what.split('tag ', 1)[1]} is not a tag a config may hold (YAML's own types only)"
    context, begun = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and begun and mark and begun.line != mark.line:
        what += f" ({context}, from line {begun.line + 1})"
    return printable(f"{where}: not valid YAML" + (f": {what}" if what else ""))


class ConfigDumper(yaml.SafeDumper):
    """SafeDumper that quotes a string wherever ConfigLoader would read it as another type ("1e-3", "08", "0o17":
    text to YAML 1.1, so SafeDumper left them bare): what rlflow writes as a config reads back as itself."""

    yaml_implicit_resolvers = ConfigLoader.yaml_implicit_resolvers


def dump_yaml(data) -> str:
    return yaml.dump(data, Dumper=ConfigDumper, sort_keys=False)     # (non-ASCII escaped: any locale writes it)
