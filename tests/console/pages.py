"""Reading the console's pages as a browser would, without one: the forms a page offers
(their fields as the browser would send them), the text a person sees, and every tag and
attribute, to check that no value became markup."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import attrs

from statemachine import SQLiteEventStore
from statemachine.events import Event


@attrs.define
class Form:
    action: str
    method: str
    classes: str
    fields: dict[str, str] = attrs.Factory(dict)


class Page(HTMLParser):
    """One page: ``forms``, ``tags`` (every start tag with its attributes), ``text``."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.forms: list[Form] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self._text: list[str] = []
        self._in: Form | None = None
        self._textarea: str | None = None
        self._tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None
        self._ids: dict[str, list[str]] = {}
        self._open: list[tuple[str, str | None]] = []
        self.feed(html)
        self.close()

    @property
    def text(self) -> str:
        return "".join(self._text)

    def table(self, table_id: str) -> list[list[str]]:
        """The cells' text (stripped) of each body row of the table ``table_id``."""
        assert table_id in self._tables, f"no table {table_id!r}"
        return self._tables[table_id]

    def element_text(self, element_id: str) -> str:
        assert element_id in self._ids, f"no element {element_id!r}"
        return "".join(self._ids[element_id]).strip()

    def counts(self) -> list[tuple[str, int]]:
        """The runs page's counts per blocker: (kind, number)."""
        found = []
        for line in self.element_text("counts").splitlines():
            if line.strip():
                number, kind = line.strip().split(" ", 1)
                found.append((kind.replace(" ", "_"), int(number)))
        return found

    VOID = frozenset({"input", "br", "meta", "link", "hr", "img", "col", "area", "base",
                      "embed", "source", "track", "wbr"})

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self.tags.append((tag, found))
        if tag not in self.VOID:
            self._open.append((tag, found.get("id")))
            if found.get("id"):
                self._ids.setdefault(str(found["id"]), [])
        if tag == "table" and found.get("id"):
            self._table = str(found["id"])
            self._tables[self._table] = []
        elif tag == "tr" and self._table is not None and self._inside("tbody"):
            self._tables[self._table].append([])
        elif tag == "td" and self._table is not None and self._inside("tbody"):
            self._cell = []
        if tag == "form":
            self._in = Form(found.get("action") or "", (found.get("method") or "get").lower(),
                            found.get("class") or "")
            self.forms.append(self._in)
        elif self._in is not None and tag == "input" and found.get("name"):
            kind = (found.get("type") or "text").lower()
            if kind in ("radio", "checkbox") and "checked" not in found:
                return
            self._in.fields[str(found["name"])] = found.get("value") or ""
        elif self._in is not None and tag == "textarea" and found.get("name"):
            self._textarea = str(found["name"])
            self._in.fields[self._textarea] = ""

    def _inside(self, tag: str) -> bool:
        return any(t == tag for t, _ in self._open)

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._table is not None:
            self._tables[self._table][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None
        while tag not in self.VOID and self._open:
            closed, _ = self._open.pop()
            if closed == tag:
                break
        if tag == "form":
            self._in = None
        elif tag == "textarea":
            self._textarea = None

    def handle_data(self, data: str) -> None:
        self._text.append(data)
        if self._cell is not None:
            self._cell.append(data)
        for _, element_id in self._open:
            if element_id:
                self._ids[element_id].append(data)
        if self._in is not None and self._textarea is not None:
            self._in.fields[self._textarea] += data

    def form(self, action: str, **fields: str) -> Form:
        """The one form posting to ``action`` whose fields hold ``fields``."""
        found = [f for f in self.forms if f.action == action
                 and all(f.fields.get(k) == v for k, v in fields.items())]
        assert len(found) == 1, f"{len(found)} forms to {action} with {fields}"
        return found[0]

    def has_form(self, action: str) -> bool:
        return any(f.action == action for f in self.forms)


def markup_is_clean(page: Page) -> None:
    """No script, no image, no frame, no event-handler attribute, no ``javascript:``:
    the console makes none, so any is a value that escaped."""
    for tag, found in page.tags:
        assert tag not in ("script", "img", "iframe", "object", "embed"), tag
        for name, value in found.items():
            assert not name.startswith("on"), (tag, name)
            assert "javascript:" not in (value or "").lower(), (tag, name)


def log(path: Path, run_id: str) -> list[Event]:
    """The run's whole log as the store holds it (read-only)."""
    store = SQLiteEventStore(path, readonly=True)
    try:
        return store.load(run_id)
    finally:
        store.close()


def send(form: Form, **changes: Any) -> dict[str, str]:
    """The fields the browser sends for ``form``, with ``changes`` (None drops one)."""
    fields = dict(form.fields)
    for name, value in changes.items():
        if value is None:
            fields.pop(name, None)
        else:
            fields[name] = str(value)
    return fields
