#!/usr/bin/env bash
# Everything that needs the GPU, in one go. Default stages: GPU tests, the quickstart on real
# graphs, host time per call (host), the decode loop users see (loop), the Hugging Face
# generate() benchmark (hf); on request: the per-mode decode benchmark (bench), step profiles
# (profile), paths, interleaved, diag. Full logs go to $1 (default $OUT or ./out); a short
# summary is printed last. STAGES picks a subset (e.g. STAGES="tests host") to fit a time limit;
# SHARDS=3 runs the GPU tests in three processes at once (about a third of the wall time), each
# logging to gpu-tests-K.log, stopped after TESTS_TIMEOUT seconds if given. PARALLEL=1 runs the
# stages tests, loop and hf side by side (compiles overlap, timed phases take turns:
# benchmarks/_turns.py); ARCHIVE=1 packs every result but summary.txt into all.tgz (a device run
# returns at most 8 files); DEADLINE=s starts no stage after s seconds (the archive still gets
# made within a device call's limit).
#   bash tests/gpu/run_all.sh "$OUT" [benchmark args, e.g. --quick]
# On a copied checkout whose git metadata may be stale, give the commit yourself:
#   CGCOMPILE_COMMIT=abc1234 bash tests/gpu/run_all.sh "$OUT"   (the tree digest is printed too)
set -uo pipefail
out="${1:-${OUT:-out}}"; shift || true
stages="${STAGES:-tests quickstart host loop hf}"
mkdir -p "$out"
: > "$out/summary.txt"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PWD}"
# the entry point makes backend="cudagraph_modes" resolve by name, as for a user
python -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 ||
  echo "install failed: see install.log" >> "$out/summary.txt"
python -c "import torch; torch._dynamo.lookup_backend('cudagraph_modes')" >> "$out/install.log" 2>&1 ||
  echo "backend 'cudagraph_modes' not registered: see install.log" >> "$out/summary.txt"
export CGCOMPILE_COMMIT="${CGCOMPILE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
# the files themselves: a copied checkout's git metadata can be older than its files
export CGCOMPILE_TREE="$(bash tests/gpu/tree_digest.sh)"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/cgcompile-inductor-cache}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python -c "import torch; print(torch.__version__, torch.version.cuda)" >> "$out/gpu.txt" 2>&1
rc=0
run() {  # run STAGE LOG CMD...: record its exit code and last line
  local stage=$1 log=$2; shift 2
  case " $stages " in *" $stage "*) ;; *) return ;; esac
  if [ -n "${DEADLINE:-}" ] && [ "$SECONDS" -gt "$DEADLINE" ]; then  # DEADLINE=s: start no more
    echo "$stage: $log not run (past DEADLINE=$DEADLINE s)" >> "$out/summary.txt"; return
  fi
  "$@" > "$out/$log" 2>&1
  local code=$?
  rc=$(( rc || code ))
  echo "$stage (rc=$code): $(tail -n 1 "$out/$log")" >> "$out/summary.txt"
}
gpu_tests() {  # SHARDS=k: k pytest processes at once on the one GPU (compiles are CPU-bound)
  local shards=${SHARDS:-1} dir k pids=() code=0
  if [ "$shards" -le 1 ]; then
    python -m pytest -q tests/gpu -p no:cacheprovider --durations=15 --junitxml="$out/gpu-tests.xml"
    return
  fi
  dir=$(mktemp -d)
  python -m pytest --collect-only -q tests/gpu -p no:cacheprovider | grep '::' > "$dir/ids"
  for ((k = 0; k < shards; k++)); do
    awk -v n="$shards" -v k="$k" 'NR % n == k' "$dir/ids" > "$dir/ids-$k"
    mapfile -t ids < "$dir/ids-$k"
    # each shard logs under $out as it runs: a device call cut off at its limit still returns them
    timeout "${TESTS_TIMEOUT:-3000}" python -m pytest -q -p no:cacheprovider --durations=5 \
      "${ids[@]}" > "$out/gpu-tests-$k.log" 2>&1 &
    pids+=($!)
  done
  for k in "${!pids[@]}"; do wait "${pids[$k]}" || code=1; done
  echo "shards: $(for ((k = 0; k < shards; k++)); do tail -n 1 "$out/gpu-tests-$k.log"; done | tr '\n' ' ')"
  return $code
}
if [ -n "${PARALLEL:-}" ]; then
  # tests, loop and hf side by side: every process compiles at once and times alone
  # (benchmarks/_turns.py); the GPU tests count as preparing while they run. Host time per call
  # runs after them, alone: beside other processes' idle CUDA contexts it read 2-5x high
  # (2026-12-02, bare replay included)
  export CGBENCH_TURNS="$(mktemp -d)"
  pids=()
  ( touch "$CGBENCH_TURNS/preparing-$BASHPID"; run tests gpu-tests.log gpu_tests ) & pids+=($!)
  for model in 4x512 16x1024; do
    extra=(); [ "$model" = 16x1024 ] && extra=(--piecewise)
    run loop "decode-loop-$model.log" python benchmarks/decode_loop.py --out "$out" \
      --models "$model" "${extra[@]}" & pids+=($!)
  done
  run hf hf-generate.log python benchmarks/hf_generate.py --out "$out" & pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  stages=" ${stages//tests/} "; stages="${stages// loop / }"; stages="${stages// hf / }"
