"""Server cost and delivery speed from check's rounds: the paper's Table 2 (Delta-g against
Cloud+MTP, MAT, tok/s), Table 11 (g, tok/s, draft ms per token, tokens per GPU-busy second,
GPU-hours per 1M tokens) and Figure 1 (server GPU time relative to Cloud+MTP against delivery
rate relative to the SLM alone).

check writes what the tables are made of to costs_inputs.json: each configuration's requests and
rounds (rows, context, committed tokens, passes, bytes), the server sweep, the phone's per-pass
figures and the network, each with its source. `hyco-convert project` reads that file back and
recomputes the same tables with other phone timings, network settings or a server profile
(hyco/runtime/server_profile.py), without running a model, and shows the check's own figures
beside the projected ones. The arithmetic is hyco/runtime/timing.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyco.base.errors import HycoError
from hyco.runtime.configs import DecodeConfig
from hyco.runtime.decode import DecodeLog
from hyco.runtime.phone_timing import PhoneTimes
from hyco.runtime.server_timing import CPU_LABEL, ServerTimes
from hyco.runtime.timing import (
    NETWORK_NOTE,
    VERDICT_BYTES,
    Link,
    Request,
    Round,
    Times,
    delta_g,
    figures,
    slm_alone,
)

REFERENCE = "cloud-mtp"  # Table 2's Delta-g is against exact Cloud+MTP
# without it (a check through the token bridge, whose verifier may have no head): the verifier alone
FALLBACK_REFERENCE = "verifier-alone"
ALONE = "slm-alone"  # Figure 1's delivery reference
INPUTS = "costs_inputs.json"


def requests_of(logs: list[DecodeLog], cfg: DecodeConfig) -> list[dict[str, Any]]:
    """Each prompt's rounds as the timing model reads them: [rows, context, committed, slm passes,
    MTP steps on the phone, head steps on the server, PD passes, bytes up, bytes down]."""
    phone_mtp = cfg.mtp_depth if cfg.mtp_depth and not cfg.mtp_on_server else 0
    head = cfg.mtp_depth if cfg.mtp_on_server else 0
    out = []
    for log in logs:
        if not log.verified:  # the SLM alone: prompt and output tokens are all the model needs
            out.append({"prompt_tokens": log.prompt_tokens, "output_tokens": len(log.tokens), "rounds": []})
            continue
        rounds, context = [], log.prompt_tokens + 1  # the first reply's token is the first root
        for i, r in enumerate(log.rounds):
            down = VERDICT_BYTES + (log.wire_per_round[i] + log.wire_kv[i] if i < len(log.wire_per_round) else 0)
            rounds.append([r.tree_nodes + 1, context - 1, r.committed, cfg.slm_passes, phone_mtp, head, cfg.pd_passes,
                           r.tree_bytes, down])
            context += r.committed
        out.append({"prompt_tokens": log.prompt_tokens, "first_reply_bytes": log.first_reply_bytes,
                    "output_tokens": len(log.tokens), "rounds": rounds})
    return out


def costs_inputs(all_logs: dict[str, list[DecodeLog]], configs: list[DecodeConfig], server: ServerTimes,
                 phone: PhoneTimes, link: Link, network_name: str, max_prompt: int) -> dict[str, Any]:
    return {"configs": {c.name: {"label": c.label, "rule": rule(c), "alone": c.alone,
                                 "requests": requests_of(all_logs[c.name], c)} for c in configs},
            "server": server.to_json(), "phone": {"ms": phone.ms, "host_ms": phone.host_ms, "sources": phone.sources,
                                                  "prefill_rows": phone.prefill_rows,
                                                  "prefill_graph": phone.prefill_graph,
                                                  "separate_prefill_rows": phone.separate_prefill_rows},
            "network": {"name": network_name, "rtt_ms": link.rtt_ms, "up_mbps": link.up_mbps,
                        "down_mbps": link.down_mbps, "note": NETWORK_NOTE},
            "max_prompt": max_prompt}


def rule(cfg: DecodeConfig) -> str:
    return "none" if cfg.alone else "exact" if cfg.epsilon >= 1.0 else f"eps={cfg.epsilon:g}"


@dataclass
class Setting:
    """The times and link a projection uses, rebuilt from costs_inputs.json (and overrides)."""

    server: ServerTimes
    phone: PhoneTimes
    link: Link
    network: dict[str, Any]
    max_prompt: int
    server_profile: str | None = None  # the profile (name or file) that replaced the check's sweep

    def times(self) -> Times:
        ms = lambda g: self.phone.ms.get(g, math.nan)  # noqa: E731  (a missing phone figure: no tok/s)
        return Times(verify=self.server.verify_ms, prefill=self.server.prefill_ms,
                     head_step=self.server.head_step if self.server.head_step is not None else math.nan,
                     slm_pass=ms("tree"), mtp_step=ms("mtp_step"), host=self.phone.host_ms,
                     slm_prefill=lambda p: self.phone.slm_prefill_ms(p, self.max_prompt))

    def sources(self) -> dict[str, str]:
        server = f"{self.server.source}: {self.server.device}" + (" (cached sweep)" if self.server.cached else "")
        if self.server_profile is not None:
            server = f"server profile {self.server_profile}: {self.server.device}; {self.server.source}"
        return {"server": server, **{f"phone {g}": s for g, s in self.phone.sources.items()},
                "network": f"{self.network['name']}: RTT {self.link.rtt_ms:g} ms, up {self.link.up_mbps:g} / down "
                           f"{self.link.down_mbps:g} Mbit/s ({self.network.get('note', 'set by the user')})"}


def setting_of(inputs: dict[str, Any]) -> Setting:
    phone = inputs["phone"]
    net = inputs["network"]
    return Setting(ServerTimes.from_json(inputs["server"]),
                   PhoneTimes(dict(phone["ms"]), phone["host_ms"], dict(phone["sources"]), phone["prefill_rows"],
                              phone.get("prefill_graph", "prefill"), phone.get("separate_prefill_rows")),
                   Link(net["rtt_ms"], net["up_mbps"], net["down_mbps"]), dict(net), inputs["max_prompt"])


def tables(inputs: dict[str, Any], setting: Setting) -> dict[str, Any]:
    """Per configuration: MAT, g, Delta-g against Cloud+MTP, tok/s, TTFT, draft ms per token, and
    Table 11's columns; the SLM alone has tok/s and draft ms only (no server)."""
    t = setting.times()
    rows: dict[str, dict[str, Any]] = {}
    for name, c in inputs["configs"].items():
        if c["alone"]:
            f = slm_alone([(q["prompt_tokens"], q["output_tokens"]) for q in c["requests"]], t)
            rows[name] = {"label": c["label"], "rule": c["rule"], "mat": 1.0, **_clean(f)}
            continue
        requests = [Request(q["prompt_tokens"], q["first_reply_bytes"],
                            tuple(Round(rows=r[0], context=r[1], committed=r[2], slm_passes=r[3], mtp_steps=r[4],
                                        head_steps=r[5], pd_passes=r[6], up_bytes=r[7], down_bytes=r[8])
                                  for r in q["rounds"]))
                    for q in c["requests"]]
        rounds = sum(len(q.rounds) for q in requests)
        mat = sum(r.committed for q in requests for r in q.rounds) / rounds if rounds else math.nan
        rows[name] = {"label": c["label"], "rule": c["rule"], "mat": mat, **_clean(figures(requests, t, setting.link))}
    reference = rows.get(reference_of(rows), {}).get("g_ms")
    alone = rows.get(ALONE, {}).get("tok_s")
    for row in rows.values():
        if row.get("g_ms") is not None:
            row["delta_g_percent"] = delta_g(row["g_ms"], reference) if reference else None
        row["delivery_vs_slm_alone"] = row["tok_s"] / alone if alone and row.get("tok_s") is not None else None
    prompts = [q["prompt_tokens"] for c in inputs["configs"].values() for q in c["requests"]]
    prefill = setting.phone.prefill_comparison(sum(prompts) / len(prompts), setting.max_prompt) if prompts else None
    return {"rows": rows, "reference": reference_of(rows), "sources": setting.sources(),
            "server_on_cpu": setting.server.source == CPU_LABEL, "slm_prefill": prefill}


