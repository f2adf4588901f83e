"""`cgcompile.trusted` binds the graphs its own compiled model ran, whatever else the process
compiled from the same class, and replays them only while the model is as it was bound."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from torch import nn

import cgcompile
from tests.support.state import compile_model
from tests.unit.test_host_path import Net


def _ten_line_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    return gm.forward


def _steps(fast, eager: nn.Module, calls: int = 4, dtype: torch.dtype = torch.float32) -> None:
    with torch.no_grad(), cgcompile.batch_hint(uniform_decode=True):
        for _ in range(calls):
            x = torch.randn(4, 4, dtype=dtype)
            cgcompile.mark_dynamic_batch(x)
            torch.testing.assert_close(fast(x), eager(x))


def _replays_without_dynamo(fast, eager: nn.Module) -> None:
    _steps(fast, eager)  # warm-up, capture, first replay through the compiled model
    through = fast.calls_through_dynamo
    _steps(fast, eager)
    assert fast.refused is None and fast.calls_through_dynamo == through


@pytest.mark.parametrize("other", ["eager", _ten_line_backend], ids=["eager", "custom"])
def test_trusted_binds_its_graphs_beside_another_backends_compile_of_the_class(other):
    torch.manual_seed(0)
    model = Net().eval()
    elsewhere = torch.compile(model, backend=other)
    fast = cgcompile.trusted(compile_model(model, "FULL"))
    _steps(elsewhere, model)  # the other backend's entry is in the forward's cache first
    _replays_without_dynamo(fast, model)
    _steps(elsewhere, model)


def test_trusted_binds_its_own_instance_of_two_compiled_with_cudagraph_modes():
    torch.manual_seed(0)
    first, second = Net().eval(), Net().eval()
    fast = [cgcompile.trusted(compile_model(m, "FULL")) for m in (first, second)]
    for _ in range(2):
        for f, m in zip(fast, (first, second), strict=True):
            _steps(f, m, calls=3)
    for f, m in zip(fast, (first, second), strict=True):
        _replays_without_dynamo(f, m)


def test_trusted_binds_its_own_compile_of_two_with_other_options():
    torch.manual_seed(0)
    model = Net().eval()
    piecewise = cgcompile.trusted(compile_model(model, "PIECEWISE"))
    full = cgcompile.trusted(compile_model(model, "FULL"))
    for fast in (piecewise, full, piecewise):
        _replays_without_dynamo(fast, model)
    assert piecewise._bindings[None].graph is not full._bindings[None].graph


def _warm(mode: str = "FULL"):
    torch.manual_seed(0)
    model = Net().eval()
    eager = copy.deepcopy(model)
    fast = cgcompile.trusted(compile_model(model, mode))
    _replays_without_dynamo(fast, model)
    return fast, model, eager


def _through_then_replays(fast, model: nn.Module, eager: nn.Module, dtype=torch.float32) -> None:
    """The next call goes through the compiled model; a few later ones replay again; every
    output equals eager's."""
    through = fast.calls_through_dynamo
    _steps(fast, eager, 6, dtype)
    assert 1 <= fast.calls_through_dynamo - through <= 4  # warm-up, capture, first replay
    through = fast.calls_through_dynamo
    _steps(fast, eager, 4, dtype)
    assert fast.calls_through_dynamo == through


def _swap_data(model: nn.Module, eager: nn.Module, name: str) -> None:
    new = torch.randn_like(model.get_parameter(name))
    model.get_parameter(name).data = new
    eager.get_parameter(name).data = new.clone()


SWAPPED = pytest.mark.parametrize(
    "name", ["a.weight", "b.weight", "b.bias"], ids=["first", "middle", "last"]
)


@SWAPPED
def test_trusted_sees_a_swapped_data_and_recaptures(name):
    fast, model, eager = _warm()
    with cgcompile.counters.expect(num_cudagraph_captured=1):  # its graphs read the old data
        _swap_data(model, eager, name)
        _through_then_replays(fast, model, eager)


