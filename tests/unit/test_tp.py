"""Tensor parallel: two processes (gloo, simulated graphs) each compile their shard of the example
Llama (`examples/tp_decode.py`: column- and row-parallel projections, functional all-reduces
inside the graph, a KV cache written in place) and run padded decode steps in every mode. Every
rank, at every step, gives the unsharded model's eager logits, and both ranks capture the same
graph keys. A worker that hangs (a collective one rank never joins) fails the test after
`TIMEOUT` seconds instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import time
from typing import Any
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.models import MODES

WORLD = 2
TIMEOUT = 300.0
COLLECTIVES = ("_c10d_functional::all_reduce", "_c10d_functional::wait_tensor")
SPLIT_AT_COLLECTIVES = "PIECEWISE split at collectives"
ONE_RANK_FAILS = "FULL, rank 1's captures fail"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failing_captures() -> Any:
    """Make every capture of this process fail after the simulated capture ran (it runs the
    graph's collectives, as the other rank's capture does; a CUDA capture runs none)."""
    from cgcompile.errors import CaptureError
    from cgcompile.graphs.simulated import SimulatedGraphRuntime

    original = SimulatedGraphRuntime.capture

    def capture(self: Any, *args: Any, **kwargs: Any) -> Any:
        original(self, *args, **kwargs)
        raise CaptureError("injected capture failure")

    return mock.patch.object(SimulatedGraphRuntime, "capture", capture)


def _worker(rank: int, port: int, results: Any) -> None:
    """Every mode on this rank, then PIECEWISE with the collectives as splitting ops, then FULL
    with every capture of rank 1 failing."""
    import torch.distributed as dist

    import cgcompile
    from examples.tp_decode import run_steps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    out: dict[str, Any] = {}
    try:
        runs = [(mode, mode, {}) for mode in MODES]
        splitting = [torch._C._nn.scaled_dot_product_attention, *COLLECTIVES]
        runs.append((SPLIT_AT_COLLECTIVES, "PIECEWISE", {"splitting_ops": splitting}))
        runs.append((ONE_RANK_FAILS, "FULL", {}))
        for name, mode, options in runs:
            cgcompile.counters.reset()
            failing = name == ONE_RANK_FAILS and rank == 1
            with _failing_captures() if failing else contextlib.nullcontext():
                worst, keys = run_steps(mode, "cpu", **options)
            out[name] = {"worst": worst, "keys": keys, **cgcompile.counters.snapshot()}
            torch._dynamo.reset()
        results.put((rank, out))
    except BaseException as exc:  # the parent reports it; the other rank may be stuck
        results.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict[str, Any]]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_worker, args=(r, port, results)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + TIMEOUT
    try:
        while len(got) < WORLD:
            if time.monotonic() > deadline:
                missing = sorted(set(range(WORLD)) - set(got))
                pytest.fail(f"ranks {missing} did not finish in {TIMEOUT:.0f} s (a hang?)")
            try:
                rank, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    pytest.fail(f"a rank died with exit code {dead[0]}")
                continue
            got[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    for rank, value in got.items():
        if isinstance(value, str):
            pytest.fail(f"rank {rank}: {value}")
    return got


@pytest.mark.parametrize("name", [*MODES, SPLIT_AT_COLLECTIVES, ONE_RANK_FAILS])
def test_every_rank_gives_the_unsharded_models_logits(ranks, name):
    for rank in range(WORLD):
        assert ranks[rank][name]["worst"] < 1e-4, (rank, ranks[rank][name])


@pytest.mark.parametrize("name", [*MODES, SPLIT_AT_COLLECTIVES])
def test_every_rank_captures_the_same_keys(ranks, name):
    runs = [ranks[rank][name] for rank in range(WORLD)]
    assert all(run["keys"] == runs[0]["keys"] for run in runs)
    captured = [run["num_cudagraph_captured"] for run in runs]
    assert captured[0] == captured[1]
    assert (captured[0] > 0) == (name != "NONE"), runs[0]


def test_collectives_as_splitting_ops_run_between_the_pieces(ranks):
    """Two collectives per layer as extra splitting ops: more pieces, each captured."""
    plain = ranks[0]["PIECEWISE"]["num_cudagraph_captured"]
    split = ranks[0][SPLIT_AT_COLLECTIVES]["num_cudagraph_captured"]
    assert split > plain


def test_a_rank_whose_captures_fail_runs_without_graphs_and_stays_in_step(ranks):
    """Rank 1 runs each key without graphs after its capture failed, rank 0 replays: both run
    the same collectives in the same order, so neither hangs and both are exact (above)."""
    ok, failing = ranks[0][ONE_RANK_FAILS], ranks[1][ONE_RANK_FAILS]
    assert ok["num_cudagraph_captured"] > 0 and ok["num_eager_fallbacks"] == 0
    assert failing["num_cudagraph_captured"] == 0 and failing["keys"] == []
