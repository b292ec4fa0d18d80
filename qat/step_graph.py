"""`mtp_step.onnx`: one static MTP drafting step, HTP-legal by construction.

The step reads the head's weights (HF names) and runs one query against a ring of `window`
K/V rows per source layer. HTP rules it follows (platform notes): rotary as host cos/sin
rows, RMSNorm as x * Reciprocal(Sqrt(mean(x*x) + eps)) (no Pow), GELU written with Tanh,
additive masks with a small negative, LogSoftmax straight after the output MatMul (no scalar
Mul before it; the assistant has no softcap; a centroid-masked head puts its Where between),
TopK over slices narrower than 65,536 with the slice offset added afterwards (HTP returns larger
indices modulo 65,536).

`quantize_graph` turns the float export into the shipped graph: every weight becomes an INT4
initializer with a per-channel DequantizeLinear (opset 21), and the float inputs get uint16
Quantize/Dequantize pairs at fixed ranges (the captures' 99.99th percentiles).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from hyco.formats.int4 import pack_int4
from hyco.npu import ops as npu_ops
from hyco.npu.host import SHORT
from hyco.npu.io_spec import GraphSpec, TensorSpec
from hyco.npu.ops import (
    MLP,
    Attention,
    DecoderLayer,
    LayerShape,
    RMSNorm,
    centroid_mask,
    centroid_masked,
    sliced_topk,
)

TOPK_SLICE = npu_ops.TOPK_SLICE  # a module name, so a test can narrow it
OPSET = 21


def linear_names(num_layers: int, centroids: bool = False) -> list[str]:
    """HF module names of the head's linears, in compute order (restricted lm_head last; a
    centroid-masked head's centroid layer just before it)."""
    names = ["pre_projection"]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.self_attn.q_proj", f"{p}.self_attn.o_proj", f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj",
                  f"{p}.mlp.down_proj"]
    return names + ["post_projection", *(["masked_embedding.centroids"] if centroids else []), "lm_head"]


def param_name(module: str) -> str:
    """ONNX initializer name of a linear's [in, out] weight in MtpStep (HF module name in):
    the step stacks hyco.npu.ops' DecoderLayer, whose attention is `attn`."""
    return module.replace("model.layers.", "layers.").replace(".self_attn.", ".attn.").replace(
        "masked_embedding.centroids", "centroids") + ".weight"


