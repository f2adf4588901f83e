"""What SDPA costs on the host while a CUDA graph is recorded: is it the first call at a new
shape (a plan built per shape) or every call (something per call under capture)?

The example Llama's attention (bf16, 16 heads of 64, a 2048-row KV cache sliced from a cache
with a trash slot: a strided view, no mask), for query lengths not seen before and seen before,
outside a capture and inside one (16 calls per capture, as one full graph of 16 layers makes).
Host milliseconds per call, the GPU synchronised before each block; torch picks the kernel, as
it does for a user (`torch._fused_sdp_choice` is printed). GPU only.

    python benchmarks/cudnn_capture.py [--no-cudnn-sdp]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

HEADS, HEAD_DIM, CACHE = 16, 64, 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-cudnn-sdp", action="store_true")
    args = parser.parse_args()
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    options = {"device": "cuda", "dtype": torch.bfloat16}
    k_cache = torch.randn(1, HEADS, CACHE + 1, HEAD_DIM, **options)
    v_cache = torch.randn_like(k_cache)

    def attention(q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k_cache[:, :, :CACHE], v_cache[:, :, :CACHE])

    def query(n: int) -> torch.Tensor:
        return torch.randn(1, HEADS, n, HEAD_DIM, **options)

    q = query(8)
    choice = torch._fused_sdp_choice(q, k_cache[:, :, :CACHE], v_cache[:, :, :CACHE])
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, sdp choice {choice}")
    attention(q)  # library load, first plan
    torch.cuda.synchronize()

    def per_call_ms(n: int, capture: bool) -> tuple[float, float]:
        """(first call, mean of the 15 after it) in host ms, for query length n."""
        q = query(n)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        times = []
        torch.cuda.synchronize()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if capture:
                graph.capture_begin()
            for _ in range(16):
                start = time.perf_counter()
                attention(q)
                times.append((time.perf_counter() - start) * 1e3)
            if capture:
                graph.capture_end()
        torch.cuda.synchronize()
        return times[0], sum(times[1:]) / 15

    rows = [
        ("eager, new length", [per_call_ms(n, False) for n in (3, 5, 7, 9)]),
        ("eager, seen length", [per_call_ms(n, False) for n in (3, 5, 7, 9)]),
        ("captured, new length", [per_call_ms(n, True) for n in (11, 13, 15, 17)]),
        ("captured, seen length", [per_call_ms(n, True) for n in (11, 13, 15, 17)]),
        ("captured, seen eagerly only", [per_call_ms(n, True) for n in (3, 5, 7, 9)]),
    ]
    print(f"{'host ms per SDPA call':32} {'first':>8} {'next 15':>8}")
    for name, values in rows:
        first = sum(v[0] for v in values) / len(values)
        rest = sum(v[1] for v in values) / len(values)
        print(f"{name:32} {first:8.3f} {rest:8.3f}")


if __name__ == "__main__":
    main()
