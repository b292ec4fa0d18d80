"""The phone's side of the timing model: per-pass milliseconds of the drafters' graphs, each with
its source, never the x86 simulator's wall time (seconds a pass: not a phone).

Sources, first found wins, per graph:
1. a device profile the user measured, JSON (`--phone-profile`, `check.timing.phone_profile`), or a
   built-in one by name (`PROFILES`: `paper-sm8850`, the paper's own figures, said to be so):
       {"device": "Galaxy S26 Ultra (SM8850)",
        "graphs": {"tree": {"median_ms": 41.2}, "prefill": {"median_ms": 95.0}, "mtp_step": {"median_ms": 2.9}},
        "host_ms_per_round": 1.5}          # optional: LUT lookups, rings, masks on the phone's CPU
2. the bundle's AI Hub profile (`hyco-convert export --hub` wrote hub.json: each graph's
   estimated_inference_time_us on the named phone);
3. the weight-bandwidth floor: a graph reads every weight once a pass, so it takes at least its
   weight bytes (bundle.json) over the memory bandwidth (`check.timing.phone_bandwidth_gbs`).
   A floor, not a measurement: the label says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyco.base.errors import HycoError
from hyco.base.loading import read_json

GRAPHS = ("tree", "prefill", "mtp_step")

# Built-in profiles, by name in place of a file. `paper-sm8850`: Gemma 4 E2B and the 26B-A4B MTP
# head on the Galaxy S26 Ultra's SM8850, derived from the paper's SB-480 mobile draft times (not
# measured by this tool): the SLM alone drafts 36.8 ms a token (one tree pass), and HyCo 12.1 ms a
# token at MAT 4.71, i.e. 57.0 ms a round = one tree pass + 4 MTP steps, so an MTP step is
# (57.0 - 36.8) / 4 = 5.05 ms; host work is inside those figures. No prefill figure is published.
PROFILES = {"paper-sm8850": {
    "device": "Galaxy S26 Ultra (SM8850), derived from the paper's SB-480 draft times, not measured here",
    "graphs": {"tree": {"median_ms": 36.8}, "mtp_step": {"median_ms": 5.05}}, "host_ms_per_round": 0.0}}


@dataclass
class PhoneTimes:
    """Milliseconds a pass per graph, the host's work per round, and each figure's source."""

    ms: dict[str, float]
    host_ms: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)
    prefill_rows: int = 1  # tokens a prefill pass takes
    # the graph that prefills: "prefill", or "tree" where the bundle ships one copy of the SLM's
    # weights (export.slm_graphs tree-only) and the tree graph prefills in passes of its rows
    prefill_graph: str = "prefill"
    separate_prefill_rows: int | None = None  # tree-only: the prefill graph's rows it would have had

    def slm_prefill_ms(self, prompt_tokens: int, max_prompt: int) -> float:
        """The phone's SLM prefill: its last `max_prompt` tokens in passes of the prefilling graph."""
        return self.prefill_passes(prompt_tokens, max_prompt) * self.ms.get(self.prefill_graph, 0.0)

    def prefill_passes(self, prompt_tokens: int, max_prompt: int, rows: int | None = None) -> int:
        return math.ceil(min(prompt_tokens, max_prompt) / (rows or self.prefill_rows))

    def prefill_comparison(self, prompt_tokens: float, max_prompt: int) -> dict[str, Any] | None:
        """What one copy of the SLM's weights costs in prefill, for a prompt of `prompt_tokens`:
        the tree graph's passes against the separate prefill graph's (its pass time from the
        profile or hub report; None where neither has one)."""
        if self.prefill_graph != "tree" or not self.separate_prefill_rows:
            return None
        tokens = round(prompt_tokens)
        separate = self.ms.get("prefill")
        passes = self.prefill_passes(tokens, max_prompt, self.separate_prefill_rows)
        return {"prompt_tokens": tokens, "tree_only_passes": self.prefill_passes(tokens, max_prompt),
                "tree_only_ms": self.slm_prefill_ms(tokens, max_prompt), "separate_passes": passes,
                "separate_ms": None if separate is None else passes * separate,
                "separate_source": self.sources.get("prefill")}


