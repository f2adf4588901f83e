"""Compile a small Llama-style model with the `cudagraph_modes` backend in every mode.

Runs batch sizes 1, 3, 8, 17 and 40 (40 is above the largest capture size, 32: no graph) as
decode and as mixed batches, three calls each (the first call of a size warms up without a
graph, the second captures, the third replays), checks every output against eager, and prints
what the backend did: pieces, resolved mode and why, graphs captured, eager fallbacks. On a
machine without a GPU the simulated graph runtime stands in for CUDA graphs (same capture and
replay semantics) and the pieces run eagerly unless `--compiler inductor` is given.

    python examples/quickstart.py                       # about 20 s on a CPU
    python examples/quickstart.py --compiler inductor   # Inductor's pieces, as on a GPU
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cgcompile
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch

SIZES = (1, 3, 8, 17, 40)
EXPECTED = (
    "WARNINGs that a batch runs without CUDA graphs are expected: 40 tokens exceed the largest\n"
    "capture size (32), and FULL_DECODE_ONLY has no graphs for mixed batches"
)


def run_mode(model: Llama, mode: str, device: str, runtime: str, compiler: str) -> bool:
    torch._dynamo.reset()
    max_size = 32
    options = {
        "cudagraph_mode": mode,
        "graph_runtime": runtime,
        "max_cudagraph_capture_size": max_size,
        "compiler": compiler,
    }
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    before = cgcompile.counters.snapshot()
    ok = True
    for n in SIZES:
        for uniform in (True, False):
            tokens, positions = make_inputs(model.cfg, n, device)
            # dynamic batch, kernels tuned for the largest size, padded rows write the trash slot
            mark_batch(model.cfg, tokens, positions, hint=max_size)
            good = True
            # call 1 of a size warms up (no graph), call 2 captures and replays, then replays
            for _ in range(3):
                with torch.no_grad(), cgcompile.batch_hint(uniform_decode=uniform):
                    got = compiled(tokens, positions).clone()
                    want = model(tokens, positions)  # writes the same cache entries again
                good &= torch.allclose(got, want, rtol=1e-3, atol=1e-3)
            ok &= good
            kind = "decode" if uniform else "mixed"
            print(f"  {kind:6} n={n:<4} {'ok' if good else 'MISMATCH'}")
    after = cgcompile.counters.snapshot()
    # in compile order: batch 1 came first, so Dynamo's batch-1 graph is graph 0 and compiled
    # on its own (its report says why); the dynamic graph serves every other size
    for graph in sorted(cgcompile.compiled_graphs(), key=lambda graph: graph.report_id):
        print(graph.format_report())
    print(f"  counters: { {k: after[k] - before[k] for k in after if after[k] != before[k]} }")
    return ok


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runtime = "cuda" if device == "cuda" else "simulated"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--compiler",
        choices=("inductor", "eager"),
        default="inductor" if device == "cuda" else "eager",
        help="how pieces are compiled; default: inductor on a GPU, eager on a CPU, where "
        "Inductor's C++ builds take about a minute for the five modes",
    )
    compiler = parser.parse_args().compiler
    print(
        f"cgcompile quickstart: torch {torch.__version__}, device {device}, runtime {runtime}, "
        f"compiler {compiler}"
    )
    print(EXPECTED)
    model = Llama(LlamaConfig.tiny()).to(device).eval()
    results = {}
    for mode in cgcompile.CUDAGraphMode:
        print(f"\n== cudagraph_mode={mode.name}")
        results[mode.name] = run_mode(model, mode.name, device, runtime, compiler)
    print("\nsummary: " + ", ".join(f"{m} {'ok' if r else 'FAILED'}" for m, r in results.items()))
    if all(results.values()):
        print("all checks passed")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
