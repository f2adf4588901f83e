"""Why a cgcompile step is slower than its hand-built ideal: kernels per step, GPU ms and host ms.

Compares, at 1, 8 and 1024 tokens on the benchmark model: the hand whole graph and hand
piecewise step (static Inductor compiles), and cgcompile FULL / PIECEWISE / FULL_AND_PIECEWISE
with an unbacked batch, FULL with a backed batch, and FULL / PIECEWISE with `compile_sizes`.
Writes DIR/diag.json and per-op tables of PIECEWISE at 1 and 8 tokens.

    python benchmarks/kernels_diag.py DIR
"""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

import cgcompile
from benchmarks._hand_graphs import HandFullGraph, HandPiecewise
from benchmarks._timing import gpu_time_per_step_ms, time_steps
from examples.llama import Llama, LlamaConfig, make_inputs

torch.backends.cuda.enable_cudnn_sdp(False)
dev = torch.device("cuda")
model = Llama(LlamaConfig.bench()).to("cuda", torch.bfloat16).eval()
W = [(1, True), (8, True), (1024, False)]
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
res = {}


def inputs(n, mark=True, unbacked=True):  # unbacked unless asked: the "FULL backed" row
    g = torch.Generator().manual_seed(1000 + n)
    t, p = make_inputs(model.cfg, n, "cuda", generator=g)
    if mark:
        cgcompile.mark_dynamic_batch(t, p, unbacked=unbacked)
    return t, p


def host_ms(step, n=30):
    h = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        h.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(h)


def measure(name, make_step):
    for n, uni in W:
        try:
            step = make_step(n, uni)
            for _ in range(3):
                step()
            t = time_steps(step, dev, 3, 10, 10)
            k = gpu_time_per_step_ms(step, dev, 5)
            r = dict(
                ms=round(t["median_ms"], 3),
                host=round(host_ms(step), 3),
                gpu=round(k["median_ms"], 3),
                kern=k["kernels_per_step"],
            )
        except Exception as e:
            r = dict(error=repr(e)[:300])
        res[f"{name}@{n}"] = r
        print(f"{name:28} n={n:<5} {r}", flush=True)


def cg(name, mode, unbacked=True, **opts):
    torch._dynamo.reset()
    t0 = time.perf_counter()
    f = torch.compile(
        model,
        backend="cudagraph_modes",
        options={"cudagraph_mode": mode, "max_cudagraph_capture_size": 1024, **opts},
    )

    def make(n, uni):
        t, p = inputs(n, unbacked=unbacked)

        def step():
            with cgcompile.batch_hint(uniform_decode=uni):
                return f(t, p)

        return step

    with torch.no_grad():
        measure(name, make)
    print(f"  {name} total {time.perf_counter() - t0:.1f}s", flush=True)


with torch.no_grad():
    torch._dynamo.reset()
    hand = HandFullGraph(model)
    measure("hand_full", lambda n, u: hand.step_for(*inputs(n, mark=False)))
    torch._dynamo.reset()
    hp = HandPiecewise(model)
    measure("hand_piecewise", lambda n, u: hp.step_for(*inputs(n, mark=False)))
cg("FULL", "FULL")
cg("FULL+sizes", "FULL", compile_sizes=[1, 8, 1024])
cg("FULL backed", "FULL", unbacked=False)
cg("PIECEWISE", "PIECEWISE")
cg("PIECEWISE+sizes", "PIECEWISE", compile_sizes=[1, 8, 1024])
cg("F&P", "FULL_AND_PIECEWISE")

# where PIECEWISE n=1 spends host time
torch._dynamo.reset()
f = torch.compile(
    model,
    backend="cudagraph_modes",
    options={"cudagraph_mode": "PIECEWISE", "max_cudagraph_capture_size": 1024},
)
with torch.no_grad():
    for n in (1, 8):
        t, p = inputs(n)
        for _ in range(5):
            f(t, p)
        torch.cuda.synchronize()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(5):
                f(t, p)
            torch.cuda.synchronize()
        tab = prof.key_averages().table(sort_by="count", row_limit=25)
        (out / f"pw-{n}.txt").write_text(tab)
        pass
(out / "diag.json").write_text(json.dumps(res, indent=1))
print("SUMMARY")
[print(k, v) for k, v in res.items()]
