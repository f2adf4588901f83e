"""The backend on real CUDA graphs (run on the GPU machine; skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

import cgcompile
from cgcompile import CaptureError, CUDAGraphMode, counters
from cgcompile.torch_features import SHARED_UNBACKED_BATCH
from tests.support import silly
from tests.support.differential import check_llama_matches_eager
from tests.support.models import MODES, dyn, fresh_model, silly_closed_form, silly_model
from tests.support.requires import needs

pytestmark = pytest.mark.cuda
CUDA = {"graph_runtime": "cuda"}


def compile_fn(fn, **options):
    """Captures on a key's first call unless told to warm up (`num_warmups=0`)."""
    return torch.compile(
        fn, backend="cudagraph_modes", options={**CUDA, "num_warmups": 0, **options}
    )


def newest_graph() -> cgcompile.CompiledGraph:
    return cgcompile.compiled_graphs()[-1]


@needs(SHARED_UNBACKED_BATCH)  # one trace for sizes 2 and 1
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_silly_piecewise_counters_cuda(compiler):
    f = compile_fn(
        silly_model,
        cudagraph_mode="PIECEWISE",
        cudagraph_capture_sizes=[1, 2],
        compiler=compiler,
        use_inductor_graph_partition=False,  # the FX split's pieces (the partition: its tests)
    )
    with counters.expect(
        num_piecewise_graphs_seen=5,
        num_piecewise_capturable_graphs_seen=3,
        num_backend_compilations=3,
        num_cudagraph_captured=6,
    ):
        for n in (2, 2, 1):  # the graph's first call runs its pieces without graphs
            x = dyn(torch.randn(n, device="cuda"))
            torch.testing.assert_close(f(x), silly_closed_form(x))
    silly.CALLS["n"] = 0
    out = f(dyn(torch.zeros(2, device="cuda")))
    assert out.tolist() == [19.0, 19.0]
    assert silly.CALLS["n"] == 2  # attention runs eagerly between replayed pieces


def test_full_replay_runs_no_python():
    f = compile_fn(
        silly_model, cudagraph_mode="FULL", cudagraph_capture_sizes=[4], compiler="inductor"
    )
    x = dyn(torch.randn(4, device="cuda"))
    f(x)  # compile; the first run without graphs
    f(x)  # capture, replay
    silly.CALLS["n"] = 0
    for _ in range(3):
        x = dyn(torch.randn(4, device="cuda"))
        torch.testing.assert_close(f(x), silly_closed_form(x))
    assert silly.CALLS["n"] == 0  # the attention op lives inside the graph


@pytest.mark.parametrize(
    "batch", [pytest.param("unbacked", marks=needs(SHARED_UNBACKED_BATCH)), "backed"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", MODES)
def test_differential_llama_cuda(mode, compiler, dtype, batch):
    # bf16: compiled kernels round differently from eager; compare against the logits' scale
    tol = 1e-4 if dtype == torch.float32 else 0.03
    check_llama_matches_eager(
        mode,
        compiler,
        device="cuda",
        graph_runtime="cuda",
        dtype=dtype,
        tol=tol,
        unbacked=batch == "unbacked",
    )


def test_fresh_attention_output_correct_every_replay_cuda():
    f = compile_fn(
        fresh_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[4], compiler="inductor"
    )
    for _ in range(4):
        x = dyn(torch.randn(4, 3, device="cuda"))
        torch.testing.assert_close(f(x), fresh_model(x))


def test_new_unmanaged_input_raises_cuda():
    f = compile_fn(
        fresh_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[4], compiler="eager"
    )
    first = dyn(torch.randn(4, 3, device="cuda"))  # kept alive: its block is not reused
    with cgcompile.set_forward_context(CUDAGraphMode.PIECEWISE, cgcompile.BatchDescriptor(4)):
        f(first)  # compile; the first run without graphs
        f(first)  # capture
        with pytest.raises(CaptureError, match="address"):
            f(dyn(torch.randn(4, 3, device="cuda")))


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_graphs_share_one_pool(mode):
    """Graph memory of N sizes stays well below N x the memory of the largest alone."""
    from examples.llama import Llama, LlamaConfig, make_inputs

    cfg = LlamaConfig(num_layers=4, hidden=256, heads=4, ffn=512, vocab=1024, cache_len=256)
    model = Llama(cfg).to("cuda").eval()
    sizes = [256, 192, 128, 64, 32]
    f = torch.compile(
        model,
        backend="cudagraph_modes",
        options={
            **CUDA,
            "cudagraph_mode": mode,
            "cudagraph_capture_sizes": sorted(sizes),
            "num_warmups": 0,
        },
    )
    memory = []
    with torch.no_grad():
        f(*dyn(*make_inputs(cfg, 1, "cuda")))  # the first run, without graphs (no capture size)
        for n in sizes:  # largest first, as bulk capture does
            f(*dyn(*make_inputs(cfg, n, "cuda")))
            memory.append(newest_graph().runtime.memory_bytes())
    largest_alone = memory[0]
    assert largest_alone > 0
    assert memory[-1] < 0.5 * len(sizes) * largest_alone, memory


def test_an_output_held_across_the_next_call_keeps_its_value():
    """An output the caller still holds at the next call keeps its value, as after an eager
    call: the next replay writes graph memory, the held output is moved to a copy first."""
    f = compile_fn(
        silly_model, cudagraph_mode="FULL", cudagraph_capture_sizes=[4], compiler="inductor"
    )
    f(dyn(torch.randn(4, device="cuda")))  # the first run, without graphs
    a = dyn(torch.randn(4, device="cuda"))
    out_a = f(a)
    b = dyn(torch.randn(4, device="cuda"))
    out_b = f(b)
    torch.testing.assert_close(out_a, silly_closed_form(a))
    torch.testing.assert_close(out_b, silly_closed_form(b))
    assert out_a.data_ptr() != out_b.data_ptr()


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_pieces_keep_residual_adds_out_of_cublas(mode):
    """A piece hands its residual sum to the next piece; Inductor would compute it with addmm
    (a copy and a beta gemm) where the unsplit graph fuses the add into the next norm
    (`passes.output_addmm`). The tiny Llama's linears have no bias: any addmm is a residual."""
    from torch._inductor.utils import run_and_get_code

    from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch

    torch._dynamo.reset()
    model = Llama(LlamaConfig.tiny()).to("cuda", torch.bfloat16).eval()
    options = {
        **CUDA,
        "cudagraph_mode": mode,
        "compiler": "inductor",
        "full_graph_compile": "pieces",
    }
    f = torch.compile(model, backend="cudagraph_modes", options=options)
    tokens, positions = make_inputs(model.cfg, 8, "cuda")
    mark_batch(model.cfg, tokens, positions)
    with torch.no_grad():
        _, codes = run_and_get_code(f, tokens, positions)
    assert len(codes) >= 2 and any("extern_kernels.mm(" in code for code in codes)
    assert not any("addmm" in code for code in codes)
