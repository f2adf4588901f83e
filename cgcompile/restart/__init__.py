"""Warm restart: what one process saves and the next loads instead of compiling again, a whole
model ahead of time (`precompile`: saved Dynamo graphs, `Precompiled` calls them) or torch's
compile caches (`compile_cache`).

It sits above the compile side: a saved graph is rebuilt by running the backend again
(`backend.entry.compile_dynamo_graph`) with the saving process's analyses; the backend never
imports this package.

    step = cgcompile.precompile(model, [(tokens8, pos8), (tokens1, pos1)], "llama.cgaot")
    cgcompile.load_compile_cache("llama.cgcache")    # a new process, before the first call
"""
