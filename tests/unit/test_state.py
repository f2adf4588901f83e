"""Every call leaves outputs and state exactly as one eager call would: counters and KV caches
written inside the graph, user inputs written in place, padded rows, strided inputs."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import cgcompile
import tests.support.silly  # noqa: F401  (registers silly::attention_columns)
from cgcompile.calls.variants import SizeVariants
from tests.support.models import MODES
from tests.support.state import (
    LAYOUTS,
    SIZES,
    check_capture_all_after_a_mixed_call,
    check_mutated_inputs,
    check_pad_rows_after_steady_calls,
    check_strided_inputs,
    compile_model,
    mutating_step,
    row_attention,
    run_against_eager,
)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", MODES)
def test_state_advances_once_per_call(mode, compiler):
    run_against_eager(mode, compiler)


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_pad_rows_after_steady_full_size_calls_hold_the_pad_value(mode):
    check_pad_rows_after_steady_calls(mode)


@pytest.mark.parametrize("num_warmups", [0, 2])
def test_state_advances_once_per_call_with_any_warmups(num_warmups):
    run_against_eager("FULL_AND_PIECEWISE", num_warmups=num_warmups)


@pytest.mark.parametrize("mode", MODES)
def test_static_address_counter_reads_n_after_n_calls(mode):
    def step(x: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        counter.add_(1)
        return row_attention(x * 2)

    counter = torch.zeros((), dtype=torch.long)
    torch._dynamo.mark_static_address(counter)
    compiled = compile_model(step, mode)
    for calls, n in enumerate(SIZES, start=1):
        x = torch.randn(n, 4)
        cgcompile.mark_dynamic_batch(x)
        torch.testing.assert_close(compiled(x, counter), step(x, torch.zeros(())))
        assert int(counter) == calls


@pytest.mark.parametrize("mode", MODES)
def test_capture_all_changes_no_state(mode):
    model, _ = run_against_eager(mode)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    cgcompile.capture_all(progress=False)
    for name, t in model.state_dict().items():
        assert torch.equal(t, state[name]), f"capture_all changed {name}"


def test_capture_all_then_calls_match_eager():
    check_capture_all_after_a_mixed_call("eager", [n for n in SIZES if n > 1])


def columns_model(x: torch.Tensor) -> torch.Tensor:
    h = torch.ops.silly.attention_columns(x + 1)
    return h * 2


def test_capture_all_keeps_the_strides_of_eager_op_outputs():
    """The stand-in for an eager op returns its real kernel's strides (CUDA SDPA's output is not
    contiguous): the next piece, compiled for them, must capture."""
    compiled = compile_model(columns_model, "PIECEWISE", "inductor")
    x = torch.randn(4, 8)
    cgcompile.mark_dynamic_batch(x)
    compiled(x)
    with cgcompile.counters.expect(num_cudagraph_captured=3 * 2, num_capture_failures=0):
        cgcompile.capture_all(progress=False)  # sizes 2, 4, 8 x 2 pieces
    for n in (3, 5, 8):
        x = torch.randn(n, 8)
        cgcompile.mark_dynamic_batch(x)
        with cgcompile.counters.expect(num_cudagraph_captured=0):
            torch.testing.assert_close(compiled(x), columns_model(x))


def test_capture_all_collects_garbage_once_and_leaves_a_frozen_heap_frozen(monkeypatch):
    import gc

    compiled = compile_model(columns_model, "FULL", "eager", batch_one="own")
    for n in (4, 1):  # two compiled graphs: batch 1 is traced and compiled apart
        x = torch.randn(n, 8)
        cgcompile.mark_dynamic_batch(x)
        compiled(x)
    assert len(cgcompile.compiled_graphs()) == 2
    collect, collections = gc.collect, []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or collect(*a))
    assert cgcompile.capture_all(progress=False) > 0
    assert len(collections) == 1 and gc.get_freeze_count() == 0
    gc.freeze()  # the user's own freeze
    try:
        cgcompile.capture_all(progress=False)
        assert len(collections) == 1 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_capture_all_works_out_identical_attention_pieces_once_per_key(monkeypatch):
    """The stand-ins of a key's N identical attention pieces share one fake run (it costs
    milliseconds of host time each), and the graphs they record still replay eager's outputs."""
    from cgcompile.backend import dry_run
    from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch

    cfg = LlamaConfig(num_layers=4)
    model, reference = Llama(cfg).eval(), Llama(cfg).eval()
    reference.load_state_dict(model.state_dict())
    options = {"cudagraph_mode": "PIECEWISE", "graph_runtime": "simulated", "compiler": "eager"}
    compiled = torch.compile(
        model, backend="cudagraph_modes", options={**options, "cudagraph_capture_sizes": [2, 4]}
    )
    runs = []

    class CountingFakeMode(dry_run.FakeTensorMode):
        def __enter__(self):
            runs.append(1)
            return super().__enter__()

    monkeypatch.setattr(dry_run, "FakeTensorMode", CountingFakeMode)
    with torch.no_grad():
        tokens, positions = make_inputs(cfg, 4, "cpu")
        mark_batch(cfg, tokens, positions)
        torch.testing.assert_close(compiled(tokens, positions), reference(tokens, positions))
        with cgcompile.counters.expect(num_cudagraph_captured=2 * 5):  # 2 keys x 5 pieces
            cgcompile.capture_all(progress=False)
        assert len(runs) == 2  # one per key, not one per layer
        for n in (2, 3, 4):
            tokens, positions = make_inputs(cfg, n, "cpu", torch.Generator().manual_seed(n + 9))
            mark_batch(cfg, tokens, positions)
            with cgcompile.counters.expect(num_cudagraph_captured=0):
                got = compiled(tokens, positions)
            torch.testing.assert_close(got, reference(tokens, positions))


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", MODES)
def test_mutated_user_inputs_equal_eager(mode, compiler):
    check_mutated_inputs(mode, compiler)


