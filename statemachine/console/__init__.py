"""The web console (DESIGN §7.5, extra ``[console]``): the runs with what blocks them,
the inbox, each run's timeline, ledger and drawing, and the four operator actions as
forms. ``statemachine serve`` starts it; `create_app` builds the application for a
`Console` to mount elsewhere (any ASGI server)."""

from statemachine.console.app import Console, create_app
from statemachine.console.auth import Logins, read_token

__all__ = ["Console", "Logins", "create_app", "read_token"]