fi
run tests gpu-tests.log gpu_tests
# host us per call, one process per peer (16 layers), and the decode loop users see
run host host-per-call.log python benchmarks/host_per_call.py --out "$out" --layers 16 --rounds 2
# not in the default stages (each fits one device call, ~5 min): the 64-layer peers (STAGES=host64)
run host64 host-per-call-64.log python benchmarks/host_per_call.py --out "$out/host64" \
  --layers 64 --rounds 2
# not in the default stages: the default call's host time split into guards, the rest of Dynamo
# and cgcompile's share, beside guarded, trusted and the 10-line backend, 16 and 64 layers,
# three families, one process each, two rounds (STAGES=guards, ~8 min; GUARDS_VARIANTS="default
# no-guards tenline" GUARDS_ROUNDS=1 adds Dynamo's path without guards, the floor of any backend)
run guards guard-costs.log python benchmarks/guard_costs.py --out "$out/guards" --cuda \
  --rounds "${GUARDS_ROUNDS:-2}" --variants ${GUARDS_VARIANTS:-default tenline}
run loop decode-loop.log python benchmarks/decode_loop.py --out "$out" --piecewise
# not in the default stages: the decode loop on the three model families at 16 and 64 layers
# (STAGES=loop3): a process per family and depth, compiles side by side, timed phases in turns
# (benchmarks/_turns.py); the opt-ins wrap the default peer's compiled model (--share). Five
# cells took 9.7 min on an H100; LOOP3_CELLS="hf-llama:64x1024" runs the sixth in a call of its own
# (its compiles and batch 1 filled 420 s at LOOP3_ROUNDS=4: LOOP3_BATCHES=8 for the other half)
case " $stages " in *" loop3 "*)
  export CGBENCH_TURNS="${CGBENCH_TURNS:-$(mktemp -d)}"
  pids=()
  for cell in ${LOOP3_CELLS:-llama:16x1024 rows:16x1024 hf-llama:16x1024 llama:64x1024 \
      rows:64x1024 hf-llama:64x1024}; do
    family=${cell%%:*} model=${cell#*:}
    run loop3 "decode-loop-$family-$model.log" timeout "${LOOP3_TIMEOUT:-540}" \
      python benchmarks/decode_loop.py --out "$out/loop3" --family "$family" --models "$model" \
      --peers hand reduce-overhead cg/FULL cg/FULL/guarded cg/FULL/trusted --share \
      --rounds "${LOOP3_ROUNDS:-6}" --steps 32 --batches ${LOOP3_BATCHES:-1 8} & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done ;;
esac
run quickstart quickstart.log python examples/quickstart.py
# not in the default stages: Inductor's pieces back in a fresh process, through its caches or
# from bundled artifacts (STAGES=pieceload, ~2 min)
run pieceload piece-load.log python benchmarks/piece_load.py --out "$out"
run bench benchmark.log python benchmarks/decode.py --out "$out" "$@"
run hf hf-generate.log python benchmarks/hf_generate.py --out "$out"
run profile profile.log python benchmarks/profile_step.py
# FULL_AND_PIECEWISE first this time: its mixed batches ran 2x slower when profiled second
run profile profile-mixed.log python benchmarks/profile_step.py \
  --modes FULL_AND_PIECEWISE PIECEWISE --tokens 64 --mixed
# not in the default stages: host Python time of a PIECEWISE step on both paths (STAGES=paths)
run paths paths.log python benchmarks/profile_step.py --modes PIECEWISE --paths fx partition partition fx \
  --python --out "$out/paths"
# not in the default stages: peers timed in turns in one process, for ratios to ~1%
# (STAGES=interleaved: FULL against FULL_AND_PIECEWISE on each path, decode 1-128 tokens;
# PIECEWISE on both paths, mixed batches of 64-1024 tokens)
run interleaved interleaved.log python benchmarks/interleaved.py --out "$out"
run interleaved interleaved-mixed.log python benchmarks/interleaved.py --out "$out" --mixed \
  --peers PIECEWISE PIECEWISE/partition
# not in the default stages: batch 1 padded into the dynamic graph against its own compile,
# decode steps timed in turns in one process (STAGES=batchone), and the 4-layer decode loop
# alone (STAGES=loop4: about 2 minutes)
run batchone interleaved-batch-one.log python benchmarks/interleaved.py --out "$out/batch-one" \
  --peers FULL_AND_PIECEWISE FULL_AND_PIECEWISE/own
run loop4 decode-loop-4x512.log python benchmarks/decode_loop.py --out "$out" --models 4x512 \
  --profile
# not in the default stages: time to ready from fresh processes, cold, warm on the same
# caches, warm from a saved compile cache (STAGES=coldwarm)
run coldwarm cold-warm.log python benchmarks/cold_warm.py --out "$out"
# warm restart: cold and warm just in time, then precompiled (STAGES=aot: about 4 minutes)
run aot cold-warm-aot.log python benchmarks/cold_warm.py --out "$out" --soak 200 \
  --phases cold warm-local aot-cold aot-warm-local aot-warm-file
# not in the default stages: a FULL call against a hand graph of the same model, 16 and 64
# layers, batch 1 padded to 2 rows and compiled on its own (STAGES=backendcall: ~4 minutes)
run backendcall backend-call.log python benchmarks/profile_backend_call.py
run backendcall backend-call-own.log python benchmarks/profile_backend_call.py --batch-one own
# the cold phase again with cuDNN attention off (STAGES=coldwarm-nocudnn): what it costs capture_all
run coldwarm-nocudnn cold-warm-no-cudnn.log python benchmarks/cold_warm.py --out "$out" \
  --phases cold --soak 200 --no-cudnn-sdp
# not in the default stages: start-up (STAGES=startup, ~5 min): which SDPA backend each shape
# takes and its plan cost; the step time of every size 1..512 under each capture grid; time to
# ready with the default grid (cold, precompiled), with the old 51-size grid, with eager pieces
case " $stages " in *" startup "*|*" families "*|*" fast4 "*|*" hfcold "*) export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$(mktemp -d)}" ;; esac
run startup attention-backends.log python benchmarks/attention_backends.py --out "$out"
run startup capture-grid.log python benchmarks/capture_grid.py --out "$out"
run startup cold-warm-grid.log python benchmarks/cold_warm.py --out "$out/grid" --soak 200 \
  --phases cold aot-cold aot-warm-local
