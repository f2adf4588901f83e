"""Pure FX passes and analyses the compile side runs: splitting, op matching, which inputs a
graph mutates, whether padding is safe, batch-1 matching. No CUDA, and no other folder of
cgcompile is imported here."""
