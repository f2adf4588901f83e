"""What a user sees: a greedy decode loop that waits for each step's token, per-token latency.

Each step builds its inputs from the last step's argmax (new tensors, as a real loop) and reads
one token on the host (`int(tokens[0])`, as stopping criteria do), so the host time of a call
is not hidden behind the GPU. Peers (`_user_peers`, each on its own model copy and `forward`
code, Inductor-compiled) are timed in turns in one process, `--rounds` rounds of `--steps`
steps each, in a rotating order; the median per-token time over rounds is reported with its
ratio to the hand-captured graph fed the same way. Models (`--models LAYERSxHIDDEN`, bf16, KV
cache written in place) of a `--family` (`_step_models`): the example Llama (default 4x512 and
16x1024), the KV-rows step with a masked SDPA, a Hugging Face Llama or Qwen3 decode step on a
static cache per batch size (called through a module that takes tensors only); batch 1 and 8.

Compiles may run beside other benchmark processes; the timed rounds run in this process's turn
(`_turns`). With other `--models` than the default the results file is named by the first.
Each row also gives the host time to issue the peer's call (the GPU idle: the last token was
read); `--profile` prints each peer's host ops per step (torch.profiler) after its timing.
`--hold` keeps the last step's logits bound during the next call (`logits = model(x)`).

    python benchmarks/decode_loop.py --out DIR [--models 4x512 16x1024] [--batches 1 8] [--profile]
    python benchmarks/decode_loop.py --out DIR --family hf-llama --models 16x1024 64x1024
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._step_models import FAMILIES, StepModel, build, rewind  # noqa: E402
from benchmarks._turns import preparing, timing_turn  # noqa: E402
from benchmarks._user_peers import Peer, make_peer  # noqa: E402

PEERS = [
    "hand",
    "tenline/inductor",
    "reduce-overhead",
    "cg/FULL",
    "cg/FULL_AND_PIECEWISE",
    "cg/FULL/trusted",
    "cg/FULL/guarded",
    "cg/FULL_AND_PIECEWISE/trusted",
]
DEFAULT_MODELS = ["4x512", "16x1024"]
PIECEWISE_PEERS = [
    "cg/PIECEWISE",
    "cg/PIECEWISE/trusted",
    "hand_pieces",
]  # with --piecewise, on the largest model


def _model(family: str, spec: str) -> StepModel:
    layers, hidden = (int(x) for x in spec.split("x"))
    return build(family, layers, hidden, "cuda", torch.bfloat16)


HOLD = False
"""`--hold`: the loop keeps the last step's logits bound during the next call, as
`logits = model(x)` in a loop does; by default it keeps only their argmax."""


def loop_us(peer: Peer, sm: StepModel, n: int, steps: int) -> tuple[float, float]:
    """Per-token microseconds of `steps` greedy steps from fresh inputs, and of them the host
    time to issue the peer's call (the GPU is idle when it starts: the last token was read)."""
    tokens, positions = sm.inputs(n)
    rewind(peer.model)
    torch.cuda.synchronize()
    issue = 0.0
    logits = None
    start = time.perf_counter()
    for _ in range(steps):
        if not HOLD:
            logits = None
        called = time.perf_counter()
        logits = peer.step(tokens, positions)
        issue += time.perf_counter() - called
        tokens = logits.argmax(-1)
        positions = sm.advance(positions)
        int(tokens[0])  # the host waits for the token
    return (time.perf_counter() - start) / steps * 1e6, issue / steps * 1e6


