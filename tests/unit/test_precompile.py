"""Warm restart without Dynamo (`cgcompile.precompile`): a process compiles the example Llama
(KV cache written in place) for a batch of 8 and a batch of 1 and saves it; a fresh process
loads it with no Dynamo trace and every Inductor compile a cache hit, serves every size with
eager's logits and caches, and `capture_all()` leaves nothing to capture; a file saved with
other options or other model code is refused with one warning and compiled again; misuse is
told apart. A decode step shaped like a user's Llama (KV cache written at index rows, a masked
SDPA over a slice bounded by the batch size, bf16) saves and loads under `no_grad` and
`inference_mode`; examples without marks get their batch marked."""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile import torch_features
from cgcompile.restart import portable
from tests.support import decorated
from tests.support.fresh_process import run_fresh
from tests.support.precompile_run import MODEL_SOURCE

needs_aot = pytest.mark.skipif(
    not torch_features.AOT_COMPILE.available, reason=torch_features.AOT_COMPILE.why_missing()
)


def write_model(model_dir: Path, scale: float) -> None:
    model_dir.mkdir(exist_ok=True)
    (model_dir / "pc_model.py").write_text(MODEL_SOURCE.format(scale=scale))


def run(path: Path, model_dir: Path, *args: str, cache: str = "inductor") -> dict:
    """tests/support/precompile_run.py in a fresh process on empty caches (`cache`, a folder
    beside `path`, and `cache`-triton): only what the file brings."""
    inductor, triton = path.parent / cache, path.parent / f"{cache}-triton"
    argv = [str(path), str(model_dir), *args]
    stdout, _ = run_fresh("tests.support.precompile_run", argv, inductor, triton)
    return json.loads(stdout.strip().splitlines()[-1])


def run_rows(path: Path, *args: str) -> dict:
    """tests/support/precompile_rows.py in a fresh process (see `run`)."""
    stdout, _ = run_fresh("tests.support.precompile_rows", [str(path), *args], path.parent / "ind")
    return json.loads(stdout.strip().splitlines()[-1])


def run_hf(path: Path, arch: str, *args: str, cache: str = "ind") -> dict:
    """tests/support/precompile_hf.py in a fresh process (see `run`)."""
    argv = [str(path), "--arch", arch, *args]
    inductor, triton = path.parent / cache, path.parent / f"{cache}-triton"
    stdout, _ = run_fresh("tests.support.precompile_hf", argv, inductor, triton)
    return json.loads(stdout.strip().splitlines()[-1])


def not_served(result: dict) -> list[str]:
    """The warnings that say the file was not saved, not loaded, or a call not served by it."""
    words = ("not precompiled", "not loaded", "fits none", "not saved")
    return [w for w in result["warnings"] if any(word in w for word in words)]


def assert_equals_eager(result: dict) -> None:
    assert result["max_error"] < 1e-5 and result["cache_error"] < 1e-5
    assert result["captured_by_calls"] == 0  # capture_all() captured every key