def reference_of(rows: dict[str, Any]) -> str:
    return REFERENCE if REFERENCE in rows or FALLBACK_REFERENCE not in rows else FALLBACK_REFERENCE


def _clean(f: dict[str, float]) -> dict[str, float | None]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in f.items()}


def _fmt(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> list[str]:
    rows = result["rows"]
    cpu = " (CPU, not a server GPU)" if result["server_on_cpu"] else ""
    reference = rows.get(result.get("reference", REFERENCE), {}).get("label", "Cloud+MTP")
    md = [f"## Server cost and delivery speed{cpu}", "",
          f"Table 2: Delta-g against exact {reference} (server time per output token, prefill included), MAT, "
          "delivery tok/s:", "", "| config | rule | delta_g_percent | mat | tok_s |", "|---|---|---|---|---|"]
    md += [f"| {n} | {r['rule']} | {_fmt(r.get('delta_g_percent'), 1)} | {_fmt(r['mat'])} | {_fmt(r.get('tok_s'), 1)} |"
           for n, r in rows.items()]
    md += ["", "Table 11: g (ms per output token), tok/s, mobile draft ms per output token, tokens per GPU-busy "
           "second (1000 / g), GPU-hours per 1M tokens (g / 3.6), and TTFT:", "",
           "| config | g_ms | tok_s | draft_ms_per_token | tokens_per_gpu_s | gpu_h_per_1m_tokens | ttft_ms |",
           "|---|---|---|---|---|---|---|"]
    md += [f"| {n} | {_fmt(r.get('g_ms'))} | {_fmt(r.get('tok_s'), 1)} | {_fmt(r.get('draft_ms_per_token'))} | "
           f"{_fmt(r.get('tokens_per_gpu_s'), 1)} | {_fmt(r.get('gpu_h_per_1m_tokens'))} | {_fmt(r.get('ttft_ms'), 0)} |"
           for n, r in rows.items()]
    md += prefill_markdown(result.get("slm_prefill"))
    md += ["", "Sources:", ""] + [f"- {k}: {v}" for k, v in result["sources"].items()]
    md += ["", "Figure 1 (figure1.png): server GPU time relative to Cloud+MTP against delivery rate relative to "
           "the SLM alone. Cloud+MTP's tok/s assumes its tokens streamed to the phone (the paper did not).", ""]
    return md


def prefill_markdown(p: dict[str, Any] | None) -> list[str]:
    """What one copy of the SLM's weights costs: the phone's prefill through the tree graph beside
    the separate prefill graph's. The phone prefills while the server answers the first reply, so
    it delays the first draft only where it outlasts TTFT (tok/s above counts that)."""
    if p is None:
        return []
    ms = lambda v: f"{v:,.0f} ms" if v >= 10 else f"{v:.2f} ms"  # noqa: E731
    separate = "no prefill pass time in the profile or hub report" if p["separate_ms"] is None else \
        f"{ms(p['separate_ms'])} ({p['separate_source']})"
    return ["", f"SLM prefill on the phone, the mean prompt of {p['prompt_tokens']} tokens: this bundle (one copy of "
            f"the SLM's weights, export.slm_graphs tree-only) {p['tree_only_passes']} passes of the tree graph, "
            f"{ms(p['tree_only_ms'])}; a bundle with a separate prefill graph (the weights twice) "
            f"{p['separate_passes']} passes, {separate}."]


MARKERS = "osD^vPX*h<>p"


def figure1(result: dict[str, Any], *, what_if: str | None = None, baseline: dict[str, Any] | None = None):
    """Figure 1 as a matplotlib Figure, not saved: each configuration's server GPU time per token
    relative to the reference against its delivery rate relative to the SLM alone. The corner
    where both are better is shaded and marked "better"; points carry numbers, named in a legend
    beside the axes (names drawn at the points collide where configurations sit close). With a
    `baseline` (a projection's before), the check's own points are hollow, with an arrow to the
    projected ones, and `what_if` goes in the title."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.5, 5.2), layout="constrained")  # no pyplot: nothing global to close
    ax = fig.add_subplot()
    rows, points = result["rows"], _points(result)
    before = _points(baseline) if baseline else {}
    moved = [name for name, xy in points.items() if before.get(name, xy) != xy]
    for i, (name, xy) in enumerate(points.items()):
        marker, color = MARKERS[i % len(MARKERS)], f"C{i % 10}"
        ax.scatter(*xy, s=42, marker=marker, color=color, zorder=3, label=f"{i + 1}  {name} ({rows[name]['label']})")
        if name in moved:
            ax.scatter(*before[name], s=42, marker=marker, facecolors="none", edgecolors=color, zorder=2)
            ax.annotate("", xy, before[name], arrowprops={"arrowstyle": "->", "color": color, "lw": 0.8})
    if moved:
        ax.plot([], [], ls="", marker="o", mfc="none", mec="grey", label="hollow: the check's own figures")
    reference = rows.get(result.get("reference", REFERENCE), {}).get("label", "Cloud+MTP")
    _limits(ax, [*points.values(), *before.values()])
    _shade_better(ax, reference)
    _number_points(ax, points, [before[name] for name in moved])
    ax.set_xlabel("delivery rate relative to the SLM alone (tok/s ratio; 1 = as fast)\nhigher is better \u2192")
    ax.set_ylabel(f"server GPU time per token relative to {reference}\n(g ratio; 1 = as much)  lower is better \u2193")
    cpu = " (server: CPU, not a server GPU)" if result["server_on_cpu"] else ""
    ax.set_title(f"Figure 1: server cost against delivery speed{cpu}" + (f"\nwhat if: {what_if}" if what_if else ""),
                 fontsize=9)
    if points:  # beside the axes, where it covers no point
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
    else:
        ax.text(0.5, 0.5, "no point to place: no SLM-alone run (the delivery reference) or no server reference",
                transform=ax.transAxes, ha="center", va="center", fontsize=8, wrap=True)
    return fig


def plot_figure1(path: Path, result: dict[str, Any], *, what_if: str | None = None,
                 baseline: dict[str, Any] | None = None) -> None:
    # no Software entry (matplotlib's version): the same figure is the same bytes on any machine
    figure1(result, what_if=what_if, baseline=baseline).savefig(path, dpi=120, metadata={"Software": None})


def _points(result: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """(delivery relative to the SLM alone, g relative to the reference) per configuration that has both."""
    rows = result["rows"]
    reference = rows.get(result.get("reference", REFERENCE), {}).get("g_ms")
    return {name: (r["delivery_vs_slm_alone"], r["g_ms"] / reference) for name, r in rows.items()
            if reference and r.get("delivery_vs_slm_alone") is not None and r.get("g_ms") is not None}


def _limits(ax, points: list[tuple[float, float]]) -> None:
    """Both axes span 1 (the references) and every point, with a margin of an eighth of the span
    on each side: the better corner shows, and its last margin holds no point."""
    xs, ys = [1.0, *(x for x, _ in points)], [1.0, *(y for _, y in points)]
    for lo, hi, setter in ((min(xs), max(xs), ax.set_xlim), (min(ys), max(ys), ax.set_ylim)):
        pad = 0.125 * (hi - lo) or 0.1
        setter(lo - pad, hi + pad)


def _shade_better(ax, reference: str) -> None:
    """Faster delivery than the SLM alone (right of x = 1) at less server time than the reference
    (below y = 1): the lower-right corner, shaded, named in the legend, and marked "better" in its
    far corner, inside the margin where no point lies."""
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    ax.fill_between([1.0, x1], y0, 1.0, color="tab:green", alpha=0.08, zorder=0, lw=0,
                    label=f"shaded: better on both, faster than\nthe SLM alone at less server time than {reference}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", zorder=1)
    ax.axvline(1.0, color="grey", lw=0.8, ls="--", zorder=1)
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.text(0.99, 0.015, "better \u2198", transform=ax.transAxes, ha="right", va="bottom", fontsize=8,
            color="darkgreen", gid="better")


# where a point's number may go, in points from the marker: tried in order until one overlaps no
# other number and no other marker
OFFSETS = [(5, 4), (5, -12), (-13, 4), (-13, -12), (5, 14), (5, -22), (-23, 14), (-23, -22)]


def _number_points(ax, points: dict[str, tuple[float, float]], hollow: list[tuple[float, float]]) -> None:
    """Each point's number beside it, clear of the other numbers and markers (the hollow ones
    too); points that coincide (X and X@float) share one label, "8,9"."""
    to_points = 72.0 / ax.figure.dpi
    at = lambda xy: tuple(v * to_points for v in ax.transData.transform(xy))  # noqa: E731
    where = {name: at(xy) for name, xy in points.items()}
    index = {name: i + 1 for i, name in enumerate(points)}
    groups: list[list[str]] = []
    for name in points:
        near = next((g for g in groups if math.dist(where[g[0]], where[name]) < 3.0), None)
        if near:
            near.append(name)
        else:
            groups.append([name])
    placed: list[tuple[float, float, float, float]] = []
    markers = [(x - 4, y - 4, x + 4, y + 4) for x, y in [*where.values(), *map(at, hollow)]]
    for group in groups:
        text, (x, y) = ",".join(str(index[n]) for n in group), where[group[0]]
        boxes = [(x + dx, y + dy, x + dx + 5 * len(text), y + dy + 8) for dx, dy in OFFSETS]
        free = [i for i, box in enumerate(boxes) if not any(_overlap(box, other) for other in placed + markers)]
        choice = free[0] if free else 0
        placed.append(boxes[choice])
        ax.annotate(text, points[group[0]], textcoords="offset points", xytext=OFFSETS[choice], fontsize=8,
                    gid="number")


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


# The what-if figures a user sets, by project's keyword: the flag, the unit, and whether 0 makes sense
# (an RTT of 0 is a LAN, host work of 0 is none; a bandwidth or a pass of 0 ms is not a figure)
OVERRIDES = {"rtt_ms": ("--rtt-ms", "ms", True), "up_mbps": ("--up-mbps", "Mbit/s", False),
             "down_mbps": ("--down-mbps", "Mbit/s", False), "host_ms": ("--host-ms", "ms", True),
             "tree": ("--slm-ms", "ms", False), "mtp_step": ("--mtp-ms", "ms", False),
             "prefill": ("--prefill-ms", "ms", False)}


def require_sensible(**values: float | None) -> None:
    """Refuse, in one line naming the flag, a figure that cannot be: not finite, negative, or 0
    where 0 means nothing could pass (a bandwidth, a pass time). None: not set."""
    for key, value in values.items():
        if value is None:
            continue
        flag, unit, zero_ok = OVERRIDES[key]
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            bound = ">= 0" if zero_ok else "> 0"
            raise HycoError(f"{flag} must be a number {bound} {unit}, but got {value:g}")


def _override_network(setting: Setting, preset: str | None, rtt_ms: float | None, up_mbps: float | None,
                      down_mbps: float | None) -> list[str]:
    """The link with a preset and any figure replaced; the network's name says "custom" wherever a
    figure was set by hand. Returns what changed, "RTT 58 -> 0 ms"."""
    from hyco.runtime.timing import network

    check_name, check_link = setting.network["name"], setting.link
    base = network(preset) if preset is not None else check_link
    given = {"RTT": (rtt_ms, "ms"), "up": (up_mbps, "Mbit/s"), "down": (down_mbps, "Mbit/s")}
    link = Link(*(base_value if value is None else float(value)
                  for base_value, (value, _) in zip((base.rtt_ms, base.up_mbps, base.down_mbps), given.values(),
                                                    strict=True)))
    set_by_hand = [f"{what} {value:g} {unit}" for what, (value, unit) in given.items() if value is not None]
    base_name = preset or check_name
    if set_by_hand:
        setting.network = {"name": f"custom ({base_name} with {', '.join(set_by_hand)})",
                           "note": f"{', '.join(set_by_hand)} set by the user; the rest as {base_name}'s"}
    elif preset is not None:
        setting.network = {"name": preset, "note": NETWORK_NOTE}
    setting.link = link
    changes = [f"network {check_name} -> {preset}"] if preset not in (None, check_name) else []
    for (what, (value, unit)), old, new in zip(given.items(), (check_link.rtt_ms, check_link.up_mbps,
                                                                check_link.down_mbps),
                                               (link.rtt_ms, link.up_mbps, link.down_mbps), strict=True):
        if value is not None or old != new:
            changes.append(f"{what} {old:g} -> {new:g} {unit}")
    return changes


def _override_server(setting: Setting, profile: str | None) -> list[str]:
    from hyco.runtime.server_profile import read_server_profile

    if profile is None:
        return []
    setting.server, setting.server_profile = read_server_profile(profile), str(profile)
    return [f"server profile {profile}"]


PHONE_FIGURES = {"tree": "SLM tree pass", "mtp_step": "MTP step", "prefill": "SLM prefill pass"}


def _override_phone(setting: Setting, profile: str | None, phone_ms: dict[str, float | None],
                    host_ms: float | None) -> list[str]:
    from hyco.runtime.phone_timing import read_profile

    phone, changes = setting.phone, []

    def replace(graph: str, ms: float, source: str) -> None:
        old = phone.ms.get(graph)
        changes.append(f"{PHONE_FIGURES[graph]} {'none' if old is None else f'{old:g}'} -> {ms:g} ms")
        phone.ms[graph], phone.sources[graph] = float(ms), source

    def replace_host(ms: float, source: str) -> None:
        changes.append(f"phone host work {phone.host_ms:g} -> {ms:g} ms a round")
        phone.host_ms, phone.sources["host"] = float(ms), source

    if profile is not None:
        data = read_profile(profile)
        changes.append(f"phone profile {profile}")
        for graph, entry in data["graphs"].items():
            replace(graph, entry["median_ms"], f"device profile of {data.get('device', 'a phone')} ({profile})")
        if "host_ms_per_round" in data:
            replace_host(data["host_ms_per_round"], f"device profile ({profile})")
    for graph, ms in phone_ms.items():
        if ms is not None:
            replace(graph, ms, "set by the user (hyco-convert project)")
    if host_ms is not None:
        replace_host(host_ms, "set by the user (hyco-convert project)")
    return changes


def read_inputs(check_dir: Path) -> dict[str, Any]:
    from hyco.base.loading import read_json

    if Path(check_dir).is_file():
        raise HycoError(f"CHECK_DIR must be a check folder, got a file: {check_dir} (its folder: {Path(check_dir).parent})")
    path = Path(check_dir) / INPUTS
    if not path.is_file():
        raise HycoError(f"{path}: no such file (a check run with check.timing.enabled writes it)")
    return read_json(path, "check's costs inputs")


COMPARED = ("g_ms", "delta_g_percent", "tok_s", "ttft_ms", "draft_ms_per_token")


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per configuration and figure: before, after and the change, in percent of before (Delta-g,
    itself a percent: in percentage points)."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for name, row in after.items():
        out[name] = {}
        for key in COMPARED:
            b, a = before.get(name, {}).get(key), row.get(key)
            entry: dict[str, float | None] = {"before": b, "after": a}
            if key == "delta_g_percent":
                entry["change_points"] = None if a is None or b is None else a - b
            else:
                entry["change_percent"] = None if a is None or not b else 100.0 * (a / b - 1.0)
            out[name][key] = entry
    return out


def what_if_line(what_if: list[str]) -> str:
    return "; ".join(what_if) if what_if else "nothing changed (the check's own figures)"


def headline_config(rows: dict[str, Any]) -> str | None:
    """HyCo's row where there is one, else the first configuration with a Delta-g that is not the reference."""
    if "hyco" in rows:
        return "hyco"
    return next((n for n, r in rows.items() if r.get("delta_g_percent") not in (None, 0.0)), None)


