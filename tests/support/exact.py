"""Exact-by-default checks shared by the CPU (simulated graphs) and GPU (real graphs) tests:
a model broken into several graphs that calls one graph twice per step, outputs kept across
calls, state written at rows chosen by a batch input, train-mode batch norm, a float attribute
that Dynamo passes as a tensor. Each compares outputs and state with eager after every call."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

import torch

import cgcompile
from tests.support.state import CAPTURE_SIZES, compile_model, row_attention


def decode():
    return cgcompile.batch_hint(uniform_decode=True)  # FULL_DECODE_ONLY's graphs need it


def dynamo_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _repeat(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    torch._dynamo.graph_break()  # the rest of this function is a graph of its own
    return torch.cat([y, y], dim=-1) + 1


class BrokenUp(torch.nn.Module):
    """Calls `_repeat` for keys and for values: its second graph runs twice per step, and the
    first call's output is read after the second call."""

    def __init__(self) -> None:
        super().__init__()
        self.k = torch.nn.Linear(8, 8)
        self.v = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = _repeat(self.k(x))
        v = _repeat(self.v(x))
        return row_attention(k * 3 + v)


BROKEN_SHAPES = [(3, 6), (3, 6), (3, 9), (3, 4), (3, 9), (4, 9), (4, 6), (2, 9), (4, 9)]


def check_broken_up(mode: str, compiler: str, device: str = "cpu", runtime: str = "simulated"):
    torch.manual_seed(0)
    model = BrokenUp().to(device).eval()
    options = {
        "graph_runtime": runtime,
        "cudagraph_mode": mode,
        "compiler": compiler,
        "cudagraph_capture_sizes": CAPTURE_SIZES,
    }
    compiled = torch.compile(model, backend="cudagraph_modes", options=options, dynamic=True)
    with torch.no_grad(), decode():
        for shape in BROKEN_SHAPES:
            x = torch.randn(*shape, 8, device=device)
            torch.testing.assert_close(compiled(x), model(x))
    assert cgcompile.counters.num_cudagraph_captured > 0


def double(x: torch.Tensor) -> torch.Tensor:
    return row_attention(x) * 2


def calls_keeping(
    mode: str,
    keep: Callable,
    device: str = "cpu",
    runtime: str = "simulated",
    calls: int = 6,
    rows: int = 4,
) -> None:
    """Calls the compiled `double` on fresh inputs of `rows` rows (3: padded to the capture
    size 4); `keep(out)` is what the caller holds on to, compared with eager's after the last
    call."""
    compiled = compile_model(double, mode, runtime=runtime)
    kept, want = [], []
    with torch.no_grad(), decode():
        for _ in range(calls):
            x = torch.randn(rows, 4, device=device)
            cgcompile.mark_dynamic_batch(x)
            kept.append(keep(compiled(x)))
            want.append(keep(double(x)))
    torch.testing.assert_close(kept, want)


class IndexedCache(torch.nn.Module):
    """Writes each row's key into a cache buffer at the row's position, then attends over the
    live slots 0..30: padded rows writing slot 0 would change what later calls read."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(32, 8))

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        k = self.proj(h)
        if self.how == "index_copy_":
            self.cache.index_copy_(0, pos, k)
        elif self.how == "index_put_":
            self.cache.index_put_((pos,), k)
        else:
            self.cache[pos] = k
        live = self.cache[None, :31]  # slot 31: a trash slot no row reads
        return torch.nn.functional.scaled_dot_product_attention(k[None], live, live)[0]


CACHE_SIZES = [3, 5, 3, 5, 4, 8, 4]  # padded (3 -> 4, 5 -> 8) and exact sizes, repeated


def run_cache(
    how: str,
    mode: str,
    compiler: str,
    pad_value: int | None,
    device: str = "cpu",
    runtime: str = "simulated",
) -> IndexedCache:
    torch.manual_seed(0)
    model = IndexedCache(how).to(device)
    eager = copy.deepcopy(model)
    compiled = compile_model(model, mode, compiler, runtime)
    rng = random.Random(0)
    with torch.no_grad(), decode():
        for n in CACHE_SIZES:
            h = torch.randn(n, 8, device=device)
            pos = torch.tensor(rng.sample(range(1, 31), n), device=device)
            cgcompile.mark_dynamic_batch(h, pos)
            if pad_value is not None:
                cgcompile.mark_dynamic_batch(pos, pad_value=pad_value)
            torch.testing.assert_close(compiled(h, pos), eager(h, pos))
            torch.testing.assert_close(model.cache[:31], eager.cache[:31])
    return model


def check_batch_norm(mode: str, compiler: str, device: str = "cpu", runtime: str = "simulated"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).to(device)
    model.train()
    eager = copy.deepcopy(model)
    compiled = compile_model(model, mode, compiler, runtime)
    with torch.no_grad(), decode():
        for n in (4, 4, 8, 2, 4):
            x = torch.randn(n, 4, device=device)
            cgcompile.mark_dynamic_batch(x)
            torch.testing.assert_close(compiled(x), eager(x))
            for name, buffer in eager[1].named_buffers():
                torch.testing.assert_close(model[1].get_buffer(name), buffer, msg=name)


class ScaledLinear(torch.nn.Module):
    """A float attribute: under dynamic=True Dynamo passes it as a 0-d CPU tensor and reads it
    with `.item()` inside the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_attention(self.lin(x)) * self.scale


def check_scaled(
    mode: str,
    compiler: str,
    scales: tuple[float, ...] = (2.0,),
    device: str = "cpu",
    runtime: str = "simulated",
) -> None:
    """Calls at every scale in turn, the same batch sizes at each: a graph captured at one
    scale must not replay at another."""
    model = ScaledLinear().to(device)
    options = {"graph_runtime": runtime, "cudagraph_mode": mode, "compiler": compiler}
    compiled = torch.compile(model, backend="cudagraph_modes", options=options, dynamic=True)
    with torch.no_grad(), decode():
        for scale in scales:
            model.scale = scale
            for n in (3, 5, 3):
                x = torch.randn(n, 4, device=device)
                torch.testing.assert_close(compiled(x), model(x))
