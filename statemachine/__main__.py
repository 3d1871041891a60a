"""``python -m statemachine`` is the ``statemachine`` command."""

import sys

from statemachine.cli import main

sys.exit(main())
