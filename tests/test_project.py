"""`hyco-convert project` answers what it is asked: 0 is a figure (an RTT of 0 ms), a figure that
cannot be is refused naming its flag, the check's own figures stand beside the projected ones, a
server profile (the paper's, derived from its published figures, or a check's own sweep) replaces
the server's times, Figure 1 says what changed and which way is better, and a reader that stops
reading (`| head -1`) ends nothing with a traceback."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hyco.runtime_check.costs import WhatIf, figure1, project, setting_of, tables
from test_costs import SERVER, inputs_for

from hyco.base.errors import HycoError
from hyco.runtime.server_profile import PAPER_PROFILE, read_server_profile

ROOT = Path(__file__).resolve().parents[1]


def test_an_rtt_of_0_is_a_value_labelled_as_the_users(tmp_path):
    """RTT 0 (a LAN) replaces the check's 58 ms: every configuration delivers faster, g stays, and
    the network is named custom, not the preset it no longer is. Host work of 0 is none."""
    inputs_for(tmp_path)
    result = project(tmp_path, tmp_path / "p", WhatIf(rtt_ms=0.0))
    for name, row in result["rows"].items():
        if not row["label"] == "SLM alone":
            assert row["tok_s"] > result["baseline"]["rows"][name]["tok_s"], name
            assert row["g_ms"] == result["baseline"]["rows"][name]["g_ms"], name
    assert result["what_if"] == ["RTT 58 -> 0 ms"]
    assert result["sources"]["network"].startswith("custom (lte-ca with RTT 0 ms): RTT 0 ms, up 20 / down 100 Mbit/s")
    assert result["baseline"]["sources"]["network"].startswith("lte-ca: RTT 58 ms")
    no_host = project(tmp_path, tmp_path / "h", WhatIf(host_ms=0.0))  # the inputs' host work is 1 ms a round
    assert no_host["rows"]["hyco"]["tok_s"] > no_host["baseline"]["rows"]["hyco"]["tok_s"]
    assert no_host["sources"]["phone host"] == "set by the user (hyco-convert project)"


def test_a_preset_with_a_figure_replaced_is_custom_and_a_plain_preset_keeps_its_name(tmp_path):
    inputs_for(tmp_path)
    preset = project(tmp_path, tmp_path / "a", WhatIf(network_name="5g-nsa"))
    assert preset["sources"]["network"].startswith("5g-nsa: RTT 40 ms, up 40 / down 300 Mbit/s")
    assert preset["what_if"] == ["network lte-ca -> 5g-nsa", "RTT 58 -> 40 ms", "up 20 -> 40 Mbit/s",
                                 "down 100 -> 300 Mbit/s"]
    custom = project(tmp_path, tmp_path / "b", WhatIf(network_name="5g-nsa", up_mbps=5.0))
    assert custom["sources"]["network"].startswith("custom (5g-nsa with up 5 Mbit/s): RTT 40 ms, up 5 / down 300")


@pytest.mark.parametrize("flags, message", [
    (["--rtt-ms", "-1"], "--rtt-ms must be a number >= 0 ms, but got -1"),
    (["--rtt-ms", "inf"], "--rtt-ms must be a number >= 0 ms, but got inf"),
    (["--up-mbps", "0"], "--up-mbps must be a number > 0 Mbit/s, but got 0"),
    (["--down-mbps", "nan"], "--down-mbps must be a number > 0 Mbit/s, but got nan"),
    (["--slm-ms", "0"], "--slm-ms must be a number > 0 ms, but got 0"),
    (["--host-ms", "-0.5"], "--host-ms must be a number >= 0 ms, but got -0.5"),
])
def test_a_figure_that_cannot_be_is_one_line_naming_the_flag(tmp_path, capsys, flags, message):
    from hyco.pipeline.cli import main

    inputs_for(tmp_path)
    assert main(["project", str(tmp_path), "--out", str(tmp_path / "p"), *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"hyco-convert project: error: {message}\n"
    assert not (tmp_path / "p").exists()


def test_before_and_after_stand_side_by_side(tmp_path, capsys):
    """The "before" column is the check's own figures, as check computed them from the same
    inputs; projection.md opens with what changed and HyCo's answer, before -> after."""
    from hyco.pipeline.cli import main

    inputs = inputs_for(tmp_path)
    assert main(["project", str(tmp_path), "--out", str(tmp_path / "p"), "--rtt-ms", "0"]) == 0
    printed = capsys.readouterr().out.splitlines()
    check = tables(inputs, setting_of(inputs))
    written = json.loads((tmp_path / "p" / "projection.json").read_text())
    assert written["baseline"]["rows"] == json.loads(json.dumps(check["rows"]))
    hyco = written["change"]["hyco"]
    assert hyco["tok_s"]["before"] == pytest.approx(check["rows"]["hyco"]["tok_s"])
    assert hyco["tok_s"]["after"] == pytest.approx(written["rows"]["hyco"]["tok_s"])
    assert hyco["tok_s"]["change_percent"] == pytest.approx(100 * (hyco["tok_s"]["after"] / hyco["tok_s"]["before"] - 1))
    assert hyco["g_ms"]["change_percent"] == 0.0
    assert hyco["delta_g_percent"]["change_points"] == 0.0
    md = (tmp_path / "p" / "projection.md").read_text().splitlines()
    tok = f"{hyco['tok_s']['before']:.1f} -> {hyco['tok_s']['after']:.1f} tok/s"
    dg = f"{hyco['delta_g_percent']['before']:+.1f}% -> {hyco['delta_g_percent']['after']:+.1f}%"
    assert md[0] == "# What if: RTT 58 -> 0 ms"
    assert md[2] == f"HyCo (hyco): Delta-g {dg} against Cloud+MTP, {tok}"
    assert printed[:2] == ["What if: RTT 58 -> 0 ms", md[2]]
    row = next(line for line in md if line.startswith("| hyco |"))
    assert row.split(" | ")[6:8] == [f"{hyco['tok_s']['before']:.1f}", f"{hyco['tok_s']['after']:.1f}"]
    assert any(line.startswith("hyco ") and tok in line for line in printed)


