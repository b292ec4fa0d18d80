"""Server cost and delivery speed (issue 39): the server sweep's lookups and cache, the phone's
sources, check's rounds as the timing model reads them, and `hyco-convert project` against
check's own tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hyco.runtime_check.costs import REFERENCE, WhatIf, costs_inputs, project, requests_of, setting_of, tables

from hyco.base.errors import HycoError
from hyco.runtime.configs import decode_config
from hyco.runtime.decode import DecodeLog, RoundLog
from hyco.runtime.phone_timing import PhoneTimes, phone_times
from hyco.runtime.server_timing import CPU_LABEL, ServerTimes
from hyco.runtime.timing import Link, Request, Round, Times, figures, network

SERVER = ServerTimes("cpu test", CPU_LABEL, {(1, 64): 10.0, (1, 256): 14.0, (33, 64): 20.0, (33, 256): 30.0},
                     {32: 5.0, 128: 11.0, 512: 35.0}, head_step=3.0)


def test_server_lookups_pad_rows_up_and_interpolate_contexts():
    assert SERVER.verify_ms(1, 64) == 10.0
    assert SERVER.verify_ms(5, 64) == 20.0  # padded up to the 33-row bucket
    assert SERVER.verify_ms(33, 160) == pytest.approx(25.0)  # halfway between 64 and 256
    assert SERVER.verify_ms(33, 448) == pytest.approx(40.0)  # extrapolated from the last two
    assert SERVER.verify_ms(66, 64) == pytest.approx(40.0)  # beyond the largest bucket: scaled by rows
    a, b = SERVER.prefill_line()
    assert b == pytest.approx(0.0625) and a == pytest.approx(3.0)  # the exact line through all three
    assert ServerTimes.from_json(json.loads(json.dumps(SERVER.to_json()))) == SERVER


def log(prompt: int, rounds: list[tuple[int, int]], wire: list[int]) -> DecodeLog:
    """A decode log of rounds (tree nodes without the root, committed tokens)."""
    out = DecodeLog(prompt, tokens=[5] * (1 + sum(c for _, c in rounds)), first_reply_bytes=4000)
    for nodes, committed in rounds:
        out.rounds.append(RoundLog(["chain"] * (committed - 1), 0, 4, 7, 0, 0, 0.0, nodes, 100 + nodes, 0.01))
    out.wire_per_round, out.wire_kv, out.wire_kv_rows = wire, [10 * w for w in wire], [1] * len(wire)
    return out


def test_check_rounds_become_the_timing_models_rounds():
    """Rows are the tree's nodes plus the root; the context grows by what each round committed; a
    round's reply carries the verdict and its hand-off (the last round, ended by EOS, none)."""
    from hyco.config.recipe import CheckConfig

    hyco, cloud = decode_config("hyco", CheckConfig()), decode_config("cloud-mtp", CheckConfig())
    (q,) = requests_of([log(50, [(32, 5), (20, 3)], [200])], hyco)
    assert q["rounds"] == [[33, 50, 5, 1, 4, 0, 0, 132, 8 + 200 + 2000], [21, 55, 3, 1, 4, 0, 0, 120, 8]]
    (c,) = requests_of([log(50, [(4, 2)], [])], cloud)
    assert c["rounds"][0][3:7] == [0, 0, 4, 0]  # Cloud+MTP: the K head steps are the server's


def inputs_for(tmp_path: Path) -> dict:
    from hyco.config.recipe import CheckConfig

    configs = [decode_config(n, CheckConfig()) for n in ("hyco", "cloud-mtp", "slm-alone")]
    logs = {"hyco": [log(50, [(32, 5), (32, 4)], [200, 200]), log(80, [(32, 3)], [150])],
            "cloud-mtp": [log(50, [(4, 3), (4, 2), (4, 3)], []), log(80, [(4, 3)], [])],
            "slm-alone": [DecodeLog(50, tokens=[5] * 9, verified=False), DecodeLog(80, tokens=[5] * 4, verified=False)]}
    phone = PhoneTimes({"tree": 36.8, "mtp_step": 5.0, "prefill": 90.0}, 1.0, {"tree": "test", "mtp_step": "test",
                                                                              "prefill": "test", "host": "test"}, 16)
    inputs = costs_inputs(logs, configs, SERVER, phone, network("lte-ca"), "lte-ca", max_prompt=64)
    (tmp_path / "costs_inputs.json").write_text(json.dumps(inputs))
    return inputs


