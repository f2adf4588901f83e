"""One process of the precompile tests on a decode step shaped like a user's Llama: each of B
requests owns a row of every layer's KV cache, the step writes its key and value in place at
`cache[rows, :, pos]` with `rows = arange(B)`, then reads `cache[:B]` (a slice bounded by the
dynamic batch size: torch 2.11's graph pickler failed on it) and calls SDPA with a boolean mask
of the positions written so far. `cgcompile.precompile` it (bf16, the default options with the
simulated graph runtime) for a batch of 8 and a batch of 1, then run decode steps of several
sizes against an eager copy; print one JSON line of what happened.

    python -m tests.support.precompile_rows PATH [--grad-mode no_grad|inference] [--unmarked]
        [--compiler eager] [--cuda]
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters as dynamo_counters

import cgcompile

HIDDEN, HEADS, ROWS, CACHE_LEN, VOCAB = 32, 2, 17, 16, 64


class RowsLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)
        shape = (ROWS, HEADS, CACHE_LEN, HIDDEN // HEADS)
        self.register_buffer("k", torch.randn(shape))
        self.register_buffer("v", torch.randn(shape))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = self.qkv(x).view(b, 3, HEADS, HIDDEN // HEADS).unbind(1)
        idx = torch.arange(b, device=x.device)
        self.k[idx, :, pos] = k
        self.v[idx, :, pos] = v
        mask = (torch.arange(CACHE_LEN, device=x.device) <= pos[:, None])[:, None, None, :]
        att = F.scaled_dot_product_attention(q[:, :, None], self.k[:b], self.v[:b], attn_mask=mask)
        return x + self.out(att.reshape(b, HIDDEN))


class RowsDecoder(nn.Module):
    """tokens[B], pos[B] -> logits[B, VOCAB]; rows 0..B-1 of every layer's cache written."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(RowsLayer() for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, pos)
        return self.head(x)


def rows_inputs(n: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + n)
    tokens = torch.randint(0, VOCAB, (n,), generator=g)
    return tokens.to(device), torch.randint(0, CACHE_LEN, (n,), generator=g).to(device)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _models(device: str) -> tuple[RowsDecoder, RowsDecoder]:
    torch.manual_seed(0)
    model = RowsDecoder().to(device, torch.bfloat16).eval()
    eager = RowsDecoder().to(device, torch.bfloat16).eval()
    eager.load_state_dict(model.state_dict())
    return model, eager


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--grad-mode", choices=["no_grad", "inference"], default="no_grad")
    parser.add_argument("--unmarked", action="store_true", help="examples without marks")
    parser.add_argument("--compiler", default="eager")
    parser.add_argument("--cuda", action="store_true", help="on the GPU, real CUDA graphs")
    args = parser.parse_args()
    warnings = _Warnings()
    logging.getLogger("cgcompile").addHandler(warnings)
    device = "cuda" if args.cuda else "cpu"
    model, eager = _models(device)
    options = {"compiler": args.compiler, "graph_runtime": "cuda" if args.cuda else "simulated"}
    grad_mode = torch.inference_mode() if args.grad_mode == "inference" else torch.no_grad()
    dynamo_counters.clear()
    error = 0.0
    with grad_mode:
        examples = [rows_inputs(n, device) for n in (8, 1)]
        if not args.unmarked:
            cgcompile.mark_dynamic_batch(*examples[0])
        step = cgcompile.precompile(model, examples, args.path, options)
        traces = dynamo_counters["stats"]["unique_graphs"]
        for i, n in enumerate([8, 5, 1, 3, 16, 1, 2]):
            tokens, pos = rows_inputs(n, device, seed=i + 1)
            got, want = step(tokens, pos), eager(tokens, pos)
            error = max(error, (got.float() - want.float()).abs().max().item())
    pairs = zip(model.buffers(), eager.buffers(), strict=True)
    caches = max((a - b).abs().max().item() for a, b in pairs)
    print(
        json.dumps(
            {
                "loaded": step.loaded,
                "functions": len(step.functions),
                "why_compiled": step.why_compiled,
                "dynamo_traces": traces,
                "dynamo_traces_after_calls": dynamo_counters["stats"]["unique_graphs"],
                "max_error": error,
                "cache_error": caches,
                "warnings": warnings.messages,
                "marks_left": sorted(n for e in examples for t in e for n in vars(t)),
            }
        )
    )


if __name__ == "__main__":
    main()