def _arrow(entry: dict[str, float | None], digits: int, unit: str = "", sign: bool = False) -> str:
    """"before -> after": "45.5 -> 60.3"; a unit that goes with each number: "-79.1% -> -80.2%"."""
    form = f"+.{digits}f" if sign else f".{digits}f"
    b, a = (("n/a" if v is None else format(v, form) + unit) for v in (entry["before"], entry["after"]))
    return f"{b} -> {a}"


def headline(result: dict[str, Any]) -> str:
    name = headline_config(result["rows"])
    if name is None:
        return "No configuration with a Delta-g to compare."
    change, label = result["change"][name], result["rows"][name]["label"]
    reference = result["rows"].get(result["reference"], {}).get("label", result["reference"])
    return (f"{label} ({name}): Delta-g {_arrow(change['delta_g_percent'], 1, '%', sign=True)} against {reference}, "
            f"{_arrow(change['tok_s'], 1)} tok/s")


def console_lines(result: dict[str, Any]) -> list[str]:
    """What `hyco-convert project` prints: what changed, the headline, then every configuration before -> after."""
    lines = [f"What if: {what_if_line(result['what_if'])}", headline(result)]
    for name, change in result["change"].items():
        g = change["g_ms"]
        g_change = "" if g["change_percent"] is None else f" ({g['change_percent']:+.1f}%)"
        dg = "" if change["delta_g_percent"]["after"] is None else \
            f", Delta-g {_arrow(change['delta_g_percent'], 1, '%', sign=True)}"
        lines.append(f"{name:18s} g {_arrow(g, 2)} ms{g_change}{dg}, {_arrow(change['tok_s'], 1)} tok/s")
    return lines