def test_tables_are_the_timing_models_figures_by_hand(tmp_path):
    inputs = inputs_for(tmp_path)
    result = tables(inputs, setting_of(inputs))
    rows = result["rows"]
    t = Times(verify=SERVER.verify_ms, prefill=SERVER.prefill_ms, head_step=3.0, slm_pass=36.8, mtp_step=5.0,
              host=1.0, slm_prefill=lambda p: -(-min(p, 64) // 16) * 90.0)
    link = Link(58.0, 20.0, 100.0)
    by_hand = figures([Request(50, 4000, (Round(33, 5, 1, 4, 0, 0, 132, 2208, 50), Round(33, 4, 1, 4, 0, 0, 132, 2208, 55))),
                       Request(80, 4000, (Round(33, 3, 1, 4, 0, 0, 132, 1658, 80),))], t, link)
    assert rows["hyco"]["g_ms"] == pytest.approx(by_hand["g_ms"])
    assert rows["hyco"]["tok_s"] == pytest.approx(by_hand["tok_s"])
    assert rows["hyco"]["mat"] == pytest.approx(12 / 3)
    assert rows[REFERENCE]["delta_g_percent"] == 0.0
    assert rows["hyco"]["delta_g_percent"] == pytest.approx(100 * (rows["hyco"]["g_ms"] / rows[REFERENCE]["g_ms"] - 1))
    # the SLM alone: its prefill (at most max_prompt 64 tokens: 4 chunks of 16), then one pass and host work a token
    wall = (4 * 90 + 9 * 37.8) + (4 * 90 + 4 * 37.8)
    assert rows["slm-alone"]["tok_s"] == pytest.approx(1e3 * 13 / wall)
    assert rows["hyco"]["delivery_vs_slm_alone"] == pytest.approx(rows["hyco"]["tok_s"] / rows["slm-alone"]["tok_s"])
    assert result["server_on_cpu"] and "CPU, not a server GPU" in result["sources"]["server"]


def test_project_recomputes_the_same_tables_and_answers_what_if(tmp_path):
    """No override: the same tables as from the inputs. A faster phone pass changes delivery, not
    g; a longer RTT lowers tok/s only; each changed figure's source says who set it."""
    inputs = inputs_for(tmp_path)
    same = project(tmp_path, tmp_path / "p0")
    assert same["rows"] == tables(inputs, setting_of(inputs))["rows"]
    assert {p.name for p in (tmp_path / "p0").iterdir()} == {"projection.json", "projection.md", "figure1.png"}
    faster = project(tmp_path, tmp_path / "p1", WhatIf(phone_ms={"tree": 20.0}))
    assert faster["rows"]["hyco"]["g_ms"] == same["rows"]["hyco"]["g_ms"]
    assert faster["rows"]["hyco"]["tok_s"] > same["rows"]["hyco"]["tok_s"]
    assert faster["sources"]["phone tree"] == "set by the user (hyco-convert project)"
    slower = project(tmp_path, tmp_path / "p2", WhatIf(rtt_ms=120.0))
    assert slower["rows"]["hyco"]["tok_s"] < same["rows"]["hyco"]["tok_s"]
    assert slower["rows"]["hyco"]["g_ms"] == same["rows"]["hyco"]["g_ms"]
    assert "RTT 120 ms" in slower["sources"]["network"]
    with pytest.raises(HycoError, match="costs_inputs.json: no such file"):
        project(tmp_path / "nowhere", tmp_path / "p3")


def test_phone_figures_come_from_the_first_source_that_has_them(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "bundle.json").write_text(json.dumps({"graphs": {"tree": {"weight_bytes": 6_000_000},
                                                               "prefill": {"weight_bytes": 6_000_000},
                                                               "mtp_step": {"weight_bytes": 600_000}}}))
    floor = phone_times(bundle, profile=None, hub_json=None, bandwidth_gbs=60.0, prefill_rows=16)
    assert floor.ms == pytest.approx({"tree": 0.1, "prefill": 0.1, "mtp_step": 0.01})
    assert "a floor, not a measurement" in floor.sources["tree"]
    hub = tmp_path / "hub.json"
    hub.write_text(json.dumps({"device": "Phone X", "jobs": [{"role": "tree", "estimated_inference_time_us": 41000}]}))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"device": "Phone Y", "graphs": {"mtp_step": {"median_ms": 3.0}}, "host_ms_per_round": 2}))
    mixed = phone_times(bundle, profile=profile, hub_json=hub, bandwidth_gbs=60.0, prefill_rows=16)
    assert mixed.ms == pytest.approx({"tree": 41.0, "mtp_step": 3.0, "prefill": 0.1})
    assert "AI Hub profile on Phone X" in mixed.sources["tree"] and "Phone Y" in mixed.sources["mtp_step"]
    assert mixed.host_ms == 2.0 and mixed.slm_prefill_ms(100, 64) == pytest.approx(4 * 0.1)
    paper = phone_times(None, profile="paper-sm8850", hub_json=None, bandwidth_gbs=60.0, prefill_rows=16)
    assert paper.ms == {"tree": 36.8, "mtp_step": 5.05} and "not measured here" in paper.sources["tree"]