@needs_aot
def test_a_fresh_process_loads_the_precompiled_model_without_tracing_or_compiling(tmp_path):
    write_model(tmp_path / "m", 1.0)
    path = tmp_path / "llama.cgaot"
    saved = run(path, tmp_path / "m")
    assert saved["loaded"] is False and "no file" in saved["why_compiled"]
    # batch >= 2 and batch 1: two Dynamo traces; the batch-1 graph is served by the first's
    # compile, whose pieces Inductor compiles (misses)
    assert saved["dynamo_traces"] == 2 and saved["autograd_cache"][0] == 0
    assert saved["autograd_cache"][1] > 0
    assert_equals_eager(saved)
    loaded = run(path, tmp_path / "m")
    assert loaded["loaded"] is True
    # the one warning: a batch-1 call in manual mode runs the batch-1 graph's own nodes,
    # which the load unpickles only then, and matches eager (max_error)
    assert [w for w in loaded["warnings"] if "manual mode" not in w] == []
    assert len(loaded["warnings"]) == len(saved["warnings"]) == 1
    assert loaded["dynamo_traces"] == 0 and loaded["dynamo_traces_after_calls"] == 0
    assert loaded["autograd_cache"] == [saved["autograd_cache"][1], 0]  # every compile a hit
    assert loaded["backend_compiles"] == saved["backend_compiles"]
    # the saving process's analyses are reused: no run of the graph on fake tensors for them
    # batch 1 is served by the dynamic graph: matched node by node when saved, not when loaded
    assert saved["analyses_run"] == ["pad_check", "find_effects", "match_batch_one"]
    assert loaded["analyses_run"] == []
    assert saved["graphs_shared"] == loaded["graphs_shared"] == 1
    assert loaded["captured_by_capture_all"] == saved["captured_by_capture_all"] > 0
    assert_equals_eager(loaded)
    # the report says so
    hits = saved["autograd_cache"][1]
    assert f"compile cache 0 hits, {hits} misses" in saved["report"]
    assert "rebuilt from a precompiled file" not in saved["report"]
    assert f"compile cache {hits} hits, 0 misses" in loaded["report"]
    assert "rebuilt from a precompiled file: no Dynamo trace" in loaded["report"]
    # the load's steps are timed, in the order they ran, and add up to the load
    steps = loaded["load_steps"]
    assert saved["load_steps"] == {}
    assert list(steps) == [
        "read",
        "header",
        "unpickle",
        "inductor artifacts",
        "graph unpickle",
        "rebuild",
        "rebuild: pieces",
        "torch's loader",
    ]
    assert steps["rebuild: pieces"] <= steps["rebuild"]
    whole = sum(s for name, s in steps.items() if name != "rebuild: pieces")
    assert whole <= loaded["seconds"] <= whole + 0.5  # the rest: marking, ordering examples


@needs_aot
def test_an_unbacked_batch_is_traced_and_saved_once_for_every_example(tmp_path):
    """The batch-1 example of an unbacked batch fits the first example's guards: it is not
    traced again, the file holds one function, and a load serves every size from it."""
    if not torch_features.SHARED_UNBACKED_BATCH.available:
        pytest.skip("needs mark_unbacked's shape_id (torch >= 2.11)")
    write_model(tmp_path / "m", 1.0)
    path, args = tmp_path / "llama.cgaot", ("--compiler", "eager", "--unbacked")
    saved = run(path, tmp_path / "m", *args)
    assert saved["loaded"] is False and saved["dynamo_traces"] == 1 and saved["functions"] == 1
    assert_equals_eager(saved)
    loaded = run(path, tmp_path / "m", *args)
    assert loaded["loaded"] is True and loaded["functions"] == 1
    assert loaded["dynamo_traces_after_calls"] == 0  # sizes 1 to 16, none traced
    assert_equals_eager(loaded)


@needs_aot
def test_changed_options_or_model_code_are_refused_once_and_compiled_again(tmp_path):
    model_dir, path = tmp_path / "m", tmp_path / "llama.cgaot"
    write_model(model_dir, 1.0)
    eager = ("--compiler", "eager")
    run(path, model_dir, *eager)
    other_sizes = run(path, model_dir, *eager, "--sizes", "4", "8")
    assert other_sizes["loaded"] is False and "options" in other_sizes["why_compiled"]
    assert other_sizes["dynamo_traces"] == 2
    assert [w for w in other_sizes["warnings"] if "not loaded" in w] == [
        f"{path} not loaded: {other_sizes['why_compiled']}; compiling the model and saving it again"
    ]
    assert_equals_eager(other_sizes)
    assert run(path, model_dir, *eager, "--sizes", "4", "8")["loaded"] is True  # saved again
    other_examples = run(path, model_dir, *eager, "--sizes", "4", "8", "--examples", "8")
    assert other_examples["loaded"] is False and "examples" in other_examples["why_compiled"]
    # batch-1 calls fit no example: compiled just in time (and captured lazily), still exact
    assert other_examples["max_error"] < 1e-5 and other_examples["cache_error"] < 1e-5
    assert [w for w in other_examples["warnings"] if "failing guards: " in w]
    run(path, model_dir, *eager, "--sizes", "4", "8")  # both examples again
    write_model(model_dir, 2.0)  # the forward's code changes; the traced graph would not fit
    changed = run(path, model_dir, *eager, "--sizes", "4", "8")
    assert changed["loaded"] is False
    assert "the source of pc_model changed" in changed["why_compiled"]
    assert len([w for w in changed["warnings"] if "not loaded" in w]) == 1
    assert_equals_eager(changed)  # eager here runs the new code


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


