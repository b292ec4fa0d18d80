"""A quiet console: the main job's terminal shows the stage lines, progress and the run summary;
what the libraries say goes to each stage's `stage.log` (hyco/base/console.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

from ladder import STAGES

from hyco.base.console import stage_log, terminal
from hyco.data.chat import TruncatedWarning

# A line Python's warnings module writes ("file.py:12: FooWarning: ...") and a library's INFO line.
PY_WARNING = re.compile(r"^.*:\d+: \w*Warning: ", re.M)
INFO = re.compile(r"\bINFO\b")
TQDM = re.compile(r"^[\w :()-]+: +\d+%\|.*\| *\d+/\d+ \[")


def test_the_main_jobs_terminal_shows_only_our_lines(ladder):
    console = ladder.parent
    out, err = (console / "stdout.txt").read_text(), (console / "stderr.txt").read_text()
    assert not PY_WARNING.search(out + err), PY_WARNING.findall(out + err)[:5]
    assert not INFO.search(out + err), [line for line in (out + err).splitlines() if INFO.search(line)][:5]
    ours = re.compile(r"^(\[[a-z_]+\] |wrote .*run_report\.json)")
    assert [line for line in out.splitlines() if not ours.match(line)] == []
    # stderr holds our progress bars (tqdm's `desc:  40%|####  | 2/5 ...`) and nothing else
    lines = [line.replace("\x1b[A", "").strip() for line in re.split(r"[\r\n]+", err)]  # a closed bar's erase
    others = [line for line in lines if line and not TQDM.search(line)]
    assert others == [], others[:5]
    for stage in STAGES:
        manifest = json.loads((ladder / stage / "manifest.json").read_text())
        assert (ladder / stage / "stage.log").is_file() and manifest["log"]["file"] == "stage.log"
        assert "stage.log" in manifest["outputs"] and "stage.log" in manifest["nondeterministic"]
    # The libraries did say things (else the test proves nothing): the logs hold them.
    logs = "".join((ladder / s / "stage.log").read_text(errors="replace") for s in STAGES)
    assert PY_WARNING.search(logs) or INFO.search(logs)


def test_stage_log_takes_python_c_level_and_child_output_but_not_our_warnings(tmp_path, capfd):
    from hyco.pipeline.cli import _one_line_warnings

    log = tmp_path / "stage.log"
    with _one_line_warnings("test"), stage_log(log) as counts:
        warnings.warn("a library's deprecation", DeprecationWarning, stacklevel=1)
        warnings.warn_explicit("a library's notice", UserWarning, "lib.py", 7)
        os.write(2, b"[W:onnxruntime] from C++\n")
        os.write(1, b"printed by C code\n")
        subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"],
                       check=True)
        warnings.warn_explicit("corpus cut mid-record", TruncatedWarning, "ours.py", 1)
        print("progress", file=terminal())
    text = log.read_text()
    for said in ("a library's notice", "from C++", "printed by C code", "child out", "child err"):
        assert said in text, said
    assert "corpus cut mid-record" not in text
    assert counts.warnings >= 1 and counts.lines == text.count("\n")
    seen = capfd.readouterr()
    assert "hyco-convert test: warning: corpus cut mid-record" in seen.err and "progress" in seen.err
    assert "child" not in seen.out + seen.err and "C++" not in seen.err
    os.write(2, b"after\n")  # fds are back
    assert capfd.readouterr().err == "after\n"


def test_known_library_warnings_are_marked_with_why_and_counted_apart(tmp_path):
    """A warning of KNOWN_WARNINGS (through `warnings` or the root logger) is logged with the reason
    it is harmless and counted as known; any other stays an unexplained warning."""
    import logging

    from hyco.base.console import KNOWN_WARNINGS

    log = tmp_path / "stage.log"
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    with warnings.catch_warnings(), stage_log(log) as counts:
        warnings.simplefilter("always")
        warnings.warn_explicit("Converting a tensor to a Python boolean might cause the trace to be incorrect.",
                               UserWarning, "lib.py", 3)
        logging.getLogger().warning("Please consider to run pre-processing before quantization. Refer to example")
        warnings.warn_explicit("something nobody has looked at", UserWarning, "lib.py", 9)
        logging.getLogger().warning("an unknown logged warning")
    logging.getLogger().removeHandler(handler)
    text = log.read_text()
    assert counts.known == 2 and counts.warnings == 2, (counts, text)
    assert text.count("[known: ") == 1 and "static by design" in text
    assert logged[0].startswith("[known: ") and "finds nothing to do" in logged[0]
    assert logged[1] == "an unknown logged warning"
    assert counts.record()["known_warnings"] == 2
    assert all(why for _, why in KNOWN_WARNINGS)
