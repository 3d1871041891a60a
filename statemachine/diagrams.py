"""Transition diagrams drawn from the declaration in `machine` (never by hand).

Two drawings of `machine.TRANSITIONS`:

- the detailed one (``run``): every row becomes an edge labelled with its trigger and
  guards; rows between the same two steps share one edge, self-loops included;
- the overview (``overview``): only the triggers that move a run to another step, one
  edge per (source, dest) pair listing its triggers, no guards; a trigger that every
  live step takes to the same step (``abandon``) is drawn once, from "any live step".

Output: Mermaid (a flowchart, so a code host renders it and a run's path can be
highlighted) and Graphviz DOT, plus SVG when the Graphviz ``dot`` program is installed.
``statemachine render`` writes them. A run's part of the machine is drawn for a web page
by `run_svg`, which needs no Graphviz.
"""

from __future__ import annotations

import html
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


# ------------------------------------------------------------------ run_svg


_SVG_WIDTH = 1000
"""The width of `run_svg`'s drawing, in its own px (its ``viewBox``): a laptop's page."""
_BOX_HEIGHT = 34
_FONT = "Helvetica, Arial, sans-serif"
_CURRENT_FILL = "#ffd54f"
_Point = tuple[float, float]
_Box = tuple[float, float, float, float]  # x0, y0, x1, y1
_INK = "#333333"
_TAKEN_TEXT = "#bf360c"
_POSITIONS: dict[Step, tuple[float, float]] = {
    Step.RUN_AGAIN: (560, 50),
    Step.HANDOFF: (250, 170),
    Step.AWAITING_MODEL: (520, 170),
    Step.INTERRUPTION: (380, 300),
    Step.TOOLS: (660, 300),
    Step.FINALIZING: (880, 300),
    Step.UNSETTLED: (110, 480),
    Step.FINAL_OUTPUT: (770, 450),
    Step.TERMINAL_UNRECOVERABLE: (330, 640),
    Step.COMPLETED: (770, 640),
}
"""Where each step's box is centred: the flow runs down the page, from ``RUN_AGAIN`` at
the top to the two terminal steps at the bottom, ``UNSETTLED`` on the left beside the
steps a publication is staged from. Fixed, so two runs' drawings line up."""
_START = (700.0, 50.0)
"""The start dot, right of ``RUN_AGAIN``."""
_VIA: dict[tuple[Step, Step], tuple[_Point, _Point]] = {
    (Step.RUN_AGAIN, Step.UNSETTLED): ((20, 30), (0, 430)),
    (Step.UNSETTLED, Step.RUN_AGAIN): ((80, 280), (110, 50)),
}
"""The control points of the long edges, drawn around the others by the left margin."""
_BENDS = (0.0, 0.2, -0.2, 0.35, -0.35, 0.5, -0.5, 0.7, -0.7, 0.9, -0.9)
"""How far an edge may bow from the straight line (a fraction of its length, either
side): the first that clears every other box is drawn."""

def _box(step: Step) -> _Box:
    x, y = _POSITIONS[step]
    half = max(96.0, 8.8 * len(step.name) + 28) / 2
    return (x - half, y - _BOX_HEIGHT / 2, x + half, y + _BOX_HEIGHT / 2)


def _grown(box: _Box, by: float) -> _Box:
    return (box[0] - by, box[1] - by, box[2] + by, box[3] + by)


def _inside(point: _Point, box: _Box) -> bool:
    return box[0] < point[0] < box[2] and box[1] < point[1] < box[3]


