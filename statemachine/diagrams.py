"""Transition diagrams drawn from the declaration in `machine` (never by hand).

Every row of `machine.TRANSITIONS` becomes an edge labelled with its trigger and guards;
rows between the same two steps share one edge. Output: Mermaid (a flowchart, so a code
host renders it and a run's path can be highlighted) and Graphviz DOT, plus SVG when the
Graphviz ``dot`` program is installed. ``statemachine render`` writes them.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import attrs

from statemachine import events as ev
from statemachine.machine import TERMINAL_STEPS, TRANSITIONS, fire
from statemachine.state import RunState
from statemachine.values import Step

_INITIAL = "start"


@attrs.frozen
class Edge:
    source: Step
    dest: Step
    labels: tuple[tuple[str, tuple[str, ...]], ...]
    """(trigger, guards) of every row between these two steps, in declaration order."""


def edges() -> list[Edge]:
    grouped: dict[tuple[Step, Step], list[tuple[str, tuple[str, ...]]]] = {}
    for row in TRANSITIONS:
        for source in row.sources:
            dest = row.dest or source
            grouped.setdefault((source, dest), []).append((row.trigger, row.guards))
    return [Edge(s, d, tuple(labels)) for (s, d), labels in grouped.items()]


@attrs.frozen
class RunPath:
    """What a run did: the (source, dest, trigger) of every event, and where it is."""

    visited: frozenset[tuple[Step, Step, str]]
    current: Step
    run_id: str


def run_path(events: Sequence[ev.Event]) -> RunPath:
    """Replay a (valid) log and collect the transitions it took."""
    started = events[0]
    assert isinstance(started, ev.RunStarted)
    state = RunState(started)
    visited = set()
    for event in events[1:]:
        dest = fire(state, event.TRIGGER, event)
        visited.add((state.step, dest, event.TRIGGER))
        state.apply(event, dest)
    return RunPath(frozenset(visited), state.step, started.run_id)


def _label(trigger: str, guards: tuple[str, ...]) -> str:
    return f"{trigger} [{', '.join(guards)}]" if guards else trigger


def _taken(edge: Edge, path: RunPath | None) -> bool:
    return path is not None and any((edge.source, edge.dest, trigger) in path.visited
                                    for trigger, _ in edge.labels)


def mermaid(path: RunPath | None = None) -> str:
    lines = ["flowchart TD"]
    lines.append(f'    {_INITIAL}(("start")) --> {Step.RUN_AGAIN.value}')
    for step in Step:
        shape = f'(["{step.name}"])' if step in TERMINAL_STEPS else f'("{step.name}")'
        lines.append(f"    {step.value}{shape}")
    highlighted = []
    for index, edge in enumerate(edges(), start=1):
        text = "<br/>".join(_label(t, g) for t, g in edge.labels)
        lines.append(f'    {edge.source.value} -->|"{text}"| {edge.dest.value}')
        if _taken(edge, path):
            highlighted.append(str(index))
    lines.append("    classDef terminal fill:#eee,stroke:#333,stroke-width:2px")
    lines.append("    class " + ",".join(s.value for s in Step if s in TERMINAL_STEPS)
                 + " terminal")
    if path is not None:
        lines.append("    classDef current fill:#ffd54f,stroke:#e65100,stroke-width:3px")
        lines.append(f"    class {path.current.value} current")
        if highlighted:
            lines.append(f"    linkStyle {','.join(highlighted)} stroke:#e65100,"
                         "stroke-width:3px")
    return "\n".join(lines) + "\n"


def dot(path: RunPath | None = None) -> str:
    title = "agent-statemachine: run steps" if path is None else f"run {path.run_id}"
    lines = [
        "digraph run {",
        f'    label="{title}"; labelloc=t; rankdir=TB; fontname="Helvetica";',
        '    node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica"];',
        '    edge [fontname="Helvetica", fontsize=9];',
        f'    {_INITIAL} [shape=point]; {_INITIAL} -> {Step.RUN_AGAIN.value};',
    ]
    for step in Step:
        attrs_ = [f'label="{step.name}"']
        if step in TERMINAL_STEPS:
            attrs_.append("peripheries=2")
        if path is not None and step is path.current:
            attrs_ += ['fillcolor="#ffd54f"', 'color="#e65100"', "penwidth=3"]
        lines.append(f"    {step.value} [{', '.join(attrs_)}];")
    for edge in edges():
        text = "\\n".join(_label(t, g) for t, g in edge.labels)
        style = ', color="#e65100", penwidth=3' if _taken(edge, path) else ""
        lines.append(f'    {edge.source.value} -> {edge.dest.value} [label="{text}"{style}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def write(out_dir: Path, *, basename: str = "run", path: RunPath | None = None) -> list[Path]:
    """Write ``basename``.mmd and .dot into ``out_dir``, and .svg when Graphviz is here."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix, text in ((".mmd", mermaid(path)), (".dot", dot(path))):
        target = out_dir / f"{basename}{suffix}"
        target.write_text(text)
        written.append(target)
    svg = svg_from_dot(out_dir / f"{basename}.dot")
    if svg is not None:
        written.append(svg)
    return written


def svg_from_dot(source: Path) -> Path | None:
    """Render a .dot file to .svg with Graphviz, or None when ``dot`` is not installed."""
    program = shutil.which("dot")
    if program is None:
        return None
    target = source.with_suffix(".svg")
    subprocess.run([program, "-Tsvg", str(source), "-o", str(target)], check=True)
    return target


def readme(mermaid_text: str) -> str:
    return (
        "# The run-step machine\n\n"
        "Generated by `statemachine render` from the declaration in "
        "`statemachine/machine.py`; do not edit by hand (`just diagrams` regenerates, and "
        "`just test` fails when these files drift from the declaration). Each edge is "
        "labelled `trigger [guards]`; `run.dot` and `run.svg` are the same graph for "
        "Graphviz.\n\n"
        "```mermaid\n" + mermaid_text + "```\n"
    )


def write_project_diagrams(out_dir: Path) -> list[Path]:
    """``diagrams/``: run.mmd, run.dot, run.svg (with Graphviz) and README.md."""
    written = write(out_dir)
    target = out_dir / "README.md"
    target.write_text(readme(mermaid()))
    return [*written, target]
