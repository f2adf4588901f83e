"""`use_inductor_graph_partition=True` on CPU: the partition path under an emulated GPU, and
its fallbacks to the FX split on stock CPU.

Inductor makes every CPU node a partition boundary, so no partition ever forms on CPU. The
`emulated_gpu` fixture makes Inductor decide partitions as it would for GPU code (the nodes
report `is_gpu()`) and lets cgcompile accept CPU inputs; the generated code is still CPU code.
The FX-graph cache ignores that patch, so emulated compiles get a cache directory of their own.
"""

from __future__ import annotations

import logging
from unittest import mock

import pytest
import torch
from torch._inductor import utils as inductor_utils
from torch._inductor.scheduler import BaseSchedulerNode, Scheduler

import cgcompile
from cgcompile import CaptureError, CUDAGraphMode, counters
from cgcompile.backend import partition
from cgcompile.calls.partition_adapter import ArgLayout
from cgcompile.torch_features import SHARED_UNBACKED_BATCH
from tests.support.differential import check_every_batch_replays, check_llama_matches_eager
from tests.support.models import SeqModel, dyn, fresh_model, silly_model
from tests.support.requires import needs

PARTITION = {"graph_runtime": "simulated", "use_inductor_graph_partition": True}
SIZES = [1, 2, 4, 8]


def compile_fn(fn, **options):
    return torch.compile(fn, backend="cudagraph_modes", options={**PARTITION, **options})


def newest_graph() -> cgcompile.CompiledGraph:
    return cgcompile.compiled_graphs()[-1]


@pytest.fixture(scope="session")
def emulated_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("inductor-emulated-gpu"))


