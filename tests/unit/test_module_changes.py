"""Changes users make to a model between calls, caught in the default mode: after each, a call
of the compiled model equals an eager call of the same model (it recompiles, recaptures or
replays as need be). Parameters replaced, assigned by `load_state_dict(assign=True)` or written
in place, a submodule swapped (an adapter), train/eval, an attribute that changes control flow,
a global the forward reads, a dtype move, a representative parameter's `.data` swapped; a
second instance of the class. `cgcompile.guarded` sees each of them too. What the default does
not see is listed in `calls/instances.py`."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import cgcompile

OPTIONS = {"graph_runtime": "simulated", "compiler": "eager", "cudagraph_capture_sizes": [4, 8]}
SCALE = 1.0
"""A global the forward reads (Dynamo guards its value)."""


@pytest.fixture(autouse=True)
def _scale_restored():
    yield
    global SCALE
    SCALE = 1.0


class Adapted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.adapter: nn.Module = nn.Identity()
        self.doubled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.adapter(self.b(torch.relu(self.a(x))))
        if self.doubled:  # a flag that changes control flow
            y = y * 2
        if self.training:
            y = y + 1
        return y * SCALE


def _replace_parameter(model: Adapted) -> None:
    model.a.weight = nn.Parameter(torch.randn(8, 8))


def _load_with_assign(model: Adapted) -> None:
    model.load_state_dict(Adapted().state_dict(), assign=True)


def _write_in_place(model: Adapted) -> None:
    with torch.no_grad():
        model.b.weight.mul_(-2)


def _swap_adapter(model: Adapted) -> None:
    model.adapter = nn.Linear(8, 8)


def _train(model: Adapted) -> None:
    model.train()


def _flag(model: Adapted) -> None:
    model.doubled = True


def _global_flag(model: Adapted) -> None:
    global SCALE
    SCALE = 3.0


def _move_dtype(model: Adapted) -> None:
    model.double()


def _swap_data(model: Adapted) -> None:
    model.a.weight.data = torch.randn(8, 8)  # the first parameter: a representative


def _swap_data_of_another(model: Adapted) -> None:
    model.a.bias.data = torch.randn(8)  # not a representative: its old storage is freed


CHANGES = [
    _replace_parameter,
    _load_with_assign,
    _write_in_place,
    _swap_adapter,
    _train,
    _flag,
    _global_flag,
    _move_dtype,
    _swap_data,
    _swap_data_of_another,
]


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_a_call_after_the_change_equals_eager(mode: str, change: Callable[[Adapted], None]):
    torch.manual_seed(0)
    model = Adapted().eval()
    compiled = torch.compile(
        model, backend="cudagraph_modes", options={**OPTIONS, "cudagraph_mode": mode}
    )
    with torch.no_grad():
        for n in (4, 8, 4):  # captured and replayed
            x = torch.randn(n, 8)
            assert torch.equal(compiled(x), model(x))
        change(model)
        dtype = next(model.parameters()).dtype
        for n in (4, 8, 4):
            x = torch.randn(n, 8, dtype=dtype)
            assert torch.allclose(compiled(x), model(x), atol=1e-6), change.__name__


def test_a_second_instance_gets_its_own_results():
    torch.manual_seed(0)
    first, second = Adapted().eval(), Adapted().eval()
    compiled = [
        torch.compile(m, backend="cudagraph_modes", options=OPTIONS) for m in (first, second)
    ]
    with torch.no_grad():
        for n in (4, 8, 4, 8):
            x = torch.randn(n, 8)
            for fn, model in zip(compiled, (first, second), strict=True):
                assert torch.equal(fn(x), model(x))
        twin = copy.deepcopy(first)  # same values, other tensors
        fn = torch.compile(twin, backend="cudagraph_modes", options=OPTIONS)
        with torch.no_grad():
            twin.a.weight.mul_(3)
        x = torch.randn(4, 8)
        assert torch.equal(fn(x), twin(x)) and torch.equal(compiled[0](x), first(x))


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_guarded_sees_every_change_the_default_sees(change: Callable[[Adapted], None]):
    """`cgcompile.guarded` skips Dynamo's bytecode, not its guards: after each change the next
    call goes through the compiled model, and later ones replay again."""
    torch.manual_seed(0)
    model = Adapted().eval()
    fast = cgcompile.guarded(torch.compile(model, backend="cudagraph_modes", options=OPTIONS))
    with torch.no_grad():
        for n in (4, 8) * 4:  # compiled (static 4, then dynamic), captured, replayed, bound
            x = torch.randn(n, 8)
            assert torch.equal(fast(x), model(x))
        through = fast.calls_through_dynamo
        for n in (4, 8):
            x = torch.randn(n, 8)
            assert torch.equal(fast(x), model(x))
        assert fast.calls_through_dynamo == through  # bound: no Dynamo
        change(model)
        dtype = next(model.parameters()).dtype
        for n in (4, 8) * 4:
            x = torch.randn(n, 8, dtype=dtype)
            assert torch.allclose(fast(x), model(x), atol=1e-6), change.__name__
        if change is _write_in_place:  # same tensors at the same addresses: nothing to see
            assert fast.calls_through_dynamo == through
        else:
            assert fast.calls_through_dynamo > through, change.__name__
        if change is _global_flag:  # Dynamo now passes the float as an input: not bound
            assert "G['SCALE']" in fast.refused
            return
        through = fast.calls_through_dynamo
        x = torch.randn(4, 8, dtype=dtype)
        assert torch.allclose(fast(x), model(x), atol=1e-6)
        assert fast.calls_through_dynamo == through, change.__name__


def test_guarded_runs_the_top_modules_hooks():
    torch.manual_seed(0)
    model = Adapted().eval()
    fast = cgcompile.guarded(torch.compile(model, backend="cudagraph_modes", options=OPTIONS))
    with torch.no_grad():
        for n in (4, 8) * 4:
            x = torch.randn(n, 8)
            assert torch.equal(fast(x), model(x))
        seen = []
        handle = model.register_forward_hook(lambda module, args, out: seen.append(out.shape))
        x = torch.randn(4, 8)
        fast(x)
        assert seen == [(4, 8)]
        handle.remove()
        through = fast.calls_through_dynamo
        fast(x)
        assert seen == [(4, 8)] and fast.calls_through_dynamo == through  # replays again