old='[1, 2, 4, '"$(seq -s ', ' 8 8 248)"', '"$(seq -s ', ' 256 16 512)"']'
run startup cold-warm-old-grid.log python benchmarks/cold_warm.py --out "$out/old-grid" --soak 0 \
  --no-prime --phases cold --options "{\"cudagraph_capture_sizes\": $old}"
run startup cold-warm-eager.log python benchmarks/cold_warm.py --out "$out/eager" --soak 0 \
  --no-prime --phases cold aot-cold aot-warm-local --options '{"compiler": "eager"}'
# not in the default stages: FULL_AND_PIECEWISE's decode steps against FULL's, one process per
# model family, peers in turns, then each peer's kernels against FULL's (STAGES=fpfull, ~4 min)
for family in ${FPFULL_FAMILIES:-llama rows hf-llama hf-qwen3}; do
  run fpfull "fp-vs-full-$family.log" python benchmarks/fp_vs_full.py --out "$out" --family "$family" \
    --kernels
done
# not in the default stages: calls served while capture_all(background=True) runs, its GPU
# tests first, each family against a control process (STAGES=background, ~8 min)
run background background-tests.log python -m pytest -q -p no:cacheprovider \
  tests/gpu/test_background_cuda.py
for family in llama rows hf-llama hf-qwen3; do
  run background "background-capture-$family.log" python benchmarks/background_capture.py \
    --out "$out" --family "$family"
