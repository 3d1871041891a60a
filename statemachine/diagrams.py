"""Transition diagrams drawn from the declaration in `machine` (never by hand).

Two drawings of `machine.TRANSITIONS`:

- the detailed one (``run``): every row becomes an edge labelled with its trigger and
  guards; rows between the same two steps share one edge, self-loops included;
- the overview (``overview``): only the triggers that move a run to another step, one
  edge per (source, dest) pair listing its triggers, no guards; a trigger that every
  live step takes to the same step (``abandon``) is drawn once, from "any live step".

Output: Mermaid (a flowchart, so a code host renders it and a run's path can be
highlighted) and Graphviz DOT, plus SVG when the Graphviz ``dot`` program is installed.
``statemachine render`` writes them.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import attrs

from statemachine import events as ev
from statemachine.machine import TRANSITIONS, fire
from statemachine.state import RunState
from statemachine.values import LIVE_STEPS, TERMINAL_STEPS, Step

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


ANY_LIVE_STEP = "any_live_step"
"""The overview's stand-in source for a trigger every live step takes to one step."""


@attrs.frozen
class OverviewEdge:
    """One edge of the overview: node ids (a `Step` value, or `ANY_LIVE_STEP`) and the
    triggers that move a run from ``source`` to ``dest``, in declaration order."""

    source: str
    dest: str
    triggers: tuple[str, ...]


def overview_edges() -> list[OverviewEdge]:
    """The moves between steps: self-loops (``dest`` None or the source itself) and
    guards folded away, one edge per (source, dest) pair."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for row in TRANSITIONS:
        if row.dest is None:
            continue
        if len(row.sources) > 1 and set(row.sources) == set(LIVE_STEPS):
            sources: list[str] = [ANY_LIVE_STEP]
        else:
            sources = [s.value for s in row.sources if s is not row.dest]
        for source in sources:
            triggers = grouped.setdefault((source, row.dest.value), [])
            if row.trigger not in triggers:
                triggers.append(row.trigger)
    return [OverviewEdge(s, d, tuple(t)) for (s, d), t in grouped.items()]


def folded_triggers() -> list[str]:
    """The triggers the overview leaves out: those that never move a run to another step."""
    moving = {t for edge in overview_edges() for t in edge.triggers}
    folded: list[str] = []
    for row in TRANSITIONS:
        if row.trigger not in moving and row.trigger not in folded:
            folded.append(row.trigger)
    return folded


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


def _overview_node(node: str) -> Step | None:
    return None if node == ANY_LIVE_STEP else Step(node)


def overview_mermaid() -> str:
    """The overview as a Mermaid flowchart."""
    edges_ = overview_edges()
    lines = ["flowchart TD"]
    lines.append(f'    {_INITIAL}(("start")) --> {Step.RUN_AGAIN.value}')
    for step in Step:
        shape = f'(["{step.name}"])' if step in TERMINAL_STEPS else f'("{step.name}")'
        lines.append(f"    {step.value}{shape}")
    if any(e.source == ANY_LIVE_STEP for e in edges_):
        lines.append(f'    {ANY_LIVE_STEP}[/"any live step"/]')
    for edge in edges_:
        arrow = "-.->" if _overview_node(edge.source) is None else "-->"
        label = "<br/>".join(edge.triggers)
        lines.append(f'    {edge.source} {arrow}|"{label}"| {edge.dest}')
    lines.append("    classDef terminal fill:#eee,stroke:#333,stroke-width:2px")
    lines.append("    class " + ",".join(s.value for s in Step if s in TERMINAL_STEPS)
                 + " terminal")
    return "\n".join(lines) + "\n"


def overview_dot() -> str:
    """The overview as Graphviz DOT, sized to fit a README column."""
    edges_ = overview_edges()
    lines = [
        "digraph overview {",
        '    label="agent-statemachine: how a run moves between steps"; labelloc=t;',
        '    rankdir=TB; nodesep=0.25; ranksep=0.35; fontname="Helvetica";',
        '    node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica"];',
        '    edge [fontname="Helvetica", fontsize=10];',
        f'    {_INITIAL} [shape=point]; {_INITIAL} -> {Step.RUN_AGAIN.value};',
    ]
    for step in Step:
        extra = ", peripheries=2" if step in TERMINAL_STEPS else ""
        lines.append(f'    {step.value} [label="{step.name}"{extra}];')
    if any(e.source == ANY_LIVE_STEP for e in edges_):
        lines.append(f'    {ANY_LIVE_STEP} [label="any live step", shape=box, '
                     'style="dashed,rounded", fontcolor="#555555"];')
    order = {step.value: index for index, step in enumerate(Step)}
    for edge in edges_:
        style = ', style=dashed, color="#555555"' if _overview_node(edge.source) is None else ""
        if order.get(edge.source, -1) > order[edge.dest]:
            style += ", constraint=false"  # a way back: ranks follow the declared order
        label = "\\n".join(edge.triggers)
        lines.append(f'    {edge.source} -> {edge.dest} [label="{label}"{style}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


class GraphvizFailed(Exception):
    """Graphviz's ``dot`` ran and failed; the message is its first line of complaint."""