class MatMulWeight(nn.Module):
    """x @ W with W [in, out] float: per-channel scales run along axis 1 when quantize_graph
    swaps W for INT4 behind a DequantizeLinear."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach().float().t().contiguous())

    def forward(self, x):
        return x @ self.weight


class MtpStep(nn.Module):
    """One drafting step over fixed-shape inputs (see `io_spec`); weights from `weights`
    (HF module name -> [out, in] float) and the HF head for norms, shapes and types.

    The head's layers are hyco.npu.ops' static DecoderLayer, the one convert's SLM graphs stack: each
    attends over the verifier's ring of its layer type, as a KV-shared SLM layer attends over its
    owner's (q_proj only). A centroid-masked head also needs `cluster_of` (each output row's
    centroid, qat/mtp.py `clusters_of`); its row is masked by `centroid_mask` before the LogSoftmax."""

    def __init__(self, head: nn.Module, weights: dict[str, torch.Tensor], topk: int,
                 cluster_of: torch.Tensor | None = None):
        super().__init__()
        text = head.config.get_text_config()
        self.layer_types = list(text.layer_types)
        self.topk = topk
        eps = text.rms_norm_eps
        params = {n: p.detach() for n, p in head.named_parameters()}

        def norm(name: str) -> RMSNorm:
            return RMSNorm(params[name], eps)

        layers = []
        for i, (layer_type, hf) in enumerate(zip(self.layer_types, head.model.layers, strict=True)):
            p = f"model.layers.{i}"
            attn = hf.self_attn
            shape = LayerShape(i, layer_type, text.num_attention_heads,
                               text.num_attention_heads // attn.num_key_value_groups, attn.head_dim, kv_owner=layer_type)
            layers.append(DecoderLayer(
                Attention(shape, MatMulWeight(weights[f"{p}.self_attn.q_proj"]), None, None,
                          MatMulWeight(weights[f"{p}.self_attn.o_proj"]), norm(f"{p}.self_attn.q_norm.weight"), None, None),
                MLP(*(MatMulWeight(weights[f"{p}.mlp.{n}"]) for n in ("gate_proj", "up_proj", "down_proj"))),
                {n: norm(f"{p}.{n}.weight") for n in ("input_layernorm", "post_attention_layernorm",
                                                      "pre_feedforward_layernorm", "post_feedforward_layernorm")},
                hf.layer_scalar))
        self.layers = nn.ModuleList(layers)
        self.pre_projection = MatMulWeight(weights["pre_projection"])
        self.post_projection = MatMulWeight(weights["post_projection"])
        self.norm = norm("model.norm.weight")
        self.lm_head = MatMulWeight(weights["lm_head"])
        self.centroid_top_k = head.config.centroid_intermediate_top_k if centroid_masked(head.config) else 0
        if self.centroid_top_k:
            if cluster_of is None or cluster_of.shape != (weights["lm_head"].shape[0],):
                raise ValueError("a centroid-masked head's step needs cluster_of, one centroid per output row")
            self.centroids = MatMulWeight(weights["masked_embedding.centroids"])
            self.register_buffer("cluster_of", cluster_of.detach().long().cpu().clone())
        self.vocab = weights["lm_head"].shape[0]

    @staticmethod
    def grouped(inputs):
        """The graph's inputs in io_spec order -> forward's arguments: (token_embed, hidden, the four
        K/V rings, the two masks, the four rotary rows). Tracing flattens them back in that order,
        so the graph's inputs stay io_spec's."""
        return inputs[0], inputs[1], tuple(inputs[2:6]), tuple(inputs[6:8]), tuple(inputs[8:12])

    def forward(self, token_embed, hidden, rings, masks, rotary):
        """`rings`: (k_full, v_full, k_sliding, v_sliding); `masks`: (mask_full, mask_sliding);
        `rotary`: (cos_full, sin_full, cos_sliding, sin_sliding) (`grouped`)."""
        k_full, v_full, k_sliding, v_sliding = rings
        mask_full, mask_sliding = masks
        cos_full, sin_full, cos_sliding, sin_sliding = rotary
        kv = {"full_attention": (k_full, v_full), "sliding_attention": (k_sliding, v_sliding)}
        rows = {"full_attention": (cos_full, sin_full, mask_full), "sliding_attention": (cos_sliding, sin_sliding, mask_sliding)}
        x = self.pre_projection(torch.cat([token_embed, hidden], dim=-1))  # [1, H]
        for layer_type, layer in zip(self.layer_types, self.layers, strict=True):
            cos, sin, mask = rows[layer_type]
            x, _ = layer(x, None, cos, sin, mask, kv)
        x = self.norm(x)
        logits = self.lm_head(x)  # [1, V']
        if self.centroid_top_k:
            logits = centroid_mask(logits, self.centroids(x), self.cluster_of, self.centroid_top_k)
        logprobs = torch.log_softmax(logits, dim=-1)
        top_lp, top_ids = sliced_topk(logprobs, self.topk, TOPK_SLICE)
        return top_lp, top_ids, self.post_projection(x)


# --- the fixed-shape interface -------------------------------------------------------------


def io_spec(head: nn.Module, kv_shapes: dict[str, tuple[int, int]], window: int, vocab: int, topk: int,
            meta: dict) -> GraphSpec:
    """`kv_shapes`: layer type -> (kv_heads, head_dim) of the verifier's source layers."""
    text = head.config.get_text_config()
    hb = head.config.backbone_hidden_size
    (hf, df), (hs, ds) = kv_shapes["full_attention"], kv_shapes["sliding_attention"]
    f32 = "float32"
    inputs = (
        TensorSpec("token_embed", (1, hb), f32, "e(x): the verifier's scaled input embedding of the last token "
                   "(hand-off for the first step, embed_lut row after)"),
        TensorSpec("hidden", (1, hb), f32, "h: the verifier's h_t for the first step, then this graph's next_hidden"),
        TensorSpec("k_full", (hf, window, df), f32, "ring of the verifier's last full-attention layer keys (rotary applied)"),
        TensorSpec("v_full", (hf, window, df), f32, "ring of the verifier's last full-attention layer values"),
        TensorSpec("k_sliding", (hs, window, ds), f32, "ring of the verifier's last sliding layer keys"),
        TensorSpec("v_sliding", (hs, window, ds), f32, "ring of the verifier's last sliding layer values"),
        TensorSpec("mask_full", (1, window), f32, "additive validity mask over ring slots (0 or mask_negative)"),
        TensorSpec("mask_sliding", (1, window), f32, "additive mask: valid and within the sliding window"),
        TensorSpec("cos_full", (1, df), f32, "rotary cos row at the burst's position (host: rope_rows)"),
        TensorSpec("sin_full", (1, df), f32, "rotary sin row at the burst's position"),
        TensorSpec("cos_sliding", (1, ds), f32, "rotary cos row, sliding layers"),
        TensorSpec("sin_sliding", (1, ds), f32, "rotary sin row, sliding layers"),
    )
    outputs = (
        TensorSpec("topk_logprobs", (1, topk), f32, "log-probabilities over the keep set, best first"),
        TensorSpec("topk_ids", (1, topk), "int64", "keep indices (keep_to_vocab.npy maps to vocab ids)"),
        TensorSpec("next_hidden", (1, hb), f32, "the head's projected state: `hidden` of the next step"),
    )
    if centroid_masked(head.config):  # informative: the graph holds its clusters
        meta = {**meta, "centroids": {"num_centroids": head.config.num_centroids,
                                      "top_k": head.config.centroid_intermediate_top_k}}
    return GraphSpec("mtp_step.onnx", inputs, outputs, {
        "window": window, "keep_size": vocab, "topk": topk, "sliding_window": text.sliding_window, **meta})


