"""Drive the graphs as the phone does, recording every pass's feeds and outputs.

SLM graphs: `hyco.runtime.slm_onnx.SlmOnnx` is the runtime's own driver (host LUTs,
rotary tables, KV rings, masks, prefill chunks, committed backlog in front of the tree). Here
its onnxruntime sessions are swapped for `Recorder`s, and a decode loop walks the verifier's
answer: each round the root is the next answer token, a planning pass over root + the
answer's next `chain_depth` tokens (the MTP chain the phone would draft) gives each node's
top-k, a second pass runs the full tree (chain + the SLM's own top-k children, as many as
the rows hold), and a seeded random number of chain tokens is accepted and committed, so
the rings fill and wrap like a real decode.

Several drivers can walk in lockstep (`lockstep`): the tree is built from the first one's
outputs, so a float graph and its QDQ twin see identical trees and can be compared row by
row while each keeps its own KV ring.

MTP step graph: from qat/'s teacher-forced captures (the verifier's h_t, e(x_{t+1}) and K/V),
`mtp_bursts` runs K steps per drafting position on the graph's own next_hidden and the
embed_lut row of its own top-1, as `hyco.runtime.mtp_onnx.MtpChainOnnx.propose` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hyco.npu.host import SHORT
from hyco.npu.io_spec import Role, role_of


def cpu_session(path: Path, providers=("CPUExecutionProvider",)):
    """`hyco.qnn.ort.ort_session` without the CPU memory arena: with it, a session keeps the
    high-water mark of every pass and grows further pass after pass; the outputs are the same
    (allocation only)."""
    from hyco.qnn.ort import ort_session

    return ort_session(path, arena=False, providers=providers)


class SpilledPasses:
    """A list of (feeds, outputs) kept on disk, one .npy pair per pass in `folder`, read back on
    access. At E2B size a pass's feeds (rings, masks, per-layer rows) and its logits are tens of
    MB: the passes calibrate and its evaluation record held GBs in memory."""

    def __init__(self, folder: Path, count: int = 0):
        """`count`: passes already in `folder` (another process's, read back)."""
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.count = count

    def append(self, item: tuple[dict, dict]) -> None:
        for part, values in zip(("feeds", "outputs"), item, strict=True):
            np.savez(self.folder / f"{self.count:05d}.{part}.npz", **values)
        self.count += 1

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[dict, dict]:
        if not -self.count <= i < self.count:
            raise IndexError(i)
        i %= self.count
        return tuple(dict(np.load(self.folder / f"{i:05d}.{part}.npz")) for part in ("feeds", "outputs"))

    def __iter__(self):
        return (self[i] for i in range(self.count))


def with_mask_value(feeds: dict, negative: float) -> dict:
    """`feeds` with every additive mask input's masked slots (< 0) set to `negative`."""
    return {k: (np.where(v < 0, np.float32(negative), v).astype(np.float32) if role_of(k) is Role.MASK else v)
            for k, v in feeds.items()}


@dataclass
class Recorder:
    """Stands in for an onnxruntime session: runs `session` and keeps every (feeds, outputs)
    (in memory, or on disk when `passes` is a SpilledPasses)."""

    session: object
    graph: str
    passes: list[tuple[dict, dict]] | SpilledPasses = field(default_factory=list)
    keep_outputs: bool = True
    active: list[int] = field(default_factory=list)  # real (non-padding) rows of each pass, leading
    prefill: list[bool] = field(default_factory=list)  # each pass: the prompt's (SlmOnnx.start), else a round's
    mask_negative: float | None = None  # rewrite the host's masks to this value before running
    output_prefixes: tuple[str, ...] | None = None  # keep only these outputs (None: all)

    def run(self, names, feeds):
        if self.mask_negative is not None:
            feeds = with_mask_value(feeds, self.mask_negative)
        values = self.session.run(names, feeds)
        kept = {n: v for n, v in zip(names, values, strict=True)
                if self.output_prefixes is None or n.startswith(self.output_prefixes)}
        # KVRing.feeds() hands out the live ring arrays, which the next ring.write changes in
        # place: keep a snapshot, or every recorded pass would replay the final ring.
        snapshot = feeds if isinstance(self.passes, SpilledPasses) else {k: np.array(v) for k, v in feeds.items()}
        self.passes.append((snapshot, kept if self.keep_outputs else {}))
        return values


def slm_driver(convert_dir: Path, keep_ids, sessions: dict[str, object] | None = None,
               mask_negative: float | None = None, output_prefixes: tuple[str, ...] | None = None,
               spill: Path | None = None, graphs: tuple[str, ...] = ("tree", "prefill")):
    """SlmOnnx on `convert_dir`'s host files, with `sessions` (role -> session; default:
    convert's float graphs) wrapped in Recorders (keeping the outputs named `output_prefixes*`,
    default all; on disk under `spill`/<graph> when given). `graphs` ("tree" alone: the phone's
    tree-only SLM) are the graphs the phone runs: without prefill, the tree graph prefills."""
    import torch

    from hyco.runtime.slm_onnx import SlmOnnx

    # Given sessions, SlmOnnx opens none of its own: it used to open (and drop) both of convert's
    # graphs with the arena on, slow and a GB-sized transient per fidelity driver at E2B size.
    open_session = (lambda name: None) if sessions else (lambda name: cpu_session(Path(convert_dir) / name))
    slm = SlmOnnx(convert_dir, keep_ids=torch.as_tensor(keep_ids), max_prompt=10**9, open_session=open_session,
                  graphs=("tree.onnx", "prefill.onnx" if "prefill" in graphs else None))
    sessions = sessions or dict(slm.sessions)
    def store(graph: str):
        return SpilledPasses(Path(spill) / graph) if spill is not None else []

    slm.sessions = {g: Recorder(sessions[g], g, store(g), mask_negative=mask_negative, output_prefixes=output_prefixes)
                    for g in slm.specs}
    run, start = slm._run, slm.start
    prefilling = [False]

    def counted(graph, tokens, parents):  # the driver knows which rows are padding, and which passes prefill
        out = run(graph, tokens, parents)
        slm.sessions[graph].active.append(len(tokens))
        slm.sessions[graph].prefill.append(prefilling[0])
        return out

    def tagged_start(prompt):
        prefilling[0] = True
        try:
            start(prompt)
        finally:
            prefilling[0] = False

    slm._run, slm.start = counted, tagged_start
    return slm


def lockstep(slms: list, prompt: list[int], answer: list[int], *, chain_depth: int, topk: int,
             rng: np.random.Generator, script: list | None = None, replay: list | None = None) -> int:
    """One answer through every driver in `slms`; returns the rounds run. `script`: a list this
    appends each round's (plan, tree, committed) to; `replay`: such a list, whose rounds the
    drivers walk instead of building them (the first driver's proposals no longer matter), so
    drivers walk the same trees one after another, each with only its own sessions open."""
    from hyco.runtime.tree import CHAIN, SLM, DraftTree

    for slm in slms:
        slm.start(list(prompt))
    if replay is not None:
        for plan, tree, committed in replay:
            for slm in slms:
                slm.propose(plan, list(range(len(plan))), topk)
                slm.propose(tree, [0], topk)
                slm.commit(committed)
        return len(replay)
    rows = slms[0].tree_spec.meta["rows"]
    pos, rounds = 0, 0
    while pos < len(answer):
        root = int(answer[pos])
        chain = [int(t) for t in answer[pos + 1:pos + 1 + chain_depth]]
        plan = DraftTree(root)
        parent = 0
        for d, token in enumerate(chain, 1):
            parent = plan.add(parent, token, d * np.log(0.66), CHAIN, d)
        nodes = list(range(len(plan)))
        proposals = [slm.propose(plan, nodes, topk) for slm in slms]
        tree = DraftTree(root)
        index = {0: 0}
        for i in range(1, len(plan)):
            index[i] = tree.add(index[plan.nodes[i].parent], plan.nodes[i].token, plan.nodes[i].score, CHAIN,
                                plan.nodes[i].chain_depth)
        room = rows - len(tree)  # propose ran the backlog, so the tree has all rows to itself
        for node in nodes:
            ids, logprobs = proposals[0][node]
            for token, lp in zip(ids, logprobs, strict=True):
                if room <= 0:
                    break
                if tree.child_with_token(index[node], token) is None:
                    tree.add(index[node], token, min(tree.nodes[index[node]].score + lp, tree.nodes[index[node]].score), SLM)
                    room -= 1
        for slm in slms:
            slm.propose(tree, [0], topk)
        accepted = int(rng.integers(0, len(chain) + 1))
        committed = [root, *chain[:accepted]]
        for slm in slms:
            slm.commit(committed)
        if script is not None:
            script.append((plan, tree, committed))
        pos += len(committed)
        rounds += 1
    return rounds


def mtp_bursts(session, spec, lut, captures, *, steps: int, positions_per_capture: int, window: int,
               rng: np.random.Generator, mask_negative: float | None = None) -> list[list[tuple[dict, dict]]]:
    """Bursts of `steps` MTP steps at drafting positions sampled from each capture. Returns per
    burst the (feeds, outputs) of each step."""
    from hyco.npu.handoff import StepInput
    from hyco.runtime.mtp import rope_rows, step_feeds

    negative = spec.meta["mask_negative"] if mask_negative is None else mask_negative
    names = [t.name for t in spec.outputs]
    bursts = []
    for cap in captures:
        ts = cap.drafting_positions.numpy()
        if len(ts) == 0:
            continue
        picked = np.sort(rng.choice(ts, size=min(positions_per_capture, len(ts)), replace=False))
        for t in picked:
            t = int(t)
            lo = max(0, t + 1 - window)
            kv = {layer: (k[:, lo:t + 1], v[:, lo:t + 1]) for layer, (k, v) in cap.kv.items()}
            embed, hidden = cap.embeds[t + 1].numpy(), cap.hidden[t].numpy()
            feeds = step_feeds(StepInput(cap.embeds[t + 1], cap.hidden[t], kv, t + 1 - lo), embed, hidden, spec,
                               spec.meta["rope"], negative)
            for layer, short in SHORT.items():
                feeds[f"cos_{short}"], feeds[f"sin_{short}"] = rope_rows(spec.meta["rope"][layer], t + 1)
            burst = []
            for _ in range(steps):
                out = dict(zip(names, session.run(names, feeds), strict=True))
                burst.append((dict(feeds), out))
                feeds = dict(feeds)
                feeds["token_embed"] = lut.rows(out["topk_ids"][0, :1])
                feeds["hidden"] = out["next_hidden"]
            bursts.append(burst)
    return bursts


def replay_mtp(session, spec, bursts) -> list[list[tuple[dict, dict]]]:
    """The same bursts through another session: each step carries that session's own
    next_hidden (its error accumulates over the burst, as on the phone) and the reference
    burst's drafted token, so both graphs condition on the same tokens and stay comparable."""
    names = [t.name for t in spec.outputs]
    out_bursts = []
    for burst in bursts:
        hidden, steps = None, []
        for ref_feeds, _ in burst:
            feeds = dict(ref_feeds)
            if hidden is not None:
                feeds["hidden"] = hidden
            out = dict(zip(names, session.run(names, feeds), strict=True))
            steps.append((feeds, out))
            hidden = out["next_hidden"]
        out_bursts.append(steps)
    return out_bursts
