"""What moving a held output out of graph memory costs on the host (GPU only).

A caller that keeps the last call's logits bound during the next call (`logits = model(x)` in
a loop) makes each call move a copy of them out of graph memory first (`runtime/outputs.py`).
This times, with the GPU idle before each call (median of 300), a bare replay, clones of
graph-pool and ordinary tensors, other copies, and `Outputs.release` + `hand_out` around a
replay, for one row of bf16 logits over a 32000-token vocabulary.

    python benchmarks/held_output_copy.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.host_per_call import host_us  # noqa: E402
from cgcompile.calls.outputs import Outputs  # noqa: E402


def median_us(fn: Callable[[], Any], calls: int = 300) -> float:
    for _ in range(30):  # warm-up
        fn()
    return host_us(fn, calls)


class _Plan:
    handed_outputs, batch_outputs, buffer_outputs = (0,), (0,), ()


def main() -> None:
    torch.manual_seed(0)
    w = torch.randn(512, 32000, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x @ w
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = x @ w
    other = torch.randn(1, 32000, device="cuda", dtype=torch.bfloat16)
    buf = torch.empty_like(out)

    def clone_and_move() -> None:
        t = out.detach()
        c = t.clone()
        t.set_(c.untyped_storage(), c.storage_offset(), c.shape, c.stride())

    outputs = Outputs(_Plan())
    keep = [outputs.hand_out([out], 1, 1)[0]]

    def held_call() -> None:  # what a call does when the caller holds the last output
        if outputs.still_held():
            outputs.release()
        graph.replay()
        keep[0] = outputs.hand_out([out], 1, 1)[0]

    rows = {
        "bare replay": median_us(graph.replay),
        "clone of the graph output": median_us(out.clone),
        "clone of an ordinary tensor": median_us(other.clone),
        "empty_like": median_us(lambda: torch.empty_like(out)),
        "copy_ into an existing tensor": median_us(lambda: buf.copy_(out)),
        "detach + clone + set_": median_us(clone_and_move),
        "release + replay + hand_out": median_us(held_call),
    }
    for name, us in rows.items():
        print(f"{name:32} {us:7.1f} us")


if __name__ == "__main__":
    main()
