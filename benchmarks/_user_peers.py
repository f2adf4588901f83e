"""The peers of the user-facing benchmarks, each a `step(tokens, positions) -> logits` that a
decode loop calls with fresh input tensors, as a user's loop does.

Each peer gets its own copy of the model (its own KV caches) and its own `forward` code object,
so in one process Dynamo never walks another peer's cache entries on a call:

- `hand`: Inductor's static compile of the step captured by hand in one CUDA graph per size;
  a call copies the inputs into its static buffers and replays (the ideal a user could write);
- `hand_pieces`: the same compiled pieces cgcompile's PIECEWISE replays, captured by hand
  (`_hand_graphs.HandPiecewise`), SDPA run eagerly between them;
- `tenline`: a 10-line Dynamo backend: the traced graph captured once on static copies of its
  example inputs; a call does one `torch._foreach_copy_` of the user inputs and the replay
  (`tenline/skip-guards` adds `guard_filter_fn=torch.compiler.skip_all_guards_unsafe`;
  `tenline/inductor` captures Inductor's compile of the graph: the hand graph's kernels behind
  Dynamo, the floor of any backend that keeps Dynamo's guards); each size traced statically;
- `reduce-overhead`: `torch.compile(mode="reduce-overhead")`;
- `cg/MODE`: `torch.compile(backend="cudagraph_modes")` in that mode (Inductor pieces), called
  bare; FULL_AND_PIECEWISE and FULL_DECODE_ONLY inside `batch_hint(uniform_decode=True)` (the
  example's flat tokens do not show a decode step); `cg/MODE/trusted` with `cgcompile.trusted`
  (`cg/MODE/guarded`: `cgcompile.guarded`);
  `cg/MODE/own` with batch 1 compiled on its own (`batch_one="own"`, not padded to 2 rows);
  `cg/MODE/precompiled` through `cgcompile.precompile` (AOT-compiled, guards checked by it).

    peer = make_peer("cg/FULL", model_copy, sizes=[1, 8])
    logits = peer.step(tokens, positions)
"""

from __future__ import annotations

import copy
import tempfile
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._hand_graphs import HandPiecewise
from examples.llama import Llama, make_inputs, mark_batch

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def own_code(model: Llama) -> Llama:
    """`model` with a class whose `forward` is a new code object (its own Dynamo cache)."""
    cls = type(model)
    f = cls.forward
    code = f.__code__.replace(co_name=f"{f.__name__}_{id(model):x}")
    forward = types.FunctionType(code, f.__globals__, code.co_name, f.__defaults__, f.__closure__)
    model.__class__ = type(cls.__name__, (cls,), {"forward": forward})
    return model


class Peer:
    """A named step and what it compiled or captured."""

    def __init__(self, name: str, step: StepFn, compiled: Any = None) -> None:
        self.name = name
        self.step = step
        self.compiled = compiled
        self.replay: Callable[[], Any] | None = None
        """A bare replay of the peer's graph for the last size stepped, where it has one."""
        self.cfg: Any = None
        """The model's config (set by `make_peer`)."""
        self.model: Any = None
        """The peer's own copy of the model (set by `make_peer`)."""
        self.fast: Any = None
        """`cg/MODE/trusted` and `/guarded`: what `cgcompile.trusted` or `guarded` returned."""


def _warm_up(fn: Callable[[], Any]) -> None:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