done
# not in the default stages: time to ready on the other model families, the KV-rows step and
# HF Llama and Qwen3 cold and precompiled (STAGES=families)
run families cold-warm-rows.log python benchmarks/cold_warm.py --out "$out/rows" --family rows \
  --soak 200 --phases cold aot-cold aot-warm-local
for family in hf-llama hf-qwen3; do
  run families "cold-warm-$family.log" python benchmarks/cold_warm.py --out "$out/$family" \
    --family "$family" --soak 50 --no-prime --phases cold aot-cold aot-warm-local
done
# not in the default stages: the KV-rows step precompiled, twice (compile-cache hits and misses
# of each warm rebuild in its report lines; STAGES=rowsaot, ~4 min; ROWSAOT_RUNS=1 for one)
for i in $(seq "${ROWSAOT_RUNS:-2}"); do
  run rowsaot "aot-rows-$i.log" python benchmarks/cold_warm.py --out "$out/aot-rows-$i" \
    --family rows --no-prime --soak 0 --phases aot-cold aot-warm-local aot-warm-file
done
# not in the default stages: the fastest start on every family, one process each, Python's
# bytecode primed (by the first run of each kind; the others read it): eager pieces (no
# Inductor), then Inductor on the HF families; their batch marked (STAGES=fast4, ~5 min)
for family in hf-llama hf-qwen3 llama rows; do
  extra=(); case $family in hf-*) extra=(--marked) ;; esac
  [ "$family" = hf-llama ] || extra+=(--no-prime)
  run fast4 "cold-eager-$family.log" python benchmarks/cold_warm.py --out "$out/eager-$family" \
    --family "$family" "${extra[@]}" --soak 0 --phases cold --options '{"compiler": "eager"}'
done
for family in hf-llama hf-qwen3; do
  extra=(); [ "$family" = hf-qwen3 ] && extra=(--no-prime)
  run fast4 "cold-inductor-$family.log" python benchmarks/cold_warm.py --out "$out/$family" \
    --family "$family" --marked "${extra[@]}" --soak 0 --phases cold
done
# not in the default stages: Inductor on the HF families alone, batch marked (STAGES=hfcold, ~2 min)
for family in hf-llama hf-qwen3; do
  extra=(); [ "$family" = hf-qwen3 ] && extra=(--no-prime)
  run hfcold "cold-inductor-$family.log" python benchmarks/cold_warm.py --out "$out/$family" \
    --family "$family" --marked "${extra[@]}" --soak 50 --phases cold
done
# not in the default stages: where a warm restart's load goes, under cProfile (the example Llama
# precompiled, cold then warm on the same caches; the top of each profile printed; STAGES=warmprof)
run warmprof cold-warm-warmprof.log python benchmarks/cold_warm.py --out "$out/warmprof" \
  --soak 0 --phases aot-cold aot-warm-local --profile-first "$out/warmprof/prof"
run warmprof warm-load-profile.log python -c 'import pstats, sys
for name in ("precompile", "capture-all"):
    print("==", name); stats = pstats.Stats(f"{sys.argv[1]}/{name}-aot-warm-local.prof")
    stats.sort_stats("cumulative").print_stats(60); stats.sort_stats("tottime").print_stats(25)' "$out/warmprof/prof"
# not in the default stages: eager pieces cold with cuDNN attention off, the batch unbacked (one
# Dynamo trace for every size; and precompiled) against backed, the example Llama and KV rows
# (STAGES=fastub, ~3.5 min; FASTUB_FAMILIES="hf-llama hf-qwen3": HF, batch and caches marked;
# FASTUB_MARKINGS=unbacked for one marking)
case " $stages " in *" fastub "*|*" hfub "*)
  export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$(mktemp -d)}" ;; esac
