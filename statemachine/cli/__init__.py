"""The `statemachine` command (`main`) and its demo."""

from statemachine.cli.main import main

__all__ = ["main"]
