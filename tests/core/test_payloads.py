"""Payloads are plain JSON, detached on the way in, bounded in depth."""

from __future__ import annotations

from typing import Any

import pytest

from statemachine import RunController, SchemaError, ToolCall, register_canonical
from statemachine.payloads import PayloadError, canonical_json, detach, fingerprint_of
from tests.helpers import assert_refused


@pytest.mark.parametrize("bad", [
    (1, 2), {1, 2}, float("nan"), float("inf"), {1: "x"}, {"k": (1,)}, [object()],
    b"bytes", [[{"k": float("-inf")}]],
], ids=["tuple", "set", "nan", "inf", "int-key", "nested-tuple", "object", "bytes",
        "nested-inf"])
def test_not_plain_json_is_refused(bad: Any) -> None:
    with pytest.raises(PayloadError):
        detach(bad)


def test_detach_copies_deeply() -> None:
    value = {"a": [1, {"b": [2.5, None, True, "s"]}]}
    copy = detach(value)
    assert copy == value
    value["a"][1]["b"].append("later")  # type: ignore[index]
    assert copy == {"a": [1, {"b": [2.5, None, True, "s"]}]}


def test_depth_limit_is_iterative_and_exact() -> None:
    deep: Any = "leaf"
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(PayloadError, match="deeper than 200"):
        detach(deep)
    ok: Any = "leaf"
    for _ in range(200):
        ok = [ok]
    assert detach(ok) == ok
    with pytest.raises(PayloadError):
        detach([ok])


def test_commands_detach_and_refuse_before_recording() -> None:
    c = RunController.start(run_id="p", session_id=None, max_depth=3)
    c.begin_model_call()
    args = {"nested": {"list": [1]}}
    c.model_responded([ToolCall("a", "t", args)])
    args["nested"]["list"].append(2)
    assert c.state.calls["a"].call.arguments == {"nested": {"list": [1]}}
    error = assert_refused(c, SchemaError, c.tool_completed, "a", {"x": {"y": {"z": {}}}})
    assert "deeper than 3" in str(error)
    assert_refused(c, SchemaError, c.hook_ran, 7)


def test_fingerprint_is_sha256_of_the_builtin_canonical_json() -> None:
    import hashlib

    expected = hashlib.sha256(b'["pay",{"a":1,"b":[true,null]}]').hexdigest()
    assert fingerprint_of("pay", {"b": [True, None], "a": 1}) == expected


def test_messages_never_echo_payload_contents() -> None:
    c = RunController.start(run_id="p", session_id=None)
    c.begin_model_call()
    secret = "card-4111-1111"
    with pytest.raises(SchemaError) as info:
        c.model_responded([ToolCall("a", "t", {secret: float("nan")})])
    assert secret not in str(info.value)


def test_canonical_forms_are_registered_once_by_name() -> None:
    def lower(item: Any) -> bytes:
        return canonical_json(item).lower()

    register_canonical("lowercase-test", lower)
    register_canonical("lowercase-test", lower)
    with pytest.raises(SchemaError):
        register_canonical("lowercase-test", canonical_json)
    c = RunController.start(run_id="c", session_id="s", canonical="lowercase-test")
    assert RunController.from_json(c.to_json()).state == c.state
    with pytest.raises(SchemaError, match="unknown canonical form"):
        RunController.start(run_id="c", session_id="s", canonical="never-registered")