def _meet(a: _Box, b: _Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _rim(box: _Box, toward: _Point, shift: _Point = (0, 0)) -> _Point:
    """Where the ray from ``box``'s centre (moved by ``shift``) toward ``toward`` leaves
    the box."""
    cx, cy = (box[0] + box[2]) / 2 + shift[0], (box[1] + box[3]) / 2 + shift[1]
    dx, dy = toward[0] - cx, toward[1] - cy
    scale = min((box[2] - cx) / abs(dx) if dx else float("inf"),
                (box[3] - cy) / abs(dy) if dy else float("inf"))
    return (cx + dx * scale, cy + dy * scale)


@attrs.frozen
class _Curve:
    """A cubic Bezier curve."""

    start: _Point
    first: _Point
    second: _Point
    end: _Point

    @classmethod
    def bowed(cls, start: _Point, control: _Point, end: _Point) -> _Curve:
        """The quadratic curve through ``control`` as a cubic one."""
        return cls(start, (start[0] + (control[0] - start[0]) * 2 / 3,
                           start[1] + (control[1] - start[1]) * 2 / 3),
                   (end[0] + (control[0] - end[0]) * 2 / 3,
                    end[1] + (control[1] - end[1]) * 2 / 3), end)

    def at(self, t: float) -> _Point:
        u = 1 - t
        a, b, c, d = u * u * u, 3 * u * u * t, 3 * u * t * t, t * t * t
        return (a * self.start[0] + b * self.first[0] + c * self.second[0] + d * self.end[0],
                a * self.start[1] + b * self.first[1] + c * self.second[1] + d * self.end[1])


def _route(source: _Box, dest: _Box, obstacles: Sequence[_Box], *, paired: bool,
           via: tuple[_Point, _Point] | None = None) -> _Curve:
    """The edge from ``source`` to ``dest``: a quadratic curve, straight when that clears
    every obstacle, else bowed the least it takes; the one touching the fewest obstacles
    when none clears them all. When an edge runs the other way (``paired``), each keeps
    to its own side of the line between the two centres. ``via``: the control points
    of a curve drawn by hand instead."""
    if via is not None:
        return _Curve(_rim(source, via[0]), via[0], via[1], _rim(dest, via[1]))
    (sx, sy), (dx, dy) = ((source[0] + source[2]) / 2, (source[1] + source[3]) / 2), (
        (dest[0] + dest[2]) / 2, (dest[1] + dest[3]) / 2)
    length = max(1.0, ((dx - sx) ** 2 + (dy - sy) ** 2) ** 0.5)
    normal = (-(dy - sy) / length, (dx - sx) / length)
    shift = (normal[0] * 9, normal[1] * 9) if paired else (0.0, 0.0)
    best: tuple[int, _Curve] | None = None
    for bend in _BENDS:
        control = ((sx + dx) / 2 + shift[0] + normal[0] * bend * length,
                   (sy + dy) / 2 + shift[1] + normal[1] * bend * length)
        curve = _Curve.bowed(_rim(source, control, shift), control,
                             _rim(dest, control, shift))
        samples = [curve.at(i / 40) for i in range(1, 40)]
        hits = sum(1 for box in obstacles for p in samples if _inside(p, _grown(box, 6)))
        hits += sum(1 for p in samples if not (0 < p[0] < _SVG_WIDTH and p[1] > 0))
        if best is None or hits < best[0]:
            best = (hits, curve)
        if hits == 0:
            break
    assert best is not None
    return best[1]


def _arrow(curve: _Curve, size: float) -> tuple[_Point, str]:
    """Where the line stops (the arrowhead's base) and the arrowhead's points."""
    (ex, ey), (cx, cy) = curve.end, curve.second
    length = max(1.0, ((ex - cx) ** 2 + (ey - cy) ** 2) ** 0.5)
    ux, uy = (ex - cx) / length, (ey - cy) / length
    base = (ex - ux * size, ey - uy * size)
    half = size * 0.5
    points = [(ex, ey), (base[0] - uy * half, base[1] + ux * half),
              (base[0] + uy * half, base[1] - ux * half)]
    return base, " ".join(f"{x:.1f},{y:.1f}" for x, y in points)


def _svg_text(text: str) -> str:
    """``text`` as XML character data or an attribute value: escaped, and every
    character XML cannot carry (controls, lone surrogates) replaced."""
    return html.escape("".join(ch if ch.isprintable() else "\ufffd" for ch in text),
                       quote=True)


def _label_box(at: _Point, lines: Sequence[str], size: float) -> _Box:
    width = max(len(line) for line in lines) * size * 0.58 + 6
    height = len(lines) * size * 1.2 + 2
    return (at[0] - width / 2, at[1] - height / 2, at[0] + width / 2, at[1] + height / 2)


def run_svg(path: RunPath) -> str:
    """A run's part of the machine (`run_part`) as one self-contained ``<svg>`` element
    for a web page, drawn without Graphviz: every step it visited (and where those lead,
    dashed and grey) at a fixed place, its moves bold, its current step filled; at most
    `_SVG_WIDTH` px wide, scaled down with the page. Each step is a ``<g class="step
    ...">`` with ``data-step`` (its value) and a ``<title>`` (its name), ``current`` in
    its class for the current step; each edge a ``<g class="move ...">`` (``taken`` when
    the run took it) with ``data-source``, ``data-dest`` and a ``<title>`` naming its
    triggers. Every text is escaped; the run id appears only in the drawing's title."""
    part = run_part(path)
    shown = (*part.visited, *part.nearby)
    boxes = {step: _box(step) for step in shown}
    start_box = (_START[0] - 6, _START[1] - 6, _START[0] + 6, _START[1] + 6)
    pairs = {(e.source, e.dest) for e in part.edges}
    routed = []
    for edge in part.edges:
        others = [b for s, b in boxes.items() if s not in (edge.source, edge.dest)]
        curve = _route(boxes[edge.source], boxes[edge.dest], [*others, start_box],
                       paired=(edge.dest, edge.source) in pairs,
                       via=_VIA.get((edge.source, edge.dest)))
        routed.append((edge, curve))
    height = max(b[3] for b in boxes.values()) + 20
    caption = (f"run {path.run_id}: the steps it visited (solid) and where they lead "
               "(dashed); its moves in orange")
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_SVG_WIDTH} {height:.0f}" '
        f'width="100%" role="img" '
        f'class="run-diagram" font-family="{_FONT}" '
        f'aria-label="{_svg_text(f"run {path.run_id}: steps and moves")}">',
        f"<title>{_svg_text(caption)}</title>",
    ]
    start_curve = _Curve.bowed(_START, _START, _rim(boxes[Step.RUN_AGAIN], _START))
    out.append(_edge_svg(start_curve, taken=True, css="start", title="start", data=""))
    out.append(f'<circle class="start" cx="{_START[0]:.0f}" cy="{_START[1]:.0f}" r="6" '
               f'fill="{_INK}"/>')
    # the moves it did not take first, then its own on top, then the steps, the labels last
    ordered = sorted(routed, key=lambda pair: pair[0].taken)
    for edge, curve in ordered:
        title = (f"{edge.source.name} \u2192 {edge.dest.name}: "
                 f"{', '.join(edge.triggers)}{' (taken)' if edge.taken else ''}")
        out.append(_edge_svg(
            curve, taken=edge.taken, css="move taken" if edge.taken else "move",
            title=title, data=f' data-source="{edge.source.value}" '
                              f'data-dest="{edge.dest.value}"'))
    for step in shown:
        out.append(_step_svg(step, boxes[step], nearby=step in part.nearby,
                             current=step is path.current))
    placed: list[_Box] = [*boxes.values()]
    lines_at = [(curve, curve.at(i / 30)) for _, curve in routed for i in range(31)]
    for edge, curve in sorted(routed, key=lambda pair: not pair[0].taken):
        out.append(_label_svg(edge, curve, placed, lines_at, height))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _edge_svg(curve: _Curve, *, taken: bool, css: str, title: str, data: str) -> str:
    color, width, size = (_TAKEN, 3.0, 13.0) if taken else (_NEARBY, 1.3, 9.0)
    base, head = _arrow(curve, size)
    (sx, sy), (ax, ay), (bx, by) = curve.start, curve.first, curve.second
    return (f'<g class="{css}"{data}><title>{_svg_text(title)}</title>'
            f'<path d="M{sx:.1f},{sy:.1f} C{ax:.1f},{ay:.1f} {bx:.1f},{by:.1f} '
            f'{base[0]:.1f},{base[1]:.1f}" '
            f'fill="none" stroke="{color}" stroke-width="{width}"/>'
            f'<polygon points="{head}" fill="{color}"/></g>')


