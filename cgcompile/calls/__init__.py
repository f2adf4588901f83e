"""What runs on every call of a compiled model: Dynamo calls a `CompiledGraph`, which finds
the batch and its key (`input_plan`, `forward_context`, `dispatcher`), checks the thread and
the module instance, fills the input buffers, runs the `CUDAGraphWrapper`s (an Inductor
partition's through `partition_adapter`) that capture a key on first sight and replay it after,
hands the outputs to the caller, and runs without graphs what no graph fits (`fallbacks`).
`capture_all`, `trusted` and `PaddedBatchOne` drive the same objects; the report is read live.
One pass top to bottom, nothing that grows with the model.

The compile side (`cgcompile.backend`) builds these objects once per Dynamo graph and hands the
`CompiledGraph` to Dynamo; nothing here imports it. Recording and replaying one graph is a graph
runtime's work (`cgcompile.graphs`), below this package.

    graph = cgcompile.compiled_graphs()[0]   # what Dynamo's code calls for each model call
    out = graph(*args)
"""
