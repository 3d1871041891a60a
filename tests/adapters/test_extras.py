"""Importing an adapter whose SDK is not installed (issue 23, row 21): the error is a
`ModuleNotFoundError` (`MissingExtra`) that names the extra to install, never a bare
"No module named ..."."""

from __future__ import annotations

import importlib
import sys

import pytest

from statemachine.adapters import MissingExtra

ADAPTERS = [("openai_agents", "agents", "openai-agents"),
            ("anthropic", "anthropic", "anthropic"),
            ("pydantic_ai", "pydantic_ai", "pydantic-ai"),
            ("langgraph", "langgraph", "langgraph"),
            ("google_adk", "google.adk", "google-adk")]


@pytest.mark.parametrize(("adapter", "sdk", "extra"), ADAPTERS)
def test_an_adapter_without_its_sdk_names_the_extra_to_install(
        monkeypatch: pytest.MonkeyPatch, adapter: str, sdk: str, extra: str) -> None:
    module = f"statemachine.adapters.{adapter}"
    monkeypatch.setitem(sys.modules, sdk, None)  # the SDK is not installed
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(MissingExtra) as missing:
        importlib.import_module(module)
    assert isinstance(missing.value, ModuleNotFoundError)
    assert missing.value.name == sdk
    assert str(missing.value) == (f"{module} needs {sdk!r}, which is not installed: "
                                  f"pip install 'agent-statemachine[{extra}]'")
    monkeypatch.delitem(sys.modules, module, raising=False)  # the half-imported module


def test_the_adapters_package_imports_no_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    for _, sdk, _ in ADAPTERS:
        monkeypatch.setitem(sys.modules, sdk, None)
    monkeypatch.delitem(sys.modules, "statemachine.adapters", raising=False)
    package = importlib.import_module("statemachine.adapters")
    assert package.MissingExtra.__name__ == "MissingExtra"
