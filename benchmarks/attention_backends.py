"""Which SDPA backend the benchmark steps take, its GPU time per call and its per-shape plan cost.

For each attention shape the three model families give SDPA (bf16, CUDA), and each backend
(cuDNN, Flash, memory-efficient; `default` is SDPA's own choice): the backend SDPA picks
(`torch._fused_sdp_choice`), the first call at a shape never seen before in this process (wall
time around a synchronised call: a cuDNN plan is built there, the others launch a kernel), and
the steady GPU time per call (CUDA events, median of 7 loops of 20 calls after a warm-up, on
random inputs). Shapes:

- `llama`: the example Llama, q [1, 16, N, 64] over a 2048-slot cache view [1, 16, 2048, 64]
  (a slice of the 2049-slot buffer, not contiguous), no mask: N tokens of any batch, decode or
  mixed, are one query of length N;
- `rows`: a decode step of B requests, one query token each, over their own cache rows
  [B, 16, 1024, 64] with a boolean mask [B, 1, 1, 1024] (the step that writes its KV cache at
  index rows; HF Llama's static-cache decode calls SDPA the same way);
- `prefill`: a causal prompt of N tokens, q, k, v [1, 16, N, 64].

    python benchmarks/attention_backends.py --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._timing import time_steps  # noqa: E402

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
SIZES = {
    "llama": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    "rows": (1, 2, 3, 4, 5, 6, 7, 8, 32),
    "prefill": (16, 64, 256, 512),
}
HEADS, HEAD_DIM = 16, 64


def make_inputs(kind: str, n: int, seed: int) -> tuple[Any, ...]:
    """(q, k, v, mask, is_causal) of one shape of `kind`, random bf16 (each seed new memory)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    if kind == "llama":
        k, v = (rand(1, HEADS, 2049, HEAD_DIM)[:, :, :2048] for _ in range(2))
        return rand(1, HEADS, n, HEAD_DIM), k, v, None, False
    if kind == "rows":
        k, v = (rand(n, HEADS, 1024, HEAD_DIM) for _ in range(2))
        lengths = torch.randint(1, 1024, (n,), device="cuda", generator=g)
        mask = (torch.arange(1024, device="cuda") < lengths[:, None])[:, None, None, :]
        return rand(n, HEADS, 1, HEAD_DIM), k, v, mask, False
    q, k, v = (rand(1, HEADS, n, HEAD_DIM) for _ in range(3))
    return q, k, v, None, True


def chosen(kind: str, n: int) -> str:
    """The backend SDPA's dispatcher picks for this shape, by name."""
    q, k, v, mask, causal = make_inputs(kind, n, 0)
    names = {member.value: name for name, member in SDPBackend.__members__.items()}
    return names.get(torch._fused_sdp_choice(q, k, v, mask, 0.0, causal), "unknown")


def measure(kind: str, n: int, backend: str, seed: int) -> dict[str, Any]:
    """First call at a new shape (ms, wall) and steady GPU us per call, under one backend."""
    ctx = sdpa_kernel([BACKENDS[backend]]) if backend in BACKENDS else contextlib.nullcontext()
    q, k, v, mask, causal = make_inputs(kind, n, seed)

    def call() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    try:
        with ctx:
            torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            torch.cuda.synchronize()
            first_ms = (time.perf_counter() - start) * 1e3
            stats = time_steps(call, torch.device("cuda"), warmup=2, repeats=7, steps=20)
    except RuntimeError as exc:  # the backend does not take this shape
        return {"error": str(exc).splitlines()[0][:160]}
    return {"first_ms": round(first_ms, 3), "us": round(stats["median_ms"] * 1e3, 2)}


def run() -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    seed = 0
    for kind, sizes in SIZES.items():
        for n in sizes:
            row: dict[str, Any] = {"shape": kind, "n": n, "default_choice": chosen(kind, n)}
            # the default first, on a shape no backend has seen: its first call pays any plan
            for backend in ("default", *BACKENDS):
                seed += 1
                row[backend] = measure(kind, n, backend, seed)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"rows": rows, "summary": summarise(rows)}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per shape kind and backend: median first-call ms and median steady us."""
    out: dict[str, Any] = {}
    for kind in SIZES:
        mine = [r for r in rows if r["shape"] == kind]
        out[kind] = {"default_choice": sorted({r["default_choice"] for r in mine})}
        for backend in ("default", *BACKENDS):
            ok = [r[backend] for r in mine if "us" in r[backend]]
            if ok:
                out[kind][backend] = {
                    "first_ms_median": round(statistics.median(x["first_ms"] for x in ok), 2),
                    "us_median": round(statistics.median(x["us"] for x in ok), 1),
                    "shapes": len(ok),
                }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("attention_backends: needs CUDA")
        return 0
    torch.ones(1, device="cuda")  # the context first, outside every timing
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        **run(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention-backends.json").write_text(json.dumps(result, indent=1))
    for kind, per in result["summary"].items():
        cells = [
            f"{b}: first {v['first_ms_median']} ms, {v['us_median']} us"
            for b, v in per.items()
            if b != "default_choice"
        ]
        print(f"{kind} (SDPA picks {per['default_choice']}): " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
