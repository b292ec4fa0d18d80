"""The timing model (issue 39's first part): server GPU time per output token (g), delivery speed and
time to first token, from what check counts per round and per-pass times, so a reader can hold it
to the paper's definitions.

"g is the total GPU time including prefill divided by output tokens; for decoding, server time per
round divided by MAT." Per request of prompt length P and rounds r:
- server, round r: T_verify(rows_r) + K T_head where the head runs on the server (Cloud+MTP,
  hyco-server-head); the request adds T_prefill(P) once (the first reply);
- phone, round r: its SLM passes x T_slm + its MTP steps x T_mtp + host ms;
- link, round r: RTT + the tree message up + the hand-off (and its K/V rows) down, bytes over
  each direction's bandwidth;
- a round's wall time: phone + link + server. With proactive drafting (specedge-pd) the phone
  drafts pd_passes x T_slm from the moment the tree leaves, so the next round starts when both the
  reply is back and that work is done: phone + max(link + server, pd_passes x T_slm);
- TTFT: the prompt up, T_prefill(P), the first reply down, after one RTT; the phone prefills its
  SLM meanwhile, and its first draft waits for whichever ends last;
- delivery tok/s: output tokens over TTFT (or the SLM's own prefill) plus every round's wall time.
The SLM alone (slm-alone) has no server and no link: its prefill, then one pass and host work a
token. Table 11's identities: tokens per GPU-busy second = 1000 / g, GPU-hours per 1M tokens =
g / 3.6 (g in ms).

Where the times come from: the server's sweep (hyco/runtime/server_timing.py), the phone's
profile, hub report or weight floor (hyco/runtime/phone_timing.py), the network preset or the
user's RTT and bandwidths (`NETWORKS`); check's report and `hyco-convert project` name each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Link:
    rtt_ms: float
    up_mbps: float
    down_mbps: float

    def ms(self, up_bytes: int, down_bytes: int) -> float:
        """One exchange: a round trip plus each direction's bytes at its bandwidth (Mbit/s)."""
        return self.rtt_ms + 8 * up_bytes / (self.up_mbps * 1e3) + 8 * down_bytes / (self.down_mbps * 1e3)


# The paper's per-round "network and serialization" (40-58 ms on SB, appendix: a recorded trace,
# not a link RTT measurement), its upper end for LTE-CA, its lower for 5G NSA, as the RTT. The
# bandwidths are not in the paper: typical commercial figures (Mbit/s up / down), stated as
# assumptions wherever shown; at these a 30 KB round adds under 3 ms.
NETWORKS = {"lte-ca": (58.0, 20.0, 100.0), "5g-nsa": (40.0, 40.0, 300.0)}
NETWORK_NOTE = ("RTT: the paper's per-round network and serialization time (40-58 ms, LTE-CA / 5G NSA); "
                "bandwidths assumed, not from the paper")


def network(name: str, rtt_ms: float | None = None, up_mbps: float | None = None,
            down_mbps: float | None = None) -> Link:
    """A preset, with any of its three figures replaced by the user's."""
    if name not in NETWORKS:
        from hyco.base.errors import HycoError

        raise HycoError(f"network must be one of {sorted(NETWORKS)}, but got {name!r}")
    rtt, up, down = NETWORKS[name]
    return Link(rtt if rtt_ms is None else rtt_ms, up if up_mbps is None else up_mbps,
                down if down_mbps is None else down_mbps)


VERDICT_BYTES = 8  # the reply's verdict: accepted path length and the bonus token, beside any hand-off


@dataclass(frozen=True)
class Round:
    """What check counts in one round (`decode.RoundLog` and the wire counts)."""

    rows: int  # tree rows the verifier runs (root included)
    committed: int  # tokens the round adds to the text
    slm_passes: int = 0  # on the phone
    mtp_steps: int = 0  # on the phone
    head_steps: int = 0  # on the server (the head there)
    pd_passes: int = 0  # proactive SLM passes while the reply is in flight
    up_bytes: int = 0  # the tree message
    down_bytes: int = 0  # the verdict, the hand-off and its K/V rows
    context: int = 0  # tokens before the round's root: what the verifier's pass attends to


