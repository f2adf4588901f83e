"""Messages that teach: each names what was seen and the fix where the user first looks."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

import cgcompile
from cgcompile.errors import ConfigError

OPTIONS = {"cudagraph_mode": "FULL", "graph_runtime": "simulated", "compiler": "eager"}


def _compile(**options: object) -> tuple[torch.nn.Module, object]:
    model = torch.nn.Linear(8, 8).eval()
    compiled = torch.compile(model, backend="cudagraph_modes", options={**OPTIONS, **options})
    return model, compiled


def _call(compiled: object, n: int, marked: bool = True) -> None:
    x = torch.randn(n, 8)
    if marked:
        cgcompile.mark_dynamic_batch(x)
    with torch.inference_mode():
        compiled(x)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("key", "guess"),
    [
        ("cudagraph_mod", "cudagraph_mode"),
        ("CUDAGRAPH_MODE", "cudagraph_mode"),
        ("mode", "cudagraph_mode"),
        ("max_capture_size", "max_cudagraph_capture_size"),
    ],
    ids=["typo", "case", "suffix", "missing-word"],
)
def test_unknown_option_suggests_the_closest_valid_one(key: str, guess: str) -> None:
    with pytest.raises(ConfigError) as info:
        cgcompile.validate_options({key: 1})
    assert str(info.value).startswith(f"unknown option(s) [{key!r}]: did you mean {guess!r}? ")
    assert "Valid options: ['cudagraph_mode'" in str(info.value)


def test_unknown_option_without_a_close_one_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"^unknown option\(s\) \['zzz'\]\. Valid options: \["):
        cgcompile.validate_options({"zzz": 1})


def test_unknown_options_get_one_suggestion_each() -> None:
    with pytest.raises(ConfigError) as info:
        cgcompile.validate_options({"cudagraph_mod": 1, "num_warmup": 1})
    assert "did you mean 'cudagraph_mode' for 'cudagraph_mod', 'num_warmups' for 'num_warmup'?" in (
        str(info.value)
    )


def test_a_typo_at_the_first_call_names_the_key_and_the_fix_under_torchs_line() -> None:
    """torch passes options to a backend only at the first compile and wraps what it raises:
    its own line comes first, cgcompile's one line right under it."""
    _, compiled = _compile(cudagraph_mod="FULL")
    with pytest.raises(BackendCompilerFailed) as info:
        _call(compiled, 4)
    assert isinstance(info.value.inner_exception, ConfigError)
    torch_line, ours = str(info.value).splitlines()[:2]
    assert torch_line == "backend='cudagraph_modes' raised:"
    assert ours.startswith(
        "ConfigError: unknown option(s) ['cudagraph_mod']: did you mean 'cudagraph_mode'?"
    )


def test_a_batch_over_the_largest_size_warns_with_the_option_to_raise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, compiled = _compile(cudagraph_capture_sizes=[2, 4])
    for n in (3, 9, 9):
        _call(compiled, n)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "9 tokens exceed the largest capture size 4" in warnings[0]
    assert "raise the option max_cudagraph_capture_size" in warnings[0]


def _never_marked(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "never marked" in r.getMessage()]


def test_a_recompile_for_an_unmarked_batch_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cgcompile")
    _, compiled = _compile()
    for n in (6, 6, 13, 13, 20):  # Dynamo: a static graph of 6, then a dynamic one
        _call(compiled, n, marked=False)
    (line,) = _never_marked(caplog)
    assert re.match(r"graph \d+: Dynamo compiled this code again \(compile \d+/1\)", line)
    assert "cgcompile.mark_dynamic_batch" in line
    assert len(cgcompile.compiled_graphs()) == 2


@pytest.mark.parametrize("sizes", [(6, 13), (1, 3)], ids=["one-trace", "batch-1-first"])
def test_a_marked_batch_gets_no_such_line(
    caplog: pytest.LogCaptureFixture, sizes: tuple[int, int]
) -> None:
    caplog.set_level(logging.INFO, logger="cgcompile")
    _, compiled = _compile()
    for n in sizes:
        _call(compiled, n)
    assert not _never_marked(caplog)


def _reports() -> list[str]:
    graphs = sorted(cgcompile.compiled_graphs(), key=lambda graph: graph.report_id)
    return [graph.format_report() for graph in graphs]


def test_a_batch_1_graph_that_came_first_says_why_it_compiled_on_its_own() -> None:
    _, compiled = _compile()
    for n in (1, 3):
        _call(compiled, n)
    first, dynamic = _reports()
    assert "batch-1 graph compiled on its own: it came first, before any graph" in first
    assert "batch-1 graph" not in dynamic


def test_a_batch_1_graph_after_the_dynamic_one_is_served_by_it() -> None:
    _, compiled = _compile()
    for n in (3, 1):
        _call(compiled, n)
    (report,) = _reports()
    assert "also serves Dynamo's batch-1 graph" in report


def test_an_unmarked_batch_of_1_is_a_static_graph_with_nothing_to_explain() -> None:
    _, compiled = _compile()
    _call(compiled, 1, marked=False)
    (report,) = _reports()
    assert "batch-1 graph" not in report