def profile_ops(peer: Peer, sm: StepModel, n: int, steps: int = 32) -> None:
    """The ops a peer's steps run on the host (torch.profiler, CPU only): calls per step and
    self CPU time, to tell apart peers whose loops differ."""
    from torch.profiler import ProfilerActivity, profile

    loop_us(peer, sm, n, 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loop_us(peer, sm, n, steps)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    print(f"  {peer.name} batch {n}, per step: calls, self CPU us", flush=True)
    for e in events:
        print(f"    {e.key[:60]:60} {e.count / steps:6.1f} {e.self_cpu_time_total / steps:8.1f}")


def run(
    family: str,
    spec: str,
    batches: list[int],
    names: list[str],
    rounds: int,
    steps: int,
    profiled: bool,
    share: bool = False,
) -> list[dict]:
    sm = _model(family, spec)
    made: dict[str, Peer] = {}
    for name in names:
        base = made.get(name.rsplit("/", 1)[0]) if share else None
        made[name] = make_peer(name, sm.model, sizes=[1, 8], mark=sm.mark, share=base)
    peers = list(made.values())
    sm.model = None
    rows = []
    with torch.no_grad():
        for n in batches:
            preparing()
            for peer in peers:  # compile, capture, warm up
                for _ in range(3):
                    loop_us(peer, sm, n, 4)
            times: dict[str, list[tuple[float, float]]] = {p.name: [] for p in peers}
            through = {p.name: p.fast.calls_through_dynamo for p in peers if p.fast is not None}
            with timing_turn():
                for r in range(rounds):
                    for peer in peers[r % len(peers) :] + peers[: r % len(peers)]:
                        times[peer.name].append(loop_us(peer, sm, n, steps))
                if profiled:
                    for peer in peers:
                        profile_ops(peer, sm, n)
            rows += _rows(family, spec, n, times)
            for row in rows[-len(peers) :]:  # an opt-in's timed calls that went through Dynamo
                fast = made[row["peer"]].fast
                if fast is not None:
                    row["through_dynamo"] = fast.calls_through_dynamo - through[row["peer"]]
                    row["why_through"] = _why_through(fast, sm, n)
                    print(
                        f"  {row['peer']}: {row['through_dynamo']} calls through Dynamo"
                        f"{'; ' + row['why_through'] if row['why_through'] else ''}"
                    )
    return rows


def _why_through(fast: Any, sm: StepModel, n: int) -> str | None:
    """Why a `guarded` call of n rows fails its bound entry's guards (None: it passes, or the
    peer is `trusted`): the first failing guard of the pruned tree, then of the whole one."""
    from cgcompile.calls.frame_binding import hooked

    if hooked(fast.compiled):
        return "module hooks"
    binding = fast._bindings.get(n) or fast._bindings.get(None)
    if binding is None or binding.guards is None:
        return None if binding is not None else "not bound"
    frame = {**fast._locals, **dict(zip(fast._params, sm.inputs(n), strict=True))}
    for name, manager in (("pruned", binding.guards), ("whole", binding.entry.guard_manager)):
        if not manager.check(frame):
            return f"{name}: {manager.check_verbose(frame).verbose_code_parts}"[:400]
    return None


def _rows(
    family: str, spec: str, n: int, times: dict[str, list[tuple[float, float]]]
) -> list[dict[str, Any]]:
    hand = statistics.median(t for t, _ in times["hand"])
    rows = []
    for name, pairs in times.items():
        values = [t for t, _ in pairs]
        us, issue = statistics.median(values), statistics.median(i for _, i in pairs)
        row = {
            "family": family,
            "model": spec,
            "batch": n,
            "peer": name,
            "us_per_token": us,
            "vs_hand": us / hand,
        }
        rows.append({**row, "issue_us": issue, "spread": [min(values), max(values)]})
        print(
            f"{spec:8} batch {n}: {name:30} {us:8.1f} us/token  {us / hand:5.3f}x"
            f"  (host issues the call in {issue:6.1f} us)",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--peers", nargs="+", default=PEERS)
    parser.add_argument("--piecewise", action="store_true", help="add PIECEWISE peers")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="each peer's host ops per step")
    parser.add_argument("--hold", action="store_true", help="keep the last logits bound")
    parser.add_argument(
        "--share",
        action="store_true",
        help="cg/MODE/trusted and /guarded wrap cg/MODE's compiled model (fewer compiles)",
    )
    args = parser.parse_args()
    llama_only = [p for p in args.peers if p == "hand_pieces" or p.endswith("/precompiled")]
    if args.family != "llama" and (args.piecewise or llama_only):
        parser.error("--piecewise, hand_pieces and */precompiled know the example Llama only")
    global HOLD
    HOLD = args.hold
    rows = []
    for spec in args.models:
        names = list(args.peers)
        if args.piecewise and spec == args.models[-1]:
            names += PIECEWISE_PEERS
        rows += run(
            args.family,
            spec,
            args.batches,
            names,
            args.rounds,
            args.steps,
            args.profile,
            args.share,
        )
        torch._dynamo.reset()
    meta = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": os.environ.get("CGCOMPILE_COMMIT", "unknown"),
        "what": "greedy decode loop reading each token on the host, us per token, median",
        "holds_logits": HOLD,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "decode-loop" if args.models == DEFAULT_MODELS else f"decode-loop-{args.models[0]}"
    if args.family != "llama":
        name += f"-{args.family}"
    name += "-hold.json" if HOLD else ".json"
    (args.out / name).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
