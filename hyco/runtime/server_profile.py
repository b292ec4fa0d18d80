"""A server for `hyco-convert project` to ask about: the verifier's per-pass milliseconds on a
server, in the form check's own sweep is stored (`ServerTimes.to_json`, the "server" object of
costs_inputs.json), so a sweep measured on one GPU is a profile for any check's rounds.

A server profile, JSON (`--server-profile FILE`), or a built-in one by name (`PROFILES`):

    {"device": "RTX PRO 6000, Gemma 4 26B-A4B AWQ",     # optional: what it was measured on
     "source": "CUDA events, CUDA graphs replayed",     # optional: how
     "verify": [[5, 1024, 18.7], [33, 1024, 21.7]],     # [rows, context tokens, ms] of one verify pass
     "prefill": [[512, 40.0], [2048, 150.0]],           # [prompt tokens, ms] of the prompt's prefill
     "head_step": 1.275}                                # ms of one MTP head step on the server; null: none

Rows are padded up to the next listed row count (the fixed shapes a server captures), contexts
interpolated between the listed lengths (one length: the same figure at every context), prefill
is the least-squares line through its points (one point: through zero). `spread` and `cached`,
which a measured sweep also carries, are accepted and ignored.

`paper-26b-a4b`: Gemma 4 26B-A4B (AWQ 4-bit) on the paper's RTX PRO 6000, derived from the
paper's published figures, not measured by this tool:
- the server's median round is 26.8 ms with the MTP head on the server and 21.7 ms with it on the
  phone, the same 33-row tree (section 3.1), so the head's K = 4 steps take 26.8 - 21.7 = 5.1 ms:
  T_head = 5.1 / 4 = 1.275 ms a step, and T_verify(33 rows) = 21.7 ms;
- Cloud+MTP verifies K + 1 = 5 rows and runs the K steps; its g is 7.81 ms a token at MAT 3.05
  (Tables 11 and 2, SB-480), i.e. 7.81 x 3.05 = 23.82 ms a round, so T_verify(5 rows) =
  23.82 - 5.1 = 18.72 ms. That round carries Cloud+MTP's share of prefill (g includes it);
- no prefill time is published for SB-480: 0 ms, so a projected g is the decoding rounds' alone;
- one context: the paper's figures are SB-480's short prompts (a 32K context costs more).
fed the paper's MATs, these give the paper's g within about 5% (tests/test_project.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hyco.base.errors import HycoError
from hyco.base.loading import read_json
from hyco.runtime.server_timing import ServerTimes

PAPER_PROFILE = "paper-26b-a4b"
K = 4  # the MTP chain's steps a round (the paper's and the recipes' K)
SERVER_HEAD_ROUND_MS = 26.8  # the server's median round, the head on the server
HYCO_ROUND_MS = 21.7  # the same tree, the head on the phone: T_verify(33 rows)
HEAD_STEP_MS = (SERVER_HEAD_ROUND_MS - HYCO_ROUND_MS) / K  # 1.275
CLOUD_MTP_G_MS, CLOUD_MTP_MAT = 7.81, 3.05  # Table 11's g and Table 2's MAT, SB-480
CLOUD_MTP_VERIFY_MS = CLOUD_MTP_G_MS * CLOUD_MTP_MAT - K * HEAD_STEP_MS  # 18.72: its 5-row pass
PAPER_CONTEXT = 1024  # one context for every figure: the paper publishes none by context

PAPER_ARITHMETIC = (f"T_head = ({SERVER_HEAD_ROUND_MS} - {HYCO_ROUND_MS}) / {K} = {HEAD_STEP_MS:.3f} ms; "
                    f"T_verify(33 rows) = {HYCO_ROUND_MS} ms; T_verify(5 rows) = {CLOUD_MTP_G_MS} x {CLOUD_MTP_MAT} "
                    f"- {K} x {HEAD_STEP_MS:.3f} = {CLOUD_MTP_VERIFY_MS:.2f} ms; no prefill published: 0 ms")

PROFILES: dict[str, dict[str, Any]] = {PAPER_PROFILE: {
    "device": "Gemma 4 26B-A4B (AWQ 4-bit) on an RTX PRO 6000",
    "source": f"derived from the paper's figures, not measured here ({PAPER_ARITHMETIC})",
    "verify": [[K + 1, PAPER_CONTEXT, CLOUD_MTP_VERIFY_MS], [33, PAPER_CONTEXT, HYCO_ROUND_MS]],
    "prefill": [[PAPER_CONTEXT, 0.0]],
    "head_step": HEAD_STEP_MS}}

REQUIRED = ("verify", "prefill")
OPTIONAL = ("device", "source", "head_step", "spread", "cached")
EXAMPLE = '{"verify": [[33, 1024, 21.7]], "prefill": [[512, 40.0]], "head_step": 1.3}'


def read_server_profile(path: Path | str) -> ServerTimes:
    """A server profile (a file, or a name in PROFILES), validated key by key: a bad one is one
    line naming the file and the key."""
    name = str(path)
    data = PROFILES[name] if name in PROFILES else read_json(path, "server profile")
    if not isinstance(data, dict):
        raise HycoError(f"{path}: a server profile is a JSON object, e.g. {EXAMPLE}")
    unknown = sorted(set(data) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise HycoError(f"{path}: {unknown[0]}: unknown key (known: {[*REQUIRED, *OPTIONAL]})")
    for key in REQUIRED:
        if key not in data:
            raise HycoError(f"{path}: {key}: missing, e.g. {EXAMPLE}")
    verify = _verify(path, data["verify"])
    prefill = _prefill(path, data["prefill"])
    head_step = data.get("head_step")
    if head_step is not None and not _positive(head_step):
        raise HycoError(f"{path}: head_step must be a positive number of milliseconds or null, but got {head_step!r}")
    for key in ("device", "source"):
        if not isinstance(data.get(key, ""), str):
            raise HycoError(f"{path}: {key} must be a string, but got {data[key]!r}")
    return ServerTimes(device=data.get("device", "a server"), source=data.get("source", f"server profile {name}"),
                       verify=verify, prefill=prefill, head_step=None if head_step is None else float(head_step))


def _verify(path: Path | str, entries: Any) -> dict[tuple[int, int], float]:
    if not isinstance(entries, list) or not entries:
        raise HycoError(f"{path}: verify must be a non-empty list of [rows, context, ms], but got {entries!r}")
    out: dict[tuple[int, int], float] = {}
    for i, entry in enumerate(entries):
        ok = isinstance(entry, list) and len(entry) == 3 and _count(entry[0], 1) and _count(entry[1], 0)
        if not ok or not _positive(entry[2]):
            raise HycoError(f"{path}: verify[{i}] must be [rows >= 1, context >= 0, ms > 0], but got {entry!r}")
        if (entry[0], entry[1]) in out:
            raise HycoError(f"{path}: verify[{i}]: rows {entry[0]} at context {entry[1]} is listed twice")
        out[(entry[0], entry[1])] = float(entry[2])
    return out


def _prefill(path: Path | str, entries: Any) -> dict[int, float]:
    if not isinstance(entries, list) or not entries:
        raise HycoError(f"{path}: prefill must be a non-empty list of [prompt tokens, ms], but got {entries!r}")
    out: dict[int, float] = {}
    for i, entry in enumerate(entries):
        ok = isinstance(entry, list) and len(entry) == 2 and _count(entry[0], 1)
        if not ok or not _number(entry[1]) or entry[1] < 0:
            raise HycoError(f"{path}: prefill[{i}] must be [prompt tokens >= 1, ms >= 0], but got {entry!r}")
        if entry[0] in out:
            raise HycoError(f"{path}: prefill[{i}]: {entry[0]} prompt tokens is listed twice")
        out[entry[0]] = float(entry[1])
    return out


def _number(value: Any) -> bool:
    """A finite JSON number (json.loads reads NaN and Infinity; a bool is not a number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: Any) -> bool:
    return _number(value) and value > 0


def _count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
