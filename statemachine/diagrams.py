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


def _moves_match_visited(path: RunPath, _attribute: object,
                         moves: tuple[tuple[Step, Step, str], ...]) -> None:
    if moves and frozenset(moves) != path.visited:
        raise ValueError("a RunPath's visited must be the set of its moves")


@attrs.frozen
class RunPath:
    """What a run did: the (source, dest, trigger) of every event, and where it is."""

    visited: frozenset[tuple[Step, Step, str]]
    """The set of `moves`: every (source, dest, trigger) the run took, once."""
    current: Step
    run_id: str
    moves: tuple[tuple[Step, Step, str], ...] = attrs.field(
        default=(), validator=_moves_match_visited)
    """(source, dest, trigger) of every event after ``RunStarted``, in log order:
    ``moves[i]`` belongs to the event of seq ``i + 1``. `run_path` fills it; a path
    drawn by hand (a test's run through every edge) may leave it empty."""


def run_path(events: Sequence[ev.Event]) -> RunPath:
    """Replay a (valid) log and collect the transitions it took."""
    started = events[0]
    assert isinstance(started, ev.RunStarted)
    state = RunState(started)
    moves = []
    for event in events[1:]:
        dest = fire(state, event.TRIGGER, event)
        moves.append((state.step, dest, event.TRIGGER))
        state.apply(event, dest)
    return RunPath(frozenset(moves), state.step, started.run_id, tuple(moves))


def _label(trigger: str, guards: tuple[str, ...]) -> str:
    return f"{trigger} [{', '.join(guards)}]" if guards else trigger


def mermaid() -> str:
    """Every transition as a Mermaid flowchart."""
    lines = ["flowchart TD"]
    lines.append(f'    {_INITIAL}(("start")) --> {Step.RUN_AGAIN.value}')
    for step in Step:
        shape = f'(["{step.name}"])' if step in TERMINAL_STEPS else f'("{step.name}")'
        lines.append(f"    {step.value}{shape}")
    for edge in edges():
        text = "<br/>".join(_label(t, g) for t, g in edge.labels)
        lines.append(f'    {edge.source.value} -->|"{text}"| {edge.dest.value}')
    lines.append("    classDef terminal fill:#eee,stroke:#333,stroke-width:2px")
    lines.append("    class " + ",".join(s.value for s in Step if s in TERMINAL_STEPS)
                 + " terminal")
    return "\n".join(lines) + "\n"


def dot() -> str:
    """Every transition as Graphviz DOT."""
    lines = [
        "digraph run {",
        '    label="agent-statemachine: run steps"; labelloc=t; rankdir=TB; '
        'fontname="Helvetica";',
        '    node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica"];',
        '    edge [fontname="Helvetica", fontsize=9];',
        f'    {_INITIAL} [shape=point]; {_INITIAL} -> {Step.RUN_AGAIN.value};',
    ]
    for step in Step:
        extra = ", peripheries=2" if step in TERMINAL_STEPS else ""
        lines.append(f'    {step.value} [label="{step.name}"{extra}];')
    for edge in edges():
        text = "\\n".join(_label(t, g) for t, g in edge.labels)
        lines.append(f'    {edge.source.value} -> {edge.dest.value} [label="{text}"];')
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


@attrs.frozen
class RunEdge:
    """One move of a run's drawing: the overview's triggers from ``source`` to ``dest``,
    and whether the run took it (by one of those triggers)."""

    source: Step
    dest: Step
    triggers: tuple[str, ...]
    taken: bool


@attrs.frozen
class RunPart:
    """The part of the machine a run's drawing shows: the steps it visited, where each
    could have gone next (``nearby``), and the moves between them."""

    visited: tuple[Step, ...]
    nearby: tuple[Step, ...]
    edges: tuple[RunEdge, ...]


def run_part(path: RunPath) -> RunPart:
    """The steps ``path`` visited (the first, ``RUN_AGAIN``, included), each one's moves to
    another step with the overview's labels (`overview_edges`), and the steps those moves
    reach. ``abandon``, which every live step takes, is drawn from the steps where the
    run took it, and from the current step while it is live (what an operator may do
    now). Self-loops are folded away, as in the overview: the drawing stays small
    enough to read at a page's width however long the run."""
    seen = {Step.RUN_AGAIN, path.current} | {s for s, _, _ in path.visited} | {
        d for _, d, _ in path.visited}
    moves: list[RunEdge] = []
    for edge in overview_edges():
        if edge.source == ANY_LIVE_STEP:
            sources = [s for s in Step if s in seen and s in LIVE_STEPS and (
                s is path.current or any((s, Step(edge.dest), t) in path.visited
                                         for t in edge.triggers))]
        else:
            sources = [Step(edge.source)] if Step(edge.source) in seen else []
        for source in sources:
            dest = Step(edge.dest)
            taken = any((source, dest, t) in path.visited for t in edge.triggers)
            moves.append(RunEdge(source, dest, edge.triggers, taken))
    reached = {m.dest for m in moves}
    return RunPart(tuple(s for s in Step if s in seen),
                   tuple(s for s in Step if s in reached and s not in seen), tuple(moves))


