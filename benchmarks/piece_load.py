"""How fast a fresh process gets Inductor's compiled pieces back: through Inductor's caches (what
a precompiled load does today: `compile_fx` again, every lookup a hit, each hashing the graph and
torch's and Triton's sources for its key) or from bundled artifacts (`compile_fx` under
`bundled_autograd_cache`, serialized as torch's AOT compile does, deserialized with no key).

    python benchmarks/piece_load.py --out OUT [--device cuda]

Three small graphs with a dynamic batch stand in for a model's distinct pieces; each phase runs
in its own process on the same cache directory; times include the phase's imports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _graphs():
    import torch

    def a(x, w):
        return (torch.relu(x @ w) * 2 + 1,)

    def b(x, w):
        h = x @ w
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6),)

    def c(x, w):
        return (torch.nn.functional.silu(x @ w) * (x @ w.t()),)

    return [a, b, c]


def _compile_all(device: str, bundle: bool, keep: list) -> float:
    """torch.compile each graph with a backend that calls compile_fx; returns the seconds in
    the backend (compile_fx's import included, Dynamo's trace not); `keep` gets the compiled
    functions."""
    import torch

    spent = [0.0]

    def backend(gm, example_inputs):
        start = time.perf_counter()
        from torch._inductor.compile_fx import compile_fx  # its import counts (a load pays it)

        with torch._functorch.config.patch(bundled_autograd_cache=bundle):
            fn = compile_fx(gm, example_inputs)
        spent[0] += time.perf_counter() - start
        keep.append(fn)
        return fn

    for fn in _graphs():
        x = torch.randn(8, 64, device=device)
        w = torch.randn(64, 64, device=device)
        torch._dynamo.mark_dynamic(x, 0)
        torch.compile(fn, backend=backend, dynamic=False)(x, w)
    return spent[0]


def _triton_key_done() -> bool | None:
    try:
        from torch._inductor.codecache import triton_key  # noqa: PLC0415
    except ImportError:
        return None
    info = getattr(triton_key, "cache_info", None)
    return None if info is None else info().currsize > 0


def phase(name: str, device: str, folder: Path) -> dict:
    t0 = time.perf_counter()
    import torch
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    imported = time.perf_counter() - t0
    result = {"phase": name, "import torch s": round(imported, 3)}
    if name == "save":
        result["compile s"] = round(_compile_all(device, False, []), 3)
        kept: list = []
        result["compile bundled s"] = round(_compile_all(device, True, kept), 3)
        for i, fn in enumerate(kept):
            (folder / f"piece{i}.bin").write_bytes(Bundled.serialize_compile_artifacts(Bundled(fn)))
    elif name == "hit":
        result["compile_fx hits s"] = round(_compile_all(device, False, []), 3)
    else:
        start = time.perf_counter()
        loaded = [
            Bundled.deserialize_compile_artifacts((folder / f"piece{i}.bin").read_bytes())
            for i in range(len(_graphs()))
        ]
        result["deserialize s"] = round(time.perf_counter() - start, 3)
        x = torch.randn(5, 64, device=device)
        w = torch.randn(64, 64, device=device)
        for fn, graph in zip(loaded, _graphs(), strict=True):
            torch.testing.assert_close(fn(5, x, w)[0], graph(x, w)[0])
        result["outputs equal"] = True
    result["triton key computed"] = _triton_key_done()
    result["phase s, with imports"] = round(time.perf_counter() - t0, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, args.device, Path(args.folder))))
        return
    folder = Path(tempfile.mkdtemp(prefix="cgcompile-piece-load-"))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}
    rows = []
    for name in ["save"] + ["hit", "bundle"] * args.rounds:
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--phase",
                name,
                "--device",
                args.device,
                "--folder",
                str(folder),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        line = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else None
        row = json.loads(line) if line else {"phase": name, "error": proc.stderr[-2000:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "piece-load.json").write_text(json.dumps(rows, indent=1))
    for name in ("hit", "bundle"):
        wall = sorted(
            r.get("phase s, with imports", float("nan")) for r in rows if r["phase"] == name
        )
        print(f"{name}: phase s with imports {wall}")


if __name__ == "__main__":
    main()