def write(out_dir: Path, *, basename: str = "run", path: RunPath | None = None) -> list[Path]:
    """Write ``basename``.mmd and .dot into ``out_dir``, and .svg when Graphviz is here."""
    return _write_pair(out_dir, basename, mermaid(path), dot(path))


def _write_pair(out_dir: Path, basename: str, mermaid_text: str, dot_text: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix, text in ((".mmd", mermaid_text), (".dot", dot_text)):
        target = out_dir / f"{basename}{suffix}"
        target.write_text(text)
        written.append(target)
    svg = svg_from_dot(out_dir / f"{basename}.dot")
    if svg is not None:
        written.append(svg)
    return written


def graphviz() -> str | None:
    """The path of Graphviz's ``dot`` program, or None when it is not installed."""
    return shutil.which("dot")


def svg_from_dot(source: Path) -> Path | None:
    """Render a .dot file to .svg with Graphviz, or None when ``dot`` is not installed;
    `GraphvizFailed` when ``dot`` rejects the file."""
    program = graphviz()
    if program is None:
        return None
    target = source.with_suffix(".svg")
    done = subprocess.run([program, "-Tsvg", str(source), "-o", str(target)],
                          capture_output=True, text=True, errors="replace", check=False)
    if done.returncode != 0:
        complaint = (done.stderr.strip().splitlines() or ["no message"])[0]
        raise GraphvizFailed(f"dot exited with status {done.returncode} on {source}: "
                             f"{complaint[:200]}")
    return target


def readme(mermaid_text: str | None = None, overview_text: str | None = None) -> str:
    """diagrams/README.md: the overview first, then every transition."""
    mermaid_text = mermaid() if mermaid_text is None else mermaid_text
    overview_text = overview_mermaid() if overview_text is None else overview_text
    folded = ", ".join(f"`{t}`" for t in folded_triggers())
    return (
        "# The run-step machine\n\n"
        "Generated by `statemachine render` from the declaration in "
        "`statemachine/machine.py`; do not edit by hand (`just diagrams` regenerates, and "
        "`just test` fails when these files drift from the declaration).\n\n"
        "## Overview\n\n"
        "How a run moves between steps: each edge lists the triggers that take it there. "
        "Guards are left out, and so are the triggers that never change the step "
        f"({folded}); a trigger that every live step accepts is drawn once, from "
        "\"any live step\". `overview.dot` and `overview.svg` are the same graph for "
        "Graphviz.\n\n"
        "```mermaid\n" + overview_text + "```\n\n"
        "## Every transition\n\n"
        "Every row of the declaration, self-loops included. Each edge is labelled "
        "`trigger [guards]`; `run.dot` and `run.svg` are the same graph for Graphviz.\n\n"
        "```mermaid\n" + mermaid_text + "```\n"
    )


def write_project_diagrams(out_dir: Path) -> list[Path]:
    """``diagrams/``: overview.mmd, overview.dot, overview.svg, run.mmd, run.dot, run.svg
    (the SVGs with Graphviz) and README.md."""
    written = _write_pair(out_dir, "overview", overview_mermaid(), overview_dot())
    written += write(out_dir)
    target = out_dir / "README.md"
    target.write_text(readme())
    return [*written, target]
