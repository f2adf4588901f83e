"""The Dynamo backend's compile side: pipeline, FX split, Inductor partition, piece
compilation, preconditions; it builds the `cgcompile.runtime.CompiledGraph` Dynamo calls."""

from cgcompile.backend.entry import cudagraph_modes

__all__ = ["cudagraph_modes"]