def rope_tables(head: nn.Module) -> dict[str, dict]:
    """inv_freq and scaling per layer type, for the host's `rope_rows`."""
    rot = head.model.rotary_emb
    return {t: {"inv_freq": getattr(rot, f"{t}_inv_freq").float().tolist(),
                "scaling": float(getattr(rot, f"{t}_attention_scaling"))}
            for t in ("full_attention", "sliding_attention")}


# --- export ----------------------------------------------------------------------------------


def export_float(step: MtpStep, spec: GraphSpec, path: Path) -> Path:
    import onnx

    example = step.grouped([torch.from_numpy(t.zeros()) for t in spec.inputs])
    torch.onnx.export(step, example, str(path), input_names=[t.name for t in spec.inputs],
                      output_names=[t.name for t in spec.outputs], opset_version=OPSET, dynamo=False,
                      do_constant_folding=False)  # folding would turn the weights' graph back into floats
    onnx.checker.check_model(str(path), full_check=True)  # from the file: no second copy of the weights
    return path


def uint16_qparams(lo: float, hi: float) -> tuple[float, int]:
    """Asymmetric uint16 scale / zero point holding [lo, hi] (widened to hold 0), ends included."""
    from hyco.quant.grids import uint16_grid

    return uint16_grid(lo, hi)


def fixed_input_ranges(spec: GraphSpec, negative: float) -> dict[str, tuple[float, float]]:
    """Ranges the step graph's other inputs have by construction: masks hold 0 or `negative`
    (both exact on the uint16 grid), rotary rows lie in [-scaling, scaling]."""
    ranges = {"mask_full": (negative, 0.0), "mask_sliding": (negative, 0.0)}
    for layer, short in SHORT.items():
        scaling = float(spec.meta["rope"][layer]["scaling"])
        ranges[f"cos_{short}"] = ranges[f"sin_{short}"] = (-scaling, scaling)
    return ranges