class _HandGraphs:
    """A callable captured in one CUDA graph per batch size on static copies of its inputs."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Any]] = {}

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> Any:
        n = tokens.shape[0]
        if n not in self.graphs:
            static = [tokens.clone(), positions.clone()]
            _warm_up(lambda: self.fn(*static))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self.fn(*static)
            self.graphs[n] = (graph, static, out)
        graph, static, out = self.graphs[n]
        torch._foreach_copy_(static, [tokens, positions])
        graph.replay()
        return out


def _hand(model: Llama, compiler: str) -> Peer:
    fn = torch.compile(own_code(model), dynamic=False) if compiler == "inductor" else model
    hand = _HandGraphs(fn)
    peer = Peer("hand", hand.step, hand)
    peer.replay = lambda: next(reversed(hand.graphs.values()))[0].replay()
    return peer


def _hand_pieces(model: Llama) -> Peer:
    hand = HandPiecewise(own_code(model))

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> Any:
        n = tokens.shape[0]
        if n not in hand.pieces:
            hand.step_for(tokens, positions)  # compiles and captures this size
        pieces = hand.pieces[n]
        torch._foreach_copy_([pieces.tokens, pieces.positions], [tokens, positions])
        return pieces.replay()

    return Peer("hand_pieces", step, hand)


def tenline_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Capture the traced graph once on static copies of its user inputs; per call one fused
    copy of those inputs and the replay (parameters and buffers are read in place)."""
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    user = [
        i
        for i, (x, node) in enumerate(zip(example_inputs, nodes, strict=True))
        if isinstance(x, torch.Tensor)
        and not isinstance(x, nn.Parameter)
        and not node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
    ]
    args = [x.clone() if i in user else x for i, x in enumerate(example_inputs)]
    _warm_up(lambda: gm(*args))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gm(*args)
    static = [args[i] for i in user]

    def run(*call_args: Any) -> Any:
        torch._foreach_copy_(static, [call_args[i] for i in user])
        graph.replay()
        return out

    run.graph = graph  # type: ignore[attr-defined]
    return run


def tenline_inductor_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """`tenline_backend` on Inductor's compile of the graph: the hand graph's kernels."""
    from torch._inductor.compile_fx import compile_fx

    compiled = compile_fx(gm, list(example_inputs))
    return tenline_backend(_Traced(gm, compiled), example_inputs)


class _Traced(torch.nn.Module):
    """A compiled graph with the traced graph's placeholders (which `tenline_backend` reads)."""

    def __init__(self, gm: torch.fx.GraphModule, compiled: Callable) -> None:
        super().__init__()
        self.graph = gm.graph
        self.compiled = compiled

    def forward(self, *args: Any) -> Any:
        return self.compiled(*args)


def _tenline(model: Llama, name: str) -> Peer:
    skip_guards = name == "tenline/skip-guards"
    options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe} if skip_guards else None
    backend = tenline_inductor_backend if name == "tenline/inductor" else tenline_backend
    compiled = torch.compile(own_code(model), backend=backend, options=options, dynamic=False)
    return Peer(name, compiled, compiled)


def _reduce_overhead(model: Llama) -> Peer:
    compiled = torch.compile(own_code(model), mode="reduce-overhead", dynamic=False)

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(tokens, positions)

    return Peer("reduce-overhead", step, compiled)


def _cgcompile(
    model: Llama,
    mode: str,
    sizes: Sequence[int],
    opt_in: str | None,
    compiler: str,
    runtime: str,
    batch_one: str | None,
    mark: Callable[[torch.Tensor, torch.Tensor, int | None], None],
    compiled: Any = None,
) -> Peer:
    import cgcompile

    options = {"cudagraph_mode": mode, "cudagraph_capture_sizes": sorted(sizes)}
    options.update(compiler=compiler, graph_runtime=runtime)
    if batch_one is not None:  # "cg/MODE/own": batch 1 compiled on its own, not padded to 2 rows
        options["batch_one"] = batch_one
    if compiled is None:
        compiled = torch.compile(own_code(model), backend="cudagraph_modes", options=options)
    wrap = {"trusted": cgcompile.trusted, "guarded": cgcompile.guarded}
    target = wrap[opt_in](compiled) if opt_in else compiled
    # the example's tokens are flat ([n]): only the modes with decode-only graphs need the hint
    # to know a decode step (FULL and PIECEWISE capture every batch alike; called bare, as users do)
    hinted = mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")
    marked: set[int] = set()

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> Any:
        n = tokens.shape[0]
        if n not in marked:  # only a call that traces needs marked inputs
            marked.add(n)
            mark(tokens, positions, max(sizes) if n > 1 else None)
        if not hinted:
            return target(tokens, positions)
        with cgcompile.batch_hint(uniform_decode=True):
            return target(tokens, positions)

    name = f"cg/{mode}" + ("/own" if batch_one else "") + (f"/{opt_in}" if opt_in else "")
    peer = Peer(name, step, compiled)
    peer.fast = target if opt_in else None
    return peer