@SWAPPED
def test_the_compiled_model_sees_a_swapped_data_and_recaptures(name):
    """Any parameter's: the freed storage of the old data is a parameter event."""
    torch.manual_seed(0)
    model = Net().eval()
    eager = copy.deepcopy(model)
    compiled = compile_model(model, "FULL")
    _steps(compiled, eager)
    with cgcompile.counters.expect(num_cudagraph_captured=1):
        _swap_data(model, eager, name)
        _steps(compiled, eager)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["double", "bfloat16"])
def test_trusted_sees_a_dtype_move_after_warm_up(dtype):
    fast, model, eager = _warm()
    model.to(dtype)
    eager.to(dtype)
    _through_then_replays(fast, model, eager, dtype)


def test_trusted_sees_a_replaced_parameter():
    fast, model, eager = _warm()
    weight = torch.randn(4, 4)
    model.b.weight = nn.Parameter(weight)
    eager.b.weight = nn.Parameter(weight.clone())
    _through_then_replays(fast, model, eager)


def test_trusted_sees_load_state_dict_with_assign():
    fast, model, eager = _warm()
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    eager.load_state_dict(state)
    _through_then_replays(fast, model, eager)


def test_trusted_replays_after_load_state_dict_in_place():
    """Copied into the parameters (the default): same addresses, the graphs read the new values."""
    fast, model, eager = _warm()
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    eager.load_state_dict(state)
    through = fast.calls_through_dynamo
    _steps(fast, eager)
    assert fast.calls_through_dynamo == through


def test_guarded_binds_beside_another_backends_compile():
    """It binds its own entry, not another backend's of the class; an input of another dtype
    goes through the compiled model, which fails as eager does."""
    torch.manual_seed(0)
    model = Net().eval()
    elsewhere = torch.compile(model, backend=_ten_line_backend)
    fast = cgcompile.guarded(compile_model(model, "FULL"))
    _steps(elsewhere, model)
    _replays_without_dynamo(fast, model)
    through = fast.calls_through_dynamo
    x = torch.randn(4, 4, dtype=torch.float64)
    with torch.no_grad(), pytest.raises(RuntimeError):  # float32 parameters, as in eager
        fast(x)
    assert fast.calls_through_dynamo == through + 1


def test_guarded_calls_with_keywords_go_through_the_compiled_model():
    torch.manual_seed(0)
    model = Net().eval()
    fast = cgcompile.guarded(compile_model(model, "FULL"))
    _replays_without_dynamo(fast, model)
    through = fast.calls_through_dynamo
    with torch.no_grad(), cgcompile.batch_hint(uniform_decode=True):
        x = torch.randn(4, 4)
        cgcompile.mark_dynamic_batch(x)
        torch.testing.assert_close(fast(x=x), model(x))
    assert fast.calls_through_dynamo == through + 1


def test_guarded_compiled_function_sees_a_global_it_reads():
    torch.manual_seed(0)
    model = Net().eval()
    fast = cgcompile.guarded(compile_model(_scaled_step, "FULL"))
    global FLIP
    try:
        for flip in (False, True):
            FLIP = flip
            for _ in range(6):
                x = torch.randn(4, 4)
                cgcompile.mark_dynamic_batch(x)
                with torch.no_grad(), cgcompile.batch_hint(uniform_decode=True):
                    torch.testing.assert_close(fast(model, x), _scaled_step(model, x))
    finally:
        FLIP = False
    assert fast.refused is None and fast.calls_through_dynamo < 10  # of 12: most replayed


FLIP = False


def _scaled_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = model(x)
    return -y if FLIP else y