OPTIONS = {"graph_runtime": "simulated", "compiler": "eager", "cudagraph_capture_sizes": [4]}


def precompile_mlp(path: Path) -> tuple[MLP, cgcompile.Precompiled]:
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(4, 16)
    cgcompile.mark_dynamic_batch(x)
    with torch.no_grad():
        return model, cgcompile.precompile(model, [(x,)], path, OPTIONS)


@needs_aot
def test_a_call_that_fits_no_example_compiles_just_in_time_and_says_so_once(tmp_path, caplog):
    model, step = precompile_mlp(tmp_path / "mlp.cgaot")
    x = torch.randn(3, 16, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="cgcompile"), torch.no_grad():
        outs = [step(x.to(model.fc.weight.dtype)), step(torch.randn(8, 16))]
        model.double()
        outs.append(step(x))  # float64: fits no precompiled function
        outs.append(step(x))
        assert torch.allclose(outs[-1], model(x))
    assert caplog.text.count("fits none of the 1 precompiled functions") == 1


@needs_aot
def test_calls_marked_as_for_torch_compile_run_the_precompiled_functions(tmp_path):
    write_model(tmp_path / "m", 1.0)
    first = run(tmp_path / "llama.cgaot", tmp_path / "m", "--compiler", "eager", "--marked")
    again = run(tmp_path / "llama.cgaot", tmp_path / "m", "--compiler", "eager", "--marked")
    assert again["loaded"] is True and again["dynamo_traces_after_calls"] == 0
    assert [w for w in again["warnings"] if "need no mark_dynamic_batch" in w]
    assert not [w for w in again["warnings"] if "fits none" in w]
    assert_equals_eager(first)
    assert_equals_eager(again)


@needs_aot
def test_a_file_that_is_not_ours_is_refused_and_replaced(tmp_path, caplog):
    path = tmp_path / "mlp.cgaot"
    path.write_bytes(b"something else")
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        _, step = precompile_mlp(path)
    assert step.loaded is False and "not a precompiled cgcompile model" in step.why_compiled
    assert caplog.text.count("not loaded") == 1
    assert precompile_mlp(path)[1].loaded is True


class Breaking(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        torch._dynamo.graph_break()  # AOT compiles one graph (fullgraph)
        return torch.relu(y)


def _local_mlp() -> MLP:
    class Local(MLP):  # not importable: a saved file could not name the model's class
        pass

    return Local()


@needs_aot
@pytest.mark.parametrize(
    "make, why",
    [(Breaking, "AOT compile failed"), (_local_mlp, "is defined in a function")],
    ids=["graph-break", "local-class"],
)
def test_a_model_that_cannot_be_precompiled_still_runs_and_says_why(tmp_path, caplog, make, why):
    torch.manual_seed(0)
    model, x = make().eval(), torch.randn(4, 16)
    cgcompile.mark_dynamic_batch(x)
    with caplog.at_level(logging.WARNING, logger="cgcompile"), torch.no_grad():
        step = cgcompile.precompile(model, [(x,)], tmp_path / "local.cgaot", OPTIONS)
        y = torch.randn(4, 16)
        assert torch.allclose(step(y), model(y))
    assert caplog.text.count("is not precompiled") == 1
    assert step.loaded is False and why in step.why_compiled
    assert not (tmp_path / "local.cgaot").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        ((MLP(), (torch.randn(2, 16),), "f"), "list of calls' arguments"),
        ((MLP(), [], "f"), "list of calls' arguments"),
        ((MLP(), [(torch.randn(2, 16),)], 3), "file path"),
        (("model", [(torch.randn(2, 16),)], "f"), "a module or a function"),
    ],
    ids=["examples-not-a-list", "no-examples", "path-not-a-path", "model-not-callable"],
)
def test_bad_arguments_raise_before_compiling(args, message):
    with pytest.raises(cgcompile.ConfigTypeError, match=message):
        cgcompile.precompile(*args)


