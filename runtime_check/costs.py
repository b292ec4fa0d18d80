"""Server cost and delivery speed from check's rounds: the paper's Table 2 (Delta-g against
Cloud+MTP, MAT, tok/s), Table 11 (g, tok/s, draft ms per token, tokens per GPU-busy second,
GPU-hours per 1M tokens) and Figure 1 (server GPU time relative to Cloud+MTP against delivery
rate relative to the SLM alone).

check writes what the tables are made of to costs_inputs.json: each configuration's requests and
rounds (rows, context, committed tokens, passes, bytes), the server sweep, the phone's per-pass
figures and the network, each with its source. `hyco-convert project` reads that file back and
recomputes the same tables with other timings or network settings (`project`), without running a
model. The arithmetic is hyco/runtime/timing.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
                                                  "prefill_rows": phone.prefill_rows},
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

    def times(self) -> Times:
        ms = lambda g: self.phone.ms.get(g, math.nan)  # noqa: E731  (a missing phone figure: no tok/s)
        return Times(verify=self.server.verify_ms, prefill=self.server.prefill_ms,
                     head_step=self.server.head_step if self.server.head_step is not None else math.nan,
                     slm_pass=ms("tree"), mtp_step=ms("mtp_step"), host=self.phone.host_ms,
                     slm_prefill=lambda p: self.phone.slm_prefill_ms(p, self.max_prompt))

    def sources(self) -> dict[str, str]:
        server = f"{self.server.source}: {self.server.device}" + (" (cached sweep)" if self.server.cached else "")
        return {"server": server, **{f"phone {g}": s for g, s in self.phone.sources.items()},
                "network": f"{self.network['name']}: RTT {self.link.rtt_ms:g} ms, up {self.link.up_mbps:g} / down "
                           f"{self.link.down_mbps:g} Mbit/s ({self.network.get('note', 'set by the user')})"}


def setting_of(inputs: dict[str, Any]) -> Setting:
    phone = inputs["phone"]
    net = inputs["network"]
    return Setting(ServerTimes.from_json(inputs["server"]),
                   PhoneTimes(dict(phone["ms"]), phone["host_ms"], dict(phone["sources"]), phone["prefill_rows"]),
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
    return {"rows": rows, "reference": reference_of(rows), "sources": setting.sources(),
            "server_on_cpu": setting.server.source == CPU_LABEL}


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
    md += ["", "Sources:", ""] + [f"- {k}: {v}" for k, v in result["sources"].items()]
    md += ["", "Figure 1 (figure1.png): server GPU time relative to Cloud+MTP against delivery rate relative to "
           "the SLM alone. Cloud+MTP's tok/s assumes its tokens streamed to the phone (the paper did not).", ""]
    return md


def plot_figure1(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    reference = rows.get(result.get("reference", REFERENCE), {}).get("g_ms")
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for i, (name, r) in enumerate(rows.items()):
        x, g = r.get("delivery_vs_slm_alone"), r.get("g_ms")
        if x is None or g is None or not reference:
            continue
        ax.scatter(x, g / reference, s=30)
        # labels stepped up and down: configurations that share a point (X and X@float) stay legible
        ax.annotate(name, (x, g / reference), textcoords="offset points", xytext=(4, 4 - 10 * (i % 3)), fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("delivery rate relative to the SLM alone")
    ax.set_ylabel(f"server GPU time per token relative to {result.get('reference', REFERENCE)}")
    cpu = " (server: CPU, not a server GPU)" if result["server_on_cpu"] else ""
    ax.set_title(f"Figure 1{cpu}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def project(check_dir: Path, out: Path, *, network_name: str | None = None, rtt_ms: float | None = None,
            up_mbps: float | None = None, down_mbps: float | None = None, phone_profile: str | None = None,
            phone_ms: dict[str, float] | None = None, host_ms: float | None = None) -> dict[str, Any]:
    """`hyco-convert project`: check's Table 2 / Table 11 / Figure 1 again from CHECK_DIR's
    costs_inputs.json, with the phone's figures or the network replaced; nothing runs a model.
    Writes OUT/projection.json, projection.md and figure1.png (through a temp folder)."""
    from hyco.artifacts import atomic_dir, write_json
    from hyco.errors import HycoError
    from hyco.loading import read_json
    from hyco.runtime.phone_timing import read_profile
    from hyco.runtime.timing import network

    path = Path(check_dir) / INPUTS
    if not path.is_file():
        raise HycoError(f"{path}: no such file (a check run with check.timing.enabled writes it)")
    inputs = read_json(path, "check's costs inputs")
    setting = setting_of(inputs)
    net = setting.network
    if network_name is not None or any(v is not None for v in (rtt_ms, up_mbps, down_mbps)):
        name = network_name or net["name"]
        setting.link = network(name, rtt_ms, up_mbps, down_mbps) if network_name else Link(
            rtt_ms or setting.link.rtt_ms, up_mbps or setting.link.up_mbps, down_mbps or setting.link.down_mbps)
        changed = [f"{k} {v:g}" for k, v in (("RTT ms", rtt_ms), ("up Mbit/s", up_mbps), ("down Mbit/s", down_mbps))
                   if v is not None]
        setting.network = {"name": name, "note": ("the preset" if network_name else "the check's network")
                           + (f", with {', '.join(changed)} set by the user" if changed else "")}
    if phone_profile is not None:
        data = read_profile(phone_profile)
        for g, entry in data["graphs"].items():
            setting.phone.ms[g] = float(entry["median_ms"])
            setting.phone.sources[g] = f"device profile of {data.get('device', 'a phone')} ({phone_profile})"
        if "host_ms_per_round" in data:
            setting.phone.host_ms = float(data["host_ms_per_round"])
            setting.phone.sources["host"] = f"device profile ({phone_profile})"
    for g, ms in (phone_ms or {}).items():
        if ms is not None:
            if not ms > 0:
                raise HycoError(f"the {g} pass time must be > 0 ms, but got {ms}")
            setting.phone.ms[g], setting.phone.sources[g] = float(ms), "set by the user (hyco-convert project)"
    if host_ms is not None:
        setting.phone.host_ms, setting.phone.sources["host"] = float(host_ms), "set by the user (hyco-convert project)"
    result = tables(inputs, setting)
    with atomic_dir(Path(out)) as tmp:
        write_json(tmp / "projection.json", {"check": str(check_dir), **result})
        (tmp / "projection.md").write_text("\n".join(["# Projection from " + str(check_dir), "", *markdown(result)]))
        plot_figure1(tmp / "figure1.png", result)
    return result
