"""End-to-end: `torch.compile(..., backend="cudagraph_modes")` on the simulated graph runtime."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch

import cgcompile
from cgcompile import CaptureError, CUDAGraphMode, counters
from cgcompile.torch_features import SHARED_UNBACKED_BATCH
from tests.support import silly
from tests.support.differential import check_every_batch_replays, check_llama_matches_eager
from tests.support.models import MODES, SeqModel, dyn, fresh_model, silly_closed_form, silly_model
from tests.support.requires import needs

SIM = {"graph_runtime": "simulated"}


def compile_fn(fn, **options):
    """Compiled on the simulated runtime; captures on a key's first call unless told to warm up
    (`num_warmups=0`), so one call per key is enough to count captures."""
    return torch.compile(
        fn, backend="cudagraph_modes", options={**SIM, "num_warmups": 0, **options}
    )


def the_graph() -> cgcompile.CompiledGraph:
    (graph,) = [g for g in cgcompile.compiled_graphs() if g.report.graph_id >= _first_id]
    return graph


_first_id = 0


@pytest.fixture(autouse=True)
def _only_new_graphs():
    global _first_id
    _first_id = max((g.report.graph_id + 1 for g in cgcompile.compiled_graphs()), default=0)


def test_backend_by_name_without_import():
    code = textwrap.dedent(
        """
        import sys, torch
        f = torch.compile(lambda x: x * 2, backend="cudagraph_modes",
                          options={"cudagraph_mode": "piecewise", "graph_runtime": "simulated"})
        out = f(torch.ones(3))
        import cgcompile
        print(out.tolist(), cgcompile.compiled_graphs()[0].report.requested_mode)
        """
    )
    assert "cgcompile" not in code.split("import cgcompile")[0]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-4:] == ["[2.0,", "2.0,", "2.0]", "PIECEWISE"]


def test_bad_option_reaches_config_error():
    f = torch.compile(lambda x: x + 1, backend="cudagraph_modes", options={"cuda_graph_mode": 1})
    with pytest.raises(Exception, match=r"unknown option\(s\) \['cuda_graph_mode'\]"):
        f(torch.ones(2))


@needs(SHARED_UNBACKED_BATCH)  # one trace for sizes 2 and 1
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_silly_piecewise_counters(compiler):
    f = compile_fn(
        silly_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[1, 2], compiler=compiler
    )
    with counters.expect(
        num_graphs_seen=1,
        num_piecewise_graphs_seen=5,  # 2N+1, N=2 attention calls
        num_piecewise_capturable_graphs_seen=3,  # N+1
        num_backend_compilations=3,
        num_cudagraph_captured=6,  # 2 sizes x 3 pieces
    ):
        f(dyn(torch.randn(2)))  # a graph's first call runs its pieces once, without graphs
        x2 = dyn(torch.randn(2))
        torch.testing.assert_close(f(x2), silly_closed_form(x2))
        x1 = dyn(torch.randn(1))
        torch.testing.assert_close(f(x1), silly_closed_form(x1))


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_silly_replay_runs_attention_between_pieces(compiler):
    f = compile_fn(
        silly_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[1, 2], compiler=compiler
    )
    for _ in range(2):  # warm-up (the pieces' first run), capture
        f(dyn(torch.randn(2)))
    silly.CALLS["n"] = 0
    with counters.expect(num_cudagraph_captured=0):
        out = f(dyn(torch.zeros(2)))
    assert out.tolist() == [19.0, 19.0]
    assert silly.CALLS["n"] == 2


def _nested(mode: CUDAGraphMode):
    f = compile_fn(
        silly_model,
        cudagraph_mode="FULL_AND_PIECEWISE",
        cudagraph_capture_sizes=[2],
        compiler="eager",
    )
    x = dyn(torch.randn(2))
    f(x)  # compile; FULL_AND_PIECEWISE without a hint captured the PIECEWISE key of size 2
    graph = the_graph()
    full, pieces = graph.wrappers[0], graph.wrappers[1:]
    for w in graph.wrappers:
        w.entries.clear()
    desc = cgcompile.BatchDescriptor(2, 2, uniform=True)
    with cgcompile.set_forward_context(mode, desc if mode != CUDAGraphMode.NONE else None):
        out = f(x)
        out = f(x)
    torch.testing.assert_close(out, silly_closed_form(x))
    return full, pieces


def test_nested_full_mode_captures_only_outer():
    full, pieces = _nested(CUDAGraphMode.FULL)
    assert full.num_captures == 1
    assert all(p.num_captures == 0 for p in pieces)


def test_nested_piecewise_mode_captures_only_inner():
    full, pieces = _nested(CUDAGraphMode.PIECEWISE)
    assert full.num_captures == 0
    assert [p.num_captures for p in pieces] == [1, 1, 1]


def test_nested_none_mode_captures_nothing():
    full, pieces = _nested(CUDAGraphMode.NONE)
    assert full.num_captures == 0 and all(p.num_captures == 0 for p in pieces)


@pytest.mark.parametrize(
    "batch",
    [pytest.param("unbacked", marks=needs(SHARED_UNBACKED_BATCH)), "backed", "backed-hint"],
)
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("mode", MODES)
def test_differential_llama_matches_eager(mode, compiler, batch):
    check_llama_matches_eager(
        mode,
        compiler,
        device="cpu",
        graph_runtime="simulated",
        unbacked=batch == "unbacked",
        hint=8 if batch == "backed-hint" else None,  # the largest capture size
    )


def test_fresh_attention_output_is_copied_in_every_replay():
    f = compile_fn(
        fresh_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[4], compiler="eager"
    )
    for _ in range(4):
        x = dyn(torch.randn(4, 3))
        torch.testing.assert_close(f(x), fresh_model(x))


def test_piece_boundaries_copy_only_what_an_eager_op_allocated():
    """An attention op writing into a buffer its previous piece allocated (`out=`): no piece
    copies anything in; one returning a fresh tensor: the next piece copies that one."""
    with_out = compile_fn(
        silly_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[4], compiler="eager"
    )
    fresh = compile_fn(
        fresh_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[4], compiler="eager"
    )
    for _ in range(3):  # warm-up, capture, replay
        x = dyn(torch.randn(4, 3))
        torch.testing.assert_close(with_out(x), silly_closed_form(x))
        torch.testing.assert_close(fresh(x), fresh_model(x))
    out_graph, fresh_graph = cgcompile.compiled_graphs()
    assert [w.copy_arg_indices for w in out_graph.wrappers] == [(), (), ()]
    assert [len(w.copy_arg_indices) for w in fresh_graph.wrappers] == [0, 1]


def test_new_unmanaged_input_raises_on_first_replay():
    f = compile_fn(
        fresh_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[4], compiler="eager"
    )
    desc = cgcompile.BatchDescriptor(4)
    first = dyn(torch.randn(4, 3))  # kept alive, so the next tensor cannot reuse its memory
    with cgcompile.set_forward_context(CUDAGraphMode.PIECEWISE, desc):
        f(first)  # compiles; the pieces' first run
        f(first)  # captures on this tensor's address
        with pytest.raises(CaptureError, match="address"):
            f(dyn(torch.randn(4, 3)))  # manual mode: nobody copies the new tensor in


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_seq_len_with_fixed_batch(mode):
    torch.manual_seed(0)
    model = SeqModel()
    f = torch.compile(
        model,
        backend="cudagraph_modes",
        dynamic=True,
        options={
            **SIM,
            "cudagraph_mode": mode,
            "compiler": "eager",
            "cudagraph_capture_sizes": [2, 4],
        },
    )
    for seq in [3, 5, 3, 6, 5]:
        x = torch.randn(3, seq, 8)
        with torch.no_grad():
            torch.testing.assert_close(f(x), model(x), rtol=1e-5, atol=1e-5)


def test_auto_runtime_on_cpu_warns_and_runs_without_graphs(caplog):
    f = torch.compile(silly_model, backend="cudagraph_modes", options={"compiler": "eager"})
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        x = dyn(torch.randn(3))
        torch.testing.assert_close(f(x), silly_closed_form(x))
    assert the_graph().report.mode == "NONE"
    assert "NO_GRAPH_RUNTIME" in caplog.text and "not on a CUDA device" in caplog.text


def test_static_batch_graph_captures_its_own_size():
    f = compile_fn(silly_model, cudagraph_mode="PIECEWISE", compiler="eager")
    with counters.expect(num_cudagraph_captured=3, num_eager_fallbacks=0):
        for _ in range(3):
            x = torch.randn(5)
            torch.testing.assert_close(f(x), silly_closed_form(x))
    assert the_graph().dispatcher.capture_sizes == (5,)


def test_batch_above_max_runs_eager_unpadded(caplog):
    f = compile_fn(
        silly_model, cudagraph_mode="FULL", cudagraph_capture_sizes=[1, 2], compiler="eager"
    )
    f(dyn(torch.randn(2)))
    with counters.expect(num_eager_fallbacks=2, num_cudagraph_captured=0):
        for n in (3, 9):
            x = dyn(torch.randn(n))
            torch.testing.assert_close(f(x), silly_closed_form(x))
    assert caplog.text.count("exceed the largest capture size") == 1


def test_padded_rows_do_not_leak_into_real_rows():
    f = compile_fn(
        silly_model, cudagraph_mode="FULL", cudagraph_capture_sizes=[8], compiler="eager"
    )
    x = dyn(torch.randn(3))
    out = f(x)
    assert out.shape == (3,)
    torch.testing.assert_close(out, silly_closed_form(x))


def test_identical_layers_compile_once():
    from examples.llama import Llama, LlamaConfig, make_inputs

    cfg = LlamaConfig(num_layers=4)
    model = Llama(cfg)
    f = torch.compile(
        model,
        backend="cudagraph_modes",
        options={**SIM, "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [4]},
    )
    # pieces: [embed+pre0], 3 x [post+pre] (one compile), [post3+head]
    with counters.expect(num_piecewise_capturable_graphs_seen=5, num_backend_compilations=3):
        tokens, positions = dyn(*make_inputs(cfg, 4, "cpu"))
        with torch.no_grad():
            torch.testing.assert_close(
                f(tokens, positions), model(tokens, positions), rtol=1e-4, atol=1e-4
            )


def test_compile_sizes_add_specialized_artifacts():
    f = compile_fn(
        fresh_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[2, 4], compile_sizes=[4]
    )
    with counters.expect(num_backend_compilations=4):  # 2 pieces x (symbolic + size 4)
        for n in (3, 4, 2):
            x = dyn(torch.randn(n, 5))
            torch.testing.assert_close(f(x), fresh_model(x))


def test_a_size_inductor_fails_to_specialise_runs_the_general_artifact(monkeypatch, caplog):
    def fails(*args, **kwargs):
        raise torch._inductor.exc.InductorError(RuntimeError("no lowering for op"), "")

    monkeypatch.setattr(torch._inductor, "standalone_compile", fails)
    f = compile_fn(
        fresh_model, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[2, 4], compile_sizes=[4]
    )
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for n in (3, 4, 2):
            x = dyn(torch.randn(n, 5))
            torch.testing.assert_close(f(x), fresh_model(x))
    assert caplog.text.count("Inductor failed to compile a piece for batch 4 (InductorError") == 2


def test_downgrade_is_logged_and_reported(caplog):
    f = compile_fn(
        silly_model,
        cudagraph_mode="FULL_AND_PIECEWISE",
        attention_cg_support="NEVER",
        compiler="eager",
        cudagraph_capture_sizes=[2],
    )
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        f(dyn(torch.randn(2)))
    report = the_graph().report
    assert report.mode == "PIECEWISE"
    assert "DECODE_NEEDS_SUPPORT" in report.reasons[0]
    assert "FULL_AND_PIECEWISE -> PIECEWISE" in caplog.text


def test_report_lists_captured_keys():
    f = compile_fn(
        silly_model,
        cudagraph_mode="FULL_AND_PIECEWISE",
        compiler="eager",
        cudagraph_capture_sizes=[2, 4],
    )
    x = dyn(torch.randn(3))
    with cgcompile.batch_hint(uniform_decode=True):
        f(x)  # the first call runs without graphs
        f(x)
    f(x)
    report = the_graph().report
    assert report.captured == {"FULL": ["4u4"], "PIECEWISE": ["4"]}
    assert "captured FULL: 1 graphs" in report.format()


def test_graph_shared_by_layers_after_graph_break_stays_correct():
    """Identical layers split into frames by a graph break share one compiled graph; each
    layer gets graphs of its own: graphs captured with layer 0's weights never replay for
    layer 1."""
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            torch._dynamo.graph_break()
            return self.lin(x).relu()

    model = nn.Sequential(Layer(), Layer()).eval()
    f = torch.compile(
        model,
        backend="cudagraph_modes",
        options={
            **SIM,
            "cudagraph_mode": "FULL",
            "compiler": "eager",
            "cudagraph_capture_sizes": [4],
        },
    )
    with torch.no_grad(), counters.expect(num_eager_fallbacks=0):
        for _ in range(3):
            x = dyn(torch.randn(4, 4))
            torch.testing.assert_close(f(x), model(x))
    (graph,) = {g for g in cgcompile.compiled_graphs() if g.wrappers and g.report_id >= _first_id}
    assert graph.report.captured == {"FULL": ["4", "4#1"]}  # each layer has its own graph


@pytest.mark.parametrize("mode", ["NONE", "FULL", "FULL_DECODE_ONLY"])
def test_modes_without_piecewise_compile_the_whole_graph(mode):
    f = compile_fn(silly_model, cudagraph_mode=mode, compiler="eager", cudagraph_capture_sizes=[2])
    with counters.expect(num_piecewise_graphs_seen=1, num_backend_compilations=1):
        x = dyn(torch.randn(2))
        torch.testing.assert_close(f(x), silly_closed_form(x))


def test_every_piece_of_a_forward_shares_one_key():
    """A [batch, seq] model: pieces that do not see seq still key on it, so one forward
    captures all pieces or replays all of them."""
    f = torch.compile(
        SeqModel(),
        backend="cudagraph_modes",
        dynamic=True,
        options={
            **SIM,
            "cudagraph_mode": "PIECEWISE",
            "compiler": "eager",
            "cudagraph_capture_sizes": [4],
            "num_warmups": 0,
        },
    )
    with torch.no_grad():  # graphs are for inference
        for seq in (3, 3, 5):  # the first call runs without graphs
            f(torch.randn(4, seq, 8))
    keys = [set(w.captured_keys()) for w in the_graph().wrappers]
    assert all(k == keys[0] for k in keys) and len(keys[0]) == 2


def test_backed_batch_marking_traces_batch_one_separately():
    f = compile_fn(
        silly_model, cudagraph_mode="PIECEWISE", compiler="eager", cudagraph_capture_sizes=[1, 2, 4]
    )
    torch._dynamo.utils.counters.clear()
    for n in (4, 3, 1, 2):
        x = torch.randn(n)
        cgcompile.mark_dynamic_batch(x)
        torch.testing.assert_close(f(x), silly_closed_form(x))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # batch 1 specialises


def test_batch_hint_is_the_size_dynamo_traces_and_batch_one_still_runs():
    hints: list[list[int]] = []

    def spy(gm, example_inputs):
        placeholders = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
        sizes = [v.shape[0] for v in placeholders if isinstance(v, torch.Tensor)]
        hints.append([s.node.hint for s in sizes if isinstance(s, torch.SymInt)])
        return gm.forward

    f = torch.compile(lambda x: (x * 2).sum(-1), backend=spy)
    for n in (3, 1, 5):
        x = torch.randn(n, 4)
        cgcompile.mark_dynamic_batch(x, hint=512)
        torch.testing.assert_close(f(x), (x * 2).sum(-1))
    assert hints == [[512], []]  # batch 1: own graph, static, no hint


@needs(SHARED_UNBACKED_BATCH)
def test_batch_hint_reaches_the_shape_env_of_an_unbacked_batch():
    hints: list[dict] = []

    def spy(gm, example_inputs):
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        hints.append(dict(fake_mode.shape_env.var_to_hint_override) if fake_mode else {})
        return gm.forward

    f = torch.compile(lambda x: (x * 2).sum(-1), backend=spy)
    for n in (1, 3):  # unbacked: one graph for every size, batch 1 included, hinted
        x = torch.randn(n, 4)
        cgcompile.mark_dynamic_batch(x, hint=512, unbacked=True)
        torch.testing.assert_close(f(x), (x * 2).sum(-1))
    assert [sorted(h.values()) for h in hints] == [[512]]


@pytest.mark.parametrize("bad", [0, True, 2.0], ids=["zero", "bool", "float"])
def test_batch_hint_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="hint must be a positive int"):
        cgcompile.mark_dynamic_batch(torch.randn(2), hint=bad)


@pytest.mark.parametrize("batch_one", ["padded", "own"])
def test_backed_batch_graph_captures_no_size_it_cannot_run(batch_one):
    """Dynamo traces batch 1 apart, so the batch >= 2 graph must not record size-1 graphs:
    batch 1 replays its size-2 graphs (padded) or has a graph of its own (own)."""
    f = compile_fn(
        silly_model,
        cudagraph_mode="FULL_AND_PIECEWISE",
        compiler="eager",
        cudagraph_capture_sizes=[1, 2, 4],
        batch_one=batch_one,
    )
    for n in (4, 1):
        x = torch.randn(n)
        cgcompile.mark_dynamic_batch(x)
        f(x)
    graphs = [g for g in cgcompile.compiled_graphs() if g.report_id >= _first_id]
    sizes = [g.report.capture_sizes for g in graphs]
    assert sizes == ([[2, 4]] if batch_one == "padded" else [[2, 4], [1]])
    dynamic = graphs[0]
    cgcompile.capture_all(progress=False)
    assert all(k[0].num_tokens >= 2 for w in dynamic.wrappers for k in w.captured_keys())
    with counters.expect(num_cudagraph_captured=0):  # every batch finds its graph captured
        for n in (1, 2, 3, 4):
            for uniform in (True, False):
                x = torch.randn(n)
                cgcompile.mark_dynamic_batch(x)
                with cgcompile.batch_hint(uniform_decode=uniform):
                    torch.testing.assert_close(f(x), silly_closed_form(x))


@needs(SHARED_UNBACKED_BATCH)  # one graph holds every key, size 1 included
@pytest.mark.parametrize(
    ("first", "expected"),
    [(3, 3 * 3 + 3), (9, 3 * 3 + 3)],
    ids=["after-a-graph-call", "after-an-eager-call"],
)
def test_capture_all_captures_every_key_once(first, expected):
    f = compile_fn(
        silly_model,
        cudagraph_mode="FULL_AND_PIECEWISE",
        compiler="eager",
        cudagraph_capture_sizes=[1, 2, 4],
    )
    f(dyn(torch.randn(first)))  # 3: PIECEWISE key 4 warms up (first run); 9: above max, eager
    # all keys: PIECEWISE 4, 2, 1 (3 pieces each) + FULL decode 4, 2, 1
    assert cgcompile.capture_all(progress=False) == expected
    check_every_batch_replays(f, silly_closed_form)


def test_capture_all_before_any_call_says_what_to_do():
    from cgcompile.calls.compiled_graph import CompiledGraph

    f = compile_fn(
        silly_model, cudagraph_mode="PIECEWISE", compiler="eager", cudagraph_capture_sizes=[2]
    )
    with cgcompile.set_forward_context():  # manual mode: no automatic call, no template
        f(dyn(torch.randn(2)))
    graph: CompiledGraph = the_graph()
    with pytest.raises(cgcompile.CGCompileError, match="needs one call of the compiled model"):
        graph.capture_all(progress=False)


def test_capture_all_skips_a_graph_never_called_when_another_was(caplog):
    f = compile_fn(
        silly_model, cudagraph_mode="PIECEWISE", compiler="eager", cudagraph_capture_sizes=[2]
    )
    with cgcompile.set_forward_context():  # manual mode: no automatic call, no template
        f(dyn(torch.randn(2)))
    g = compile_fn(SeqModel().eval(), compiler="eager", cudagraph_capture_sizes=[2, 4])
    x = torch.randn(4, 3, 8)
    cgcompile.mark_dynamic_batch(x)
    with torch.no_grad():
        g(x)
        with caplog.at_level(logging.WARNING, logger="cgcompile"):
            captured = cgcompile.capture_all(progress=False)
    assert captured > 0  # the called graph's keys
    assert caplog.text.count("capture_all skips it: it was never called") == 1


class _IndexesNineRows(torch.nn.Module):
    """Reads rows 0-8 of an 8-row buffer: batches of 9 rows and more index out of range."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.randn(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b[torch.arange(x.shape[0]) % 9]