def test_options_are_validated_before_compiling():
    with pytest.raises(cgcompile.ConfigError, match="cudagraph_mode"):
        cgcompile.precompile(MLP(), [(torch.randn(2, 16),)], "f", {"cudagraph_mode": "FAST"})
    with pytest.raises(cgcompile.ConfigError, match="backend's options only"):
        cgcompile.precompile(MLP(), [(torch.randn(2, 16),)], "f", {"guard_filter_fn": len})


@needs_aot
def test_a_precompiled_model_beside_a_compiled_copy_keeps_their_graphs_apart(tmp_path, caplog):
    """Dynamo's batch-1 graph of a just-in-time copy is not served by the precompiled model's
    dynamic graph (its inputs are named otherwise), so `trusted` binds the copy's own."""
    from examples.llama import Llama, LlamaConfig, make_inputs, mark_batch

    cfg = LlamaConfig(num_layers=1, cache_len=32)
    torch.manual_seed(0)
    first, second, eager = (Llama(cfg).eval() for _ in range(3))
    second.load_state_dict(eager.state_dict())
    options = {**OPTIONS, "cudagraph_capture_sizes": [1, 8]}
    examples = [make_inputs(cfg, n, "cpu") for n in (8, 1)]
    for tokens, positions in examples:
        mark_batch(cfg, tokens, positions, hint=8 if tokens.shape[0] > 1 else None)
    with caplog.at_level(logging.WARNING, logger="cgcompile"), torch.no_grad():
        step = cgcompile.precompile(first, examples, tmp_path / "llama.cgaot", options)
        for n in (1, 8, 1, 8):
            step(*make_inputs(cfg, n, "cpu"))
        compiled = torch.compile(second, backend="cudagraph_modes", options=options)
        fast = cgcompile.trusted(compiled)
        for n in (1, 8, 1, 8, 1):
            tokens, positions = make_inputs(cfg, n, "cpu")
            mark_batch(cfg, tokens, positions, hint=8 if n > 1 else None)
            assert torch.allclose(fast(tokens, positions), eager(tokens, positions), atol=1e-5)
    assert "cannot bind" not in caplog.text


def test_without_aot_compile_it_compiles_just_in_time_and_saves_nothing(
    tmp_path, caplog, monkeypatch
):
    import dataclasses

    missing = dataclasses.replace(torch_features.AOT_COMPILE, available=False)
    monkeypatch.setattr(torch_features, "AOT_COMPILE", missing)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        model, step = precompile_mlp(tmp_path / "mlp.cgaot")
    assert step.loaded is False and step.functions == [] and "needs torch >= 2.10" in caplog.text
    assert not (tmp_path / "mlp.cgaot").exists()
    y = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.allclose(step(y), model(y))


@needs_aot
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference"])
def test_a_decode_step_writing_kv_rows_with_a_masked_sdpa_saves_and_loads(tmp_path, grad_mode):
    path = tmp_path / "rows.cgaot"
    saved = run_rows(path, "--grad-mode", grad_mode)
    assert saved["functions"] == 2 and "no file" in saved["why_compiled"]
    loaded = run_rows(path, "--grad-mode", grad_mode)
    assert loaded["loaded"] is True and loaded["dynamo_traces_after_calls"] == 0
    for result in (saved, loaded):
        assert not_served(result) == []
        assert result["max_error"] == 0 and result["cache_error"] == 0  # compiler eager: exact


@needs_aot
def test_unmarked_examples_are_marked_on_aliases_and_serve_every_batch_size(tmp_path):
    path = tmp_path / "rows.cgaot"
    saved = run_rows(path, "--unmarked")
    loaded = run_rows(path, "--unmarked")
    assert loaded["loaded"] is True and loaded["dynamo_traces_after_calls"] == 0  # 1 to 16 rows
    for result in (saved, loaded):
        assert not_served(result) == [] and result["max_error"] == 0
        assert result["marks_left"] == []  # the caller's tensors stay unmarked