def _step_svg(step: Step, box: _Box, *, nearby: bool, current: bool) -> str:
    css = ["step", "nearby" if nearby else "visited"]
    if current:
        css.append("current")
    if step in TERMINAL_STEPS:
        css.append("terminal")
    if current:
        fill, stroke, width, dash, ink = _CURRENT_FILL, _TAKEN, 3.0, "", _INK
    elif nearby:
        fill, stroke, width, dash, ink = "#ffffff", _NEARBY, 1.3, ' stroke-dasharray="5 3"', \
            "#777777"
    else:
        fill, stroke, width, dash, ink = "#ffffff", _INK, 1.5, "", _INK
    x0, y0, x1, y1 = box
    rects = [f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{x1 - x0:.1f}" height="{y1 - y0:.1f}" '
             f'rx="9" fill="{fill}" stroke="{stroke}" stroke-width="{width}"{dash}/>']
    if step in TERMINAL_STEPS:
        rects.append(f'<rect class="inner" x="{x0 + 4:.1f}" y="{y0 + 4:.1f}" '
                     f'width="{x1 - x0 - 8:.1f}" height="{y1 - y0 - 8:.1f}" rx="6" '
                     f'fill="none" stroke="{stroke}" stroke-width="1.2"{dash}/>')
    weight = ' font-weight="bold"' if current else ""
    return (f'<g class="{" ".join(css)}" data-step="{step.value}"><title>{step.name}</title>'
            + "".join(rects)
            + f'<text x="{(x0 + x1) / 2:.1f}" y="{(y0 + y1) / 2:.1f}" dy="0.35em" '
              f'text-anchor="middle" font-size="14" fill="{ink}"{weight}>{step.name}</text>'
            + "</g>")


