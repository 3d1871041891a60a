"""OpenTelemetry's own SDK with its in-memory exporter, for the telemetry tests (the
``traced`` fixture in tests/conftest.py): one tracer provider, installed as the global
one once per process (SDKs that trace, pydantic-ai's instrumentation and ADK, find it
there), and readings of the finished spans as a tree."""

from __future__ import annotations

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

    def transitions(self) -> list[dict[str, Any]]:
        """Every ``statemachine.transition`` span event, by seq, each with the name of the
        span it is on (``"span"``)."""
        found = [dict(event.attributes or {}, span=span.name) for span in self.spans
                 for event in span.events if event.name == "statemachine.transition"]
        return sorted(found, key=lambda event: event["statemachine.seq"])

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
