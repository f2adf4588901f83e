"""Hand-built CUDA graphs of the example Llama: the ideals the cgcompile modes are held to.

`HandFullGraph`: the whole step compiled by Inductor for one static size and captured in one
CUDA graph. `HandPiecewise`: the model split by hand at its SDPA calls into
[embed + layer 0 pre-attention], [layer i post-attention + layer i+1 pre-attention]...,
[last post-attention + norm + lm_head]; each piece compiled by Inductor for a static size and
captured into one pool per size, SDPA run eagerly between pieces with its result copied into the
static buffer the next piece reads. Both capture a size on first request, then replay:

    hand = HandFullGraph(model)
    step = hand.step_for(tokens, positions)    # capture (first time for this size)
    logits = step()                            # copy inputs in, replay; output is graph memory
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from examples.llama import Layer, Llama

Step = Callable[[], torch.Tensor]


def _warm_up(fn: Callable[[], Any], times: int = 2) -> None:
    """Run eagerly on a side stream before capture: compile, autotune, allocator, lazy init."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


class HandFullGraph:
    """One Inductor static-shape compile and one CUDA graph per batch size."""

    def __init__(self, model: Llama) -> None:
        self.compiled = torch.compile(model, dynamic=False)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}

    def _capture(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        static_t, static_p = tokens.clone(), positions.clone()
        _warm_up(lambda: self.compiled(static_t, static_p))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
            out = self.compiled(static_t, static_p)
        self.graphs[tokens.shape[0]] = (graph, (static_t, static_p, out))

    def step_for(self, tokens: torch.Tensor, positions: torch.Tensor) -> Step:
        if tokens.shape[0] not in self.graphs:
            self._capture(tokens, positions)
        graph, (static_t, static_p, out) = self.graphs[tokens.shape[0]]

        def step() -> torch.Tensor:
            static_t.copy_(tokens)
            static_p.copy_(positions)
            graph.replay()
            return out

        return step

    def eager_step_for(self, tokens: torch.Tensor, positions: torch.Tensor) -> Step:
        """The same compiled code run without the graph (for profiling its kernels)."""
        return lambda: self.compiled(tokens, positions)


def _first(model: Llama, tokens: torch.Tensor, positions: torch.Tensor) -> Any:
    return model.layers[0].pre_attention(model.embed(tokens), positions)


def _middle(post: Layer, pre: Layer, residual: Any, attn: Any, positions: Any) -> Any:
    return pre.pre_attention(post.post_attention(residual, attn), positions)


def _last(model: Llama, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    return model.head(model.layers[-1].post_attention(residual, attn))


class _Pieces:
    """The captured pieces of one batch size, their static buffers, and how to replay them."""

    def __init__(self, model: Llama, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        self.layers = model.layers
        self.tokens, self.positions = tokens.clone(), positions.clone()
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.queries: list[torch.Tensor] = []  # q of layer i, written by graph i
        self.attn: torch.Tensor | None = None  # SDPA result, read by the graph after it
        self.out: torch.Tensor | None = None

    def capture(self, first: Callable, middle: Callable, last: Callable, model: Llama) -> None:
        pool = torch.cuda.graph_pool_handle()
        residual, q = self._graph(pool, lambda: first(model, self.tokens, self.positions))
        self.attn = torch.empty_like(q)
        self.queries.append(q)
        for post, pre in zip(self.layers[:-1], self.layers[1:], strict=True):
            residual, q = self._graph(
                pool, lambda p=post, r=pre, x=residual: middle(p, r, x, self.attn, self.positions)
            )
            self.queries.append(q)
        self.out = self._graph(pool, lambda x=residual: last(model, x, self.attn))

    def _graph(self, pool: Any, fn: Callable[[], Any]) -> Any:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            result = fn()
        self.graphs.append(graph)
        return result

    def replay(self) -> torch.Tensor:
        self.graphs[0].replay()
        for layer, q, graph in zip(self.layers, self.queries, self.graphs[1:], strict=True):
            self.attn.copy_(layer.attention(q))
            graph.replay()
        return self.out


class HandPiecewise:
    """Pieces compiled once per static size (shared by every layer) and captured per size."""

    def __init__(self, model: Llama) -> None:
        self.model = model
        self.first = torch.compile(_first, dynamic=False)
        self.middle = torch.compile(_middle, dynamic=False)
        self.last = torch.compile(_last, dynamic=False)
        self.pieces: dict[int, _Pieces] = {}

    def _run_uncaptured(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        residual, q = self.first(self.model, tokens, positions)
        for post, pre in zip(self.model.layers[:-1], self.model.layers[1:], strict=True):
            residual, q = self.middle(post, pre, residual, post.attention(q), positions)
        return self.last(self.model, residual, self.model.layers[-1].attention(q))

    def step_for(self, tokens: torch.Tensor, positions: torch.Tensor) -> Step:
        n = tokens.shape[0]
        if n not in self.pieces:
            _warm_up(lambda: self._run_uncaptured(tokens, positions))
            pieces = _Pieces(self.model, tokens, positions)
            pieces.capture(self.first, self.middle, self.last, self.model)
            self.pieces[n] = pieces
        pieces = self.pieces[n]

        def step() -> torch.Tensor:
            pieces.tokens.copy_(tokens)
            pieces.positions.copy_(positions)
            return pieces.replay()

        return step