class SlicedCache(nn.Module):
    """Reads `cache[:B]`: Dynamo's graph holds a slice bounded by the batch size's node."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.randn(8, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cache[: x.shape[0]]


@needs_aot
def test_a_slice_bounded_by_the_batch_size_saves_with_a_pickler_that_maps_no_slices(
    tmp_path, monkeypatch, caplog
):
    """Torch 2.11's graph pickler did not map the nodes inside slices ("Unexpected raw Node
    during pickling"); newer torch's is made to behave as it did."""
    from torch.fx import _graph_pickler

    if hasattr(_graph_pickler, "patch_pytree_map_over_slice"):
        monkeypatch.setattr(_graph_pickler, "patch_pytree_map_over_slice", contextlib.nullcontext)
    model, x = SlicedCache(), torch.randn(4, 16)
    cgcompile.mark_dynamic_batch(x)
    path = tmp_path / "sliced.cgaot"
    with caplog.at_level(logging.WARNING, logger="cgcompile"), torch.no_grad():
        saved = cgcompile.precompile(model, [(x,)], path, OPTIONS)
        loaded = cgcompile.precompile(model, [(x,)], path, OPTIONS)
        for n in (3, 8):
            y = torch.randn(n, 16)
            assert torch.allclose(loaded(y), model(y))
    assert len(saved.functions) == 1 and loaded.loaded is True
    assert "not precompiled" not in caplog.text and "fits none" not in caplog.text


class Project(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w)


@needs_aot
def test_only_tensors_whose_dim_0_differs_between_unmarked_examples_are_marked(tmp_path, caplog):
    w = torch.randn(16, 16)  # dim 0 is not the batch: marked, x @ w would fail to trace
    examples = [(torch.randn(4, 16), w), (torch.randn(1, 16), w)]
    with caplog.at_level(logging.WARNING, logger="cgcompile"), torch.no_grad():
        step = cgcompile.precompile(Project(), examples, tmp_path / "p.cgaot", OPTIONS)
        for n in (3, 8, 1):
            x = torch.randn(n, 16)
            assert torch.allclose(step(x, w), torch.relu(x @ w), atol=1e-5)
    assert len(step.functions) == 2
    assert "not precompiled" not in caplog.text and "fits none" not in caplog.text
    with pytest.raises(cgcompile.ConfigError, match="mark_dynamic_batch"):  # whose batch?
        cgcompile.precompile(Project(), [(w, torch.randn(4, 16)), (w[:2], w[:1])], "f", OPTIONS)


@needs_aot
def test_a_file_saved_under_no_grad_is_refused_once_under_inference_mode(tmp_path, caplog):
    """Inference tensors (made under `inference_mode`) fail no_grad examples' guards."""
    model, path = MLP().eval(), tmp_path / "mlp.cgaot"
    with torch.no_grad():
        cgcompile.precompile(model, [(torch.randn(4, 16),)], path, OPTIONS)
    with caplog.at_level(logging.WARNING, logger="cgcompile"), torch.inference_mode():
        again = cgcompile.precompile(model, [(torch.randn(4, 16),)], path, OPTIONS)
        last = cgcompile.precompile(model, [(torch.randn(4, 16),)], path, OPTIONS)
        x = torch.randn(3, 16)
        assert torch.allclose(last(x), model(x))
    assert again.loaded is False and "examples" in again.why_compiled and last.loaded is True
    assert caplog.text.count("not loaded") == 1 and "fits none" not in caplog.text


def test_a_saved_graph_keeps_the_values_a_rebuild_reads() -> None:
    """The saved Dynamo graph carries the example values of the inputs, outputs, sizes, the
    values handed between pieces and the splitting ops' arguments; the others (most of a
    graph's tensors) are left out, which is most of a load's unpickling."""
    from cgcompile.passes.op_match import OpMatcher
    from cgcompile.passes.split import split_graph
    from cgcompile.restart.saved_graph import _values_read_on_load
    from examples.llama import Llama, LlamaConfig, make_inputs
    from tests.unit.test_split import trace

    cfg = LlamaConfig(num_layers=2, cache_len=64)
    model = Llama(cfg).eval()
    tokens, positions = make_inputs(cfg, 4, "cpu")
    with torch.no_grad():
        gm = trace(model, tokens, positions).gm
    kept = _values_read_on_load(gm, {})
    nodes = {n.name: n for n in gm.graph.nodes}
    tensors = [n for n in nodes.values() if isinstance(n.meta.get("example_value"), torch.Tensor)]
    assert {n for n, node in nodes.items() if node.op in ("placeholder", "output")} <= kept
    sdpa = [n for n in nodes.values() if n.target is torch._C._nn.scaled_dot_product_attention]
    assert len(sdpa) == 2 and all({a.name for a in n.all_input_nodes} <= kept for n in sdpa)
    split = split_graph(gm, OpMatcher([torch.nn.functional.scaled_dot_product_attention]))
    handed = {p.name for i in split.items for p in i.graph.graph.find_nodes(op="placeholder")}
    assert handed & set(nodes) <= kept
    assert len(kept & {n.name for n in tensors}) < len(tensors) / 2


