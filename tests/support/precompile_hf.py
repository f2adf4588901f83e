"""One process of the precompile tests on a Hugging Face `LlamaForCausalLM` (transformers 5: a
decorated forward, `kernels` wrappers of functions defined in a function) decoding with a
`StaticCache` per batch size, as generate() does. `cgcompile.precompile` it for a batch of 8
and a batch of 1 (unmarked keyword examples, as generate() calls; the cache fixes each batch
size), then run
decode steps of both sizes on the precompiled model and on an eager copy, each with caches of
its own; print one JSON line of what happened, with a digest of every logit and cache value so
processes can be compared bit for bit.

    python -m tests.support.precompile_hf PATH [--compiler eager] [--arch Qwen3] [--cuda]
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import torch
import transformers
from torch._dynamo.utils import counters as dynamo_counters
from torch.compiler._cache import CacheArtifactManager

import cgcompile
from tests.support.hf import VOCAB, tiny_llama
from tests.support.precompile_rows import _Warnings

CACHE_LEN = 32
_PARAMETERS = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
CACHE_KEYWORD = "cache" if "cache" in _PARAMETERS else "past_key_values"


def _cache(model: Any, n: int) -> Any:
    """A static cache of `n` rows, its first position written by an eager call (generate()'s
    uncompiled prefill)."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=CACHE_LEN)
    device = model.device
    ids = torch.arange(n, device=device)[:, None] + 3
    pos = torch.zeros(n, 1, dtype=torch.long, device=device)
    model(input_ids=ids, position_ids=pos, use_cache=True, **{CACHE_KEYWORD: cache})
    return cache


def _step(n: int, position: int, cache: Any, seed: int, device: str) -> dict[str, Any]:
    """A decode step's keyword arguments (the cache's keyword: `cache` in newer transformers
    5 releases, `past_key_values` before)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, 1), generator=g).to(device)
    step = {"input_ids": ids, "use_cache": True}
    step["position_ids"] = torch.full((n, 1), position, device=device)
    step["cache_position"] = torch.tensor([position], device=device)
    return step | {CACHE_KEYWORD: cache}


def _tensors(caches: dict[int, Any]) -> list[torch.Tensor]:
    return [t for n in (8, 1) for layer in caches[n].layers for t in (layer.keys, layer.values)]


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _tuned_kernels(path: Path) -> int:
    """How many Triton kernels' tuning the file holds (`saved_file.add_tuning`)."""
    data = path.read_bytes()
    cache = pickle.loads(data.split(b"\n", 2)[2])["cache"]
    artifacts = CacheArtifactManager.deserialize(cache) if cache else None
    return len((artifacts or {}).get("autotune", []))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--compiler", default="eager")
    parser.add_argument("--arch", default="Llama", help="Llama or Qwen3")
    parser.add_argument("--cuda", action="store_true", help="on the GPU, real CUDA graphs")
    args = parser.parse_args()
    warnings = _Warnings()
    logging.getLogger("cgcompile").addHandler(warnings)
    device = "cuda" if args.cuda else "cpu"
    model = tiny_llama(device, arch=args.arch)
    options = {"compiler": args.compiler, "graph_runtime": "cuda" if args.cuda else "simulated"}
    dynamo_counters.clear()
    with torch.no_grad():
        ours = {n: _cache(model, n) for n in (8, 1)}
        theirs = {n: _cache(model, n) for n in (8, 1)}
        examples = [_step(n, 1, ours[n], n, device) for n in (8, 1)]
        step = cgcompile.precompile(model, examples, args.path, options)
        traces = dynamo_counters["stats"]["unique_graphs"]
        logits, error = [], 0.0
        for i, (n, position) in enumerate([(8, 2), (1, 2), (8, 3), (1, 3), (8, 4)]):
            got = step(**_step(n, position, ours[n], i, device)).logits
            want = model(**_step(n, position, theirs[n], i, device)).logits
            error = max(error, (got - want).abs().max().item())
            logits.append(got)
        before_capture_all = _digest(_tensors(ours))
        cgcompile.capture_all(progress=False)  # the saver's file takes its kernels' tuning
    caches, eager_caches = _tensors(ours), _tensors(theirs)
    pairs = zip(caches, eager_caches, strict=True)
    cache_error = max((a - b).abs().max().item() for a, b in pairs)
    print(
        json.dumps(
            {
                "loaded": step.loaded,
                "functions": len(step.functions),
                "why_compiled": step.why_compiled,
                "dynamo_traces": traces,
                "max_error": error,
                "cache_error": cache_error,
                "digest": _digest(logits + caches),
                "digests": [_digest([t]) for t in logits] + [_digest(caches)],
                "caches_before_capture_all": before_capture_all,
                "tuned_kernels": _tuned_kernels(Path(args.path)),
                "warnings": warnings.messages,
            }
        )
    )


if __name__ == "__main__":
    main()
