"""The keyed chain (DESIGN §6.6): I10 rejects an illegal or malformed log, but an edit that
keeps the log legal loads. ``to_json(key=...)`` adds ``"chain"``, an HMAC-SHA256 chain
over the events, and ``from_json(..., key=...)`` refuses any document whose chain does not
verify under that key (edited, truncated, reordered, unsigned or signed with another key)
before any state is built. Without a key the chain is checked for shape and ignored."""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
from collections.abc import Iterator
from typing import Any

import pytest

from statemachine import ControlError, MemoryEventStore, RunController, SchemaError, sizes
from statemachine.payloads import canonical_json
from tests.helpers import B, P, at_interruption, failed, run_charge

KEY = b"k" * 32
OTHER = b"another key"


def _rich() -> RunController:
    """A run with payloads of every kind: arguments, outputs, guardrail results, items,
    a rejection message and a final output."""
    c = failed()
    c.reconcile(P, "session-1", take_over=True)
    c.publication_committed()
    c.reject("notify", {"why": "not now", "code": 3})
    c.stage_publication([{"call_id": "notify", "output": "rejected"}], [*P, *B],
                        call_ids=["notify"], whole=True)
    c.publication_committed()
    c.begin_model_call()
    c.model_responded(output={"text": "done", "tokens": [1, 2.5, None, True]})
    c.guardrail_evaluated("final", {"allowed": True, "score": 0.5}, stage="output")
    c.accept_final_output({"text": "done"})
    return c


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if type(value) is dict:
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif type(value) is list:
        for index, item in enumerate(value):
            yield from _leaves(item, (*path, index))
    else:
        yield path


def _edited(value: Any) -> Any:
    if type(value) is bool:
        return not value
    if type(value) in (int, float):
        return value + 1
    if type(value) is str:
        return value + "!"
    return "was null"


def _with(doc: dict[str, Any], path: tuple[Any, ...]) -> dict[str, Any]:
    changed = copy.deepcopy(doc)
    target: Any = changed
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = _edited(target[path[-1]])
    return changed


def test_a_signed_document_round_trips_as_dict_and_text() -> None:
    c = _rich()
    signed = c.to_json(key=KEY)
    assert set(signed) == {"schema_version", "run_id", "events", "chain"}
    assert {k: v for k, v in signed.items() if k != "chain"} == c.to_json()
    for data in (signed, json.dumps(signed), json.dumps(signed, sort_keys=True, indent=2)):
        again = RunController.from_json(data, key=KEY)
        assert again.state == c.state
        assert again.to_json(key=KEY) == signed


def test_the_chain_is_hmac_sha256_over_the_canonical_events() -> None:
    c = at_interruption()
    tag = b""
    for event in c.to_json()["events"]:
        tag = hmac.new(KEY, tag + canonical_json(event), hashlib.sha256).digest()
    assert c.to_json(key=KEY)["chain"] == tag.hex()


@pytest.mark.invariant("I10")
def test_every_single_edit_is_refused_with_the_key_and_legal_ones_load_without() -> None:
    signed = _rich().to_json(key=KEY)
    legal = 0
    paths = list(_leaves(signed["events"], ("events",)))
    assert len(paths) > 100
    for path in paths:
        changed = _with(signed, path)
        try:
            RunController.from_json(changed)
        except ControlError:  # I10: an illegal or malformed edit is rejected by itself
            with pytest.raises(ControlError):
                RunController.from_json(changed, key=KEY)
            continue
        legal += 1
        with pytest.raises(SchemaError, match="keyed chain does not verify"):
            RunController.from_json(changed, key=KEY)
    # the edits I10 cannot see: tool outputs, guardrail verdicts, outputs, error names...
    assert legal >= 20
    at = next(i for i, e in enumerate(signed["events"]) if e["type"] == "ToolCompleted")
    edited = RunController.from_json(_with(signed, ("events", at, "output")))
    assert edited.state.calls["charge"].result == "charged 7!"  # loads, changed


@pytest.mark.invariant("I10")
def test_a_wrong_key_a_truncation_and_a_missing_chain_are_refused() -> None:
    c = _rich()
    signed = c.to_json(key=KEY)
    with pytest.raises(SchemaError, match="keyed chain does not verify"):
        RunController.from_json(signed, key=OTHER)
    truncated = {**signed, "events": signed["events"][:-1]}
    RunController.from_json(truncated)  # a legal, shorter log: I10 alone cannot tell
    with pytest.raises(SchemaError, match="keyed chain does not verify"):
        RunController.from_json(truncated, key=KEY)
    swapped = {**signed, "events": [*signed["events"][:-2], *signed["events"][:-3:-1]]}
    with pytest.raises(SchemaError, match="keyed chain does not verify"):
        RunController.from_json(swapped, key=KEY)
    with pytest.raises(SchemaError, match="carries no keyed chain"):
        RunController.from_json(c.to_json(), key=KEY)
    resigned = RunController.from_json(truncated).to_json(key=OTHER)
    with pytest.raises(SchemaError, match="keyed chain does not verify"):
        RunController.from_json(resigned, key=KEY)