@needs_aot
@pytest.mark.parametrize("arch", ["Llama", "Qwen3"])
def test_a_hugging_face_model_with_static_caches_saves_and_loads(tmp_path, arch):
    """Its forward is decorated (the closure holds the undecorated one), the `kernels` package
    wraps functions in classes defined in a function, Dynamo reads modules through other
    modules' globals, and each static cache fixes a batch size: the auto-marked batch is
    dropped and each example compiled for its own shapes."""
    pytest.importorskip("transformers")
    first, second = (run_hf(tmp_path / "hf.cgaot", arch) for _ in range(2))
    assert first["loaded"] is False and not not_served(first), first
    assert second["loaded"] is True and second["dynamo_traces"] == 0, second
    assert second["warnings"] == []
    assert second["digest"] == first["digest"]  # the loaded graphs compute what the saved did
    # capture_all (after the steps) leaves the caches as the steps left them
    assert [r["caches_before_capture_all"] for r in (first, second)] == [first["digests"][-1]] * 2
    assert second["max_error"] < 1e-5 and second["cache_error"] < 1e-5


def test_functions_pickle_cannot_find_by_name_are_supplied_from_the_live_forward():
    forward = decorated.Decorated.forward
    inner = forward.__wrapped__  # its qualified name leads to the wrapper
    assert not portable.findable(inner)
    assert portable.findable(forward) and portable.findable(decorated.named)
    assert portable.findable(lambda: None) and portable.findable(3)  # saved by value or code
    assert portable.closure_externals(forward) == {"closure 0": inner}
    assert portable.closure_externals(decorated.named) == {}


@needs_aot
def test_a_decorated_forward_and_a_class_defined_in_a_function_save_and_load(tmp_path, caplog):
    torch.manual_seed(0)
    model, x = decorated.Decorated().eval(), torch.randn(4, 16)
    cgcompile.mark_dynamic_batch(x)
    path = tmp_path / "decorated.cgaot"
    with caplog.at_level(logging.INFO, logger="cgcompile"), torch.no_grad():
        saved = cgcompile.precompile(model, [(x,)], path, OPTIONS)
        loaded = cgcompile.precompile(model, [(x,)], path, OPTIONS)
        y = torch.randn(3, 16)
        assert torch.allclose(loaded(y), model(y))
    assert saved.loaded is False and loaded.loaded is True
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "guards are not saved (on globals, or pinning objects" in caplog.text


class SqueezeRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).unsqueeze(1).squeeze() + 1


@needs_aot
def test_a_loaded_graph_whose_one_row_calls_differ_still_raises_at_one_row(tmp_path):
    """The saved graph keeps the example values the one-row check reads (a squeeze's input):
    the loaded graph of an unbacked batch that squeezes it raises at one row as the compiled
    one does."""
    if not torch_features.SHARED_UNBACKED_BATCH.available:
        pytest.skip("needs mark_unbacked's shape_id (torch >= 2.11)")
    model, path = SqueezeRows().eval(), tmp_path / "squeeze.cgaot"
    x = torch.randn(4, 16)
    cgcompile.mark_dynamic_batch(x, unbacked=True)
    with torch.no_grad():
        cgcompile.precompile(model, [(x,)], path, OPTIONS)
        torch._dynamo.reset()
        loaded = cgcompile.precompile(model, [(x,)], path, OPTIONS)
        y = torch.randn(3, 16)
        cgcompile.mark_dynamic_batch(y, unbacked=True)
        torch.testing.assert_close(loaded(y), model(y))
        one = torch.randn(1, 16)
        cgcompile.mark_dynamic_batch(one, unbacked=True)
        with pytest.raises(cgcompile.CGCompileError, match="squeezes dim 0"):
            loaded(one)
    assert loaded.loaded is True


