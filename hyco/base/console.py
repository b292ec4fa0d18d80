"""The terminal while a stage runs: the stage lines, our progress bars and one-line messages only.

Everything the libraries say (Python warnings, logging INFO lines, onnxruntime's and QNN's C++
logs, the output of worker processes) goes to the stage's log file, `stage.log` in its folder:
file descriptors 1 and 2 are pointed at the log for the length of the stage, so C++ code and child
processes write there too, and our own output reaches the terminal through a saved copy of fd 2
(`terminal()`). The counts go into the stage's manifest (`log`) and the run's stage line.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

STAGE_LOG = "stage.log"

_terminal: TextIO | None = None  # the saved terminal while a stage log is open


def terminal() -> TextIO:
    """Where our own progress and messages go: the terminal, also while a stage log is open."""
    return _terminal if _terminal is not None else sys.stderr


class TerminalStream:
    """A file-like view of `terminal()` at each write: for a logging handler made before a stage
    opens its log (bench/bench_fullsize.py shows each phase as it ends)."""

    def write(self, text: str) -> int:
        return terminal().write(text)

    def flush(self) -> None:
        terminal().flush()


def is_ours(category: type[Warning]) -> bool:
    """A warning class of this package's own (a corpus cut mid-record, degenerate answers): it is
    about the user's input and is shown on the terminal as one line."""
    return category.__module__.split(".")[0] == "hyco"


# Library warnings this project meets on every run, each checked and harmless here, with why: the
# log marks them `[known: why]` and the counts keep them apart from the ones nobody has explained.
KNOWN_WARNINGS = (
    (r"Exporting to ONNX opset version \d+ is not supported",
     "the TorchScript exporter writes the ops these graphs use at opset 21; onnx.checker and the parity "
     "proofs check every graph it writes"),
    (r"Converting a tensor to a Python boolean might cause the trace to be incorrect",
     "the NPU graphs are static by design: every traced shape decision is the one intended"),
    (r"`torch\.jit\.trace(_method)?` is deprecated",
     "the TorchScript exporter is chosen on purpose: torch.export folds small integer weights to float"),
    (r"`is_gradient_checkpointing` is deprecated", "inside transformers; nothing here calls it"),
    (r"To copy construct from a tensor, it is recommended", "inside aimet-torch's QuantSim; values unchanged"),
    (r"Please consider (to run )?pre-?processing before quantization",
     "onnxruntime's quantizer: its pre-processing finds nothing to do on these prepared graphs"),
)


def known_warning(message: str) -> str | None:
    """Why a library's warning is harmless here, or None for one nobody has explained."""
    import re

    return next((why for pattern, why in KNOWN_WARNINGS if re.search(pattern, message)), None)


def progress(iterable=None, **kwargs):
    """tqdm on the terminal (fd 2 itself goes to the stage's log while a stage runs)."""
    from tqdm import tqdm

    return tqdm(iterable, file=terminal(), **kwargs)


@dataclass
class LogCounts:
    path: Path
    warnings: int = 0  # through Python's warnings module or logging, none of KNOWN_WARNINGS
    known: int = 0  # of KNOWN_WARNINGS: harmless, each with its reason in the log
    lines: int = 0  # every line of the log, warnings included

    def record(self) -> dict:
        return {"file": self.path.name, "warnings": self.warnings, "known_warnings": self.known, "lines": self.lines}


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):  # pytest's capsys, a StringIO
        return None


@contextlib.contextmanager
def stage_log(path: Path) -> Iterator[LogCounts]:
    """Send fds 1 and 2, Python's warnings and whatever the libraries log to `path` while the
    block runs; this package's own warnings (about the user's input) still reach the terminal as
    one line."""
    global _terminal
    counts = LogCounts(Path(path))
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(ValueError, OSError):
            stream.flush()
    try:
        saved = {fd: os.dup(fd) for fd in (1, 2)}
    except OSError:  # a parent closed stdout or stderr: nothing to keep off a terminal
        yield counts
        return
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    previous_terminal, previous_show = _terminal, warnings.showwarning
    # Where sys.stderr is not fd 2 (a test's capture) our messages go where they went before.
    _terminal = (open(os.dup(saved[2]), "w", buffering=1, encoding="utf-8", errors="replace")
                 if _fileno(sys.stderr) == 2 else sys.stderr)

    log_text = open(log_fd, "a", buffering=1, encoding="utf-8", errors="replace", closefd=False)

    def show(message, category, filename, lineno, file=None, line=None):
        if is_ours(category):
            previous_show(message, category, filename, lineno, file, line)
            return
        why = known_warning(str(message))
        if why:
            counts.known += 1
            log_text.write(f"[known: {why}] ")
        else:
            counts.warnings += 1  # written to the log itself: sys.stderr may be redirected to the terminal
        log_text.write(warnings.formatwarning(message, category, filename, lineno, line))

    known_logs = KnownLogWarnings(counts)
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        warnings.showwarning = show
        logging.getLogger().addFilter(known_logs)
        yield counts
    finally:
        logging.getLogger().removeFilter(known_logs)
        warnings.showwarning = previous_show
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(ValueError, OSError):
                stream.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        log_text.close()
        os.close(log_fd)
        if _terminal is not sys.stderr:
            _terminal.close()
        _terminal = previous_terminal
        counts.lines = _count_lines(path)


class KnownLogWarnings(logging.Filter):
    """A library's WARNING through `logging` (onnxruntime's quantizer logs to the root logger):
    counted like a warning, and a known one marked with why it is harmless."""

    def __init__(self, counts: LogCounts):
        super().__init__()
        self.counts = counts

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING:
            why = known_warning(record.getMessage())
            if why:
                self.counts.known += 1
                record.msg, record.args = f"[known: {why}] {record.getMessage()}", ()
            else:
                self.counts.warnings += 1
        return True


def _count_lines(path: Path) -> int:
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    return 0
