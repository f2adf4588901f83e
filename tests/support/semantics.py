"""Eager-equivalence checks shared by the CPU (simulated graphs) and GPU (real graphs) tests:
outputs padding could change, row-wise graphs that keep padding, training steps, concurrent
threads, inputs moved in manual mode, grad mode with a batch hint. Each compares with eager
after every call."""

from __future__ import annotations

import copy
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import cgcompile
from tests.support.state import compile_model

SIZES = [4, 3, 3, 5, 8, 6]  # exact, padded (3 -> 4, 5 -> 8, 6 -> 8), repeated
GRAPH_MODES = ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"]


def row_attention(h: torch.Tensor) -> torch.Tensor:
    """SDPA with each row its own sequence: rows stay independent."""
    q = h.unsqueeze(1)
    return torch.nn.functional.scaled_dot_product_attention(q, q.sin(), q.cos()).squeeze(1)


def y_of(x: torch.Tensor) -> torch.Tensor:
    return row_attention(x * 2)


UNSAFE: dict[str, tuple[Callable[[torch.Tensor], Any], str]] = {
    "transposed": (lambda x: y_of(x).t(), "output 0 has shape (8, s"),
    "flattened": (lambda x: y_of(x).reshape(-1), "output 0 has shape (8*s"),
    "cat": (lambda x: torch.cat([y_of(x), x]), "aten.cat"),
    "sum0": (lambda x: y_of(x).sum(0), "y_of(x).sum(0)"),
    "mean": (lambda x: y_of(x).mean(), "aten.mean"),
    "last_row": (lambda x: y_of(x)[-1], "counted from the end"),
    "batch_size": (lambda x: (y_of(x), x.shape[0]), "output 1 is"),
}
"""Graphs whose results padding would change: (fn, what the warning names)."""


def heads_view(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    h = x.view(n, 2, 4).softmax(-1).reshape(n, 8)
    return row_attention(h) + x.flatten().view(n, 8)


def causal_self_attention(x: torch.Tensor) -> torch.Tensor:
    q = x[None, None]
    return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)[0, 0]


def first_row_added(x: torch.Tensor) -> torch.Tensor:
    y = row_attention(x)
    return y + y[0]


ROW_WISE = [row_attention, heads_view, causal_self_attention, first_row_added]
"""Graphs padding cannot change: they keep padding."""


def assert_same(got: Any, want: Any) -> None:
    """Equal values, and ints of the same type (an int output is an int, not a padded size)."""
    if isinstance(want, tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want)
    else:
        assert got == want and type(got) is type(want)


def check_against_eager(compiled, fn, device: str = "cpu") -> None:
    """Every size of SIZES, outputs equal eager's."""
    with torch.no_grad():
        for n in SIZES:
            x = torch.randn(n, 8, device=device)
            cgcompile.mark_dynamic_batch(x)
            assert_same(compiled(x), fn(x))


class TwoLayers(nn.Module):
    """Linear, row-wise SDPA, linear: split into two pieces in piecewise modes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu().unsqueeze(1)
        h = torch.nn.functional.scaled_dot_product_attention(h, h, h).squeeze(1)
        return self.b(h)


def check_training_matches_eager(mode: str, compiler: str, **where: str) -> None:
    """Four training steps: outputs require grad, input and parameter grads equal eager's."""
    device = where.get("device", "cpu")
    torch.manual_seed(0)
    model = TwoLayers().to(device)
    eager = copy.deepcopy(model)
    compiled = compile_model(model, mode, compiler, where.get("runtime", "simulated"))
    for n in (4, 3, 4, 5):
        x = torch.randn(n, 8, device=device, requires_grad=True)
        ex = x.detach().clone().requires_grad_()
        cgcompile.mark_dynamic_batch(x)
        out = compiled(x)
        assert out.requires_grad
        out.square().sum().backward()
        eager(ex).square().sum().backward()
        torch.testing.assert_close(x.grad, ex.grad)
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)


def check_threads_match_eager(mode: str, threads: int = 4, calls: int = 40, **where: str) -> None:
    """Threads call one compiled graph at once while its owner replays and captures: all equal
    eager, and no thread fails. Inputs are drawn on the CPU: torch's CUDA generator refuses to
    advance in one thread while another captures a graph ("Offset increment outside graph
    capture"), whoever does the capture."""
    device = where.get("device", "cpu")
    compiled = compile_model(row_attention, mode, runtime=where.get("runtime", "simulated"))
    wrong: list[Any] = []

    def call(n: int) -> bool:
        x = torch.randn(n, 8).to(device)
        cgcompile.mark_dynamic_batch(x)
        with torch.no_grad():
            got = compiled(x).clone()
        return torch.allclose(got, row_attention(x), atol=1e-5)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            wrong.extend(seed for _ in range(calls) if not call(rng.choice([2, 3, 4, 5, 8])))
        except Exception as exc:  # noqa: BLE001 - a failed thread fails the check
            wrong.append(exc)

    assert call(4)  # compiled, and owned, by this thread
    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    wrong.extend(-1 for _ in range(calls) if not call(3))  # the owner replays meanwhile
    for t in workers:
        t.join()
    assert wrong == []


def check_moved_input_raises(mode: str, **where: str) -> None:
    """Manual mode: a new view of the persistent buffer is fine on every call; an input that
    moved after the first replay raises `CaptureError` instead of replaying stale memory."""
    device = where.get("device", "cpu")
    model = TwoLayers().to(device)
    compiled = compile_model(model, mode, runtime=where.get("runtime", "simulated"))
    buffer = torch.randn(16, 8, device=device)

    def rows(source: torch.Tensor) -> torch.Tensor:
        view = source[:4]
        cgcompile.mark_dynamic_batch(view)
        return view

    runtime_mode = cgcompile.CUDAGraphMode[mode]
    with torch.no_grad(), cgcompile.set_forward_context(runtime_mode, num_tokens=4):
        for _ in range(4):  # compile and warm up, capture, first replay, later replays
            buffer.normal_()
            torch.testing.assert_close(compiled(rows(buffer)), model(rows(buffer)))
        with pytest.raises(cgcompile.CaptureError, match="stale memory"):
            compiled(rows(torch.randn(16, 8, device=device)))


class TinyAttention(torch.nn.Module):
    """The README's example model: parameters that require grad, SDPA."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(0).chunk(3, dim=-1)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attn[0])


def check_grad_mode_with_a_hint(device: str, runtime: str) -> None:
    """A newcomer's first script without no_grad() and with the advised hint: eager's values
    and gradients at every size (once reported to fail inside torch: 'Guard failed on the same
    frame it was created')."""
    torch.manual_seed(0)
    model = TinyAttention().to(device)
    options = {"cudagraph_mode": "FULL_AND_PIECEWISE", "graph_runtime": runtime}
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    for n in (6, 6, 13, 300, 1, 5):
        x = torch.randn(n, 64, device=device)
        cgcompile.mark_dynamic_batch(x, hint=512)
        got = compiled(x)
        want = model(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        (g,) = torch.autograd.grad(got.sum(), model.out.weight)
        (w,) = torch.autograd.grad(want.sum(), model.out.weight)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
