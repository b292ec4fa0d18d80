"""hyco/base/launch.py's rules without a launcher: the identity outside a launch, and the refusals inside
one (tests/test_launch.py launches real processes, in the slow tier)."""

from __future__ import annotations

import pytest

from hyco.base.errors import HycoError
from hyco.base.launch import in_order, is_follower, my_positions, run_split
from hyco.pipeline.cli import main


def test_outside_a_launch_everything_is_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert list(my_positions(5)) == [0, 1, 2, 3, 4] and not is_follower()
    assert in_order([(2, "c"), (0, "a"), (1, "b")], 3, "x") == ["a", "b", "c"]
    assert run_split(lambda: 7, lambda: pytest.fail("no follower outside a launch")) == 7


def test_a_missing_or_doubled_position_is_refused(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(HycoError, match="answers: the processes returned positions"):
        in_order([(0, "a"), (0, "b")], 2, "answers")
    with pytest.raises(HycoError, match="check: the processes returned positions"):
        in_order([(0, "a")], 2, "check")


@pytest.mark.parametrize("command", [["vocab", "--tokenizer", "t", "--size", "9", "--out", "o"], ["run", "recipes/tiny.yaml"]])
def test_a_command_that_does_not_split_refuses_a_launch(monkeypatch, capsys, tmp_path, command):
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    argv = [*command[:-1], str(tmp_path / "o")] if command[0] == "vocab" else command
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not split over the 2 processes of a launch" in err[0], err
    assert not (tmp_path / "o").exists()
