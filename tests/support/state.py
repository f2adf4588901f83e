"""Stateful checks shared by the CPU (simulated graphs) and GPU (real graphs) tests: a model
that writes a counter and a KV cache in place, inputs written in place, strided inputs; each
compared with eager after every call."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

import torch

import cgcompile
from tests.support.models import CacheStep

CAPTURE_SIZES = [1, 2, 4, 8]
SIZES = [3, 3, 5, 8, 2, 3, 7, 1, 3, 6]  # padded (3 -> 4, 5 -> 8, ...) and exact sizes, repeated


def row_attention(h: torch.Tensor) -> torch.Tensor:
    """SDPA with each row its own sequence (rows stay independent, as padding needs)."""
    q = h.unsqueeze(1)
    return torch.nn.functional.scaled_dot_product_attention(q, q.sin(), q.cos()).squeeze(1)


def compile_model(model, mode, compiler="eager", runtime="simulated", **options):
    options = {
        "graph_runtime": runtime,
        "cudagraph_capture_sizes": CAPTURE_SIZES,
        "cudagraph_mode": mode,
        "compiler": compiler,
        **options,
    }
    return torch.compile(model, backend="cudagraph_modes", options=options)


def step_inputs(n: int, rng: random.Random, pad_value: int | None = None, device: str = "cpu"):
    x = torch.randn(n, 8, device=device)
    slot = torch.tensor(rng.sample(range(CacheStep.SLOTS), n), device=device)
    cgcompile.mark_dynamic_batch(x, slot)
    if pad_value is not None:
        cgcompile.mark_dynamic_batch(slot, pad_value=pad_value)
    return x, slot


def run_against_eager(
    mode,
    compiler="eager",
    pad_value=CacheStep.SLOTS,
    device="cpu",
    runtime="simulated",
    **options,
):
    """The compiled CacheStep and an eager copy, called on the same batches; asserts outputs,
    the step counter and the live cache slots after every call; returns both models."""
    torch.manual_seed(0)
    model = CacheStep().to(device)
    eager = copy.deepcopy(model)
    compiled = compile_model(model, mode, compiler, runtime, **options)
    rng = random.Random(mode)
    for calls, n in enumerate(SIZES, start=1):
        x, slot = step_inputs(n, rng, pad_value, device)
        with cgcompile.batch_hint(uniform_decode=rng.random() < 0.5), torch.no_grad():
            got = compiled(x, slot).clone()
            want = eager(x, slot)
        torch.testing.assert_close(got, want)
        assert int(model.steps) == calls  # one eager call's worth of state per call
        torch.testing.assert_close(model.cache[:-1], eager.cache[:-1])
    return model, eager


def check_pad_rows_after_steady_calls(mode, compiler="eager", device="cpu", runtime="simulated"):
    """Calls of 8 rows and of 5 rows padded to 8 until both replay at their steady state
    (prebuilt), then one of each: the pad rows must hold the trash slot again, not the 8-row
    call's slots (5..7), which this call's real rows write too (a stale pad row, written after
    them, would overwrite them)."""
    torch.manual_seed(0)
    model = CacheStep().to(device)
    eager = copy.deepcopy(model)
    compiled = compile_model(model, mode, compiler, runtime)
    for n, first in [(8, 0)] * 4 + [(5, 0)] * 4 + [(8, 0), (5, 5)]:
        x = torch.randn(n, 8, device=device)
        slot = torch.arange(first, first + n, device=device)
        cgcompile.mark_dynamic_batch(x)
        cgcompile.mark_dynamic_batch(slot, pad_value=CacheStep.SLOTS)
        with torch.no_grad():
            got = compiled(x, slot).clone()
            torch.testing.assert_close(got, eager(x, slot))
        torch.testing.assert_close(model.cache[:-1], eager.cache[:-1])


def mutating_step(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Writes a batch input (x) and a non-batch input (state) in place."""
    out = row_attention(x)
    state.add_(out[0])
    x.mul_(2)
    return out + state


def check_mutated_inputs(mode, compiler, device="cpu", runtime="simulated") -> None:
    compiled = compile_model(mutating_step, mode, compiler, runtime)
    state, eager_state = torch.zeros(4, device=device), torch.zeros(4, device=device)
    for n in SIZES:
        x = torch.randn(n, 4, device=device)
        eager_x = x.clone()
        cgcompile.mark_dynamic_batch(x)
        with torch.no_grad():
            got = compiled(x, state).clone()
            want = mutating_step(eager_x, eager_state)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(x, eager_x)
        torch.testing.assert_close(state, eager_state)


LAYOUTS: dict[str, Callable[[int, str], torch.Tensor]] = {
    "transposed": lambda n, d: torch.randn(8, n, device=d).t(),
    "sliced": lambda n, d: torch.randn(n, 16, device=d)[:, ::2],
    "expanded": lambda n, d: torch.randn(1, 8, device=d).expand(n, 8),
    "channels_last": lambda n, d: torch.randn(n, 2, 2, 2, device=d).to(
        memory_format=torch.channels_last
    ),
}


def layout_model(x: torch.Tensor) -> torch.Tensor:
    h = x.reshape(x.shape[0], -1) * 2 + 1
    return row_attention(h) - h


def check_strided_inputs(mode, compiler, layout, device="cpu", runtime="simulated") -> None:
    compiled = compile_model(layout_model, mode, compiler, runtime)
    for n in SIZES:
        x = LAYOUTS[layout](n, device)
        cgcompile.mark_dynamic_batch(x)
        torch.testing.assert_close(compiled(x), layout_model(x))


def check_capture_all_after_a_mixed_call(compiler: str, sizes: list[int]) -> None:
    """FULL_AND_PIECEWISE after one mixed call: `capture_all` records sizes 2, 4, 8 (a backed
    batch: size 1 is another graph) x (1 piece + 1 full graph), changes no state, and the
    calls of `sizes` after it capture nothing and equal eager's."""
    torch.manual_seed(0)
    model = CacheStep()
    eager = copy.deepcopy(model)
    compiled = compile_model(model, "FULL_AND_PIECEWISE", compiler)
    rng = random.Random(1)
    with torch.no_grad():
        x, slot = step_inputs(3, rng, CacheStep.SLOTS)
        compiled(x, slot), eager(x, slot)  # the key's warm-up: nothing captured yet
        state = {name: t.clone() for name, t in model.state_dict().items()}
        with cgcompile.counters.expect(num_cudagraph_captured=3 * 2):
            cgcompile.capture_all(progress=False)
        for name, t in model.state_dict().items():
            assert torch.equal(t, state[name]), f"capture_all changed {name}"
        for i, n in enumerate(sizes):
            x, slot = step_inputs(n, rng, CacheStep.SLOTS)
            with cgcompile.counters.expect(num_cudagraph_captured=0):
                with cgcompile.batch_hint(uniform_decode=i % 2 == 0):
                    got = compiled(x, slot).clone()
            torch.testing.assert_close(got, eager(x, slot))
    torch.testing.assert_close(model.cache[:-1], eager.cache[:-1])
    assert int(model.steps) == len(sizes) + 1
