"""Adapters: the control core embedded in the agent runners people already use (DESIGN
§6.8). Each adapter is a module here, installed with an extra and imported by its own
name, so importing this package never imports an SDK:

* `statemachine.adapters.anthropic` — the Anthropic SDK (``anthropic``), installed with
  ``agent-statemachine[anthropic]``.
* `statemachine.adapters.openai_agents` — the OpenAI Agents SDK (``openai-agents``),
  installed with ``agent-statemachine[openai-agents]``.
* `statemachine.adapters.pydantic_ai` — Pydantic AI (``pydantic-ai-slim``), installed
  with ``agent-statemachine[pydantic-ai]``.

The core never imports this package.
"""

from __future__ import annotations

__all__: list[str] = []
