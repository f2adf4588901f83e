"""Tensor-parallel decode steps with CUDA graphs: the example Llama sharded over N processes
(Megatron style), compiled with the `cudagraph_modes` backend on every rank.

    torchrun --nproc_per_node=2 examples/tp_decode.py   # NCCL on GPUs, gloo on CPUs
    python examples/tp_decode.py                        # starts 2 CPU processes itself

Each rank holds 1/N of every layer: q, k, v and the MLP's gate and up projections split by
output (column-parallel), the attention output and the MLP's down projection split by input
(row-parallel) and followed by a functional all-reduce (`_functional_collectives.all_reduce`,
which Dynamo traces into the graph), and 1/N of the heads of each KV cache, written in place.
Every rank runs the same padded decode steps; each step's logits are checked against the
unsharded model's eager logits on every rank. Without a GPU the simulated graph runtime stands
in for CUDA graphs.

The rules a tensor-parallel user must know (docs/guide.md#tensor-parallel):
- every rank must replay the same graph key at every step: pass the same options and call with
  the same batch sizes and hints on every rank (keys depend on nothing else);
- `capture_all()` must run on every rank, after the same calls;
- collectives are not splitting ops: they are recorded inside the graphs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cgcompile  # noqa: E402
from examples.llama import Layer, Llama, LlamaConfig, make_inputs, mark_batch  # noqa: E402

STEPS = (6, 6, 6, 3, 8)
"""Tokens per decode step: 6 and 3 are padded to the capture sizes 8 and 4."""


def _rows(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return weight.chunk(world, dim=0)[rank].clone()


def _columns(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return weight.chunk(world, dim=1)[rank].clone()


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


class TPLayer(Layer):
    """One rank's shard of a `Layer`: its heads and its slice of the MLP."""

    def __init__(self, layer: Layer, rank: int, world: int) -> None:
        cfg = layer.cfg
        if cfg.heads % world or cfg.ffn % world:
            raise ValueError(f"{cfg.heads} heads and ffn {cfg.ffn} must divide by {world} ranks")
        super().__init__(cfg, layer.rotary)
        self.local_heads = cfg.heads // world
        for name in ("wq", "wk", "wv", "w1", "w3"):  # column-parallel
            setattr(self, name, _linear(_rows(getattr(layer, name).weight, rank, world)))
        for name in ("wo", "w2"):  # row-parallel: partial sums, all-reduced
            setattr(self, name, _linear(_columns(getattr(layer, name).weight, rank, world)))
        self.attn_norm.load_state_dict(layer.attn_norm.state_dict())
        self.mlp_norm.load_state_dict(layer.mlp_norm.state_dict())
        self.k_cache = layer.k_cache.chunk(world, dim=1)[rank].clone()
        self.v_cache = layer.v_cache.chunk(world, dim=1)[rank].clone()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, self.local_heads, self.cfg.head_dim)

    def post_attention(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        local = attn.squeeze(0).transpose(0, 1).reshape(residual.shape[0], -1)
        x = residual + all_reduce(self.wo(local))
        h = self.mlp_norm(x)
        return x + all_reduce(self.w2(F.silu(self.w1(h)) * self.w3(h)))


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks, as a functional collective that Dynamo records in the graph."""
    return fc.all_reduce(x, "sum", dist.group.WORLD)


def shard(model: Llama, rank: int, world: int) -> Llama:
    """A copy of `model` whose layers hold this rank's shards; embedding, final norm and head
    are replicated."""
    device = model.lm_head.weight.device
    sharded = Llama(model.cfg).to(device)
    sharded.load_state_dict(model.state_dict())
    layers = nn.ModuleList(TPLayer(layer, rank, world) for layer in model.layers)
    sharded.layers = layers.to(device)  # a new layer's norms are made on the CPU
    return sharded


def run_steps(
    mode: str, device: str, steps: tuple[int, ...] = STEPS, **options: object
) -> tuple[float, list[str]]:
    """Compile this rank's shard in `mode` (more backend `options` if given), run decode
    `steps`, and return the largest difference from the unsharded model's eager logits and the
    graph keys captured."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig.tiny()
    reference = Llama(cfg).to(device).eval()  # the same seed on every rank: the same weights
    tp = shard(reference, rank, world).eval()
    options |= {"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4, 8]}
    if device == "cpu":
        options |= {"graph_runtime": "simulated", "compiler": "eager"}
    compiled = torch.compile(tp, backend="cudagraph_modes", options=options)
    worst = 0.0
    with torch.inference_mode():
        for step, n in enumerate(steps):  # every rank draws the same tokens
            tokens, positions = make_inputs(cfg, n, device, torch.Generator().manual_seed(step))
            mark_batch(cfg, tokens, positions)
            with cgcompile.batch_hint(uniform_decode=True):
                got = compiled(tokens, positions)
            worst = max(worst, (got - reference(tokens, positions)).abs().max().item())
    captured = [graph.report.captured for graph in cgcompile.compiled_graphs()]
    return worst, [key for keys in captured for mode_keys in keys.values() for key in mode_keys]


def main() -> int:
    if "RANK" not in os.environ:  # not under torchrun: two CPU processes of our own
        return _spawn(2)
    cuda = torch.cuda.is_available()
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ok = True
    try:
        for mode in ("FULL", "FULL_AND_PIECEWISE", "PIECEWISE"):
            worst, keys = run_steps(mode, device)
            ok &= worst < 1e-4
            print(
                f"rank {rank}/{world} {mode}: logits within {worst:.1e} of the unsharded model's; "
                f"graphs captured {keys}",
                flush=True,
            )
            torch._dynamo.reset()
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


def _spawn(world: int) -> int:
    import subprocess

    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}
    env.setdefault("MASTER_PORT", "29511")
    procs = [
        subprocess.Popen([sys.executable, __file__], env={**env, "RANK": str(r)})
        for r in range(world)
    ]
    return max(proc.wait(timeout=300) for proc in procs)


if __name__ == "__main__":
    sys.exit(main())
