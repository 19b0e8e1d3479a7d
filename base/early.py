"""Ctrl-C before start-up (while torch and transformers load, and while the flags are checked): one line, exit 1.

The handler ends the process at once (os._exit) instead of raising SystemExit into whatever library import is
running: some catch it (a lazy module re-raises it as an ImportError with a traceback, a half-imported numpy then
refuses to load again, a broad `except` swallows it and the run goes on). Nothing is written before start-up, so
there is nothing to clean; lifecycle.Startup takes Ctrl-C over once a run folder can exist. Imports nothing heavy.
"""

import os
import signal
import sys

MESSAGE = "interrupted before start-up; nothing was written"


def install() -> None:
    """Only where Python's own handler is in place (a launcher may have set its own)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _stop)


def _stop(signum, frame) -> None:
    print(MESSAGE, file=sys.stderr, flush=True)
    os._exit(1)
