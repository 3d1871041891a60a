"""OpenTelemetry's own SDK with its in-memory exporter, for the telemetry tests (the
``traced`` fixture in tests/conftest.py): one tracer provider, installed as the global
one once per process (SDKs that trace, pydantic-ai's instrumentation and ADK, find it
there), and readings of the finished spans as a tree."""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Iterable, Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from statemachine.telemetry import SCOPE

_EXPORTER = InMemorySpanExporter()
_PROVIDER = TracerProvider()
_PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))
_INSTALLED = {"done": False}


def provider() -> TracerProvider:
    """The provider, the global one from the first call on."""
    if not _INSTALLED["done"]:
        trace.set_tracer_provider(_PROVIDER)
        _INSTALLED["done"] = True
    return _PROVIDER


class Traced:
    """What was exported since the test began."""

    def __init__(self) -> None:
        _EXPORTER.clear()

    @property
    def spans(self) -> tuple[ReadableSpan, ...]:
        return tuple(_EXPORTER.get_finished_spans())

    def clear(self) -> None:
        _EXPORTER.clear()

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [span for span in self.spans if span.name.startswith(prefix)]

    def parent_of(self, span: ReadableSpan) -> ReadableSpan | None:
        if span.parent is None:
            return None
        for other in self.spans:
            if other.context.span_id == span.parent.span_id:
                return other
        return None

    def ancestors(self, span: ReadableSpan) -> list[str]:
        """The names of the spans above ``span``, nearest first."""
        names = []
        parent = self.parent_of(span)
        while parent is not None:
            names.append(parent.name)
            parent = self.parent_of(parent)
        return names

    def tree(self) -> str:
        """Every exported span as an indented tree, children under their parent, each level
        in order of starting: a span's name and its `SHOWN` attributes (``label=value``),
        then, one level deeper behind ``· ``, the classes of the transition events on it in
        seq order. A span whose parent was not exported is a root."""
        spans = sorted(self.spans, key=lambda span: span.start_time or 0)
        ids = {span.context.span_id for span in spans}
        below: dict[int | None, list[ReadableSpan]] = {}
        for span in spans:
            parent = span.parent.span_id if span.parent is not None else None
            below.setdefault(parent if parent in ids else None, []).append(span)
        lines: list[str] = []

        def walk(parent: int | None, depth: int) -> None:
            for span in below.get(parent, []):
                lines.append("  " * depth + line(span))
                found = sorted(((e.attributes or {}) for e in span.events
                                if e.name == "statemachine.transition"),
                               key=lambda e: int(e["statemachine.seq"]))  # type: ignore[arg-type]
                if found:
                    lines.append("  " * (depth + 1) + "· " + " ".join(
                        str(e["statemachine.event"]) for e in found))
                walk(span.context.span_id, depth + 1)

        walk(None, 0)
        return "\n".join(lines)

    def assert_conventions(self) -> None:
        """Every span of the library's (the bridge's mirrors of an SDK's included), or an
        SDK's the library joined, named for a GenAI operation (``execute_tool {tool}``,
        ``invoke_agent {agent}``) says it in its attributes as the GenAI semantic
        conventions ask: ``gen_ai.operation.name`` and the tool's (or agent's) name; every
        span that carries the ledger's outcome carries its call id. (An SDK's other spans
        are its own business.)"""
        for span in self.spans:
            scope = span.instrumentation_scope
            said = span.attributes or {}
            ledgers = "statemachine.tool.outcome" in said
            if (scope is None or scope.name != SCOPE) and not ledgers:
                continue
            operation, _, target = span.name.partition(" ")
            if ledgers:
                assert said.get("gen_ai.operation.name") == "execute_tool", span.name
                assert said.get("gen_ai.tool.call.id"), span.name
            if operation == "execute_tool":
                assert (said.get("gen_ai.operation.name"), said.get("gen_ai.tool.name")) == (
                    "execute_tool", target), span.name
            elif operation == "invoke_agent":
                assert said.get("gen_ai.operation.name") == "invoke_agent", span.name

    def transitions(self) -> list[dict[str, Any]]:
        """Every ``statemachine.transition`` span event, by seq, each with the name of the
        span it is on (``"span"``)."""
        found = [dict(event.attributes or {}, span=span.name) for span in self.spans
                 for event in span.events if event.name == "statemachine.transition"]
        return sorted(found, key=lambda event: event["statemachine.seq"])

    def walk(self, first_seq: int = 0) -> list[dict[str, Any]]:
        """The transition events (`transitions`), checked to be one unbroken walk of the
        run: seq after seq from ``first_seq``, each starting where the one before
        ended."""
        events = self.transitions()
        assert [e["statemachine.seq"] for e in events] == list(
            range(first_seq, first_seq + len(events)))
        for before, after in itertools.pairwise(events):
            assert after["statemachine.from"] == before["statemachine.to"], (before, after)
        return events

    def assert_no_payloads(self, *payloads: str) -> None:
        """No attribute value of the library's spans holds any of ``payloads``
        (arguments, results, items, the model's words, fingerprints)."""
        for value in self.values():
            for payload in payloads:
                assert payload not in str(value), (payload, value)

    def values(self) -> Iterator[Any]:
        """Every attribute value of every span and span event the library made (an SDK's
        own spans carry what its instrumentation chose)."""
        for span in self.spans:
            scope = span.instrumentation_scope
            if scope is None or scope.name != SCOPE:
                continue
            yield from (span.attributes or {}).values()
            for event in span.events:
                yield from (event.attributes or {}).values()


def attributes(spans: Iterable[ReadableSpan], *keys: str) -> list[tuple[Any, ...]]:
    """``keys`` of each span's attributes, in the spans' order of ending."""
    return [tuple((span.attributes or {}).get(key) for key in keys) for span in spans]


SHOWN = {"gen_ai.tool.call.id": "call", "statemachine.tool.outcome": "outcome",
         "statemachine.publication.via": "via", "statemachine.publication.items": "items",
         "statemachine.publication.outcome": "outcome", "statemachine.actor": "actor",
         "error.type": "error"}
"""The attributes `Traced.tree` shows, by the label it shows them with."""


def line(span: ReadableSpan) -> str:
    """One span as `Traced.tree` shows it: ``name label=value ...``."""
    said = span.attributes or {}
    return " ".join([span.name, *(f"{label}={said[key]}" for key, label in SHOWN.items()
                                  if key in said)])


def dedent(text: str) -> str:
    """An expected tree written indented in a test, as `Traced.tree` prints it."""
    return textwrap.dedent(text).strip("\n")
