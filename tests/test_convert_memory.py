"""Convert's peak memory on a mid-size case, measured in a fresh process, bounded by the packed
weight bytes.

The case: the e2b-shapes preset at 4 layers (S, F, S, F, the last two KV-shared) and E2B's real
widths, written by the full-size writer (hyco/fixtures/fullsize.py), with the vocabulary cut to
65,536 rows so the test stays near 30 s (the full 262,144 rows took 5 min under load): 161 MiB of
safetensors, a 4-bit token table and untied 4-bit output layer of 48 MiB each, the
2-bit per-layer table, ~70 MiB of layers. convert runs without a keep set, parity off, in a
child process that reports its own VmHWM (hyco.pipeline.artifacts.peak_rss_mb) and its RSS after
importing what convert imports; the difference is what convert itself held.

Why 2x the checkpoint's bytes. convert holds the weights once, packed: from_pretrained maps the
safetensors and the static module keeps those packed tensors (file pages, counted in RSS as
they are read); the embedding tables are copied file to file (luts.py). On top come bounded
transients: finalize builds one initializer at a time (the largest tensor's INT4 bytes and their
proto copy), the trace's float activations (128 prefill rows x the vocabulary) and bitexact's row
blocks (two threads, 8 M values each). Measured (2 cores, load ~1, 161 MiB checkpoint): 291-296
MiB above the imports = 1.81-1.84x, the same with bitexact on one thread, so its blocks do not
set the peak. Holding the linears unpacked to int8 as well (what convert did before issue 13;
simulated by IntLinear keeping `int_values()` beside `packed`) measured 3.28x, so this test fails
then. (Without
compat_torch.onnx_shape_inference_without it measured 1.77x here, inside the bound: that copy scales with the output
layer's rows, +0.8 GB at 262,144 rows; bench/bench_fullsize.py shows it.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from hyco.base.errors import HycoError

pytestmark = pytest.mark.slow

VOCAB = 65_536
BOUND = 2.0  # peak RSS above the imports, as a multiple of the checkpoint's packed bytes

CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import onnx, onnx.checker, safetensors, torch, transformers  # what convert imports, before the baseline
    import transformers.integrations.gemma_quant
    from transformers import Gemma4ForCausalLM  # noqa: F401
    import hyco.convert.export_onnx, hyco.npu.host, hyco.convert.load, hyco.convert.luts, hyco.qnn.ort
    import hyco.convert.rewrites, hyco.convert.stage as stage
    from hyco.base.memory import peak_rss_mb
    from hyco.config.recipe import ConvertConfig

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    baseline = rss_mb()
    summary = stage.convert(checkpoint=Path(sys.argv[1]), out=Path(sys.argv[2]),
                            config=ConvertConfig(parity=False, use_keep_set=False))
    print(json.dumps({"baseline_mb": baseline, "peak_mb": peak_rss_mb(), "summary": summary}))
""")


@pytest.fixture(scope="module")
def mid_size_slm(tmp_path_factory):
    from hyco.fixtures import fullsize
    from hyco.fixtures.presets import get_preset

    try:
        fullsize.tokenizer_source()
    except HycoError as e:
        pytest.skip(f"the real Gemma tokenizer is absent: {e}")
    spec = fullsize.reduced(get_preset("e2b-shapes"), slm_layers=4, full_period=2, kv_shared=2, verifier_layers=1)
    spec = dataclasses.replace(spec, tokenizer=dataclasses.replace(spec.tokenizer, vocab_size=VOCAB))
    out = tmp_path_factory.mktemp("convert_memory")
    return fullsize.write_family(out / "family", spec, seed=0, only=("slm",))["slm"]


def test_convert_peak_rss_is_bounded_by_the_packed_weight_bytes(mid_size_slm, tmp_path):
    packed = sum(p.stat().st_size for p in mid_size_slm.glob("*.safetensors"))
    assert packed > 150 * 2**20
    done = subprocess.run([sys.executable, "-c", CHILD, str(mid_size_slm), str(tmp_path / "convert")],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["summary"]["bitexact_all_equal"] and stats["summary"]["keep_size"] == VOCAB
    extra = (stats["peak_mb"] - stats["baseline_mb"]) * 2**20
    assert extra > 0.5 * packed  # convert did read the weights (a vacuous run would not)
    assert extra <= BOUND * packed, (f"convert held {extra / 2**20:.0f} MiB above its imports = "
                                     f"{extra / packed:.2f}x the {packed / 2**20:.0f} MiB checkpoint ({stats})")
    written = json.loads((tmp_path / "convert" / "report.json").read_text())
    data = sum(g["data_bytes"] for g in written["graphs"].values())
    assert data > packed / 2  # both graphs' INT4/INT8 weights were written (sanity of the case)
