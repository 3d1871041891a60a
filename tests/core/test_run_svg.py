"""`diagrams.run_svg`, a run's drawing for a web page without Graphviz, and
`RunPath.moves`, checked against logs replayed here: one node a step (the current one
marked), the run's own moves bold, every text escaped, the boxes apart and the drawing at
most a laptop page wide."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable

import pytest

from statemachine import RecoveryPolicy, RunController, Step, ToolCall, diagrams
from statemachine.values import LIVE_STEPS
from tests.helpers import SESSION, at_interruption, failed, run_charge, staged

SVG = "{http://www.w3.org/2000/svg}"
HOSTILE = "</title><script>alert(1)</script>&"
Box = tuple[float, float, float, float]


def _completed() -> RunController:
    """A run without a Session: an output, accepted and completed."""
    c = RunController.start(run_id="done", session_id=None)
    c.begin_model_call()
    c.model_responded(output="hello")
    c.accept_final_output("hello")
    c.complete()
    return c


def _in_doubt() -> RunController:
    """A non-idempotent call started and never finished, loaded in a new process."""
    c = RunController.start(run_id="doubt", session_id=SESSION)
    c.begin_model_call()
    c.model_responded([ToolCall("pay", "pay", {"x": 1})])
    c.begin_tool("pay")
    c = RunController.from_json(c.to_json())
    assert c.in_doubt() == ("pay",)
    return c


def _abandoned() -> RunController:
    c = at_interruption()
    c.abandon("the operator gave up")
    return c


def _committed() -> RunController:
    """The seed run's batch published: back in INTERRUPTION (notify still waits)."""
    c = staged()
    c.publication_committed()
    return c


def everywhere(run_id: str = "everywhere") -> RunController:
    """A run through every step but TERMINAL_UNRECOVERABLE: a failed model call, a
    handoff, an approval, a published batch, an output published and completed."""
    c = RunController.start(run_id=run_id, session_id=SESSION)
    c.begin_model_call()
    c.model_failed(RuntimeError("overloaded"))
    c.handoff("refunds")
    c.begin_model_call()
    c.model_responded([ToolCall("charge", "charge", {"x": 7}, needs_approval=True)])
    c.approve("charge")
    c.resume()
    c.begin_tool("charge")
    c.tool_completed("charge", "charged 7")
    history: list[object] = [{"role": "user", "content": "charge me 7"}]
    items: list[object] = [
        {"type": "function_call", "call_id": "charge", "name": "charge"},
        {"type": "function_call_output", "call_id": "charge", "output": "charged 7"}]
    c.stage_publication(items, history, call_ids=["charge"])
    c.publication_committed()
    c.begin_model_call()
    c.model_responded(output="done")
    c.accept_final_output("done")
    c.stage_publication([{"role": "assistant", "content": "done"}],
                        [*history, *items], whole=True)
    c.publication_committed()
    assert c.step is Step.COMPLETED
    return c


def _charged() -> RunController:
    c = at_interruption()
    run_charge(c)
    return c


RUNS: dict[str, Callable[[], RunController]] = {
    "completed": _completed,
    "interruption": at_interruption,
    "tools-in-doubt": _in_doubt,
    "tools-charged": _charged,
    "abandoned": _abandoned,
    "unsettled": staged,
    "unsettled-failed": failed,
    "fail-closed": lambda: failed(RecoveryPolicy.FAIL_CLOSED),
    "committed": _committed,
    "everywhere": everywhere,
}
ENDS = {"completed": Step.COMPLETED, "interruption": Step.INTERRUPTION,
        "tools-in-doubt": Step.TOOLS, "tools-charged": Step.TOOLS,
        "abandoned": Step.TERMINAL_UNRECOVERABLE, "unsettled": Step.UNSETTLED,
        "unsettled-failed": Step.UNSETTLED, "fail-closed": Step.TERMINAL_UNRECOVERABLE,
        "committed": Step.INTERRUPTION, "everywhere": Step.COMPLETED}


