"""A stage's per-prompt work split over the processes of `accelerate launch`.

    accelerate launch --multi_gpu --num_processes N $(which hyco-convert) answers ...   (check, qat)

Every process loads the models and takes every N-th prompt; the results come back to the main
process in prompt order, and only the main process owns the stage's folder (lock, temp folder,
rename), so the bytes are those of one process. qat's followers capture their share of the
sequences into the main process's temp folder (one machine) and stop; the main process trains. On a machine without GPUs the processes talk over
gloo on the CPU: accelerate's own `--cpu` launcher starts several processes only through mpirun, so
`--multi_gpu` (torchrun) is the launcher that works everywhere; `PartialState` is told to stay on
the CPU when there is no GPU.

Outside a launch (or with one process) every function here is the identity.

The main process decides whether the stage runs at all (its manifest may be up to date): it tells
the others "go" when its build starts (`start_followers`) or "skip" when it ends without one, and a
follower does its share only on "go". A process that dies takes the launch down: torchrun stops
the others (SIGTERM), and the main process, stopped before its rename, leaves nothing in place.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from hyco.base.errors import HycoError

_told_followers = False


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def launched() -> bool:
    return world_size() > 1


def is_follower() -> bool:
    """A process of a launch other than the main one: it writes nothing and prints nothing."""
    return launched() and rank() > 0


def _state():
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def my_positions(count: int) -> range:
    """Positions of a list of `count` items this process works on: every N-th from its rank (the
    long and short prompts of a list sorted by split spread over the processes alike)."""
    if not launched():
        return range(count)
    state = _state()
    return range(state.process_index, count, state.num_processes)


def in_order(mine: Sequence[tuple[int, Any]], count: int, what: str) -> list[Any]:
    """Every process's (position, result) pairs as one list in position order, on every process.
    Raises HycoError naming `what` when a position is missing or doubled, or when another process
    stopped during the exchange."""
    if not launched():
        pairs = list(mine)
    else:
        from accelerate.utils import gather_object

        _state()
        try:
            pairs = gather_object(list(mine))
        except RuntimeError as e:
            raise HycoError(f"{what}: another process of the launch stopped ({str(e).splitlines()[0][:160]})") from None
    positions = sorted(p for p, _ in pairs)
    if positions != list(range(count)):
        raise HycoError(f"{what}: the processes returned positions {positions[:8]}..., not 0..{count - 1} once each")
    return [result for _, result in sorted(pairs, key=lambda pair: pair[0])]


def start_followers(**word: Any) -> None:
    """Called by the main process when its build starts: the followers begin their shares, with
    `word` (e.g. the folder they write their part into)."""
    global _told_followers
    if launched() and not is_follower() and not _told_followers:
        _tell({"go": True, **word})
        _told_followers = True


def _tell(word: dict[str, Any] | None) -> dict[str, Any]:
    from accelerate.utils import broadcast_object_list

    _state()
    return broadcast_object_list([word], from_process=0)[0]


def run_split(main: Callable[[], int], follower: Callable[[dict[str, Any]], Any]) -> int:
    """A split stage's command: the main process runs `main` (its `run_stage`, whose build calls
    `start_followers` before the shared work); a follower waits for the main process's word and,
    on "go", runs `follower(word)` (the same work, its share only, writing nothing of its own but
    what the word asks)."""
    global _told_followers
    if not launched():
        return main()
    if is_follower():
        word = _tell(None)
        if word["go"]:
            follower(word)
        _end_launch()
        return 0
    _told_followers = False
    try:
        return main()
    finally:
        if not _told_followers:
            _tell({"go": False})  # up to date, or refused before its build: the followers have nothing to do
        _end_launch()


def _end_launch() -> None:
    """Take this process's part of the process group down once its last exchange is done. Left to
    the interpreter's exit, gloo's threads were destroyed still joinable now and then, and the
    process aborted ("terminate called without an active exception") after its work was written."""
    _state().destroy_process_group()


def refuse_launch(command: str) -> None:
    if launched():
        raise HycoError(f"`hyco-convert {command}` does not split over the {world_size()} processes of a launch; "
                        "launch the answers, qat or check subcommand instead")
