"""Just enough of the GraphQL language to read the documents RunPod drivers send.

Supported: `query`/`mutation` operations (named or anonymous, shorthand `{ ... }`), variable
definitions, aliases, arguments, nested selection sets, comments. Not supported, and
reported as a syntax error rather than misread: fragments, directives, block strings.
A real engine is not needed: the emulator only has to know which operation was asked,
where its input comes from, and which fields to send back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_TOKEN_RE = re.compile(
    r"""
    (?P<skip>[\s,\ufeff]+|\#[^\n\r]*)
  | (?P<spread>\.\.\.)
  | (?P<punct>[!$():=@\[\]{}])
  | (?P<name>[_A-Za-z][_0-9A-Za-z]*)
  | (?P<number>-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
    """,
    re.VERBOSE,
)


class GraphQLSyntaxError(ValueError):
    """The document is not GraphQL this parser understands (HTTP 400, GRAPHQL_PARSE_FAILED)."""


@dataclass(frozen=True)
class Variable:
    name: str


@dataclass(frozen=True)
class Literal:
    """An inline value; kept apart from variables so callers can refuse user data inline."""

    value: Any


@dataclass
class Field:
    name: str
    alias: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    selections: list[Field] = field(default_factory=list)

    @property
    def response_key(self) -> str:
        return self.alias or self.name


@dataclass
class Operation:
    kind: str  # "query" | "mutation" | "subscription"
    name: str | None
    variable_types: dict[str, str]  # variable name -> declared type, e.g. "PodFilter!"
    selections: list[Field]


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    at: int


def parse_document(source: str) -> list[Operation]:
    return _Parser(_tokenize(source)).document()


def _tokenize(source: str) -> list[_Token]:
    tokens, position = [], 0
    while position < len(source):
        match = _TOKEN_RE.match(source, position)
        if match is None:
            raise GraphQLSyntaxError(f"Syntax Error: Unexpected character at offset {position}.")
        kind = match.lastgroup or ""
        if source.startswith('"""', position):
            raise GraphQLSyntaxError("Syntax Error: block strings are not supported here.")
        if kind != "skip":
            tokens.append(_Token(kind, match.group(), position))
        position = match.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[_Token]) -> None:
        self.tokens = tokens
        self.index = 0

    # -- token helpers

    def peek(self, text: str | None = None, kind: str | None = None) -> bool:
        if self.index >= len(self.tokens):
            return False
        token = self.tokens[self.index]
        return (text is None or token.text == text) and (kind is None or token.kind == kind)

    def take(self, text: str | None = None, kind: str | None = None) -> _Token:
        if not self.peek(text, kind):
            found = self.tokens[self.index].text if self.index < len(self.tokens) else "<EOF>"
            wanted = text or kind
            raise GraphQLSyntaxError(f"Syntax Error: Expected {wanted}, found {found}.")
        token = self.tokens[self.index]
        self.index += 1
        return token

    def name(self) -> str:
        return self.take(kind="name").text

    # -- grammar

    def document(self) -> list[Operation]:
        operations = []
        while self.index < len(self.tokens):
            operations.append(self.operation())
        if not operations:
            raise GraphQLSyntaxError("Syntax Error: Unexpected <EOF>.")
        return operations

    def operation(self) -> Operation:
        if self.peek("{"):
            return Operation("query", None, {}, self.selection_set())
        kind = self.name()
        if kind == "fragment":
            raise GraphQLSyntaxError("Syntax Error: fragments are not supported here.")
        if kind not in ("query", "mutation", "subscription"):
            raise GraphQLSyntaxError(f"Syntax Error: Unexpected Name {kind!r}.")
        name = self.name() if self.peek(kind="name") else None
        variable_types = self.variable_definitions() if self.peek("(") else {}
        self.refuse_directives()
        return Operation(kind, name, variable_types, self.selection_set())

    def variable_definitions(self) -> dict[str, str]:
        self.take("(")
        definitions = {}
        while not self.peek(")"):
            self.take("$")
            variable = self.name()
            self.take(":")
            definitions[variable] = self.type_ref()
            if self.peek("="):
                self.take("=")
                self.value()
        self.take(")")
        return definitions

    def type_ref(self) -> str:
        if self.peek("["):
            self.take("[")
            inner = f"[{self.type_ref()}]"
            self.take("]")
        else:
            inner = self.name()
        if self.peek("!"):
            self.take("!")
            return inner + "!"
        return inner

    def selection_set(self) -> list[Field]:
        self.take("{")
        fields = []
        while not self.peek("}"):
            if self.peek(kind="spread"):
                raise GraphQLSyntaxError("Syntax Error: fragment spreads are not supported here.")
            fields.append(self.field())
        self.take("}")
        if not fields:
            raise GraphQLSyntaxError("Syntax Error: Expected Name, found }.")
        return fields

    def field(self) -> Field:
        name, alias = self.name(), None
        if self.peek(":"):
            self.take(":")
            name, alias = self.name(), name
        arguments = self.named_values("(", ")") if self.peek("(") else {}
        self.refuse_directives()
        selections = self.selection_set() if self.peek("{") else []
        return Field(name, alias, arguments, selections)

    def named_values(self, opening: str, closing: str) -> dict[str, Any]:
        """`name: value` pairs between `opening` and `closing`: a field's arguments, or
        the fields of an input object literal (the same grammar in the spec)."""
        self.take(opening)
        values = {}
        while not self.peek(closing):
            key = self.name()
            self.take(":")
            values[key] = self.value()
        self.take(closing)
        return values

    def value(self) -> Any:
        """A variable, or a literal whose containers may hold variables."""
        if self.peek("$"):
            self.take("$")
            return Variable(self.name())
        if self.peek("["):
            self.take("[")
            items = []
            while not self.peek("]"):
                items.append(self.value())
            self.take("]")
            return items
        if self.peek("{"):
            return self.named_values("{", "}")
        return Literal(self.scalar())

    def scalar(self) -> Any:
        if self.peek(kind="string"):
            return json.loads(self.take(kind="string").text)
        if self.peek(kind="number"):
            text = self.take(kind="number").text
            return float(text) if any(c in text for c in ".eE") else int(text)
        word = self.name()
        return {"true": True, "false": False, "null": None}.get(word, word)

    def refuse_directives(self) -> None:
        if self.peek("@"):
            raise GraphQLSyntaxError("Syntax Error: directives are not supported here.")