@pytest.fixture
def emulated_gpu(monkeypatch: pytest.MonkeyPatch, emulated_cache: str) -> None:
    stock = Scheduler.should_partition

    def should_partition(self: Scheduler, node: BaseSchedulerNode, *args, **kwargs):
        # torch 2.9 passes should_log=; it returns a bool there and a reason (str) from 2.11
        with mock.patch.object(BaseSchedulerNode, "is_gpu", lambda _: True):
            return stock(self, node, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "should_partition", should_partition)
    monkeypatch.setattr(partition, "gpu_input_reason", lambda inputs: None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", emulated_cache)


def attention_chain(n: int):
    """n silly attention calls (out = q + k + v, written in place) with math between them."""

    def f(x: torch.Tensor) -> torch.Tensor:
        for i in range(n):
            x = x * 2 + i
            out = torch.empty_like(x)
            torch.ops.silly.attention(x, x, x, out)
            x = out
        return x - 1

    return f


@pytest.mark.parametrize("n", [1, 2, 3], ids=lambda n: f"{n}-attention")
def test_n_splitting_ops_give_n_plus_1_wrapped_partitions(emulated_gpu, n):
    model = attention_chain(n)
    f = compile_fn(model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[2, 4])
    torch._dynamo.utils.counters.clear()
    with counters.expect(
        num_graphs_seen=1,
        num_backend_compilations=1,  # the whole graph, once
        num_inductor_partitions=n + 1,
        num_cudagraph_captured=2 * (n + 1),  # 2 sizes x (n+1) partitions
    ):
        for size in (4, 4, 2, 2, 3):  # each size's first call runs without graphs
            x = dyn(torch.randn(size))
            torch.testing.assert_close(f(x), model(x))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    report = newest_graph().report
    assert (report.compile_path, report.num_partitions) == ("Inductor partition", n + 1)
    assert f"{n + 1} partitions of one whole-graph compile" in report.format()


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize(
    "make_model",
    [lambda: silly_model, lambda: fresh_model, SeqModel],
    ids=["silly-out-param", "silly-fresh-output", "sdpa"],
)
def test_outputs_match_eager_across_batch_sizes(emulated_gpu, make_model, mode):
    torch.manual_seed(0)
    model = make_model()
    f = compile_fn(model, cudagraph_mode=mode, cudagraph_capture_sizes=SIZES)
    shape = {SeqModel: (5, 8)}.get(make_model, (3,) if model is fresh_model else ())
    for i, n in enumerate([4, 3, 1, 8, 2, 5, 4, 9, 3, 1]):
        x = dyn(torch.randn(n, *shape))
        with cgcompile.batch_hint(uniform_decode=i % 2 == 0), torch.no_grad():
            torch.testing.assert_close(f(x), model(x), rtol=1e-5, atol=1e-5)
    assert newest_graph().report.compile_path == "Inductor partition"
    assert counters.num_capture_failures == 0


@pytest.mark.parametrize(
    "batch", [pytest.param("unbacked", marks=needs(SHARED_UNBACKED_BATCH)), "backed-hint"]
)
@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_llama_matches_eager(emulated_gpu, mode, batch):
    last = max((g.report.graph_id for g in cgcompile.compiled_graphs()), default=-1)
    check_llama_matches_eager(
        mode,
        "inductor",
        device="cpu",
        graph_runtime="simulated",
        unbacked=batch == "unbacked",
        hint=8 if batch == "backed-hint" else None,  # the largest capture size
        extra_options={"use_inductor_graph_partition": True},
    )
    graphs = [g for g in cgcompile.compiled_graphs() if g.report.graph_id > last]
    assert graphs and all(g.report.compile_path == "Inductor partition" for g in graphs)


@needs(SHARED_UNBACKED_BATCH)  # one graph holds every key, size 1 included
def test_capture_all_captures_every_key_of_every_partition(emulated_gpu):
    f = compile_fn(
        silly_model, cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes=[1, 2, 4]
    )
    f(dyn(torch.randn(9)))  # above the largest size: runs eagerly, builds the adapters
    # PIECEWISE 4, 2, 1 (3 partitions each) + FULL decode 4, 2, 1
    assert cgcompile.capture_all(progress=False) == 3 * 3 + 3
    check_every_batch_replays(f, silly_model)


def test_cache_salt_wraps_after_a_cached_compile_without_wrapper(
    emulated_gpu, monkeypatch, tmp_path
):
    """The FX-graph cache ignores whether a partition wrapper is set: without the salt, the
    second compile loads the first one's artifact, which has no partitions to wrap."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    patches = partition.partition_config_patches(["silly::attention"])
    patches["custom_should_partition_ops"].remove(partition.PARTITION_SALT)
    x = dyn(torch.randn(4))
    torch._dynamo.utils.counters.clear()
    with torch._inductor.config.patch(patches):
        torch.compile(silly_model, backend="inductor")(x)  # no wrapper set: no partitions
    assert torch._dynamo.utils.counters["inductor"]["fxgraph_cache_miss"] == 1  # now cached
    torch._dynamo.reset()
    f = compile_fn(
        silly_model,
        cudagraph_mode="PIECEWISE",
        cudagraph_capture_sizes=[4],
        splitting_ops=["silly::attention"],  # the same Inductor config but for the salt
    )
    with counters.expect(num_inductor_partitions=3, num_cudagraph_captured=3):
        for _ in range(2):  # the partitions' first run, then the captures
            torch.testing.assert_close(f(x), silly_model(x))


def test_keys_include_the_int_args_of_the_list(emulated_gpu):
    """Manual mode, one descriptor for two sequence lengths: each partition keys on the ints
    in its list, so each length gets its own graphs instead of replaying the other's."""
    torch.manual_seed(0)
    model = SeqModel()
    f = torch.compile(
        model,
        backend="cudagraph_modes",
        dynamic=True,
        options={**PARTITION, "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [3]},
    )
    inputs = {seq: torch.randn(3, seq, 8) for seq in (5, 7)}
    with torch.no_grad(), cgcompile.set_forward_context(CUDAGraphMode.PIECEWISE, num_tokens=3):
        for seq in (5, 7, 5, 7):  # capture, capture, replay, replay
            torch.testing.assert_close(f(inputs[seq]), model(inputs[seq]), rtol=1e-5, atol=1e-5)
    wrappers = newest_graph().wrappers
    assert len(wrappers) == 2 and all(w.num_captures == 2 for w in wrappers)


def test_first_replay_checks_the_address_of_each_tensor_in_the_list(emulated_gpu):
    f = compile_fn(silly_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[4])
    first = dyn(torch.randn(4))  # kept alive, so the next tensor cannot reuse its memory
    with cgcompile.set_forward_context(CUDAGraphMode.PIECEWISE, num_tokens=4):
        f(first)  # compiles; the partitions' first run
        f(first)  # captures on this tensor's address
        with pytest.raises(CaptureError, match="address"):
            f(dyn(torch.randn(4)))  # manual mode: nobody copies the new tensor in


def test_only_tensors_from_eager_ops_are_copied_in(emulated_gpu):
    """SDPA's output (a tuple in the list) is allocated anew by each call: copied in. The
    parameters and the previous partition's outputs keep their addresses: read in place.
    Of SDPA's (out, logsumexp) the partition reads only out: logsumexp is never copied."""
    torch.manual_seed(0)
    model = SeqModel()
    f = compile_fn(model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[4])
    with torch.no_grad(), counters.expect(num_cudagraph_captured=2):
        for _ in range(4):  # warm-up, capture, replay, replay: fresh SDPA outputs each time
            x = dyn(torch.randn(4, 5, 8))
            torch.testing.assert_close(f(x), model(x), rtol=1e-5, atol=1e-5)
    first, second = newest_graph().wrappers
    assert first.copy_arg_indices == ()
    # flat list of the second: SDPA's (out, logsumexp), then parameters and sizes
    assert second.copy_arg_indices == (0,)


def test_a_partition_that_unpacks_a_tuple_reads_all_of_it():
    """Reads are learnt from indexing; iterating a tuple counts as reading every element."""
    layout = ArgLayout([(torch.ones(1), torch.zeros(1), torch.ones(2)), 3])
    flat = layout.flatten([(torch.ones(1), torch.zeros(1), torch.ones(2)), 3])
    reads: set[int] = set()
    (t, n) = layout.rebuild(flat, reads)
    t[-1]
    assert reads == {2}
    a, b, c = t
    assert reads == {0, 1, 2} and layout.nested_positions() == {0, 1, 2}


def test_compile_sizes_add_partitioned_artifacts(emulated_gpu):
    f = compile_fn(
        fresh_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[2, 4], compile_sizes=[4]
    )
    with counters.expect(num_backend_compilations=2, num_inductor_partitions=2):
        for n in (3, 4, 2):
            x = torch.randn(n, 5)
            cgcompile.mark_dynamic_batch(x)  # backed: the batch is an int arg of the graph
            torch.testing.assert_close(f(x), fresh_model(x))
    names = sorted(w.name.split(".", 1)[1] for w in newest_graph().wrappers)
    # sizes 3 and 4 ran the size-4 artifact, size 2 the general one
    assert names == ["partition_0", "partition_1", "size4.partition_0", "size4.partition_1"]


def test_a_partition_wrapper_set_before_is_restored(emulated_gpu):
    def theirs(fn, meta):
        return fn

    inductor_utils.set_customized_partition_wrappers(theirs)
    try:
        f = compile_fn(silly_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[4])
        with counters.expect(num_inductor_partitions=3):
            f(dyn(torch.randn(4)))
        assert inductor_utils._unstable_customized_partition_wrapper.wrapper is theirs
    finally:
        inductor_utils.set_customized_partition_wrappers(None)


def check_falls_back(caplog, rule: str, *, warns: bool = True, **options) -> None:
    f = compile_fn(silly_model, cudagraph_capture_sizes=[4], **options)
    with caplog.at_level(logging.INFO, logger="cgcompile"):
        x = dyn(torch.randn(4))
        torch.testing.assert_close(f(x), silly_model(x))
    report = newest_graph().report
    assert report.compile_path == "FX split" and report.num_partitions == 0
    assert report.partition_fallback.startswith(rule)
    assert f"partition not used: {rule}" in report.format()
    records = [r for r in caplog.records if "partition not used" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING if warns else logging.INFO]
    assert rule in records[0].getMessage()


def test_stock_cpu_falls_back_to_the_fx_split(caplog):
    check_falls_back(caplog, "NOT_ON_GPU", cudagraph_mode="PIECEWISE")
    assert "inputs are on cpu" in newest_graph().report.partition_fallback


def test_where_available_falls_back_quietly(caplog):
    check_falls_back(
        caplog,
        "NOT_ON_GPU",
        warns=False,
        cudagraph_mode="PIECEWISE",
        use_inductor_graph_partition=None,
    )


def test_where_available_uses_the_partition(emulated_gpu):
    f = compile_fn(
        silly_model,
        cudagraph_mode="FULL_AND_PIECEWISE",
        cudagraph_capture_sizes=[4],
        use_inductor_graph_partition=None,
    )
    with counters.expect(num_inductor_partitions=3):
        x = dyn(torch.randn(4))
        torch.testing.assert_close(f(x), silly_model(x))


def test_false_never_tries_the_partition(emulated_gpu):
    f = compile_fn(silly_model, cudagraph_mode="PIECEWISE", use_inductor_graph_partition=False)
    x = dyn(torch.randn(4))
    torch.testing.assert_close(f(x), silly_model(x))
    report = newest_graph().report
    assert (report.compile_path, report.partition_fallback) == ("FX split", None)


def test_eager_compiler_falls_back_to_the_fx_split(emulated_gpu, caplog):
    check_falls_back(caplog, "EAGER_COMPILER", cudagraph_mode="PIECEWISE", compiler="eager")


def test_torch_without_the_partition_api_falls_back(emulated_gpu, monkeypatch, caplog):
    monkeypatch.setattr(partition, "has_partition_api", lambda: False)
    check_falls_back(caplog, "TORCH_TOO_OLD", cudagraph_mode="FULL_AND_PIECEWISE")


def test_callable_splitting_op_falls_back(emulated_gpu, caplog):
    def python_attention(q):  # not a torch op: Inductor cannot name it
        return q

    check_falls_back(
        caplog,
        "UNNAMED_SPLITTING_OP",
        cudagraph_mode="PIECEWISE",
        splitting_ops=["silly::attention", python_attention],
    )


def test_no_partition_formed_falls_back(monkeypatch, tmp_path, caplog):
    """Inputs accepted, but stock Inductor on CPU forms no partition: the compile is wasted,
    counted, and the FX split takes over."""
    monkeypatch.setattr(partition, "gpu_input_reason", lambda inputs: None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with counters.expect(num_backend_compilations=1 + 3, num_inductor_partitions=0):
        check_falls_back(caplog, "NO_PARTITION_FORMED", cudagraph_mode="PIECEWISE")


@pytest.mark.parametrize("mode", ["NONE", "FULL", "FULL_DECODE_ONLY"])
def test_modes_without_piecewise_graphs_note_it_quietly(emulated_gpu, caplog, mode):
    check_falls_back(caplog, "NO_PIECEWISE_GRAPHS", warns=False, cudagraph_mode=mode)


@pytest.mark.parametrize(
    "args",
    [
        [torch.ones(2), 3],
        [(torch.ones(2), torch.zeros(1)), torch.ones(3), 4, [torch.ones(1)]],
        [((torch.ones(2),), torch.zeros(1)), 5],
    ],
    ids=["flat", "one-level", "deeper"],
)
def test_arg_layout_flattens_tensors_and_rebuilds_the_list(args):
    layout = ArgLayout(args)
    flat = layout.flatten(args)
    assert not any(isinstance(a, (tuple, list)) for a in flat)
    rebuilt = layout.rebuild(flat)
    assert repr(rebuilt) == repr(args)
    assert [type(a) for a in rebuilt] == [type(a) for a in args]