def projection_markdown(result: dict[str, Any]) -> list[str]:
    """projection.md: what changed and the headline first, then before and after side by side,
    then the projected Table 2 / Table 11 with each source (and the check's, where it changed)."""
    pct = lambda v: "n/a" if v is None else f"{v:+.1f}"  # noqa: E731
    md = [f"# What if: {what_if_line(result['what_if'])}", "", headline(result), "",
          f"Projected from {result['check']}/{INPUTS}: the rounds the check counted, the times above replaced; "
          "no model ran.", "", "## Before (the check's own figures) and after", "",
          "| config | g_ms before | g_ms after | g change % | delta_g_percent before | delta_g_percent after | "
          "tok_s before | tok_s after | tok_s change % | ttft_ms before | ttft_ms after |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in result["change"].items():
        g, dg, tok, ttft = c["g_ms"], c["delta_g_percent"], c["tok_s"], c["ttft_ms"]
        md.append(f"| {name} | {_fmt(g['before'])} | {_fmt(g['after'])} | {pct(g['change_percent'])} | "
                  f"{pct(dg['before'])} | {pct(dg['after'])} | {_fmt(tok['before'], 1)} | {_fmt(tok['after'], 1)} | "
                  f"{pct(tok['change_percent'])} | {_fmt(ttft['before'], 0)} | {_fmt(ttft['after'], 0)} |")
    before = result["baseline"]["sources"]
    sources = {k: v if before.get(k) in (None, v) else f"{v} (the check's: {before[k]})"
               for k, v in result["sources"].items()}
    return [*md, "", "Figure 1 (figure1.png) shows both: the check's points hollow, an arrow to each projected one.",
            "", "# After: the projected tables", "", *markdown({**result, "sources": sources})]


@dataclass(frozen=True)
class WhatIf:
    """What `project` replaces in the check's inputs (None: the check's own): the network (a named
    preset, then any of its round trip and bandwidths), the phone (a profile, then pass times in
    ms per graph and the host's work per round), the server (a profile)."""

    network_name: str | None = None
    rtt_ms: float | None = None
    up_mbps: float | None = None
    down_mbps: float | None = None
    phone_profile: str | None = None
    phone_ms: dict[str, float | None] = field(default_factory=dict)
    host_ms: float | None = None
    server_profile: str | None = None


def project(check_dir: Path, out: Path, what_if: WhatIf = WhatIf(), *,
            write_server_profile: Path | None = None) -> dict[str, Any]:
    """`hyco-convert project`: check's Table 2 / Table 11 / Figure 1 again from CHECK_DIR's
    costs_inputs.json, with the phone's figures, the network or the server replaced; nothing runs
    a model. The result holds the projection (rows, sources as `tables` gives them), the check's
    own tables (`baseline`), what changed (`what_if`) and each figure before and after (`change`).
    Writes OUT/projection.json, projection.md and figure1.png (through a temp folder), and the
    check's server sweep as a server profile to `write_server_profile` when given."""
    from hyco.base.files import write_json
    from hyco.pipeline.artifacts import atomic_dir

    w = what_if
    require_sensible(rtt_ms=w.rtt_ms, up_mbps=w.up_mbps, down_mbps=w.down_mbps, host_ms=w.host_ms, **w.phone_ms)
    inputs = read_inputs(check_dir)
    baseline = tables(inputs, setting_of(inputs))
    setting = setting_of(inputs)
    what_if = [*_override_network(setting, w.network_name, w.rtt_ms, w.up_mbps, w.down_mbps),
               *_override_server(setting, w.server_profile),
               *_override_phone(setting, w.phone_profile, w.phone_ms, w.host_ms)]
    projected = tables(inputs, setting)
    result = {"check": str(check_dir), "what_if": what_if, **projected, "baseline": baseline,
              "change": compare(baseline["rows"], projected["rows"])}
    with atomic_dir(Path(out)) as tmp:
        write_json(tmp / "projection.json", result)
        (tmp / "projection.md").write_text("\n".join(projection_markdown(result)))
        plot_figure1(tmp / "figure1.png", result, what_if=what_if_line(what_if), baseline=baseline)
    if write_server_profile is not None:
        Path(write_server_profile).parent.mkdir(parents=True, exist_ok=True)
        write_json(Path(write_server_profile), inputs["server"])
    return result
