#!/usr/bin/env bash
# Everything that needs the GPU, in one go: GPU tests, the quickstart on real graphs, the
# benchmark. Full logs go to $1 (default $OUT or ./out); a short summary is printed last.
#   bash tests/gpu/run_all.sh "$OUT" [--quick]
set -uo pipefail
out="${1:-${OUT:-out}}"; shift || true
mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PWD}"
# the entry point makes backend="cudagraph_modes" resolve by name, as for a user
pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || true
export CGCOMPILE_COMMIT="${CGCOMPILE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/cgcompile-inductor-cache}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python -c "import torch; print(torch.__version__, torch.version.cuda)" >> "$out/gpu.txt" 2>&1

python -m pytest -q tests/gpu -p no:cacheprovider --junitxml="$out/gpu-tests.xml" \
  > "$out/gpu-tests.log" 2>&1
tests_rc=$?
python examples/quickstart.py > "$out/quickstart.log" 2>&1
quick_rc=$?
python benchmarks/decode.py --out "$out" "$@" > "$out/benchmark.log" 2>&1
bench_rc=$?

echo "== summary"
cat "$out/gpu.txt"
echo "gpu tests (rc=$tests_rc): $(tail -n 1 "$out/gpu-tests.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu-tests.log" | head -20
echo "quickstart (rc=$quick_rc): $(tail -n 1 "$out/quickstart.log")"
echo "benchmark (rc=$bench_rc):"; tail -n 40 "$out/benchmark.log"
exit $(( tests_rc || quick_rc || bench_rc ))