def test_without_a_key_a_chain_is_checked_for_shape_and_otherwise_ignored() -> None:
    c = _rich()
    signed = c.to_json(key=KEY)
    assert RunController.from_json(signed).state == c.state
    assert RunController.from_json(json.dumps(signed)).to_json() == c.to_json()
    for bad in ("abc", "A" * 64, 7, None, ["0" * 64], "g" * 64):
        with pytest.raises(SchemaError, match="chain must be 64 lowercase hex"):
            RunController.from_json({**signed, "chain": bad})


def _as_version_2(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` as a version 2 library wrote it: without time and actor (DESIGN §7.2)."""
    return {**doc, "schema_version": 2,
            "events": [{k: v for k, v in e.items() if k not in ("at", "by", "reason")}
                       for e in doc["events"]]}


def test_version_1_documents_cannot_carry_a_chain() -> None:
    signed = at_interruption().to_json(key=KEY)
    with pytest.raises(SchemaError, match=r"unknown key.*'chain'.*schema_version 1"):
        RunController.from_json({**signed, "schema_version": 1})
    unsigned = {k: v for k, v in signed.items() if k != "chain"}
    RunController.from_json({**_as_version_2(unsigned), "schema_version": 1})


def test_a_forged_time_or_actor_breaks_the_chain() -> None:
    """Version 3's fields are chained like every other: moving an event's ``at``, or
    naming another approver, keeps the log legal (it loads without a key) and is refused
    with one."""
    c = at_interruption()
    c.approve("charge", by="alice", reason="asked")
    c.abandon("stop", by="bob")
    signed = c.to_json(key=KEY)
    approved = next(i for i, e in enumerate(signed["events"]) if e["type"] == "CallApproved")
    for position, key, value in ((1, "at", signed["events"][1]["at"] - 1),
                                 (1, "at", None),
                                 (approved, "by", "mallory"), (approved, "reason", None),
                                 (len(signed["events"]) - 1, "by", None)):
        forged = copy.deepcopy(signed)
        forged["events"][position][key] = value
        RunController.from_json(forged)  # legal: I10 alone cannot tell
        with pytest.raises(SchemaError, match="keyed chain does not verify"):
            RunController.from_json(forged, key=KEY)
        with pytest.raises(SchemaError, match="keyed chain does not verify"):
            RunController.from_json(json.dumps(forged), key=KEY)


def test_a_version_2_document_signed_by_a_version_2_library_still_verifies() -> None:
    """A version 2 library chained its events as it wrote them, without ``at``: the
    chain is checked over the events as written, before they are upcast, so an older
    signed log stays verifiable (and any edit of it is still refused)."""
    doc = _as_version_2(_rich().to_json())
    tag = b""
    for event in doc["events"]:  # the chain as the version 2 library computed it
        tag = hmac.new(KEY, tag + canonical_json(event), hashlib.sha256).digest()
    signed = {**doc, "chain": tag.hex()}
    for data in (signed, json.dumps(signed)):
        again = RunController.from_json(data, key=KEY)
        assert all(e.at is None for e in again.events)
    edited = copy.deepcopy(signed)
    edited["events"][-1]["output"] = {"text": "forged"}
    with pytest.raises(SchemaError, match="keyed chain does not verify"):
        RunController.from_json(edited, key=KEY)
    resigned = again.to_json(key=KEY)  # written again: version 3, chained as written now
    assert resigned["schema_version"] == 3
    assert RunController.from_json(resigned, key=KEY).state == again.state


@pytest.mark.parametrize("key", ["secret", b"", bytearray(b"secret"), 7],
                         ids=["str", "empty", "bytearray", "int"])
def test_a_key_must_be_non_empty_bytes(key: Any) -> None:
    c = at_interruption()
    with pytest.raises(SchemaError, match="non-empty bytes"):
        c.to_json(key=key)
    with pytest.raises(SchemaError, match="non-empty bytes"):
        RunController.from_json(c.to_json(key=KEY), key=key)


def test_a_run_loaded_from_a_snapshot_signs_its_whole_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from statemachine import controller as controller_module

    monkeypatch.setattr(controller_module, "SNAPSHOT_EVERY", 4)
    store = MemoryEventStore()
    c = at_interruption(store=store)
    run_charge(c)
    loaded = RunController.load(store, "run-1")
    signed = loaded.to_json(key=KEY)
    assert signed == c.to_json(key=KEY)
    assert RunController.from_json(signed, key=KEY).state == c.state
    added = len(json.dumps(signed, separators=(",", ":"))) - len(
        json.dumps(c.to_json(), separators=(",", ":")))
    assert added == sizes.CHAIN_BYTES