def _precompiled(
    model: Llama, mode: str, sizes: Sequence[int], compiler: str, runtime: str
) -> Peer:
    """`cgcompile.precompile` for a batch of the largest size (dynamic) and of 1, into a
    temporary file (compiled in this process); called unmarked, as its calls need no marks."""
    import cgcompile

    options = {"cudagraph_mode": mode, "cudagraph_capture_sizes": sorted(sizes)}
    options.update(compiler=compiler, graph_runtime=runtime)
    # no own_code: an AOT-compiled forward adds no entry to Dynamo's cache of the code, and the
    # saved guards name the model's class, which must be importable
    device = next(model.parameters()).device
    examples = []
    for n in {max(sizes), 1}:
        tokens, positions = make_inputs(model.cfg, n, device)
        mark_batch(model.cfg, tokens, positions, hint=n if n > 1 else None)
        examples.append((tokens, positions))
    path = Path(tempfile.mkdtemp(prefix="cgcompile-peer-")) / "model.cgaot"
    with torch.no_grad():
        compiled = cgcompile.precompile(model, examples, path, options)
    hinted = mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> Any:
        if not hinted:
            return compiled(tokens, positions)
        with cgcompile.batch_hint(uniform_decode=True):
            return compiled(tokens, positions)

    return Peer(f"cg/{mode}/precompiled", step, compiled)


def make_peer(
    name: str,
    model: Llama,
    sizes: Sequence[int],
    compiler: str = "inductor",
    graph_runtime: str = "auto",
    mark: Callable[[torch.Tensor, torch.Tensor, int | None], None] | None = None,
    share: Peer | None = None,
) -> Peer:
    """The peer called `name` (see the module docstring) on its own deep copy of `model`;
    `compiler` for the hand graph and cgcompile's pieces ("eager": the model's own ops);
    `graph_runtime` for cgcompile ("simulated": a CPU smoke run of the cg peers); `mark(tokens,
    positions, hint)`: how a cg peer marks a tracing call's batch (default: the example's);
    `share`: the `cg/MODE` peer whose compiled model (copy, graphs) an opt-in peer
    (`cg/MODE/trusted`, `/guarded`) wraps instead of compiling its own (one compile less)."""
    model = copy.deepcopy(model) if share is None else share.model
    if mark is None:
        mark = lambda t, p, hint: mark_batch(model.cfg, t, p, hint=hint)  # noqa: E731
    if share is not None:
        parts = name.split("/")
        peer = _cgcompile(
            model, parts[1], sizes, parts[2], compiler, graph_runtime, None, mark, share.compiled
        )
        peer.cfg, peer.model = share.cfg, model
        return peer
    if name == "hand":
        peer = _hand(model, compiler)
    elif name == "hand_pieces":
        peer = _hand_pieces(model)
    elif name in ("tenline", "tenline/skip-guards", "tenline/inductor"):
        peer = _tenline(model, name)
    elif name == "reduce-overhead":
        peer = _reduce_overhead(model)
    elif name.startswith("cg/") and name.endswith("/precompiled"):
        peer = _precompiled(model, name.split("/")[1], sizes, compiler, graph_runtime)
    elif name.startswith("cg/"):
        parts = name.split("/")
        opt_in = next((p for p in ("trusted", "guarded") if p in parts), None)
        batch_one = "own" if "own" in parts else None
        peer = _cgcompile(model, parts[1], sizes, opt_in, compiler, graph_runtime, batch_one, mark)
    else:
        raise ValueError(f"unknown peer {name!r}")
    peer.cfg = getattr(model, "cfg", None)
    peer.model = model
    return peer
