"""Adapters: the control core embedded in the agent runners people already use (DESIGN
§6.8). Each adapter is a module here, installed with an extra and imported by its own
name, so importing this package never imports an SDK:

* `statemachine.adapters.anthropic` — the Anthropic SDK (``anthropic``), installed with
  ``agent-statemachine[anthropic]``.
* `statemachine.adapters.openai_agents` — the OpenAI Agents SDK (``openai-agents``),
  installed with ``agent-statemachine[openai-agents]``.
* `statemachine.adapters.pydantic_ai` — Pydantic AI (``pydantic-ai-slim``), installed
  with ``agent-statemachine[pydantic-ai]``.
* `statemachine.adapters.langgraph` — LangGraph and LangChain agents (``langgraph``,
  ``langchain``), installed with ``agent-statemachine[langgraph]``.
* `statemachine.adapters.google_adk` — Google ADK agents (``google-adk``), installed with
  ``agent-statemachine[google-adk]``.

Importing an adapter whose SDK is missing raises `MissingExtra` (a
`ModuleNotFoundError`) naming the extra to install. The core never imports this package.
"""

from __future__ import annotations

__all__ = ["MissingExtra"]


class MissingExtra(ModuleNotFoundError):
    """An adapter was imported without its SDK: the message names the extra that
    installs it (``pip install 'agent-statemachine[<extra>]'``). ``name`` is the missing
    module, as for any `ModuleNotFoundError`."""


def missing_extra(adapter: str, extra: str, error: ModuleNotFoundError) -> MissingExtra:
    """The error an adapter raises (``from error``) when its SDK's import failed."""
    missing = error.name or "its SDK"
    return MissingExtra(
        f"{adapter} needs {missing!r}, which is not installed: "
        f"pip install 'agent-statemachine[{extra}]'", name=error.name)
