"""Keep-or-drop rules over RedPajama-V2 quality signals, in a tiny expression language.

Rules come from the command line or a YAML file, i.e. from anywhere, so they are parsed here
into closures and never handed to `eval`. A rule says what a document must satisfy to be
kept (`rps_doc_word_count >= 50`). Grammar:

    rule  := or
    or    := and ("or" and)*
    and   := not ("and" not)*
    not   := "not" not | "(" or ")" | value OP value        OP: < <= > >= == !=
    value := NUMBER | "string" | SIGNAL | AGG "(" SIGNAL ")" AGG: sum mean min max count

RedPajama-V2 stores each signal as a list of `[start, end, value]` spans over `raw_content`:
document-level signals (`rps_doc_*`, `ccnet_*`) have one span, line-level ones (`rps_lines_*`)
one per line. A bare SIGNAL is the value of a one-span signal; line-level signals must be
aggregated. A value that is absent or null (e.g. an English-only classifier score on German
text) makes the rule unevaluable: the document is dropped and counted as such, so a misspelt
signal name shows up in the summary instead of silently keeping everything.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import yaml

from megazpp.errors import DataError

Signals = dict[str, object]
Value = float | str
Getter = Callable[[Signals], Value]
Predicate = Callable[[Signals], bool]

DUPLICATE_RULE = "not a duplicate"
LINE_SIGNAL_PREFIX = "rps_lines_"

_TOKEN = re.compile(
    r"""\s*(?:
    (?P<number>-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)
  | (?P<string>"[^"]*"|'[^']*')
  | (?P<op><=|>=|==|!=|<|>)
  | (?P<paren>[()])
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<bad>\S)
)""",
    re.VERBOSE,
)
_COMPARE = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}
_KEYWORDS = {"and", "or", "not"}


class Unavailable(Exception):
    """The document lacks a value the rule needs."""


def _span_values(signals: Signals, name: str) -> list[object]:
    spans = signals.get(name)
    if not isinstance(spans, list):
        raise Unavailable(name)
    try:
        return [span[2] for span in spans]
    except (TypeError, IndexError, KeyError):
        raise Unavailable(name) from None


def _numbers(values: list[object], name: str) -> list[float]:
    numbers: list[float] = []
    for v in values:
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise Unavailable(name)
        numbers.append(v)
    return numbers


def _aggregate(kind: str, name: str) -> Getter:
    def get(signals: Signals) -> Value:
        values = _span_values(signals, name)
        if kind == "count":
            return float(len(values))
        numbers = _numbers(values, name)
        if kind == "sum":
            return float(sum(numbers))
        if not numbers:
            raise Unavailable(name)
        if kind == "mean":
            return sum(numbers) / len(numbers)
        return float(min(numbers) if kind == "min" else max(numbers))

    return get


def _single(name: str) -> Getter:
    def get(signals: Signals) -> Value:
        values = _span_values(signals, name)
        value = values[0] if len(values) == 1 else None
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):  # JSON: not null, list, dict
            raise Unavailable(name)
        return value

    return get


AGGREGATES = ("sum", "mean", "min", "max", "count")


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.tokens: list[tuple[str, str, int]] = []
        for m in _TOKEN.finditer(text):
            kind = m.lastgroup
            if kind is None:
                continue
            if kind == "bad":
                self._fail(f"unexpected character {m.group(kind)!r}", m.start(kind))
            self.tokens.append((kind, m.group(kind), m.start(kind)))
        self.pos = 0

    def _fail(self, what: str, column: int | None = None) -> NoReturn:
        where = f" at column {column + 1}" if column is not None else " at the end"
        raise DataError(f"filter rule {self.text!r}: {what}{where}")

    def _peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self, kind: str, value: str | None = None, expected: str = "") -> tuple[str, str, int]:
        token = self._peek()
        if token is None or token[0] != kind or (value is not None and token[1] != value):
            self._fail(
                f"expected {expected or value or kind}" + (f", got {token[1]!r}" if token else ""),
                token[2] if token else None,
            )
        self.pos += 1
        return token

    def _is(self, kind: str, value: str) -> bool:
        token = self._peek()
        return token is not None and token[0] == kind and token[1] == value

    def parse(self) -> Predicate:
        if not self.tokens:
            self._fail("empty rule", 0)
        predicate = self._or()
        token = self._peek()
        if token is not None:
            self._fail(f"unexpected {token[1]!r}", token[2])
        return predicate

    def _or(self) -> Predicate:
        return self._joined("or", self._and, any)

    def _and(self) -> Predicate:
        return self._joined("and", self._not, all)

    def _joined(self, word: str, term: Callable[[], Predicate], combine: Callable[[Iterable[bool]], bool]) -> Predicate:
        """`term (word term)*`, true when `combine` (any / all) of the terms is."""
        terms = [term()]
        while self._is("name", word):
            self.pos += 1
            terms.append(term())
        return terms[0] if len(terms) == 1 else (lambda s: combine(t(s) for t in terms))

    def _not(self) -> Predicate:
        if self._is("name", "not"):
            self.pos += 1
            inner = self._not()
            return lambda s: not inner(s)
        if self._is("paren", "("):
            self.pos += 1
            inner = self._or()
            self._take("paren", ")")
            return inner
        left = self._value()
        op = self._take("op", expected="a comparison (< <= > >= == !=)")[1]
        right = self._value()
        compare = _COMPARE[op]

        def predicate(signals: Signals) -> bool:
            a, b = left(signals), right(signals)
            if isinstance(a, str) != isinstance(b, str):
                raise Unavailable(f"{a!r} {op} {b!r}")
            return bool(compare(a, b))

        return predicate

    def _value(self) -> Getter:
        token = self._peek()
        if token is None:
            self._fail("expected a number, a string or a signal name")
        kind, text, column = token
        self.pos += 1
        if kind == "number":
            number = float(text)
            return lambda s: number
        if kind == "string":
            string = text[1:-1]
            return lambda s: string
        if kind != "name" or text in _KEYWORDS:
            self._fail(f"expected a number, a string or a signal name, got {text!r}", column)
        if text in AGGREGATES and self._is("paren", "("):
            self.pos += 1
            name = self._take("name", expected="a signal name")[1]
            self._take("paren", ")")
            return _aggregate(text, name)
        if text.startswith(LINE_SIGNAL_PREFIX):
            self._fail(f"{text} is a per-line signal; use it inside one of {', '.join(AGGREGATES)}()", column)
        return _single(text)


def parse_rule(text: str) -> Predicate:
    """The keep-predicate of one rule; a `DataError` naming the rule and column if malformed."""
    return _Parser(text).parse()


@dataclass(frozen=True)
class FilterSpec:
    """What to filter, as plain data (it travels to worker processes and into resume markers)."""

    rules: tuple[str, ...] = ()
    drop_duplicates: bool = False

    def __post_init__(self) -> None:
        for rule in self.rules:
            parse_rule(rule)

    @property
    def active(self) -> bool:
        return bool(self.rules) or self.drop_duplicates

    @property
    def needs_signals(self) -> bool:
        return bool(self.rules)

    def rule_order(self) -> list[str]:
        """The rules in the order a document meets them (duplicates first)."""
        return ([DUPLICATE_RULE] if self.drop_duplicates else []) + list(self.rules)

    def describe(self) -> str:
        return "; ".join(self.rule_order()) or "none"


def load_filter_file(path: str | Path) -> FilterSpec:
    """A YAML mapping: `rules:` (a list of rule strings) and optionally `drop_duplicates: true`."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise DataError(f"filter file {path}: cannot read ({e})") from e
    if not isinstance(data, dict) or set(data) - {"rules", "drop_duplicates"}:
        raise DataError(
            f"filter file {path}: expected a mapping with keys 'rules' (a list of rule strings) "
            f"and 'drop_duplicates' (true/false), got {data!r:.100}"
        )
    rules = data.get("rules") or []
    if not isinstance(rules, list) or not all(isinstance(r, str) for r in rules):
        raise DataError(f"filter file {path}: 'rules' must be a list of strings, got {rules!r:.100}")
    drop = data.get("drop_duplicates", False)
    if not isinstance(drop, bool):
        raise DataError(f"filter file {path}: 'drop_duplicates' must be true or false, got {drop!r}")
    return FilterSpec(tuple(rules), drop)


class DocumentFilter:
    """A compiled `FilterSpec`: says which rule (if any) drops a document."""

    def __init__(self, spec: FilterSpec):
        self.spec = spec
        self.rules = [(text, parse_rule(text)) for text in spec.rules]

    def first_failure(self, signals: Signals | None, is_duplicate: bool) -> tuple[str, bool] | None:
        """None to keep; else (the first rule that drops it, whether it was unevaluable)."""
        if self.spec.drop_duplicates and is_duplicate:
            return DUPLICATE_RULE, False
        for text, predicate in self.rules:
            try:
                if not predicate(signals or {}):
                    return text, False
            except Unavailable:
                return text, True
        return None
