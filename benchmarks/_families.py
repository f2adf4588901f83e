"""The model families every start-up and step figure is taken on, behind one interface.

- `llama`: the example Llama (`examples/llama.py`, `LlamaConfig.bench()`): tokens as the batch,
  one shared context, KV cache written with `index_copy_`, trash slot for padded rows;
- `rows`: a decode step of B requests that writes each request's KV cache row in place at
  `arange(B)` and calls SDPA with a boolean mask (`_rows_model.py`): padding is unsafe (padded
  rows would write real rows), so only exact capture sizes replay graphs;
- `hf-llama`, `hf-qwen3`: Hugging Face `LlamaForCausalLM` and `Qwen3ForCausalLM` built from
  configs of the same size (16 layers, hidden 1024), decode steps `input_ids [B, 1]` writing a
  `StaticCache` of B rows in place (a static batch: each B compiles on its own).

`build(name, device, dtype)` gives a `Family`: `model`, `inputs(n)` (fresh random inputs of n
rows: args and kwargs, batch dims marked) and `run(fn, inputs)`, which calls a compiled (or
eager) model on them as a decode step, as a user would.

    family = build("rows", "cuda", torch.bfloat16)
    compiled = torch.compile(family.model, backend="cudagraph_modes")
    logits = family.run(compiled, family.inputs(8))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

import cgcompile
from benchmarks._rows_model import RowsConfig, RowsLlama, rows_inputs
from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
NAMES = ("llama", "rows", "hf-llama", "hf-qwen3")
HF_SIZE = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 1024,
}
HF_CACHE_LEN = 256


@dataclasses.dataclass
class Family:
    name: str
    model: torch.nn.Module
    inputs: Callable[[int], Inputs]
    """inputs(n): fresh random (args, kwargs) of a decode step of n rows."""
    hint: bool = True
    """Whether a call says `batch_hint(uniform_decode=...)` (HF's steps are recognised from
    `input_ids [B, 1]`, as its users call them)."""
    sizes: tuple[int, ...] | None = None
    """The batch sizes calls may use; None: any of 1..512 (HF: a static cache per size)."""
    before_call: Callable[[Inputs], None] | None = None
    """Run before each call (HF: rewinds a static cache that is full)."""

    def run(self, fn: Any, inputs: Inputs, decode: bool = True) -> Any:
        """A call of `fn` on `inputs`: a decode step, or a mixed batch (`decode=False`)."""
        if self.before_call is not None:
            self.before_call(inputs)
        args, kwargs = inputs
        if not self.hint:
            return fn(*args, **kwargs)
        with cgcompile.batch_hint(uniform_decode=decode):
            return fn(*args, **kwargs)


def build(
    name: str,
    device: str,
    dtype: torch.dtype,
    quick: bool = False,
    quick_layers: int = 2,
    unbacked: bool = False,
    marked: bool = False,
) -> Family:
    """The family `name`; `quick`: a tiny CPU build of `quick_layers` layers;
    `unbacked`: the batch marked unbacked (one trace for every size, batch 1 included; the
    Hugging Face families only with `marked`); `marked`: the Hugging Face families' batch
    marked, the static cache's tensors with it (sizes >= 2 share a trace)."""
    if name == "llama":
        return _llama(device, dtype, quick, quick_layers, unbacked)
    if name == "rows":
        return _rows(device, dtype, quick, quick_layers, unbacked)
    if name.startswith("hf-"):
        return _hf(name, device, dtype, quick, quick_layers, marked, unbacked)
    raise ValueError(f"unknown family {name!r}; one of {NAMES}")


def _llama(device: str, dtype: torch.dtype, quick: bool, layers: int, unbacked: bool) -> Family:
    cfg = LlamaConfig(num_layers=layers, cache_len=600) if quick else LlamaConfig.bench()
    seeds = iter(range(10**9))

    def inputs(n: int) -> Inputs:
        tokens, positions = make_inputs(cfg, n, device, torch.Generator().manual_seed(next(seeds)))
        mark_batch(cfg, tokens, positions, hint=512, unbacked=unbacked)
        return (tokens, positions), {}

    return Family("llama", Llama(cfg).to(device, dtype).eval(), inputs)


def _rows(device: str, dtype: torch.dtype, quick: bool, layers: int, unbacked: bool) -> Family:
    cfg = RowsConfig(layers, rows=512) if quick else RowsConfig.bench()  # rows >= the size hint
    seeds = iter(range(10**9))

    def inputs(n: int) -> Inputs:
        tokens, pos = rows_inputs(cfg, n, device, next(seeds))
        cgcompile.mark_dynamic_batch(tokens, pos, hint=512, unbacked=unbacked)
        return (tokens, pos), {}

    return Family("rows", RowsLlama(cfg).to(device, dtype).eval(), inputs)


def _hf(
    name: str,
    device: str,
    dtype: torch.dtype,
    quick: bool,
    layers: int,
    marked: bool,
    unbacked: bool,
) -> Family:
    import transformers

    arch = {"hf-llama": "Llama", "hf-qwen3": "Qwen3"}[name]
    size = dict(HF_SIZE)
    if quick:
        size |= {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers}
        size |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    config = getattr(transformers, f"{arch}Config")(**size)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).to(device, dtype).eval()
    caches: dict[int, Any] = {}  # one static cache per batch size, kept: graphs write it
    seeds = iter(range(10**9))

    def inputs(n: int) -> Inputs:
        g = torch.Generator().manual_seed(next(seeds))
        step = int(torch.randint(0, HF_CACHE_LEN, (1,), generator=g))
        kwargs = {
            "input_ids": torch.randint(1, config.vocab_size, (n, 1), generator=g).to(device),
            "position_ids": torch.full((n, 1), step, device=device),
            "cache_position": torch.tensor([step], device=device),
            "use_cache": True,
        }
        if n not in caches:  # made by an eager call, as generate()'s uncompiled prefill does
            caches[n] = transformers.StaticCache(config=config, max_cache_len=HF_CACHE_LEN)
            with torch.no_grad():
                model(**kwargs, past_key_values=caches[n])
        if marked:
            layers = caches[n].layers
            cache = [t for layer in layers for t in (layer.keys, layer.values)]
            batch = (kwargs["input_ids"], kwargs["position_ids"], *cache)
            cgcompile.mark_dynamic_batch(*batch, unbacked=unbacked)
        return (), kwargs | {"past_key_values": caches[n]}

    written: dict[int, int] = {}  # positions each cache holds (its eager prefill wrote one)

    def rewind_when_full(inputs: Inputs) -> None:
        """A `StaticCache` writes each step at its own counter (`cumulative_length`), whatever
        `cache_position` says: past `HF_CACHE_LEN` steps the write indexes out of bounds (a
        device-side assert on CUDA), eager or compiled. A full cache starts over (in place)."""
        cache = inputs[1]["past_key_values"]
        held = written.get(id(cache), 1)
        if held >= HF_CACHE_LEN:
            cache.reset()
            held = 0
        written[id(cache)] = held + 1

    return Family(name, model, inputs, hint=False, sizes=(1, 2, 4, 8), before_call=rewind_when_full)