# Tables 2 and 11, SB-480: MAT and g (ms a token) per configuration, with each one's tree rows,
# SLM passes, MTP steps on the phone and head steps on the server (Table 5)
PAPER = {"cloud-mtp": (3.05, 7.81, 5, 0, 0, 4), "specedge": (3.53, 6.20, 33, 4, 0, 0),
         "specedge-pd": (3.69, 5.94, 33, 4, 0, 0), "specedge-eps": (4.13, 5.50, 33, 4, 0, 0),
         "hyco": (4.71, 4.80, 33, 1, 4, 0)}


def paper_inputs(tmp_path: Path) -> None:
    """A check's inputs with the paper's MATs: 100 rounds a configuration, each committing the
    MAT's floor or ceiling so that they average to it."""
    inputs = inputs_for(tmp_path)
    configs = {}
    for name, (mat, _, rows, slm, mtp, head) in PAPER.items():
        ceil = round(100 * (mat - math.floor(mat)))
        committed = [math.ceil(mat)] * ceil + [math.floor(mat)] * (100 - ceil)
        rounds = [[rows, 200 + 5 * i, c, slm, mtp, head, 0, 165, 8] for i, c in enumerate(committed)]
        configs[name] = {"label": name, "rule": "exact", "alone": False, "requests": [
            {"prompt_tokens": 200, "first_reply_bytes": 4000, "output_tokens": 1 + sum(committed), "rounds": rounds}]}
    (tmp_path / "costs_inputs.json").write_text(json.dumps({**inputs, "configs": configs}))