def _label_svg(edge: RunEdge, curve: _Curve, placed: list[_Box],
               lines_at: Sequence[tuple[_Curve, _Point]], height: float) -> str:
    """The edge's triggers, one a line, on or beside the curve: where they cover no step
    and no label placed before (``placed`` grows by this one), and the fewest points of
    the other edges' lines (``lines_at``), inside the drawing."""
    size, color, weight = (13.0, _TAKEN_TEXT, ' font-weight="bold"') if edge.taken else (
        11.0, "#666666", "")
    best: tuple[float, _Box, _Point] | None = None
    for t in (0.5, 0.4, 0.6, 0.3, 0.7, 0.22, 0.78):
        (x, y), ahead, behind = curve.at(t), curve.at(t + 0.01), curve.at(t - 0.01)
        along = max(1e-6, ((ahead[0] - behind[0]) ** 2 + (ahead[1] - behind[1]) ** 2) ** 0.5)
        nx, ny = -(ahead[1] - behind[1]) / along, (ahead[0] - behind[0]) / along
        x0, y0, x1, y1 = _label_box((x, y), edge.triggers, size)
        aside = abs(nx) * (x1 - x0) / 2 + abs(ny) * (y1 - y0) / 2 + 3
        for side in (0, 1, -1):
            at = (x + nx * aside * side, y + ny * aside * side)
            box = _label_box(at, edge.triggers, size)
            score = 10.0 * sum(1 for other in placed if _meet(box, other))
            score += 0 if box[0] >= 0 and box[2] <= _SVG_WIDTH and box[1] >= 0 and \
                box[3] <= height else 10
            score += sum(1 for other, p in lines_at if other is not curve and _inside(p, box))
            if best is None or score < best[0]:
                best = (score, box, at)
        if best is not None and best[0] == 0:
            break
    assert best is not None
    _, box, (x, y) = best
    placed.append(box)
    first = y - (len(edge.triggers) - 1) * size * 0.6
    lines = "".join(f'<tspan x="{x:.1f}" y="{first + i * size * 1.2:.1f}" dy="0.35em">'
                    f"{_svg_text(trigger)}</tspan>" for i, trigger in enumerate(edge.triggers))
    css = "move-label taken" if edge.taken else "move-label"
    x0, y0, x1, y1 = box
    return (f'<g class="{css}" data-source="{edge.source.value}" '
            f'data-dest="{edge.dest.value}"><rect x="{x0:.1f}" y="{y0:.1f}" '
            f'width="{x1 - x0:.1f}" height="{y1 - y0:.1f}" rx="3" fill="#ffffff" '
            f'fill-opacity="0.85"/><text text-anchor="middle" font-size="{size:.0f}" '
            f'fill="{color}"{weight}>{lines}</text></g>')


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
