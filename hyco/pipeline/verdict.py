"""The verdict that opens every summary: one line per proof or headline figure, each with its
figure and its threshold, so the first lines say whether the stage worked, how faithful it is and
whether it pays off. A stage's lines go into its manifest, and `run` gathers them for
run_summary.md."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

PASS, FAIL, OFF, INFO, WARN = "PASS", "FAIL", "OFF", "INFO", "WARN"


@dataclass(frozen=True)
class Line:
    """`status`: PASS / FAIL for a proof that can fail the stage, OFF for one the recipe turned
    off, WARN for a figure outside its expected range that fails nothing, INFO for a figure."""

    check: str
    status: str
    figure: str
    threshold: str = ""

    def markdown(self, stage: str | None = None) -> str:
        where = f"{stage}: " if stage else ""
        bar = f" (threshold: {self.threshold})" if self.threshold else ""
        return f"- **{self.status}** {where}{self.check}: {self.figure}{bar}"


def proof(check: str, passed: bool | None, figure: str, threshold: str = "", off: str = "") -> Line:
    """A proof's line: PASS / FAIL, or OFF (with why) when it did not run."""
    if passed is None:
        return Line(check, OFF, off or "not run", "")
    return Line(check, PASS if passed else FAIL, figure, threshold)


def block(lines: Iterable[Line], stage: str | None = None) -> str:
    """The Markdown verdict: its overall word first, then one line each."""
    lines = list(lines)
    return f"**Verdict: {overall(lines)}**\n\n" + "\n".join(line.markdown(stage) for line in lines) + "\n"


def overall(lines: Iterable[Line]) -> str:
    """FAILED if any proof failed; else PASSED with how many proofs held and how many were off."""
    statuses = [line.status for line in lines]
    warned = ", with warnings" if WARN in statuses else ""
    if FAIL in statuses:
        return f"FAILED ({statuses.count(FAIL)} of {statuses.count(FAIL) + statuses.count(PASS)} proofs)"
    held, off = statuses.count(PASS), statuses.count(OFF)
    if not held:
        return ("no proof ran: " + ", ".join(line.check for line in lines if line.status == OFF) if off
                else "figures only (this stage has no proof)") + warned
    return f"PASSED ({held} {'proof' if held == 1 else 'proofs'} held" + (f", {off} off" if off else "") + ")" + warned


def with_verdict(markdown: str, lines: Iterable[Line]) -> str:
    """`markdown` with the verdict block right under its first heading (or on top without one)."""
    verdict = block(lines)
    head, sep, rest = markdown.partition("\n")
    if head.startswith("# "):
        return f"{head}\n\n{verdict}\n{rest.lstrip(chr(10))}"
    return f"{verdict}\n{markdown}"


def to_json(lines: Iterable[Line]) -> list[dict[str, str]]:
    return [asdict(line) for line in lines]


def from_json(rows: Iterable[Mapping[str, Any]]) -> list[Line]:
    return [Line(**{k: str(row.get(k, "")) for k in ("check", "status", "figure", "threshold")}) for row in rows]


def percent(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f}%"
