"""A clean shutdown on SIGTERM is a success: status 0, not 143."""

from __future__ import annotations

import signal
from typing import Any


def exit_zero_on_sigterm() -> None:
    """Call before `uvicorn.run`: SIGTERM then ends the process with status 0.

    uvicorn catches SIGTERM, shuts down gracefully, then puts back the handler it
    found and raises the signal again, so with the default handler a shutdown that
    went well ends as "killed by SIGTERM" (143), which supervisors count as a
    failure. The handler it finds is this one: it exits 0, whether the signal comes
    after uvicorn finished or before it took over (nothing was serving yet).
    """

    def stop(_signum: int, _frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