def test_the_paper_profile_gives_the_papers_g_at_the_papers_mats(tmp_path):
    """T_head = (26.8 - 21.7) / 4, T_verify(33 rows) = 21.7, T_verify(5 rows) = 7.81 x 3.05 - 4 T_head:
    each configuration's g within 5% of Table 11's, HyCo's Delta-g within 3 points of Table 2's -38.6%."""
    paper = read_server_profile(PAPER_PROFILE)
    assert paper.head_step == pytest.approx(1.275)
    assert paper.verify_ms(33, 500) == 21.7 and paper.verify_ms(5, 4000) == pytest.approx(18.7205)
    assert paper.verify_ms(33, 0) + 4 * paper.head_step == pytest.approx(26.8)  # the server head's round
    paper_inputs(tmp_path)
    result = project(tmp_path, tmp_path / "p", WhatIf(server_profile=PAPER_PROFILE))
    for name, (_, g, *_) in PAPER.items():
        assert result["rows"][name]["g_ms"] == pytest.approx(g, rel=0.05), name
    assert result["rows"]["cloud-mtp"]["g_ms"] == pytest.approx(7.81, rel=0.005)
    assert result["rows"]["hyco"]["delta_g_percent"] == pytest.approx(-38.6, abs=3.0)
    assert not result["server_on_cpu"]
    assert "T_head = (26.8 - 21.7) / 4 = 1.275 ms" in result["sources"]["server"]
    assert result["sources"]["server"].startswith(f"server profile {PAPER_PROFILE}: ")
    assert result["what_if"] == [f"server profile {PAPER_PROFILE}"]


def test_a_checks_own_sweep_is_a_server_profile_that_projects_the_same(tmp_path, capsys):
    """--write-server-profile writes the check's sweep; read back with --server-profile it gives
    the check's own rows; ServerTimes.to_json (what a sweep is cached as) is a profile too."""
    from hyco.pipeline.cli import main

    inputs_for(tmp_path)
    profile = tmp_path / "profiles" / "server.json"
    assert main(["project", str(tmp_path), "--out", str(tmp_path / "a"), "--write-server-profile", str(profile)]) == 0
    assert main(["project", str(tmp_path), "--out", str(tmp_path / "b"), "--server-profile", str(profile)]) == 0
    capsys.readouterr()
    again = json.loads((tmp_path / "b" / "projection.json").read_text())
    assert again["rows"] == again["baseline"]["rows"]
    assert again["sources"]["server"].startswith(f"server profile {profile}: cpu test")
    (tmp_path / "sweep.json").write_text(json.dumps(SERVER.to_json()))
    read = read_server_profile(tmp_path / "sweep.json")
    assert (read.verify, read.prefill, read.head_step, read.device) == (SERVER.verify, SERVER.prefill, 3.0, "cpu test")


@pytest.mark.parametrize("text, match", [
    ('[1, 2]', "a server profile is a JSON object"),
    ('{"verify": [[33, 64, 2.0]], "prefill": [[32, 1.0]], "gpu": "x"}', "gpu: unknown key"),
    ('{"prefill": [[32, 1.0]]}', "verify: missing"),
    ('{"verify": [[33, 64, NaN]], "prefill": [[32, 1.0]]}', r"verify\[0\] must be \[rows >= 1, context >= 0, ms > 0\]"),
    ('{"verify": [[0, 64, 2.0]], "prefill": [[32, 1.0]]}', r"verify\[0\] must be"),
    ('{"verify": [[33, 64, 2.0], [33, 64, 3.0]], "prefill": [[32, 1.0]]}', r"verify\[1\]: rows 33 at context 64 is listed twice"),
    ('{"verify": [[33, 64, 2.0]], "prefill": [[32, -1.0]]}', r"prefill\[0\] must be \[prompt tokens >= 1, ms >= 0\]"),
    ('{"verify": [[33, 64, 2.0]], "prefill": []}', "prefill must be a non-empty list"),
    ('{"verify": [[33, 64, 2.0]], "prefill": [[32, 1.0]], "head_step": 0}', "head_step must be a positive number"),
    ('{"verify": [[33, 64, 2.0]], "prefill": [[32, 1.0]], "head_step": Infinity}', "head_step must be a positive"),
])
def test_a_bad_server_profile_is_named_by_file_and_key(tmp_path, text, match):
    path = tmp_path / "server.json"
    path.write_text(text)
    with pytest.raises(HycoError, match=f"{path}: {match}"):
        read_server_profile(path)


