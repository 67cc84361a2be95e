"""Errors for people: a refusal is printed as its cause in a line or two; the traceback goes to a log file.

The zoo's own errors already name the file, key or sample at fault and what was expected (`ValueError` and
its kin: `MediaError`, `UnsafeConfigError`; `OSError` for missing files; `FloatingPointError` for a
diverged loss). Behind a 40-80-line traceback that message is hard to find, so `zoo` prints only the
message and says where the full traceback is; `--debug` (or `ZOO_DEBUG=1`) prints it as Python would.
Anything else (a bug, not a refusal) keeps its traceback on the terminal.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

USER_ERRORS = (ValueError, OSError, FloatingPointError, ImportError, KeyError)
DEBUG_FLAG = "--debug"
MAX_MESSAGE_LINES = 4


def debug_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """Whether `--debug` is among the arguments (or `ZOO_DEBUG=1`), and the arguments without it."""
    debug = DEBUG_FLAG in argv or os.environ.get("ZOO_DEBUG", "") not in ("", "0")
    return debug, [a for a in argv if a != DEBUG_FLAG]


def write_traceback(error: BaseException) -> Path:
    """The full traceback of `error` in a fresh log file under the temporary folder."""
    folder = Path(tempfile.gettempdir()) / "zoo-errors"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path.write_text("".join(traceback.format_exception(error)))
    return path


def short_message(error: BaseException) -> str:
    """The cause of `error` in a few lines: its message (a worker's re-raised traceback cut off), with the
    messages of the errors it was raised from when they add something."""
    text = str(error).strip() or type(error).__name__
    if isinstance(error, KeyError) and error.args:
        text = f"missing key {error.args[0]!r}"
    lines = text.splitlines()
    if "Original Traceback" in text:  # a DataLoader worker's error: its last line is the cause
        lines = [lines[0], lines[-1]]
    message = "\n".join(lines[:MAX_MESSAGE_LINES]) + ("\n..." if len(lines) > MAX_MESSAGE_LINES else "")
    cause = error.__cause__
    if cause is not None and str(cause) and str(cause) not in message:
        message += f"\n  caused by {type(cause).__name__}: {str(cause).splitlines()[0]}"
    return message


def report(command: str, error: BaseException) -> int:
    """Print `error` for a person on stderr and return the exit status (1)."""
    log = write_traceback(error)
    print(f"zoo {command}: error: {short_message(error)}", file=sys.stderr)
    print(f"(full traceback in {log}; rerun with {DEBUG_FLAG} to print it)", file=sys.stderr)
    return 1


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time (a captured stream in tests, the terminal otherwise)."""

    @property
    def stream(self):  # noqa: ANN201 (a text stream)
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def show_zoo_messages() -> None:
    """Show the zoo's log messages (warnings such as resampling, skipped samples, overrides; and notes at
    INFO) on stderr once per process, as Lightning shows its own; the library itself configures no handler."""
    logger = logging.getLogger("zoo")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