def _zero(*_: int) -> float:
    return 0.0


@dataclass(frozen=True)
class Times:
    """Milliseconds. `verify(rows, context)`, `prefill(prompt_tokens)` on the server;
    `slm_prefill(prompt_tokens)` the phone's SLM prefill of one prompt."""

    verify: Callable[[int, int], float]
    prefill: Callable[[int], float] = _zero
    head_step: float = 0.0
    slm_pass: float = 0.0
    mtp_step: float = 0.0
    host: float = 0.0
    slm_prefill: Callable[[int], float] = _zero
    sources: dict[str, str] = field(default_factory=dict)


def _times(count: int, ms: float) -> float:
    return count * ms if count else 0.0  # no steps cost nothing, also where the step has no figure (NaN)


def server_ms(r: Round, t: Times) -> float:
    return t.verify(r.rows, r.context) + _times(r.head_steps, t.head_step)


def phone_ms(r: Round, t: Times) -> float:
    """The phone's drafting; host work (LUTs, rings, masks) only in a round it drafts."""
    drafting = r.slm_passes or r.mtp_steps
    return _times(r.slm_passes, t.slm_pass) + _times(r.mtp_steps, t.mtp_step) + (t.host if drafting else 0.0)


def round_wall_ms(r: Round, t: Times, link: Link) -> float:
    in_flight = link.ms(r.up_bytes, r.down_bytes) + server_ms(r, t)
    return phone_ms(r, t) + max(in_flight, r.pd_passes * t.slm_pass)


def ttft_ms(prompt_tokens: int, first_reply_bytes: int, t: Times, link: Link) -> float:
    """The prompt up (int32 ids), the server's prefill, the first reply down."""
    return link.ms(4 * prompt_tokens, first_reply_bytes) + t.prefill(prompt_tokens)


@dataclass(frozen=True)
class Request:
    prompt_tokens: int
    first_reply_bytes: int
    rounds: tuple[Round, ...]

    @property
    def output_tokens(self) -> int:
        # the verifier's first token comes with the first reply; every round adds its committed tokens
        return 1 + sum(r.committed for r in self.rounds)


def figures(requests: list[Request], t: Times, link: Link) -> dict[str, float]:
    """g (server ms per output token, prefill included), delivery tok/s, mean TTFT, and Table 11's
    derived columns, over the requests together."""
    tokens = sum(q.output_tokens for q in requests)
    server = sum(t.prefill(q.prompt_tokens) + sum(server_ms(r, t) for r in q.rounds) for q in requests)
    ttfts = [ttft_ms(q.prompt_tokens, q.first_reply_bytes, t, link) for q in requests]
    wall = sum(max(ttft, t.slm_prefill(q.prompt_tokens)) + sum(round_wall_ms(r, t, link) for r in q.rounds)
               for q, ttft in zip(requests, ttfts, strict=True))
    g = server / tokens
    return {"g_ms": g, "tok_s": 1e3 * tokens / wall, "ttft_ms": sum(ttfts) / len(ttfts),
            "draft_ms_per_token": sum(phone_ms(r, t) for q in requests for r in q.rounds) / tokens,
            **table11(g)}


def slm_alone(requests: list[tuple[int, int]], t: Times) -> dict[str, float]:
    """The SLM on the phone by itself, per (prompt tokens, output tokens): its prefill, then one
    pass and host work a token."""
    tokens = sum(n for _, n in requests)
    wall = sum(t.slm_prefill(p) + n * (t.slm_pass + t.host) for p, n in requests)
    return {"tok_s": 1e3 * tokens / wall, "draft_ms_per_token": t.slm_pass + t.host}


def table11(g_ms: float) -> dict[str, float]:
    return {"tokens_per_gpu_s": 1e3 / g_ms, "gpu_h_per_1m_tokens": g_ms / 3.6}


def delta_g(g_ms: float, reference_ms: float) -> float:
    """Percent change of g against the reference configuration's (Cloud+MTP in Table 2)."""
    return 100.0 * (g_ms / reference_ms - 1.0)
