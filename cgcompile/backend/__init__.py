"""The Dynamo backend's compile side: what runs once per Dynamo graph. The pipeline reads the
graph (its inputs, `input_analysis`; its attention ops, `attention`; one fake run, `analyses`),
resolves the mode (`resolution`), compiles the pieces on the FX split or Inductor's partition,
and builds the objects every call runs (`cgcompile.calls`), handing Dynamo a `CompiledGraph`.
FX passes it runs are in `cgcompile.passes`; nothing here is called again per model call.

    compiled = torch.compile(model, backend="cudagraph_modes", options={...})
"""

from cgcompile.backend.entry import cudagraph_modes

__all__ = ["cudagraph_modes"]
