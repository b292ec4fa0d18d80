"""The MTP Drafter on qat/'s static step graph through onnxruntime (CPU, optimisations off).

Same interface as `MtpChainTorch` (receive / propose) and the same hand-off window. A burst runs
`mtp_step.onnx` (INT4 weights, uint16 input QDQ; or its float twin `mtp_step.float.onnx`) K
times, as the phone does: the first step takes the hand-off's e(x_{t+1}) and h_t, each later
step the 8-bit `EmbedLut` row of the token the previous step drafted and that step's
`next_hidden`; the K/V ring, masks and rotary rows stay those of the hand-off for the whole
burst (qat/step_graph.py's `step_feeds` and `rope_rows` build them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hyco.base.errors import HycoError
from hyco.npu.embed_lut import EMBED_LUT, EmbedLut
from hyco.npu.handoff import StepInput
from hyco.npu.host import SHORT
from hyco.npu.io_spec import read_io_spec
from hyco.qnn.ort import ort_session
from hyco.runtime.drafters import HandoffWindow
from hyco.runtime.mtp import Draft, rope_rows, step_feeds

STEP_GRAPH = "mtp_step.onnx"
FLOAT_TWIN = "mtp_step.float.onnx"


class MtpChainOnnx(HandoffWindow):
    def __init__(self, qat_dir: Path, *, keep_ids: torch.Tensor | None, window: int, capture_point: str,
                 quantize_wire: bool, graph: str = STEP_GRAPH, spec_key: str = STEP_GRAPH, open_session=None):
        """`spec_key`: the step graph's io_spec key; `open_session(graph)` returns an object with
        onnxruntime's `run(names, feeds)` (default: onnxruntime CPU on qat_dir/graph)."""
        qat_dir = Path(qat_dir)
        if not (qat_dir / "io_spec.json").is_file():
            raise HycoError(f"{qat_dir}/io_spec.json not found (run the qat stage first)")
        specs = read_io_spec(qat_dir / "io_spec.json")
        if spec_key not in specs or (open_session is None and not (qat_dir / graph).is_file()):
            raise HycoError(f"{qat_dir}: no {graph} in io_spec.json or on disk (run the qat stage first)")
        spec = specs[spec_key]  # the float twin has the same interface
        meta = spec.meta
        # The ring, the hand-off's rows and h_t must be what the graph was built and trained for.
        if int(meta["window"]) != window:
            raise HycoError(f"{qat_dir}/io_spec.json: {graph} has a {meta['window']}-row K/V ring, but the check "
                            f"keeps {window} hand-off rows (qat.window)")
        if meta.get("capture_point", capture_point) != capture_point:
            raise HycoError(f"{qat_dir}/io_spec.json: {graph} was trained on h_t {meta['capture_point']}, but the "
                            f"verifier hands off h_t {capture_point} (qat.capture_point)")
        lut = EmbedLut.load(qat_dir / EMBED_LUT)
        if keep_ids is None:
            raise HycoError(f"{qat_dir}/io_spec.json: {graph} drafts over a keep set of {meta['keep_size']} tokens; "
                            "the check needs that keep set (add vocab to the recipe's stages)")
        if not np.array_equal(lut.keep_to_vocab.astype(np.int64), keep_ids.numpy()) or meta["keep_size"] != len(keep_ids):
            raise HycoError(f"{qat_dir}/{EMBED_LUT}: tensor 'keep_to_vocab' ({len(lut.keep_to_vocab)} tokens) is not "
                            f"the check's keep set ({len(keep_ids)} tokens)")
        super().__init__(window=window, quantize_wire=quantize_wire)
        self.spec, self.lut, self.keep_ids = spec, lut, keep_ids
        self.session = open_session(graph) if open_session else ort_session(qat_dir / graph)
        self.outputs = [t.name for t in spec.outputs]

    def propose(self, depth: int, topk: int) -> Draft:
        meta = self.spec.meta
        if topk > meta["topk"]:
            raise HycoError(f"{STEP_GRAPH} returns the top {meta['topk']} tokens, but the tree asks for {topk}")
        last = self.last
        kv_rows = next(iter(self.kv.values()))[0].shape[1]
        oldest = last.position - kv_rows  # absolute position of the window's first row
        # `step_feeds` lays positions 0..n-1 into slots p % window; our window holds only the last
        # rows, so it gets positions counted from `oldest` (masks depend on distances only) and the
        # rotary rows are then taken at the true position, as qat's graph parity does.
        start = StepInput(last.embed, last.hidden, self.kv, last.position - oldest)
        feeds = step_feeds(start, last.embed.numpy(), last.hidden.numpy(), self.spec, meta["rope"],
                           meta["mask_negative"])
        for layer, short in SHORT.items():
            feeds[f"cos_{short}"], feeds[f"sin_{short}"] = rope_rows(meta["rope"][layer], last.position)
        keep_index, logprobs = [], []
        for _ in range(depth):
            out = dict(zip(self.outputs, self.session.run(self.outputs, feeds), strict=True))
            keep_index.append(out["topk_ids"][0, :topk])
            logprobs.append(out["topk_logprobs"][0, :topk])
            # the phone embeds its own drafted token from the 8-bit table of kept tokens
            feeds["token_embed"] = self.lut.rows(out["topk_ids"][0, :1])
            feeds["hidden"] = out["next_hidden"]
        ids = self.keep_ids[torch.from_numpy(np.stack(keep_index))]
        return Draft(ids[:, 0].clone(), ids, torch.from_numpy(np.stack(logprobs)))
