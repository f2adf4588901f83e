"""`use_inductor_graph_partition=True` on real CUDA graphs (GPU machine; skipped without one):
Inductor compiles the whole graph, partitions it at the splitting ops, and each partition
replays from its own CUDA graph."""

from __future__ import annotations

import pytest
import torch

import cgcompile
from cgcompile import CaptureError, CUDAGraphMode, counters
from tests.support import silly
from tests.support.differential import check_llama_matches_eager
from tests.support.models import MODES, SeqModel, dyn, fresh_model, silly_closed_form, silly_model

pytestmark = pytest.mark.cuda
PARTITION = {"graph_runtime": "cuda", "compiler": "inductor", "use_inductor_graph_partition": True}


def compile_fn(fn, **options):
    return torch.compile(fn, backend="cudagraph_modes", options={**PARTITION, **options})


def newest_graph() -> cgcompile.CompiledGraph:
    return cgcompile.compiled_graphs()[-1]


def test_silly_partitions_cuda():
    f = compile_fn(silly_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[1, 2])
    with counters.expect(
        num_graphs_seen=1,
        num_backend_compilations=1,  # the whole graph, once
        num_inductor_partitions=3,  # 2 attention calls
        num_cudagraph_captured=6,  # 2 sizes x 3 partitions
    ):
        for n in (2, 2, 1, 1):  # each size's first call runs without graphs (num_warmups=1)
            x = dyn(torch.randn(n, device="cuda"))
            torch.testing.assert_close(f(x), silly_closed_form(x))
    assert newest_graph().report.compile_path == "Inductor partition"
    silly.CALLS["n"] = 0
    out = f(dyn(torch.zeros(2, device="cuda")))
    assert out.tolist() == [19.0, 19.0]
    assert silly.CALLS["n"] == 2  # attention runs eagerly between replayed partitions


def test_full_graph_of_the_partitioned_compile_runs_no_python():
    f = compile_fn(silly_model, cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes=[4])
    with cgcompile.batch_hint(uniform_decode=True):
        f(dyn(torch.randn(4, device="cuda")))  # compile; the first run without graphs
        f(dyn(torch.randn(4, device="cuda")))  # capture the FULL graph, replay
        silly.CALLS["n"] = 0
        for _ in range(3):
            x = dyn(torch.randn(4, device="cuda"))
            torch.testing.assert_close(f(x), silly_closed_form(x))
    assert silly.CALLS["n"] == 0  # the attention op lives inside the full graph


@pytest.mark.parametrize(
    "partition", [None, True, False], ids=["where-available", "partition", "fx"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_differential_llama_partition_cuda(mode, dtype, partition):
    """Both paths equal eager (test_backend_cuda covers the default with other options);
    None ("where available") takes the partition wherever the mode has piecewise graphs."""
    piecewise = CUDAGraphMode[mode].has_piecewise_cudagraphs()
    if not piecewise and partition is not None:
        pytest.skip("no piecewise graphs: every setting compiles the same whole graph")
    last = max((g.report.graph_id for g in cgcompile.compiled_graphs()), default=-1)
    check_llama_matches_eager(
        mode,
        "inductor",
        device="cuda",
        graph_runtime="cuda",
        dtype=dtype,
        tol=1e-4 if dtype == torch.float32 else 0.03,  # bf16: kernels round differently
        unbacked=True,
        extra_options={"use_inductor_graph_partition": partition},
    )
    graphs = [g.report for g in cgcompile.compiled_graphs() if g.report.graph_id > last]
    want = "Inductor partition" if piecewise and partition is not False else "FX split"
    assert graphs and all(r.compile_path == want for r in graphs), [r.format() for r in graphs]


def test_sdpa_kernels_cut_partitions_cuda():
    torch.manual_seed(0)
    model = SeqModel().cuda()
    f = compile_fn(model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[2, 4])
    with torch.no_grad():
        for n in (4, 3, 2, 4):
            x = dyn(torch.randn(n, 5, 8, device="cuda"))
            torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
    assert newest_graph().report.num_partitions == 2  # SDPA's CUDA kernel is a boundary


def test_fresh_attention_output_correct_every_replay_partition_cuda():
    f = compile_fn(fresh_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[4])
    for _ in range(4):
        x = dyn(torch.randn(4, 3, device="cuda"))
        torch.testing.assert_close(f(x), fresh_model(x))
    assert newest_graph().report.num_partitions == 2


def test_new_unmanaged_input_raises_partition_cuda():
    f = compile_fn(silly_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[4])
    first = dyn(torch.randn(4, device="cuda"))  # kept alive: its block is not reused
    with cgcompile.set_forward_context(CUDAGraphMode.PIECEWISE, cgcompile.BatchDescriptor(4)):
        f(first)  # compile; the first run without graphs
        f(first)  # capture on this tensor's address
        with pytest.raises(CaptureError, match="address"):
            f(dyn(torch.randn(4, device="cuda")))