def test_capture_all_leaves_keys_whose_capture_fails_to_lazy_capture_with_one_warning(caplog):
    sizes = [2, 4, 8, 16, 24]
    options = {"compiler": "eager", "cudagraph_mode": "FULL", "cudagraph_capture_sizes": sizes}
    f = compile_fn(_IndexesNineRows().eval(), **options)
    x = torch.randn(4, 4)
    cgcompile.mark_dynamic_batch(x)
    with torch.no_grad():
        f(x)
        with caplog.at_level(logging.WARNING, logger="cgcompile"):
            captured = cgcompile.capture_all(progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 of 5 keys not captured ahead" in warnings[0]
    assert "the first: FULL key 24: " in warnings[0] and "IndexError" in warnings[0]
    assert captured == 3  # 2, 4 and 8 rows


def test_compiled_graphs_lists_the_dynamic_batch_graph_first_whatever_the_first_call():
    f = compile_fn(SeqModel().eval(), compiler="eager", cudagraph_capture_sizes=[1, 2, 4, 8])
    with torch.no_grad():
        for n in (1, 8):  # backed batch: batch 1 is traced apart, first
            x = torch.randn(n, 3, 8)
            cgcompile.mark_dynamic_batch(x)
            f(x)
    graphs = [g for g in cgcompile.compiled_graphs() if g.report.graph_id >= _first_id]
    assert [g.plan.static_batch for g in graphs] == [None, 1]
    assert graphs[0].report.graph_id > graphs[1].report.graph_id  # compiled second


def test_a_piece_inductor_fails_to_compile_runs_eagerly_with_one_warning(monkeypatch, caplog):
    """Inductor raising on one piece (a lowering bug) must not fail the model's call: that piece
    runs its generated forward, the rest stay compiled, and the model still equals eager
    (KV cache written in place) on every call."""
    import torch._inductor.compile_fx as inductor

    real, calls = inductor.compile_fx, []

    def fails_first(gm, example_inputs, *args, **kwargs):
        calls.append(gm)
        if len(calls) == 1:
            raise torch._inductor.exc.InductorError(RuntimeError("no lowering for op"), "")
        return real(gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", fails_first)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        check_llama_matches_eager(
            "PIECEWISE", "inductor", device="cpu", graph_runtime="simulated", unbacked=False
        )
    assert len(calls) > 1  # the other pieces compiled
    failed = [r for r in caplog.records if "Inductor failed to compile a piece" in r.message]
    assert len(failed) == 1 and "InductorError" in failed[0].message