def test_mutated_input_at_a_new_address_runs_without_graphs(caplog):
    compiled = compile_model(mutating_step, "FULL_AND_PIECEWISE")
    states = [torch.zeros(4), torch.zeros(4)]
    eager_states = [torch.zeros(4), torch.zeros(4)]
    with caplog.at_level(logging.WARNING, logger="cgcompile"), torch.no_grad():
        for i, n in enumerate(SIZES):
            x = torch.randn(n, 4)
            eager_x = x.clone()
            cgcompile.mark_dynamic_batch(x)
            torch.testing.assert_close(
                compiled(x, states[i % 2]), mutating_step(eager_x, eager_states[i % 2])
            )
    torch.testing.assert_close(states, eager_states)
    moved = [m for m in caplog.messages if "not the tensor of the first" in m]
    assert len(moved) == 1 and "L['state']" in moved[0]


class _FixedTable(torch.nn.Module):
    """A step that reads (and, `writes`, updates) a table the caller passes at a static address,
    its dim 0 not the batch."""

    def __init__(self, writes: bool) -> None:
        super().__init__()
        self.a, self.writes = torch.nn.Linear(4, 4), writes

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        if self.writes:
            table.add_(1)
        return self.a(x) + table.sum(0)


@pytest.mark.parametrize("writes", [True, False])
@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_another_static_address_argument_runs_without_graphs(mode, writes, caplog):
    """Graphs bake in a static-address argument's address and no parameter event tells when a
    call passes another: such a call runs eagerly, equal to eager, and says why once."""
    model = _FixedTable(writes).eval()
    options = {"cudagraph_mode": mode, "graph_runtime": "simulated", "compiler": "eager"}
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    ours = {k: torch.randn(6, 4) for k in "AB"}
    for table in ours.values():
        torch._dynamo.mark_static_address(table)
    theirs = {k: t.clone() for k, t in ours.items()}
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="cgcompile"):
        for step, name in enumerate("AAABBAB"):
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
            cgcompile.mark_dynamic_batch(x)
            got, want = compiled(x, ours[name]), model(x, theirs[name])
            assert torch.equal(got, want) and all(torch.equal(ours[k], theirs[k]) for k in "AB")
    moved = [m for m in caplog.messages if "not the tensor of the first" in m]
    assert len(moved) == 1 and "L['table']" in moved[0]


