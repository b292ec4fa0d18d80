#!/usr/bin/env bash
# Prepare .gpu/ for bench/gpu_check.sh, here on the CPU machine: what check reads of the main
# job's run (the embedded default, run first if it is not there), and the wheels the GPU image
# lacks for this package (its python3 holds torch, onnx, onnxruntime 1.30, accelerate, but
# transformers 5.17 with the hub it needs; this package needs transformers 5.24-5.25).
# Everything under .gpu/ is ignored by git and travels with `carry: [".gpu"]` (64 MiB in all with
# the working tree; this is ~40 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f runs/tiny/export/manifest.json ] || .venv/bin/hyco-convert run recipes/tiny.yaml
rm -rf .gpu && mkdir -p .gpu/run .gpu/whl
for stage in fixtures vocab answers convert; do cp -r "runs/tiny/$stage" .gpu/run/; done
mkdir -p .gpu/run/qat .gpu/run/export
find runs/tiny/qat -maxdepth 1 -type f -exec cp {} .gpu/run/qat/ \;  # not the captures: qat's own input
cp -r runs/tiny/export/bundle .gpu/run/export/
cp runs/tiny/export/manifest.json .gpu/run/export/
rm -f .gpu/run/export/bundle/*_qnn.bin .gpu/run/export/bundle/*_ctx.onnx  # the HTP's, not check's
cp runs/tiny/check/report.json .gpu/run/check_cpu.json  # the CPU run's MATs, for comparison
mkdir -p .gpu/run/calibrate  # bench_deployed's input: the deployed QDQ graphs and their io_spec
cp runs/tiny/calibrate/io_spec.json .gpu/run/calibrate/
for g in tree prefill mtp_step; do cp runs/tiny/calibrate/$g.qdq.onnx* .gpu/run/calibrate/; done
# The GPU image's Python is 3.12; each wheel below, then, is the one a 3.12 pip picks.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
  transformers==5.25.0 huggingface-hub==2.4.0 kernels==0.19.1 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 \
  click==8.5.1 hf-xet==1.8.0 tomlkit==0.15.3 regex==2026.12.2 idna==3.21 anyio==4.16.0 h11==0.16.0 \
  typing-extensions==4.16.0
du -sh .gpu .gpu/run .gpu/whl
