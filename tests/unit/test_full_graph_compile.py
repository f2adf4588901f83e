"""FULL_AND_PIECEWISE on the FX split: full graphs replay the split's pieces
(`full_graph_compile='pieces'`, the default) or a whole-graph compile of their own ('whole')."""

from __future__ import annotations

import pytest
import torch

import cgcompile
from cgcompile.counters import counters
from cgcompile.torch_features import SHARED_UNBACKED_BATCH
from tests.support.models import dyn, silly_closed_form, silly_model
from tests.support.requires import needs
from tests.support.state import check_capture_all_after_a_mixed_call, run_against_eager

SIM = {"graph_runtime": "simulated", "cudagraph_capture_sizes": [1, 2, 4]}


def compile_silly(**options):
    options = {**SIM, "cudagraph_mode": "FULL_AND_PIECEWISE", **options}
    return torch.compile(silly_model, backend="cudagraph_modes", options=options)


def call(f, n: int, decode: bool) -> None:
    x = dyn(torch.randn(n))
    with cgcompile.batch_hint(uniform_decode=decode):
        torch.testing.assert_close(f(x), silly_closed_form(x))


def piece_wrappers_ran(graph) -> bool:
    return any(w.ran for w in graph.wrappers if w.runtime_mode.name == "PIECEWISE")


@needs(SHARED_UNBACKED_BATCH)  # one trace for every size: one graph to count
@pytest.mark.parametrize(
    ("setting", "compiles", "report"),
    [
        ({}, 3, "pieces"),  # three pieces
        ({"full_graph_compile": "whole"}, 3 + 1, "whole"),  # and the whole graph once more
        ({"compiler": "eager"}, 3, "pieces"),  # nothing to fuse: no second compile
        ({"full_graph_compile": "Whole"}, 3 + 1, "whole"),
    ],
)
def test_full_graphs_compile_the_whole_graph_once_more(setting, compiles, report):
    f = compile_silly(**{"compiler": "inductor", **setting})
    with counters.expect(num_backend_compilations=compiles, num_piecewise_capturable_graphs_seen=3):
        for n in (3, 4, 3, 3):  # decode: warm-up, capture (padded and exact), replays
            call(f, n, decode=True)
    graph = cgcompile.compiled_graphs()[-1]
    assert graph.report.full_graph_compile == report
    # decode batches never entered the split's pieces when full graphs have their own compile
    assert piece_wrappers_ran(graph) == (report == "pieces")
    for n in (3, 4, 2, 2, 3):  # mixed batches: the split's pieces, with graphs
        call(f, n, decode=False)
    assert piece_wrappers_ran(graph)
    captured = graph.report.captured
    assert captured == {"FULL": ["4u4"], "PIECEWISE": ["2", "4"]}
    assert "full graphs replay: " in graph.format_report()
    # what each compile cost: the whole graph's own part only where it has one
    parts = graph.report.compile_parts
    assert list(parts) == (["pieces", "whole graph"] if report == "whole" else ["pieces"])
    assert 0 < sum(parts.values()) <= graph.report.compile_seconds
    assert f"pieces {parts['pieces']:.2f}s" in graph.format_report()


def test_modes_with_one_kind_of_graph_report_no_full_graph_compile():
    for mode in ("FULL", "PIECEWISE"):
        f = torch.compile(
            silly_model, backend="cudagraph_modes", options={**SIM, "cudagraph_mode": mode}
        )
        call(f, 2, decode=True)
        assert cgcompile.compiled_graphs()[-1].report.full_graph_compile is None


@needs(SHARED_UNBACKED_BATCH)
def test_capture_all_records_full_graphs_from_the_whole_compile():
    f = compile_silly(compiler="inductor", full_graph_compile="whole")
    call(f, 4, decode=True)  # the whole compile's first run: a warm-up of a full key
    call(f, 4, decode=False)  # the pieces' first run
    assert cgcompile.capture_all(progress=False) > 0
    for n in (1, 2, 3, 4):
        for decode in (True, False):
            call(f, n, decode)
    graph = cgcompile.compiled_graphs()[-1]
    assert sorted(graph.report.captured["FULL"]) == ["1u1", "2u2", "4u4"]


def test_bad_value_is_a_config_error():
    with pytest.raises(cgcompile.ConfigError, match="full_graph_compile"):
        cgcompile.validate_options({"full_graph_compile": "fused"})


@pytest.mark.parametrize("setting", ["whole", "pieces"])
def test_stateful_step_changes_state_once_per_call(setting):
    """KV-cache writes and a step counter in the graph, decode and mixed batches, padded."""
    run_against_eager("FULL_AND_PIECEWISE", "inductor", full_graph_compile=setting)


@needs(SHARED_UNBACKED_BATCH)
@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
def test_capture_all_captures_everything_after_one_call_of_either_kind(caplog, decode):
    """The other kind's compiled code never ran: capture_all runs it once on padding rows,
    then captures every key of both kinds; later calls only replay."""
    f = compile_silly(compiler="inductor")
    call(f, 4, decode=decode)
    with caplog.at_level("WARNING", logger="cgcompile"):
        captured = cgcompile.capture_all(progress=False)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("cgcompile")] == []
    assert captured == 3 + 3 * 3  # sizes 1, 2, 4: a full graph, and three pieces, each
    graph = cgcompile.compiled_graphs()[-1]
    assert sorted(graph.report.captured["FULL"]) == ["1u1", "2u2", "4u4"]
    with counters.expect(num_cudagraph_captured=0):
        for n in (1, 2, 3, 4):
            for d in (True, False):
                call(f, n, d)


def test_capture_all_after_mixed_calls_changes_no_state():
    """The full graphs' first run on padding rows writes the KV cache and the step counter;
    both get their values back, and later calls equal eager's."""
    check_capture_all_after_a_mixed_call("inductor", [2, 4, 8, 3, 2])