@pytest.mark.parametrize("how", ["trusted", "guarded"])
def test_trusted_and_guarded_take_another_static_address_argument_through_the_model(how):
    """What the default call checks of a static-address argument, `trusted` and `guarded` check
    too: another one goes through the compiled model, equal to eager."""
    model = _FixedTable(writes=True).eval()
    options = {"cudagraph_mode": "FULL", "graph_runtime": "simulated", "compiler": "eager"}
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    ours = {k: torch.randn(6, 4) for k in "AB"}
    for table in ours.values():
        torch._dynamo.mark_static_address(table)
    theirs = {k: t.clone() for k, t in ours.items()}
    fast = getattr(cgcompile, how)(compiled)
    with torch.no_grad():
        for step, name in enumerate("AAAAABAB"):
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
            cgcompile.mark_dynamic_batch(x)
            got = (compiled if step < 3 else fast)(x, ours[name])
            want = model(x, theirs[name])
            assert torch.equal(got, want) and all(torch.equal(ours[k], theirs[k]) for k in "AB")


def test_padding_with_pad_value_does_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        run_against_eager("FULL_AND_PIECEWISE")
    assert "pad_value" not in caplog.text


def test_pad_value_must_be_a_number():
    with pytest.raises(TypeError, match="pad_value must be a number"):
        cgcompile.mark_dynamic_batch(torch.zeros(2), pad_value=torch.tensor(1))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", MODES)
def test_strided_inputs_equal_eager(mode, compiler, layout):
    check_strided_inputs(mode, compiler, layout)


class _PerBatchCache(torch.nn.Module):
    """A decode step writing a cache allocated for one batch size and passed in at a static
    address, as Hugging Face's `StaticCache` is: the cache's dim 0 is the batch."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(1, pos, x[:, None])
        return cache.sum(1) * 2


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_capture_all_captures_a_cache_sized_by_the_batch_at_its_own_size_only(mode):
    options = {"cudagraph_mode": mode, "graph_runtime": "simulated", "compiler": "eager"}
    options["cudagraph_capture_sizes"] = [2, 3, 4, 8]
    compiled = torch.compile(_PerBatchCache(), backend="cudagraph_modes", options=options)
    caches = {n: torch.zeros(n, 5, 4) for n in (3, 4)}
    theirs = {n: c.clone() for n, c in caches.items()}

    def call(fn: Any, n: int, caches: dict[int, torch.Tensor], pos: int) -> torch.Tensor:
        x = torch.randn(n, 4, generator=torch.Generator().manual_seed(pos))
        if fn is compiled:
            torch._dynamo.mark_static_address(caches[n])
            cgcompile.mark_dynamic_batch(x, caches[n])
        return fn(x, caches[n], torch.tensor([pos]))

    with torch.no_grad():
        for n in (3, 4):
            assert torch.equal(call(compiled, n, caches, 0), call(_PerBatchCache(), n, theirs, 0))
        graph = cgcompile.compiled_graphs()[-1]
        assert graph.plan.batch_state  # the cache: dim 0 is the batch
        assert cgcompile.capture_all(progress=False) > 0  # keys 3 and 4, one per cache
        before = cgcompile.counters.num_cudagraph_captured
        for pos, n in enumerate((4, 3, 4, 3), start=1):
            got, want = call(compiled, n, caches, pos), call(_PerBatchCache(), n, theirs, pos)
            assert torch.equal(got, want) and torch.equal(caches[n], theirs[n])
    assert cgcompile.counters.num_cudagraph_captured == before  # replays of captured keys


class _CountingCache(torch.nn.Module):
    """A layer writing a cache per batch size that also keeps a step counter, a static tensor
    not sized by the batch (as a Hugging Face `StaticCache` layer's `cumulative_length`)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(1, count % 5, self.a(x)[:, None])
        count.add_(1)
        return cache.sum(1) * 2


def test_a_cache_per_batch_size_with_its_counter_replays_its_own_graphs():
    """The counter of each size's cache comes with that cache, whose address keys the graphs:
    calls alternating sizes replay, equal to eager, none runs eagerly."""
    options = {"cudagraph_mode": "FULL", "graph_runtime": "simulated", "compiler": "eager"}
    options["cudagraph_capture_sizes"] = [2, 4, 8]
    model = _CountingCache().eval()
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    ours = {n: (torch.zeros(n, 5, 4), torch.zeros((), dtype=torch.long)) for n in (2, 4)}
    for tensor in (t for pair in ours.values() for t in pair):
        torch._dynamo.mark_static_address(tensor)
    theirs = {n: tuple(t.clone() for t in pair) for n, pair in ours.items()}
    with torch.no_grad():
        for step, n in enumerate((2, 4, 2, 4, 4, 2)):
            x = torch.randn(n, 4, generator=torch.Generator().manual_seed(step))
            cgcompile.mark_dynamic_batch(x, ours[n][0])
            got, want = compiled(x, *ours[n]), model(x, *theirs[n])
            assert torch.equal(got, want)
            assert all(
                torch.equal(a, b) for k in ours for a, b in zip(ours[k], theirs[k], strict=True)
            )
    assert cgcompile.counters.num_eager_fallbacks == 0


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_a_cache_sized_by_the_batch_is_never_padded(mode, caplog):
    """Padding cannot grow a static-address cache whose dim 0 is the batch (a `StaticCache` per
    batch size, its batch marked): sizes between capture sizes, batch 1 included, run without
    graphs on the caller's cache, equal to eager, and say why once; capture sizes replay."""
    options = {"cudagraph_mode": mode, "graph_runtime": "simulated", "compiler": "eager"}
    options["cudagraph_capture_sizes"] = [2, 4, 8]
    compiled = torch.compile(_PerBatchCache(), backend="cudagraph_modes", options=options)
    sizes = (4, 3, 1, 2, 3, 1, 4)
    caches = {n: torch.zeros(n, 5, 4) for n in set(sizes)}
    theirs = {n: c.clone() for n, c in caches.items()}
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="cgcompile"):
        for pos, n in enumerate(sizes):
            x = torch.randn(n, 4)
            torch._dynamo.mark_static_address(caches[n])
            cgcompile.mark_dynamic_batch(x, caches[n])
            at = torch.tensor([pos % 5])
            got, want = compiled(x, caches[n], at), _PerBatchCache()(x, theirs[n], at)
            assert torch.equal(got, want) and torch.equal(caches[n], theirs[n]), (pos, n)
    dynamic = next(g for g in cgcompile.compiled_graphs() if g.plan.batch_exprs)
    assert "cache" in (dynamic.plan.pad_unsafe or "")
    assert dynamic.report.num_eager_fallbacks == 2  # the calls of 3 rows
    unpadded = [m for m in caplog.messages if "padding cannot grow it" in m]
    assert len(unpadded) == 1, caplog.messages