def test_a_bad_server_profile_is_one_line_and_exit_2(tmp_path, capsys):
    from hyco.pipeline.cli import main

    inputs_for(tmp_path)
    (tmp_path / "server.json").write_text('{"verify": [[33, 64, -2]], "prefill": [[32, 1.0]]}')
    assert main(["project", str(tmp_path), "--server-profile", str(tmp_path / "server.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'server.json'}: verify[0] must be" in err


def test_a_reader_that_stops_reading_ends_nothing_with_a_traceback(tmp_path):
    """`project ... | head -1`: the pipe's reader is gone before project prints (its end closed
    here at once), so every print meets a closed pipe."""
    inputs_for(tmp_path)
    child = subprocess.Popen([sys.executable, "-m", "hyco.pipeline.cli", "project", str(tmp_path), "--out", str(tmp_path / "p")],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err and err == ""
    assert (tmp_path / "p" / "projection.json").is_file()


def test_figure1_says_what_changed_and_which_way_is_better(tmp_path):
    """Axis labels with what they measure and which way is better, the better corner marked, the
    what-if in the title, the check's points hollow beside the projected ones, every point
    numbered and named in the legend, no two numbers overlapping."""
    inputs_for(tmp_path)
    result = project(tmp_path, tmp_path / "p", WhatIf(rtt_ms=0.0))
    fig = figure1(result, what_if="RTT 58 -> 0 ms", baseline=result["baseline"])
    (ax,) = fig.axes
    assert "higher is better" in ax.get_xlabel() and "SLM alone" in ax.get_xlabel()
    assert "lower is better" in ax.get_ylabel() and "Cloud+MTP" in ax.get_ylabel()
    assert "what if: RTT 58 -> 0 ms" in ax.get_title()
    assert [t.get_text() for t in ax.texts if t.get_gid() == "better"] == ["better \u2198"]
    better_x, better_y = ax.transLimits.inverted().transform((0.99, 0.015))
    assert better_x > 1.0 and better_y < 1.0  # in the corner faster than the SLM alone at less server time
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:2] == ["1  hyco (HyCo)", "2  cloud-mtp (Cloud+MTP)"]
    assert "hollow: the check's own figures" in legend and any(t.startswith("shaded: better") for t in legend)
    hollow = [c for c in ax.collections if len(c.get_facecolors()) == 0]
    assert len(hollow) == 2  # hyco and cloud-mtp moved; the SLM alone is the delivery reference itself
    numbers = [t for t in ax.texts if t.get_gid() == "number"]
    assert sorted(t.get_text() for t in numbers) == ["1", "2"]


def test_figure1_numbers_do_not_collide_and_coinciding_points_share_one():
    """Seven configurations crowded near one another, two at the very same point (X and X@float):
    their numbers are placed apart, the two share "6,7"."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    at = {"a": (1.50, 0.40), "b": (1.52, 0.41), "c": (1.51, 0.39), "d": (1.49, 0.405), "e": (1.53, 0.395),
          "f": (1.2, 0.5), "f@float": (1.2, 0.5)}
    rows = {n: {"label": n, "g_ms": 10 * y, "delivery_vs_slm_alone": x} for n, (x, y) in at.items()}
    rows["cloud-mtp"] = {"label": "Cloud+MTP", "g_ms": 10.0, "delivery_vs_slm_alone": 0.6}
    fig = figure1({"rows": rows, "reference": "cloud-mtp", "server_on_cpu": False})
    FigureCanvasAgg(fig).draw()
    numbers = [t for t in fig.axes[0].texts if t.get_gid() == "number"]
    assert sorted(t.get_text() for t in numbers) == ["1", "2", "3", "4", "5", "6,7", "8"]
    boxes = [t.get_window_extent() for t in numbers]
    overlaps = [(numbers[i].get_text(), numbers[j].get_text()) for i in range(len(boxes))
                for j in range(i + 1, len(boxes)) if boxes[i].overlaps(boxes[j])]
    assert overlaps == []


def test_check_timing_takes_an_rtt_of_0_and_refuses_a_bandwidth_of_0():
    from hyco.config.recipe import load_recipe

    assert load_recipe(ROOT / "recipes/tiny.yaml", ["check.timing.rtt_ms=0"]).check.timing.rtt_ms == 0.0
    with pytest.raises(HycoError, match="check.timing.rtt_ms must be >= 0, but got -1"):
        load_recipe(ROOT / "recipes/tiny.yaml", ["check.timing.rtt_ms=-1"])
    with pytest.raises(HycoError, match="check.timing.up_mbps must be > 0, but got 0"):
        load_recipe(ROOT / "recipes/tiny.yaml", ["check.timing.up_mbps=0"])

