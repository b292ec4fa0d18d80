#!/usr/bin/env bash
# The GPU checks issues 38 and 39 wait for, as one call on a lent GPU machine (the library's
# `device`), after bench/gpu_prepare.sh here:
#     run(command="bash bench/gpu_check.sh", carry=[".gpu"], timeout_s=600)
# Each step has its own time limit and the script goes on past a failed one; everything lands in
# $OUT (8 files at most come back):
#   1. the CUDA tests (CUDA graph capture of the server sweep's verify pass, the torch QDQ
#      executor on CUDA eager and replayed, against onnxruntime);
#   2. the main job's check on the GPU path: the verifier on CUDA, the deployed drafters by the
#      torch executor (one CUDA graph a pass), the server sweep as CUDA graphs; its MATs beside
#      the CPU run's (.gpu/run/check_cpu.json);
#   3. the server sweep at the paper's verifier's shapes, the whole depth in BF16 (26B-A4B, then
#      31B), bench/bench_server.py;
#   4. the deployed drafters' per-pass cost by executor (bench/bench_deployed.py, tiny shapes).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
WHEELS=${WHEELS:-.gpu/whl}  # a rehearsal on a CPU machine of another Python gives its own wheels
SERVER_EXTRA=${SERVER_EXTRA:-}  # and shrinks the sweeps, e.g. "--device cpu --layers 2 --contexts 64 256"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1

# The image's python3 has torch; the wheels add transformers 5.25 and what it needs. The package
# itself is laid out as its pyproject's package-dir maps it (no build step, no setuptools needed);
# PYTHONSAFEPATH keeps the checkout's own hyco/ off the path.
SITE=/tmp/site
rm -rf "$SITE" && mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl || exit 1
cp -r hyco "$SITE/hyco"
for stage in convert qat calibrate vocab export runtime_check; do cp -r "$stage" "$SITE/hyco/$stage"; done
export PYTHONPATH="$SITE" PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 HYCO_CACHE=/tmp/hyco-cache
python3 - <<'PY' | tee "$OUT/env.txt"
import platform, torch, transformers, onnxruntime, onnx
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__,
      "onnxruntime", onnxruntime.__version__, "onnx", onnx.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
PY

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name (limit ${limit} s)"
  timeout "$limit" "$@"
  echo "=== $name: exit $? in $((SECONDS - start)) s"
}

step "cuda tests" 110 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="" \
  tests/test_server_timing.py tests/test_qdq_torch.py tests/test_bench_server.py -k "cuda or replayed or static_pass or stand_in or summary"

step "check on the GPU" 170 python3 -m hyco.pipeline.cli check --recipe recipes/tiny.yaml --run-dir .gpu/run --out /tmp/check --force
cp /tmp/check/report.json "$OUT/check_report.json" 2>/dev/null
cp /tmp/check/summary.md "$OUT/check_summary.md" 2>/dev/null
python3 - <<'PY' || true
import json
gpu, cpu = (json.load(open(p)) for p in ("/tmp/check/report.json", ".gpu/run/check_cpu.json"))
mat = lambda r: {n: c.get("mat") for n, c in r["configs"].items()}
g, c = mat(gpu), mat(cpu)
print("MAT, GPU vs CPU:", {n: (g.get(n), c.get(n)) for n in sorted(set(g) | set(c))})
PY

step "server sweep 26b-a4b" 160 python3 bench/bench_server.py --out /tmp/server-26b --model 26b-a4b $SERVER_EXTRA
cp /tmp/server-26b/bench_report.json "$OUT/server_26b.json" 2>/dev/null
step "server sweep 31b" 110 python3 bench/bench_server.py --out /tmp/server-31b --model 31b --contexts 64 1024 8192 --prefill 128 1024 4096 $SERVER_EXTRA
cp /tmp/server-31b/bench_report.json "$OUT/server_31b.json" 2>/dev/null

step "deployed drafters" 60 python3 bench/bench_deployed.py --calibrate .gpu/run/calibrate \
  --executors onnxruntime,torch:cpu,torch:cuda --passes 20 --out "$OUT/deployed.json"
echo "=== done"