class _CacheBetweenLayers(torch.nn.Module):
    """A decode step whose cache, sized by the batch and passed at a static address, sits
    between two layers' parameters (the first and last static inputs are parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(1, pos, self.a(x)[:, None])
        return self.b(cache.sum(1))


def _caches(sizes: dict[str, int]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Named caches of these batch sizes at static addresses, and eager's copies."""
    ours = {name: torch.zeros(n, 5, 4) for name, n in sizes.items()}
    for cache in ours.values():
        torch._dynamo.mark_static_address(cache)
    return ours, {name: c.clone() for name, c in ours.items()}


def _cache_calls(compiled: Any, model: Any, order: list[tuple[str, int]], ours: Any, theirs: Any):
    """Calls of `compiled` and `model` on the caches named in `order`; yields whether each
    call's output and every cache equal eager's (a cache freed would drop its graphs)."""
    for step, (name, pos) in enumerate(order):
        x = torch.randn(ours[name].shape[0], 4, generator=torch.Generator().manual_seed(step))
        cgcompile.mark_dynamic_batch(x, ours[name])
        got = compiled(x, ours[name], torch.tensor([pos]))
        want = model(x, theirs[name], torch.tensor([pos]))
        yield torch.equal(got, want) and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_another_cache_of_the_same_size_gets_graphs_of_its_own(mode):
    """A graph bakes in its cache's address: a second cache of the same batch size (a new
    `StaticCache` per request) must not replay the first one's graph, which would write it."""
    model = _CacheBetweenLayers().eval()
    options = {"cudagraph_mode": mode, "graph_runtime": "simulated", "compiler": "eager"}
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    order = [("A", 0), ("A", 1), ("A", 2), ("B", 0), ("B", 1), ("A", 3), ("B", 2), ("A", 4)]
    caches = _caches({"A": 4, "B": 4})
    with torch.no_grad():
        assert all(_cache_calls(compiled, model, order, *caches))
    (graph,) = cgcompile.compiled_graphs()
    captured = [key for w in graph.wrappers for key in w.entries]
    assert len({key[1] for key in captured}) == 2  # a shape key per cache


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_capture_all_captures_every_cache_size_a_call_brought(mode):
    """One call per cache size first (a `StaticCache` per batch size, one module instance):
    `capture_all` captures each size's keys, and calls after it capture nothing."""
    model = _CacheBetweenLayers().eval()
    options = {"cudagraph_mode": mode, "graph_runtime": "simulated", "compiler": "eager"}
    options["cudagraph_capture_sizes"] = [2, 4, 8]
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    caches = _caches({"two": 2, "four": 4, "eight": 8})
    first = [("eight", 0), ("two", 0), ("four", 0)]
    later = [("two", 1), ("four", 1), ("eight", 1), ("four", 2), ("two", 2)]
    with torch.no_grad():
        calls = _cache_calls(compiled, model, first + later, *caches)
        assert all(next(calls) for _ in first)
        assert cgcompile.capture_all(progress=False) > 0
        before = cgcompile.counters.num_cudagraph_captured
        assert all(calls)
    assert cgcompile.counters.num_cudagraph_captured == before


