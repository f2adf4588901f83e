"""The FX-split path: split Dynamo's graph at the splitting ops, compile and wrap each piece.

Steps of `build_split`:
1. split at the splitting ops (`passes.split`) if the mode has piecewise graphs; otherwise the
   whole graph is one piece, so Inductor can fuse across attention;
2. compile each capturable piece once, with the symbolic batch (`piece_compiler`);
3. shadow each capturable submodule with its runner, wrapped PIECEWISE if the mode has
   piecewise graphs; splitting pieces run eagerly;
4. FULL_AND_PIECEWISE with Inductor and `full_graph_compile='whole'`: compile the unsplit
   graph too, for the full graphs, so a decode step replays the kernels FULL replays (fused
   across attention, no buffers materialised at piece boundaries) for one more compile.

    built = build_split(request)      # a `BuildRequest`
    built.runnable(*args)
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from cgcompile.backend.build import BuildRequest, Built
from cgcompile.backend.dry_run import shapes_only
from cgcompile.backend.piece_compiler import PieceRunner, compile_pieces, count_compilations
from cgcompile.calls.cuda_graph_wrapper import WrapperFactory
from cgcompile.calls.report import PieceInfo
from cgcompile.config import CompilationConfig, CUDAGraphMode
from cgcompile.passes.op_match import OpMatcher
from cgcompile.passes.split import SplitResult, generated_forward, split_graph


def build_split(request: BuildRequest) -> Built:
    mode, config = request.mode, request.config
    # Only piecewise graphs need the split; otherwise Inductor sees (and fuses) the whole graph.
    matcher = OpMatcher(request.specs if mode.requires_piecewise_compilation() else ())
    start = time.perf_counter()
    split, runners = _compile(request, matcher)
    parts = {"pieces": time.perf_counter() - start}
    _install_pieces(split, runners, mode, request.make_wrapper, request.plan.static_tensors)
    counts = {
        "num_graphs_seen": 1,
        "num_piecewise_graphs_seen": len(split.items),
        "num_piecewise_capturable_graphs_seen": len(split.capturable),
        "num_backend_compilations": count_compilations(runners),
    }
    full_runnable = None
    if wants_whole_full_graphs(config, mode) and split.splitting:
        start = time.perf_counter()
        whole, whole_runners = _compile(request, OpMatcher(()))
        parts["whole graph"] = time.perf_counter() - start
        _install_pieces(whole, whole_runners, CUDAGraphMode.FULL, request.make_wrapper, ())
        full_runnable = generated_forward(whole.split_gm)
        counts["num_backend_compilations"] += count_compilations(whole_runners)
    pieces = [
        PieceInfo(
            item.name,
            not item.is_splitting,
            item.ops,
            None if item.is_splitting else runners[item.name].shares_compile_with,
        )
        for item in split.items
    ]
    return Built(
        generated_forward(split.split_gm),
        pieces,
        counts,
        full_runnable=full_runnable,
        compile_parts=parts,
        shapes_only=partial(shapes_only, split),
    )


def wants_whole_full_graphs(config: CompilationConfig, mode: CUDAGraphMode) -> bool:
    """Whether full graphs get a compile of their own (the piecewise ones replay the split)."""
    return (
        mode.has_full_cudagraphs()
        and mode.has_piecewise_cudagraphs()
        and config.compiler == "inductor"
        and config.full_graph_compile == "whole"
    )


def _compile(
    request: BuildRequest, matcher: OpMatcher
) -> tuple[SplitResult, dict[str, PieceRunner]]:
    split = split_graph(request.gm, matcher)
    runners = compile_pieces(
        split,
        request.example_inputs,
        request.config.compiler,
        request.config.compile_sizes,
        request.plan.batch_exprs,
    )
    return split, runners


def _install_pieces(
    split: SplitResult,
    runners: dict[str, PieceRunner],
    mode: CUDAGraphMode,
    make_wrapper: WrapperFactory,
    static_inputs: tuple[int, ...],
) -> None:
    """Shadow each capturable submodule with its compiled runner, wrapped if PIECEWISE. A
    piece's args that are graph inputs holding parameters or buffers are its fixed args."""
    static = set(static_inputs)
    last = split.capturable[-1].name if split.capturable else None
    for item in split.capturable:
        runner = runners[item.name]
        piece: Any = runner if runner.by_size else runner.general  # one call less per piece
        if mode.has_piecewise_cudagraphs():
            piece = make_wrapper(
                piece,
                name=item.name,
                copy_arg_indices=item.fresh_arg_indices,
                fixed_arg_indices=[i for i, j in enumerate(item.input_args) if j in static],
                weak_output=item.name == last,
            )
        # An instance attribute wins over nn.Module's submodule lookup in forward().
        split.split_gm.__dict__[item.name] = piece
    for item in split.splitting:  # eager attention: skip nn.Module.__call__ per call
        split.split_gm.__dict__[item.name] = generated_forward(item.graph)