prime=()
primes() {  # primes STAGE: the first selected run primes Python's bytecode, later ones read it
  prime=(); case " $stages " in *" $1 "*) ;; *) return ;; esac
  [ -n "${primed:-}" ] && prime=(--no-prime); primed=1
}
for family in ${FASTUB_FAMILIES:-llama rows}; do
  for marking in ${FASTUB_MARKINGS:-unbacked backed}; do
    primes fastub; extra=("${prime[@]}" --phases cold)
    [ "$marking" = unbacked ] && extra=("${prime[@]}" --unbacked --phases cold aot-cold aot-warm-local)
    case $family in hf-*) extra+=(--marked) ;; esac
    run fastub "cold-eager-nocudnn-$family-$marking.log" python benchmarks/cold_warm.py \
      --out "$out/fastub-$family-$marking" --family "$family" "${extra[@]}" --soak 50 \
      --no-cudnn-sdp --options '{"compiler": "eager"}'
  done
done
# not in the default stages: Inductor (default options) cold on the HF families, batch and caches
# marked unbacked: one Dynamo trace; cuDNN attention off, without which torch 2.11 breaks the
# graph at every SDPA call of an unbacked batch (cgcompile/dynamic.py) (STAGES=hfub, ~2 min)
for family in hf-llama hf-qwen3; do
  primes hfub
  run hfub "cold-inductor-unbacked-$family.log" python benchmarks/cold_warm.py \
    --out "$out/hfub-$family" --family "$family" --marked --unbacked "${prime[@]}" \
    --soak 50 --no-cudnn-sdp --phases cold
done
# not in the default stages: where a cold start with eager pieces goes, under cProfile (the
# example Llama; the top of its first call and capture_all printed; STAGES=coldprof)
run coldprof cold-eager-profile.log python benchmarks/cold_warm.py --out "$out/coldprof" \
  --soak 0 --phases cold --options '{"compiler": "eager"}' --profile-first "$out/coldprof/prof"
run coldprof cold-eager-profile-top.log python -c 'import pstats, sys
for name in ("first-call", "capture-all"):
    print("==", name); stats = pstats.Stats(f"{sys.argv[1]}/{name}-cold.prof")
    stats.sort_stats("cumulative").print_stats(60); stats.sort_stats("tottime").print_stats(25)' \
  "$out/coldprof/prof"
# not in the default stages: where the time of a step goes, row by row (STAGES=diag, ~4 min)
run diag diag.log python benchmarks/kernels_diag.py --out "$out/diag" --trace
# not in the default stages: the precompiled HF Llama's saver and loader, three pairs of fresh
# processes, each call's digest printed when a pair differs; then two cold savers (STAGES=digests,
# ~4 min)
for i in 1 2 3; do
  run digests "digests-$i.log" python -m pytest -q -p no:cacheprovider \
    tests/gpu/test_precompile_cuda.py -k hugging_face
done
run digests digests-cold.log python -c 'import json, tempfile; from pathlib import Path
from tests.unit.test_precompile import run_hf
for i in range(2):  # two cold savers, each on empty caches: does a cold compile repeat itself?
    r = run_hf(Path(tempfile.mkdtemp()) / "x.cgaot", "Llama", "--cuda", "--compiler", "inductor")
    print("cold saver", i, json.dumps({k: r[k] for k in ("digests", "tuned_kernels", "max_error")}))'

echo "== summary (commit $CGCOMPILE_COMMIT, tree digest $CGCOMPILE_TREE)"
cat "$out/gpu.txt" "$out/summary.txt"
grep -hE "^(FAILED|ERROR)" "$out"/gpu-tests*.log 2>/dev/null | head -20
grep -ho "'digests': \[[^]]*\]" "$out"/digests-*.log 2>/dev/null
grep -h "^cold saver" "$out/digests-cold.log" 2>/dev/null
grep -h "compile cache" "$out"/aot-rows-*.log 2>/dev/null
[ -f "$out/benchmark.log" ] && tail -n 12 "$out/benchmark.log"
[ -f "$out/hf-generate.log" ] && tail -n 8 "$out/hf-generate.log"
[ -f "$out/host-per-call.log" ] && cat "$out/host-per-call.log"
cat "$out"/decode-loop*.log 2>/dev/null | grep "us/token"
# at most 8 files come back from a device run: everything but the summary goes in one archive
if [ -n "${ARCHIVE:-}" ]; then
  (cd "$out" && tar czf all.tgz --exclude summary.txt --exclude all.tgz . &&
    find . -mindepth 1 ! -name summary.txt ! -name all.tgz -delete)
fi
exit $rc