def test_cache_address_sets_are_bounded_apart_from_int_values():
    """At most 8 values of the non-batch ints and 64 address sets of the batch-sized caches
    (a set per cache size, more for further caches of a size) get graphs, each on its own."""

    class Addressed:
        def __init__(self, address: int) -> None:
            self.address = address

        def data_ptr(self) -> int:
            return self.address

    variants = SizeVariants(positions=(0,), state=(1,))
    keys = [variants.key([v, Addressed(8 * v + s)]) for v in range(8) for s in range(8)]
    assert all(variants.admits(key) for key in keys)  # 8 values, 64 address sets
    assert variants.admits(variants.key([3, Addressed(5)]))  # seen parts, a new pairing
    assert not variants.admits(variants.key([8, Addressed(0)]))  # a ninth value
    assert not variants.admits(variants.key([0, Addressed(64)]))  # a 65th address set


@pytest.mark.parametrize("wrap", [cgcompile.trusted, cgcompile.guarded])
def test_trusted_and_guarded_replay_each_cache_its_own_graph(wrap):
    """`trusted` and `guarded` bind a graph key, which holds the cache's address: calls that
    alternate two caches of one batch size through them equal eager's, caches included."""
    model = _CacheBetweenLayers().eval()
    options = {"cudagraph_mode": "FULL", "graph_runtime": "simulated", "compiler": "eager"}
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    caches = _caches({"A": 4, "B": 4})
    warm = [("A", 0), ("B", 0), ("A", 1), ("B", 1)]
    later = [("A", 2), ("B", 2), ("B", 3), ("A", 3), ("A", 4), ("B", 4)]
    with torch.no_grad():
        assert all(_cache_calls(compiled, model, warm, *caches))
        fast = wrap(compiled)
        assert all(_cache_calls(fast, model, later, *caches))
        assert fast.refused is None
        assert fast.calls_through_dynamo == 2  # A's to bind, B's first replay; the rest direct


class _Store:
    """Holds a cache outside the module's parameters and buffers (as a `StaticCache` does)."""

    def __init__(self, rows: int) -> None:
        self.cache = torch.zeros(rows, 5, 4)
        torch._dynamo.mark_static_address(self.cache)


class _OwnCache(torch.nn.Module):
    """A decode step writing a cache it holds, sized by the batch (its dim 0 marked)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.store = _Store(rows)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.a(x)[:, None]  # x first: the batch's size comes from the caller's tensor
        cache = self.store.cache
        cache.index_copy_(1, pos, h)
        return cache.sum(1)


def test_trusted_refuses_state_sized_by_the_batch_it_is_not_passed(caplog):
    """State sized by the batch that the forward reads from the module, not from the caller,
    cannot key a graph without running the forward: `trusted` refuses it, naming the fix, and
    every call still equals eager's."""
    model = _OwnCache(4).eval()
    eager = _OwnCache(4).eval()
    eager.load_state_dict(model.state_dict())
    options = {"cudagraph_mode": "FULL", "graph_runtime": "simulated", "compiler": "eager"}
    compiled = torch.compile(model, backend="cudagraph_modes", options=options)
    fast = cgcompile.trusted(compiled)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="cgcompile"):
        for pos in range(4):
            x = torch.randn(4, 4)
            cgcompile.mark_dynamic_batch(x, model.store.cache)
            fn = compiled if pos < 2 else fast
            assert torch.equal(fn(x, torch.tensor([pos])), eager(x, torch.tensor([pos])))
            assert torch.equal(model.store.cache, eager.store.cache)
    assert "does not pass" in (fast.refused or ""), fast.refused