def _record_tuning(key: str, config: dict) -> None:
    """Record a kernel's tuning as Inductor's autotuner does after timing its configs."""
    import torch._inductor.runtime.autotune_cache  # noqa: F401 - registers the artifact kind
    from torch.compiler._cache import CacheArtifactManager

    CacheArtifactManager.record_artifact("autotune", key, config)


@needs_aot
@pytest.mark.parametrize("background", [False, True])
def test_the_first_capture_all_adds_the_kernels_tuning_to_the_saved_file(tmp_path, background):
    """Triton kernels tune on their first run, after the save: the saver's first `capture_all`
    rewrites the file with them (on the CPU no kernel tunes: one is recorded as Inductor's
    autotuner records it), the functions unchanged; a later capture_all writes nothing."""
    from torch.compiler._cache import CacheArtifactManager

    CacheArtifactManager.clear()  # what earlier tests recorded in this process
    path = tmp_path / "mlp.cgaot"
    _, step = precompile_mlp(path)
    saved = path.read_bytes()
    with torch.no_grad():
        step(torch.randn(4, 16))
        key = f"ab/kernel-{background}.best_config"
        _record_tuning(key, {"XBLOCK": 64, "num_warps": 4})
        job = cgcompile.capture_all(progress=False, background=background)
        if background:
            job.wait()
    tuned = path.read_bytes()
    header = saved.partition(b"\n")[2].partition(b"\n")[0]
    assert tuned.partition(b"\n")[2].partition(b"\n")[0] == header
    before, after = (pickle.loads(data.split(header + b"\n", 1)[1]) for data in (saved, tuned))
    assert after["functions"] == before["functions"] and before["cache"] is None
    artifacts = CacheArtifactManager.deserialize(after["cache"])
    assert [a.key for a in artifacts["autotune"]] == [key]
    with torch.no_grad():
        cgcompile.capture_all(progress=False)
    assert path.read_bytes() == tuned
    _, again = precompile_mlp(path)
    assert again.loaded, again.why_compiled


def _raises() -> None:
    raise RuntimeError("dictionary changed size during iteration")


@needs_aot
@pytest.mark.parametrize(
    "case, message",
    [
        ("saved again", "was saved again since: kernel tuning not added"),
        ("torch fails", "kernel tuning not added (RuntimeError("),
        ("record cleared", "this process's artifacts lack some of the file's: tuning not added"),
    ],
)
def test_kernel_tuning_is_not_added_where_the_file_would_lose(tmp_path, caplog, case, message):
    """The file stays as it is, with one line saying why, when another save replaced it since
    (the same header: the same model and options), when torch fails (capture_all's thread may
    run beside a compile), or when torch's record of artifacts was cleared since the save (the
    file's would be dropped, and a loader would miss them)."""
    from torch.compiler._cache import CacheArtifactManager

    CacheArtifactManager.clear()
    _record_tuning("ef/saved.best_config", {"XBLOCK": 8})
    path = tmp_path / "mlp.cgaot"
    _, step = precompile_mlp(path)
    if case == "saved again":
        path.write_bytes(path.read_bytes() + b"\0")  # as a concurrent save of the same model
    if case == "record cleared":
        CacheArtifactManager.clear()
    _record_tuning("ef/later.best_config", {"XBLOCK": 16})
    before = path.read_bytes()
    with caplog.at_level(logging.INFO, logger="cgcompile"), torch.no_grad():
        step(torch.randn(4, 16))
        with pytest.MonkeyPatch.context() as patch:
            if case == "torch fails":
                patch.setattr(torch.compiler, "save_cache_artifacts", _raises)
            cgcompile.capture_all(progress=False)
    assert path.read_bytes() == before
    assert message in caplog.text