@pytest.mark.parametrize("content, match", [
    ({"graphs": {}}, "a phone profile needs a 'graphs' object"),
    ({"graphs": {"lm_head": {"median_ms": 3}}}, r"graphs.lm_head: unknown graph"),
    ({"graphs": {"tree": {"median_ms": -1}}}, r"graphs.tree.median_ms must be a positive number"),
    ({"graphs": {"tree": {"p50": 3}}}, r"graphs.tree.median_ms must be"),
    ({"graphs": {"tree": {"median_ms": 3}}, "host_ms_per_round": "x"}, "host_ms_per_round must be a number"),
    # json.loads reads NaN and Infinity, which slip past `> 0` / `< 0`; a bool is an int to isinstance
    ({"graphs": {"tree": {"median_ms": float("inf")}}}, r"graphs.tree.median_ms must be a positive number"),
    ({"graphs": {"tree": {"median_ms": True}}}, r"graphs.tree.median_ms must be a positive number"),
    ({"graphs": {"tree": {"median_ms": 3}}, "host_ms_per_round": float("nan")}, "host_ms_per_round must be a number"),
])
def test_a_bad_phone_profile_is_named(tmp_path, content, match):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(content))
    with pytest.raises(HycoError, match=f"{path}: {match}"):
        phone_times(None, profile=path, hub_json=None, bandwidth_gbs=60.0, prefill_rows=16)


def test_network_presets_and_overrides():
    assert network("lte-ca") == Link(58.0, 20.0, 100.0)
    assert network("5g-nsa", rtt_ms=30.0).rtt_ms == 30.0
    with pytest.raises(HycoError, match="network must be one of"):
        network("wifi")


def test_the_sweep_is_cached_per_verifier_and_device(tiny_family, tmp_path, monkeypatch):
    """The second call reads the first's sweep; another device name measures anew. The sweep on
    the CPU: each figure positive, labelled CPU, and a 33-row pass not faster than a 1-row pass at
    the same context by more than the two figures' measured spread (noise on a shared CPU)."""
    from hyco.runtime import server_timing
    from hyco.runtime.inputs import load_model

    monkeypatch.setenv("HYCO_CACHE", str(tmp_path))
    verifier = load_model(tiny_family["verifier"], "verifier")
    grid = server_timing.Grid(rows=(1, 33), contexts=(16, 64), prefill=(16, 48), head_steps=2, repeats=5, warmup=1)
    args = dict(vocab=verifier.config.get_text_config().vocab_size, model_dirs=[tiny_family["verifier"]], dtype="fp32")
    first = server_timing.server_times(verifier, None, grid, **args)
    assert not first.cached and first.source == CPU_LABEL and first.head_step is None
    assert all(ms > 0 for ms in [*first.verify.values(), *first.prefill.values()])
    for context in grid.contexts:
        noise = first.spread[f"verify 1x{context}"] + first.spread[f"verify 33x{context}"]
        assert first.verify[(33, context)] >= first.verify[(1, context)] * (1 - noise) * 0.9
    monkeypatch.setattr(server_timing, "measure", lambda *a, **k: pytest.fail("measured again"))
    again = server_timing.server_times(verifier, None, grid, **args)
    assert again.cached and again.verify == first.verify
    monkeypatch.setattr(server_timing, "device_name", lambda device: "cuda:0 another GPU")
    with pytest.raises(pytest.fail.Exception, match="measured again"):
        server_timing.server_times(verifier, None, grid, **args)


def test_the_main_jobs_check_shows_table2_table11_figure1_and_project_agrees(ladder, tmp_path):
    """The ladder's check (the tiny recipe's settings, three configurations): Table 2 and Table 11
    in summary.md with every input's source, figure1.png drawn, and `project` on its folder gives
    the same rows."""
    check = ladder / "check"
    report = json.loads((check / "report.json").read_text())
    rows = report["costs"]["rows"]
    assert set(rows) == {"hyco", "hyco-exact", "cloud-mtp"}
    assert rows["cloud-mtp"]["delta_g_percent"] == 0.0 and rows["hyco"]["g_ms"] > 0
    assert rows["hyco"]["mat"] == pytest.approx(report["configs"]["hyco"]["mat"])
    sources = report["costs"]["sources"]
    assert sources["server"].startswith(CPU_LABEL) and "paper" in sources["phone tree"] and "lte-ca" in sources["network"]
    summary = (check / "summary.md").read_text()
    assert "Table 2: Delta-g" in summary and "Table 11: g" in summary and "(CPU, not a server GPU)" in summary
    assert (check / "figure1.png").stat().st_size > 10_000
    assert project(check, tmp_path / "projection")["rows"] == rows


def test_the_project_command(tmp_path, capsys):
    """`hyco-convert project` as a user types it: the rows printed and the files written; a folder
    without check's inputs is one line and exit 2."""
    from hyco.pipeline.cli import main

    inputs_for(tmp_path)
    assert main(["project", str(tmp_path), "--out", str(tmp_path / "what-if"), "--slm-ms", "20", "--rtt-ms", "60"]) == 0
    out = capsys.readouterr().out
    assert "hyco" in out and "tok/s" in out and "wrote" in out
    written = json.loads((tmp_path / "what-if" / "projection.json").read_text())
    assert written["sources"]["phone tree"] == "set by the user (hyco-convert project)"
    assert main(["project", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "costs_inputs.json: no such file" in err