def read_profile(path: Path | str) -> dict:
    """A device profile (a file, or a name in PROFILES), validated: every number named by file and key."""
    data = PROFILES[str(path)] if str(path) in PROFILES else read_json(path, "phone profile")
    graphs = data.get("graphs") if isinstance(data, dict) else None
    if not isinstance(graphs, dict) or not graphs:
        raise HycoError(f"{path}: a phone profile needs a 'graphs' object, e.g. "
                        '{"graphs": {"tree": {"median_ms": 41.2}}}')
    for name, entry in graphs.items():
        if name not in GRAPHS:
            raise HycoError(f"{path}: graphs.{name}: unknown graph (known: {list(GRAPHS)})")
        value = entry.get("median_ms") if isinstance(entry, dict) else None
        if not _number(value) or not value > 0:
            raise HycoError(f"{path}: graphs.{name}.median_ms must be a positive number of milliseconds, "
                            f"but got {value!r}")
    host = data.get("host_ms_per_round", 0.0)
    if not _number(host) or host < 0:
        raise HycoError(f"{path}: host_ms_per_round must be a number >= 0, but got {host!r}")
    return data


def _number(value) -> bool:
    """A finite JSON number: json.loads reads NaN and Infinity, which pass `> 0` or `< 0` tests
    the wrong way, and a bool is an int to isinstance."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def hub_times(hub_json: Path) -> dict[str, tuple[float, str]]:
    data = read_json(hub_json, "AI Hub report")
    out = {}
    for job in data.get("jobs", []):
        us = job.get("estimated_inference_time_us")
        if job.get("role") in GRAPHS and isinstance(us, int | float) and us > 0:
            out[job["role"]] = (us / 1e3, f"AI Hub profile on {data.get('device', '?')} ({hub_json})")
    return out


def phone_times(bundle: Path | None, *, profile: Path | None, hub_json: Path | None, bandwidth_gbs: float,
                prefill_rows: int, prefill_graph: str = "prefill", separate_prefill_rows: int | None = None) -> PhoneTimes:
    found: dict[str, tuple[float, str]] = {}
    host, host_source = 0.0, "not measured: 0"
    if profile is not None:
        data = read_profile(profile)
        device = data.get("device", "a phone")
        found = {g: (float(e["median_ms"]), f"device profile of {device} ({profile})") for g, e in data["graphs"].items()}
        if "host_ms_per_round" in data:
            host, host_source = float(data["host_ms_per_round"]), f"device profile of {device} ({profile})"
    if hub_json is not None:
        for g, value in hub_times(Path(hub_json)).items():
            found.setdefault(g, value)
    if bundle is not None and (Path(bundle) / "bundle.json").is_file():
        meta = read_json(Path(bundle) / "bundle.json", "bundle.json")
        for g in GRAPHS:
            # a tree-only bundle has no prefill graph; the one it would have had holds the tree's weights
            held = "tree" if g == "prefill" and prefill_graph == "tree" else g
            weight_bytes = meta["graphs"].get(held, {}).get("weight_bytes")
            if weight_bytes:
                found.setdefault(g, (weight_bytes / (bandwidth_gbs * 1e6),
                                     f"weight-bandwidth floor: {weight_bytes:,} B at {bandwidth_gbs:g} GB/s (a floor, "
                                     "not a measurement)"))
    missing = [g for g in GRAPHS if g not in found]
    sources = {g: s for g, (_, s) in found.items()} | {g: "none: no profile, hub report or bundle" for g in missing}
    return PhoneTimes({g: ms for g, (ms, _) in found.items()}, host, {**sources, "host": host_source}, prefill_rows,
                      prefill_graph, separate_prefill_rows)
