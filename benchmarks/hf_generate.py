"""Hugging Face `generate()` with a static KV cache: ms per new token and first-generate seconds
for eager, HF's default compile (Inductor, mode="reduce-overhead") and cgcompile's modes
(`CompileConfig(backend="cudagraph_modes", mode=None, options=...)`), all in one process.

The model: a 16-layer Llama config (hidden 1024, 16 heads, 8 KV heads, FFN 2816, vocab 32000),
random weights, bf16 on CUDA (fp32 on CPU with --quick). A batch of 4 random prompts of 32
tokens, greedy. HF runs the prefill without compile and every decode step through the
compiled forward, which writes the static cache and its length counter in place. cgcompile
peers are called as HF users call them, without a `batch_hint` (decode steps are recognised
from `input_ids` of shape [batch, 1]); `--hint` wraps them in `batch_hint(uniform_decode=True)`.
Per peer also: CUDA graphs captured per timed generate() (after the first), and whether the
static cache tensors moved between generate() calls. Every peer keeps one `StaticCache`, reset
before each generate(), as the README advises (graphs read the cache where it was at capture);
`--new-cache` lets HF build a new cache in every call instead (`cache_implementation="static"`).

Each peer has its own copy of the model (same weights). Per peer: the first generate
(compile, warm-up, capture) timed alone; then, in rounds where the peers take turns in a
rotating order (machine drift hits every peer alike), `generate(max_new_tokens=N)` and
`generate(max_new_tokens=1)` (prefill only), timed with CUDA events; ms per new token = median
over rounds of (t_N - t_1) / (N - 1). Tokens are compared with eager's (bf16 kernels may round
differently, so a late divergence is reported, not failed).

    python benchmarks/hf_generate.py --out DIR            # the H200 run (~3 min)
    python benchmarks/hf_generate.py --out DIR --quick    # tiny config, CPU or GPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cgcompile  # noqa: E402
from benchmarks._turns import preparing, timing_turn  # noqa: E402

PEERS = ("eager", "hf_default_compile", "cg/FULL", "cg/FULL_AND_PIECEWISE", "cg/PIECEWISE")


def make_model(quick: bool, device: str, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    size = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16}
    heads = {"num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000}
    if quick:
        size = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
        heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    config = LlamaConfig(**size, **heads, max_position_embeddings=512)
    return LlamaForCausalLM(config).to(device, dtype).eval()


def generate_kwargs(peer: str, new_tokens: int, hint: bool = False) -> tuple[dict[str, Any], Any]:
    """generate() keyword arguments and the context to call it in, for one peer."""
    from transformers import CompileConfig

    kwargs: dict[str, Any] = {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "cache_implementation": "static",
        "pad_token_id": 0,
    }
    if peer == "eager":
        kwargs["disable_compile"] = True
    elif peer.startswith("cg/"):
        options = {"cudagraph_mode": peer[3:]}
        config = CompileConfig(backend="cudagraph_modes", mode=None, options=options)
        config._compile_all_devices = True
        kwargs["compile_config"] = config
        if hint:
            return kwargs, cgcompile.batch_hint(uniform_decode=True)
        return kwargs, contextlib.nullcontext()
    else:  # HF's own default: Inductor with mode="reduce-overhead"
        config = CompileConfig()
        config._compile_all_devices = True
        kwargs["compile_config"] = config
    return kwargs, contextlib.nullcontext()


HINT = False
"""--hint: cgcompile peers run inside batch_hint(uniform_decode=True)."""
KEPT: dict[str, Any] = {}
"""Peer -> the StaticCache it keeps across generate() calls (empty with --new-cache)."""


def timed_generate(model: Any, prompts: torch.Tensor, peer: str, new_tokens: int) -> tuple:
    kwargs, context = generate_kwargs(peer, new_tokens, HINT)
    if peer in KEPT:
        from examples.hf_generate import cache_argument

        del kwargs["cache_implementation"]
        kwargs[cache_argument()] = KEPT[peer]
        KEPT[peer].reset()
    if prompts.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with context, torch.no_grad():
            out = model.generate(prompts, **kwargs)
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end)
    began = time.perf_counter()
    with context, torch.no_grad():
        out = model.generate(prompts, **kwargs)
    return out, (time.perf_counter() - began) * 1e3


def first_generate(model: Any, prompts: torch.Tensor, peer: str, args: argparse.Namespace) -> dict:
    """The peer's first generate (compile, warm-up, capture), timed alone."""
    _, first_ms = timed_generate(model, prompts, peer, args.new_tokens)
    return {"first_generate_s": first_ms / 1e3}