def quantize_graph(float_path: Path, out_path: Path, int_weights: dict[str, tuple[np.ndarray, np.ndarray]],
                   input_ranges: dict[str, tuple[float, float]]) -> Path:
    """INT4 per-channel weights (`int_weights`: module -> (int8 values [out, in], scale [out]))
    and uint16 QDQ on the inputs named in `input_ranges`."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(float_path))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    nodes = []
    for module, (values, scale) in int_weights.items():
        name = param_name(module)
        if name not in inits:
            raise KeyError(f"{float_path}: no initializer {name!r} for {module}")
        graph.initializer.remove(inits[name])
        q = values.T  # [in, out] like the float initializer; channel axis 1
        graph.initializer.extend([
            helper.make_tensor(f"{name}__q", TensorProto.INT4, q.shape, pack_int4(q), raw=True),
            numpy_helper.from_array(scale.astype(np.float32), f"{name}__scale"),
            helper.make_tensor(f"{name}__zero", TensorProto.INT4, scale.shape, pack_int4(np.zeros(scale.shape, np.int8)), raw=True),
        ])
        nodes.append(helper.make_node("DequantizeLinear", [f"{name}__q", f"{name}__scale", f"{name}__zero"], [name],
                                      axis=1, name=f"dq__{name}"))
    for inp, (lo, hi) in input_ranges.items():
        scale, zero = uint16_qparams(lo, hi)
        graph.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), f"{inp}__scale"),
                                  numpy_helper.from_array(np.array(zero, np.uint16), f"{inp}__zero")])
        for node in graph.node:  # consumers read the dequantized input
            for j, x in enumerate(node.input):
                if x == inp:
                    node.input[j] = f"{inp}__dq"
        nodes += [helper.make_node("QuantizeLinear", [inp, f"{inp}__scale", f"{inp}__zero"], [f"{inp}__q"],
                                   name=f"q__{inp}"),
                  helper.make_node("DequantizeLinear", [f"{inp}__q", f"{inp}__scale", f"{inp}__zero"], [f"{inp}__dq"],
                                   name=f"dq__{inp}")]
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + rest)
    onnx.save(model, str(out_path))
    del model, graph, inits
    onnx.checker.check_model(str(out_path), full_check=True)  # from the file: no serialized copy in memory
    return out_path


# --- parity build ----------------------------------------------------------------------------


def tap_input_qdq(path: Path, dst: Path) -> dict[str, str]:
    """Parity build of a quantized step graph: each input's uint16 QDQ output (`<input>__dq`)
    becomes a graph output too. Returns {input: its dequantized tensor}.

    The step graph rounds nowhere else: its weights are INT4 initializers behind
    DequantizeLinear, and every activation between its ops stays float (the 16-bit activation
    encodings go to encodings.json for the HTP compiler, not into the graph). This is checked
    here: a QuantizeLinear other than an input's raises. So a reference fed these tapped inputs
    sees every rounding the graph makes, no rounding tie can separate the two, and what is left
    is float32 summation order."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path))
    graph = model.graph
    quantizers = [n for n in graph.node if n.op_type == "QuantizeLinear"]
    inputs = {i.name: i for i in graph.input}
    taps = {}
    for node in quantizers:
        name = node.input[0]
        if name not in inputs:
            raise RuntimeError(f"{path}: QuantizeLinear {node.name!r} rounds an activation ({name}), not a graph input")
        taps[name] = f"{name}__dq"
        dims = [d.dim_value for d in inputs[name].type.tensor_type.shape.dim]
        graph.output.append(helper.make_tensor_value_info(taps[name], onnx.TensorProto.FLOAT, dims))
    onnx.save(model, str(dst))
    return taps