def _steps_after_each_event(c: RunController) -> list[Step]:
    """The step after each event, by loading each prefix of the log (a replay of its
    own: not `run_path`)."""
    doc = c.to_json()
    events = doc["events"]
    assert isinstance(events, list)
    return [RunController.from_json({**doc, "events": events[:n]}).step
            for n in range(1, len(events) + 1)]


def _classes(element: ET.Element) -> set[str]:
    return set(element.get("class", "").split())


def _groups(root: ET.Element, *wanted: str) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if set(wanted) <= _classes(g)]


def _rect(element: ET.Element) -> Box:
    x, y = float(element.get("x", "nan")), float(element.get("y", "nan"))
    return (x, y, x + float(element.get("width", "nan")),
            y + float(element.get("height", "nan")))


def _bounds(group: ET.Element) -> Box:
    rects = [_rect(r) for r in group.iter(f"{SVG}rect")]
    assert rects
    return (min(r[0] for r in rects), min(r[1] for r in rects),
            max(r[2] for r in rects), max(r[3] for r in rects))


def _within(box: Box, view: list[float]) -> bool:
    return box[0] >= 0 and box[1] >= 0 and box[2] <= view[2] and box[3] <= view[3]


def _meet(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _drawn(c: RunController) -> tuple[diagrams.RunPath, str, ET.Element]:
    path = diagrams.run_path(c.events)
    svg = diagrams.run_svg(path)
    return path, svg, ET.fromstring(svg)


@pytest.mark.parametrize("name", list(RUNS))
def test_moves_are_the_logs_events_in_order(name: str) -> None:
    c = RUNS[name]()
    assert c.step is ENDS[name]
    path = diagrams.run_path(c.events)
    after = _steps_after_each_event(c)
    assert len(path.moves) == c.version - 1 == len(after) - 1
    assert [trigger for _, _, trigger in path.moves] == [e.TRIGGER for e in c.events[1:]]
    for i, (source, dest, _) in enumerate(path.moves):
        assert source is after[i]  # the step before event seq i + 1
        assert dest is after[i + 1]
        if i:
            assert source is path.moves[i - 1][1]
    assert path.moves[0][0] is Step.RUN_AGAIN
    assert path.moves[-1][1] is c.step is path.current
    assert path.visited == frozenset(path.moves)


def test_a_path_whose_moves_are_not_its_visited_set_is_refused() -> None:
    path = diagrams.run_path(at_interruption().events)
    with pytest.raises(ValueError, match="visited"):
        diagrams.RunPath(path.visited - {path.moves[0]}, path.current, path.run_id,
                         path.moves)


@pytest.mark.parametrize("name", list(RUNS))
def test_the_drawing_marks_the_current_step_and_the_runs_own_moves(name: str) -> None:
    c = RUNS[name]()
    path, svg, root = _drawn(c)
    assert root.tag == f"{SVG}svg"
    assert not svg.startswith("<?xml")
    nodes = _groups(root, "step")
    drawn = [g.get("data-step") for g in nodes]
    assert len(drawn) == len(set(drawn)), "a step is drawn twice"
    after = _steps_after_each_event(c)
    assert {s.value for s in after} <= set(drawn)
    for g in nodes:
        title = g.find(f"{SVG}title")
        assert title is not None
        assert title.text == Step(g.get("data-step")).name
        assert ("visited" in _classes(g)) is (Step(g.get("data-step")) in after)
        assert ("terminal" in _classes(g)) is (
            Step(g.get("data-step")) in {Step.COMPLETED, Step.TERMINAL_UNRECOVERABLE})
    current = _groups(root, "step", "current")
    assert [g.get("data-step") for g in current] == [c.step.value]
    # the moves it took, from the log replayed here, self-loops folded away
    moved = {(after[i].value, after[i + 1].value) for i in range(len(after) - 1)
             if after[i] is not after[i + 1]}
    assert moved == {(a.value, b.value) for a, b, _ in path.moves if a is not b}
    taken = [(g.get("data-source"), g.get("data-dest")) for g in _groups(root, "move", "taken")]
    assert len(taken) == len(set(taken))
    assert set(taken) == moved
    others = {(g.get("data-source"), g.get("data-dest")) for g in _groups(root, "move")
              if "taken" not in _classes(g)}
    assert not others & moved
    labels = {(g.get("data-source"), g.get("data-dest"))
              for g in _groups(root, "move-label", "taken")}
    assert labels == moved
    # every edge joins two drawn steps, and says its triggers on hover
    for g in _groups(root, "move"):
        assert {g.get("data-source"), g.get("data-dest")} <= set(drawn)
        title = g.find(f"{SVG}title")
        assert title is not None
        assert title.text
    if c.step in LIVE_STEPS:  # what an operator may do now
        assert (c.step.value, Step.TERMINAL_UNRECOVERABLE.value) in {
            (g.get("data-source"), g.get("data-dest")) for g in _groups(root, "move")}


def _check_layout(root: ET.Element) -> None:
    view = [float(v) for v in root.get("viewBox", "").split()]
    assert view[0] == view[1] == 0
    assert 0 < view[2] <= 1000
    assert root.get("width") == "100%"
    # no inline style anywhere: the console's Content-Security-Policy forbids them (its
    # stylesheet bounds the drawing's width)
    assert all(e.get("style") is None for e in root.iter())
    boxes = [_bounds(g) for g in _groups(root, "step")]
    for i, box in enumerate(boxes):
        assert _within(box, view)
        for other in boxes[i + 1:]:
            assert not _meet(box, other), f"step boxes {box} and {other} overlap"
    for g in _groups(root, "move-label"):
        label = _bounds(g)
        assert _within(label, view)
        for box in boxes:
            assert not _meet(label, box), f"a label {label} covers a step {box}"


@pytest.mark.parametrize("name", list(RUNS))
def test_the_drawing_fits_a_page_and_nothing_sits_on_a_step(name: str) -> None:
    _, svg, root = _drawn(RUNS[name]())
    _check_layout(root)
    # self-contained: no script, no foreign content, no reference outside itself
    tags = {e.tag for e in root.iter()}
    assert not {f"{SVG}script", f"{SVG}foreignObject", f"{SVG}image", f"{SVG}use"} & tags
    assert not any("href" in key for e in root.iter() for key in e.attrib)
    assert "url(" not in svg
    assert "http" not in svg.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_a_path_through_every_edge_stays_legible() -> None:
    """Every move of the machine taken (a path built by hand, as the Graphviz test has):
    every step drawn once, every labelled edge bold, no label on a step."""
    every = tuple((Step(e.source), Step(e.dest), e.triggers[0])
                  for e in diagrams.overview_edges() if e.source != diagrams.ANY_LIVE_STEP)
    path = diagrams.RunPath(frozenset(every), Step.COMPLETED, "everywhere", every)
    root = ET.fromstring(diagrams.run_svg(path))
    assert sorted(g.get("data-step", "") for g in _groups(root, "step")) == sorted(
        s.value for s in Step)
    assert {(g.get("data-source"), g.get("data-dest"))
            for g in _groups(root, "move", "taken")} == {(a.value, b.value)
                                                         for a, b, _ in every}
    _check_layout(root)
    labels = [_bounds(g) for g in _groups(root, "move-label", "taken")]
    for i, label in enumerate(labels):
        for other in labels[i + 1:]:
            assert not _meet(label, other), f"labels {label} and {other} overlap"


@pytest.mark.parametrize("run_id", [HOSTILE, 'a"b\'c<d>&amp;', "tab\there"])
def test_the_run_id_is_escaped(run_id: str) -> None:
    c = everywhere(run_id)
    _, svg, root = _drawn(c)
    assert run_id not in svg or run_id == "tab\there"
    assert "<script" not in svg
    assert not any(e.tag.endswith("script") for e in root.iter())
    title = root.find(f"{SVG}title")
    assert title is not None
    assert title.text is not None
    assert run_id.replace("\t", "\ufffd") in title.text
    assert run_id.replace("\t", "\ufffd") in root.get("aria-label", "")
    # the run id is in the drawing's title and label, and nowhere else
    assert sum(1 for e in root.iter() for text in (e.text, *e.attrib.values())
               if text and "run " + run_id.replace("\t", "\ufffd") in text) == 2