def time_in_turns(
    models: dict[str, Any], prompts: torch.Tensor, results: dict, args: argparse.Namespace
) -> None:
    """Per round, each peer's generate(N) and generate(1) in a rotating order, so drift of the
    machine hits every peer alike; medians over rounds."""
    peers = [p for p in models if "error" not in results[p]]
    full: dict[str, list[float]] = {p: [] for p in peers}
    prefill: dict[str, list[float]] = {p: [] for p in peers}
    captured: dict[str, list[int]] = {p: [] for p in peers}
    addresses = {p: _cache_addresses(p, models[p]) for p in peers}
    for r in range(args.repeats):
        for peer in peers[r % len(peers) :] + peers[: r % len(peers)]:
            before = cgcompile.counters.num_cudagraph_captured
            tokens, ms = timed_generate(models[peer], prompts, peer, args.new_tokens)
            captured[peer].append(cgcompile.counters.num_cudagraph_captured - before)
            full[peer].append(ms)
            prefill[peer].append(timed_generate(models[peer], prompts, peer, 1)[1])
            results[peer]["tokens"] = tokens.tolist()
            if _cache_addresses(peer, models[peer]) != addresses[peer]:
                results[peer]["cache_moved"] = True
    for peer in peers:
        per_token = statistics.median(
            (f - p) / (args.new_tokens - 1) for f, p in zip(full[peer], prefill[peer], strict=True)
        )
        results[peer].setdefault("cache_moved", False)
        results[peer].update(
            graphs_captured_per_generate=captured[peer],
            generate_ms_median=statistics.median(full[peer]),
            prefill_ms_median=statistics.median(prefill[peer]),
            ms_per_token=per_token,
        )


def _cache_addresses(peer: str, model: Any) -> list[int]:
    """Addresses of the key/value tensors of the peer's static cache."""
    cache = KEPT.get(peer, getattr(model, "_cache", None))
    layers = getattr(cache, "layers", [])
    keys = [getattr(layer, "keys", None) for layer in layers]
    return [t.data_ptr() for t in keys if t is not None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7, help="rounds of timed generates")
    parser.add_argument("--peers", nargs="*", default=list(PEERS))
    parser.add_argument("--hint", action="store_true", help="cgcompile peers in batch_hint")
    parser.add_argument("--new-cache", action="store_true", help="HF's new cache per call")
    args = parser.parse_args()
    global HINT
    HINT = args.hint
    preparing()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch._dynamo.config.recompile_limit = 64  # every peer's model shares forward's code
    models = {peer: make_model(args.quick, device, dtype) for peer in args.peers}  # same weights
    if not args.new_cache:
        from transformers import StaticCache

        for peer, model in models.items():
            KEPT[peer] = StaticCache(config=model.config, max_cache_len=32 + args.new_tokens)
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).config.vocab_size
    prompts = torch.randint(1, vocab, (4, 32), generator=g).to(device)
    results: dict[str, Any] = {}
    for peer, model in models.items():
        print(f"[hf_generate] {peer}: first generate ...", flush=True)
        try:
            results[peer] = first_generate(model, prompts, peer, args)
        except Exception as e:  # one failing peer must not end the run
            results[peer] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    print(f"[hf_generate] {args.repeats} rounds, peers in turns ...", flush=True)
    with timing_turn():
        time_in_turns(models, prompts, results, args)
    report = summarize(results, args, device, dtype)
    report["graphs"] = [g.format_report() for g in cgcompile.compiled_graphs()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf-generate-results.json").write_text(json.dumps(report, indent=1))
    print(report["table"])
    return 0


def summarize(results: dict, args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict:
    eager = results.get("eager", {}).get("tokens")
    hf = results.get("hf_default_compile", {}).get("generate_ms_median")
    lines = [
        "| peer | ms / generate | vs HF | ms / new token | first generate s | graphs captured per "
        "generate | cache moved | tokens equal eager |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for peer, r in results.items():
        if "error" in r:
            lines.append(f"| {peer} | error: {r['error'][:80]} | | | |")
            continue
        ratio = f"{r['generate_ms_median'] / hf:.2f}" if hf else "-"
        same = _matching_prefix(r["tokens"], eager) if eager else "-"
        lines.append(
            f"| {peer} | {r['generate_ms_median']:.1f} | {ratio} | {r['ms_per_token']:.3f} | "
            f"{r['first_generate_s']:.1f} | {r['graphs_captured_per_generate']} | "
            f"{r['cache_moved']} | {same} |"
        )
    return {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "new_tokens": args.new_tokens,
        "hint": args.hint,
        "kept_cache": not args.new_cache,
        "repeats": args.repeats,
        "results": results,
        "table": "\n".join(lines),
    }


def _matching_prefix(tokens: list, eager: list) -> str:
    """'all' or how many generated positions agree before the first difference."""
    if tokens == eager:
        return "all"
    first = min(
        next((i for i, (a, b) in enumerate(zip(t, e, strict=True)) if a != b), len(t))
        for t, e in zip(tokens, eager, strict=True)
    )
    return f"first {first - 32} of {len(tokens[0]) - 32}"


if __name__ == "__main__":
    sys.exit(main())