@pytest.mark.parametrize("wrap", [cgcompile.trusted, cgcompile.guarded], ids=["trusted", "guarded"])
def test_calls_from_other_threads_equal_eager(wrap):
    """The graphs belong to the thread that owns the compiled graph: another thread's calls go
    through the compiled model (which runs them eagerly), never replay beside the owner's."""
    torch.manual_seed(0)
    model = Net().eval()
    fast = wrap(compile_model(model, "FULL"))
    _replays_without_dynamo(fast, model)
    wrong: list[object] = []

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        try:
            for _ in range(30):
                x = torch.randn(4, 4, generator=gen)
                with torch.no_grad(), cgcompile.batch_hint(uniform_decode=True):
                    if not torch.allclose(fast(x).clone(), model(x), atol=1e-6):
                        wrong.append(seed)
        except Exception as exc:  # noqa: BLE001 - a failed thread fails the test
            wrong.append(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in workers:
        t.start()
    work(99)  # the owner replays meanwhile
    for t in workers:
        t.join()
    assert wrong == []


@pytest.mark.parametrize("wrap", [cgcompile.trusted, cgcompile.guarded], ids=["trusted", "guarded"])
def test_a_forward_context_set_by_the_caller_decides(wrap):
    """Manual mode: under the caller's own context (here NONE: no graphs) calls go through the
    compiled model, which follows it."""
    fast, model, eager = _warm() if wrap is cgcompile.trusted else _warm_guarded()
    through = fast.calls_through_dynamo
    with cgcompile.set_forward_context(cgcompile.CUDAGraphMode.NONE, cgcompile.BatchDescriptor(4)):
        with cgcompile.counters.expect(num_cudagraph_captured=0):
            _steps(fast, eager, calls=3)
    assert fast.calls_through_dynamo == through + 3


def _warm_guarded():
    torch.manual_seed(0)
    model = Net().eval()
    eager = copy.deepcopy(model)
    fast = cgcompile.guarded(compile_model(model, "FULL"))
    _replays_without_dynamo(fast, model)
    return fast, model, eager


def _tensor_guards(manager) -> int:
    """The TENSOR_MATCH guards of a guard tree (a dict manager's keys and values included)."""
    count = sum(type(g).__name__ == "TENSOR_MATCH" for g in manager.get_leaf_guards())
    children = list(manager.get_child_managers())
    if hasattr(manager, "get_key_value_managers"):
        children += [m for pair in manager.get_key_value_managers().values() for m in pair if m]
    return count + sum(_tensor_guards(child) for child in children)


@pytest.mark.skipif(
    not hasattr(torch._C._dynamo.guards.RootGuardManager, "clone_manager"),
    reason="torch has no guard tree cloning: guarded checks the whole tree",
)
def test_guarded_checks_as_many_tensors_at_any_depth():
    """The per-call guard check of `guarded` leaves the parameters and buffers to the O(1)
    instance check: it inspects the inputs only, whatever the depth; Dynamo's whole tree
    inspects every parameter and buffer."""
    from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch

    counts = []
    for layers in (2, 8):
        torch.manual_seed(0)
        cfg = dataclasses.replace(LlamaConfig.tiny(), num_layers=layers)
        model = Llama(cfg).eval()
        fast = cgcompile.guarded(compile_model(model, "FULL"))
        with torch.no_grad():
            for _ in range(4):
                tokens, positions = make_inputs(cfg, 4, "cpu")
                mark_batch(cfg, tokens, positions)
                fast(tokens, positions)
            through = fast.calls_through_dynamo
            fast(*make_inputs(cfg, 4, "cpu"))
        assert fast.refused is None and fast.calls_through_dynamo == through  # bound
        (binding,) = [b for b in fast._bindings.values() if b.guards is not None]
        tensors = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
        whole = _tensor_guards(binding.entry.guard_manager.root)
        counts.append((_tensor_guards(binding.guards), whole - tensors))
    assert counts == [(2, 2), (2, 2)]  # tokens and positions; the whole tree: every tensor too


class _Sliced(nn.Module):
    """A forward that slices its layers, as Hugging Face's do (`self.layers[: n]`)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[: len(self.layers)]:
            x = torch.relu(layer(x))
        return x


@pytest.mark.parametrize("wrap", [cgcompile.trusted, cgcompile.guarded], ids=["trusted", "guarded"])
def test_an_eager_forward_that_slices_its_layers_leaves_the_binding(wrap):
    """An eager call of such a forward builds a new container of existing layers: no event, so
    calls after it still replay; assigning a slice to the model is one."""
    torch.manual_seed(0)
    model = _Sliced().eval()
    fast = wrap(compile_model(model, "FULL"))
    _replays_without_dynamo(fast, model)
    through = fast.calls_through_dynamo
    with torch.no_grad():
        model(torch.randn(4, 4))  # eager, beside the compiled calls
    _steps(fast, model)
    assert fast.calls_through_dynamo == through
    model.layers = model.layers[:2]
    _steps(fast, model)  # equal to eager with two layers
    assert fast.calls_through_dynamo > through
