"""hyco/runtime/timing.py: the timing model's arithmetic on hand-computed rounds (PD and the first
reply included), and Table 11's identities and Table 2's Delta-g on the paper's own numbers."""

from __future__ import annotations

import pytest

from hyco.runtime.timing import (
    Link,
    Request,
    Round,
    Times,
    delta_g,
    figures,
    round_wall_ms,
    server_ms,
    slm_alone,
    table11,
)

T = Times(verify=lambda rows, context: {33: 20.0, 5: 12.0}[rows], head_step=3.0, prefill=lambda n: 0.05 * n,
          slm_pass=25.0, mtp_step=4.0, host=2.0, slm_prefill=lambda n: 300.0)
LINK = Link(rtt_ms=50.0, up_mbps=10.0, down_mbps=50.0)
HYCO = Round(rows=33, committed=5, slm_passes=1, mtp_steps=4, up_bytes=165, down_bytes=9000)


def test_a_round_by_hand():
    # phone 25 + 4 x 4 + 2 = 43; link 50 + 8 x 165 / 10e3 + 8 x 9000 / 50e3 = 51.572; server 20
    assert round_wall_ms(HYCO, T, LINK) == pytest.approx(43 + 51.572 + 20)
    cloud = Round(rows=5, committed=3, head_steps=4)  # Cloud+MTP: the K head steps are the server's
    assert server_ms(cloud, T) == pytest.approx(12 + 4 * 3)


def test_proactive_drafting_overlaps_the_reply_until_it_is_the_longer():
    pd = Round(rows=33, committed=4, slm_passes=4, pd_passes=2, up_bytes=165, down_bytes=9000)
    # phone 4 x 25 + 2 = 102; in flight 51.572 + 20 = 71.572 > 2 x 25: PD is hidden
    assert round_wall_ms(pd, T, LINK) == pytest.approx(102 + 71.572)
    longer = Round(rows=33, committed=4, slm_passes=4, pd_passes=4, up_bytes=165, down_bytes=9000)
    assert round_wall_ms(longer, T, LINK) == pytest.approx(102 + 100)  # 4 x 25 outlasts the reply


def test_a_request_gives_g_tok_s_and_ttft_by_hand():
    q = Request(prompt_tokens=100, first_reply_bytes=4000, rounds=(HYCO, HYCO))
    f = figures([q], T, LINK)
    tokens = 1 + 5 + 5  # the first reply's token, then each round's committed tokens
    assert f["g_ms"] == pytest.approx((100 * 0.05 + 2 * 20) / tokens)  # prefill included
    ttft = 50 + 8 * 400 / 10e3 + 8 * 4000 / 50e3 + 100 * 0.05
    assert f["ttft_ms"] == pytest.approx(ttft)
    wall = max(ttft, 300.0) + 2 * (43 + 51.572 + 20)  # the phone's SLM prefill outlasts the first reply
    assert f["tok_s"] == pytest.approx(1e3 * tokens / wall)
    assert f["draft_ms_per_token"] == pytest.approx(2 * 43 / tokens)
    assert slm_alone([(100, 10)], T) == pytest.approx({"tok_s": 1e4 / (300 + 10 * 27), "draft_ms_per_token": 27.0})


# Table 11 (SB-480): g in ms per token, tokens per GPU-busy second, GPU-hours per 1M tokens
TABLE11 = {"cloud-mtp": (7.81, 128.1, 2.17), "specedge": (6.20, 161.3, 1.72), "specedge-pd": (5.94, 168.4, 1.65),
           "specedge-eps": (5.50, 181.9, 1.53), "hyco": (4.80, 208.5, 1.33)}
TABLE2_DELTA_G = {"cloud-mtp": 0.0, "specedge": -20.6, "specedge-pd": -23.9, "specedge-eps": -29.6, "hyco": -38.6}


@pytest.mark.parametrize("name", list(TABLE11))
def test_table11_identities_on_the_papers_numbers(name):
    """1000 / g and g / 3.6 against the table, within the rounding of its g (two decimals: the
    table averages each run's own figures, so HyCo's 208.5 is 1000 / 4.796)."""
    g, per_s, gpu_h = TABLE11[name]
    lo, hi = table11(g + 0.005), table11(g - 0.005)
    assert lo["tokens_per_gpu_s"] - 0.05 <= per_s <= hi["tokens_per_gpu_s"] + 0.05
    assert round(table11(g)["gpu_h_per_1m_tokens"], 2) == pytest.approx(gpu_h, abs=0.01)


@pytest.mark.parametrize("name", list(TABLE2_DELTA_G))
def test_delta_g_from_table11_gives_table2(name):
    """Table 2's Delta-g from Table 11's rounded g: within the rounding (HyCo: -38.5 from the
    rounded 4.80 and 7.81, -38.6 in the table)."""
    g, ref = TABLE11[name][0], TABLE11["cloud-mtp"][0]
    extremes = [delta_g(g + a, ref + b) for a in (-0.005, 0.005) for b in (-0.005, 0.005)]
    assert min(extremes) - 0.05 <= TABLE2_DELTA_G[name] <= max(extremes) + 0.05
    assert round(delta_g(4.80, 7.81), 1) == -38.5