RUN_WIDTH = 11
"""The widest a run's drawing may be, in inches (1,056 px at 96 px an inch): a page."""
_TAKEN = "#e65100"
_NEARBY = "#888888"


def run_mermaid(path: RunPath) -> str:
    """A run's part of the machine (`run_part`) as a Mermaid flowchart: its path and
    current step highlighted, the steps it did not visit dashed."""
    part = run_part(path)
    lines = ["flowchart TD"]
    lines.append(f'    {_INITIAL}(("start")) --> {Step.RUN_AGAIN.value}')
    for step in (*part.visited, *part.nearby):
        shape = f'(["{step.name}"])' if step in TERMINAL_STEPS else f'("{step.name}")'
        lines.append(f"    {step.value}{shape}")
    taken = []
    for index, edge in enumerate(part.edges, start=1):
        label = "<br/>".join(edge.triggers)
        lines.append(f'    {edge.source.value} -->|"{label}"| {edge.dest.value}')
        if edge.taken:
            taken.append(str(index))
    lines.append("    classDef terminal fill:#eee,stroke:#333,stroke-width:2px")
    terminal = [s.value for s in (*part.visited, *part.nearby) if s in TERMINAL_STEPS]
    if terminal:
        lines.append(f"    class {','.join(terminal)} terminal")
    if part.nearby:
        lines.append(f"    classDef nearby fill:#fff,stroke:{_NEARBY},color:{_NEARBY},"
                     "stroke-dasharray:4 3")
        lines.append(f"    class {','.join(s.value for s in part.nearby)} nearby")
    lines.append(f"    classDef current fill:#ffd54f,stroke:{_TAKEN},stroke-width:3px")
    lines.append(f"    class {path.current.value} current")
    # link 0 is start --> run_again, which every run takes
    lines.append(f"    linkStyle {','.join(['0', *taken])} stroke:{_TAKEN},stroke-width:3px")
    return "\n".join(lines) + "\n"


def run_dot(path: RunPath) -> str:
    """A run's part of the machine (`run_part`) as Graphviz DOT, top to bottom in the
    declared order of the steps (a way back does not push the layout wider), sized like
    the overview; a run that visited nearly every step is scaled down to `RUN_WIDTH`."""
    part = run_part(path)
    lines = [
        "digraph run {",
        f'    label="run {_dot_text(path.run_id)}: the steps it visited (solid) and '
        'where they lead (dashed)"; labelloc=t;',
        f'    size="{RUN_WIDTH},40"; rankdir=TB; nodesep=0.25; ranksep=0.35; '
        'fontname="Helvetica";',
        '    node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica"];',
        '    edge [fontname="Helvetica", fontsize=10];',
        f'    {_INITIAL} [shape=point]; {_INITIAL} -> {Step.RUN_AGAIN.value} '
        f'[color="{_TAKEN}", penwidth=3];',
    ]
    for step in part.visited:
        extra = ", peripheries=2" if step in TERMINAL_STEPS else ""
        if step is path.current:
            extra += f', fillcolor="#ffd54f", color="{_TAKEN}", penwidth=3'
        lines.append(f'    {step.value} [label="{step.name}"{extra}];')
    for step in part.nearby:
        extra = ", peripheries=2" if step in TERMINAL_STEPS else ""
        lines.append(f'    {step.value} [label="{step.name}", style="dashed,rounded", '
                     f'color="{_NEARBY}", fontcolor="{_NEARBY}"{extra}];')
    order = {step: index for index, step in enumerate(Step)}
    for edge in part.edges:
        style = (f', color="{_TAKEN}", penwidth=3' if edge.taken
                 else f', color="{_NEARBY}", fontcolor="{_NEARBY}"')
        if order[edge.source] > order[edge.dest]:
            style += ", constraint=false"  # a way back: ranks follow the declared order
        label = "\\n".join(edge.triggers)
        lines.append(f'    {edge.source.value} -> {edge.dest.value} [label="{label}"{style}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_text(text: str) -> str:
    """``text`` inside a DOT string: quotes and backslashes escaped, one line."""
    return "".join(ch if ch.isprintable() and ch not in '"\\' else "_" for ch in text[:100])


class GraphvizFailed(Exception):
    """Graphviz's ``dot`` ran and failed; the message is its first line of complaint."""


def write(out_dir: Path, *, basename: str = "run", path: RunPath | None = None) -> list[Path]:
    """Write ``basename``.mmd and .dot into ``out_dir``, and .svg when Graphviz is here:
    every transition, or with ``path`` the run's part of the machine (`run_part`)."""
    if path is None:
        return _write_pair(out_dir, basename, mermaid(), dot())
    return _write_pair(out_dir, basename, run_mermaid(path), run_dot(path))


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
