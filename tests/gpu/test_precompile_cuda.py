"""Warm restart without Dynamo on the GPU: a precompiled model saved by one process serves a
fresh process on empty Inductor and Triton caches with no Dynamo trace, every compile a cache
hit (Triton kernels from the file), real CUDA graphs captured by `capture_all()`, and eager's
logits and KV caches; so does a Hugging Face Llama with a static cache per batch size, bit for
bit as the saver computed (the file holds the saver's kernel tuning)."""

from __future__ import annotations

import pytest

from tests.unit.test_precompile import assert_equals_eager, needs_aot, run, run_hf, write_model

pytestmark = [pytest.mark.cuda, needs_aot]


def test_a_precompiled_model_serves_a_fresh_process_on_the_gpu(tmp_path):
    write_model(tmp_path / "m", 1.0)
    path = tmp_path / "llama.cgaot"
    saved = run(path, tmp_path / "m", "--cuda", cache="a")
    assert saved["loaded"] is False and saved["autograd_cache"][1] > 0
    assert_equals_eager(saved)
    loaded = run(path, tmp_path / "m", "--cuda", cache="b")
    assert loaded["loaded"] is True
    # the one warning: the manual-mode batch-1 call runs without CUDA graphs (as in the saver)
    assert [w for w in loaded["warnings"] if "manual mode" not in w] == []
    assert len(loaded["warnings"]) == 1
    assert loaded["dynamo_traces_after_calls"] == 0
    assert loaded["autograd_cache"] == [saved["autograd_cache"][1], 0]
    assert loaded["captured_by_capture_all"] == saved["captured_by_capture_all"] > 0
    assert_equals_eager(loaded)


def test_a_precompiled_hugging_face_llama_serves_a_fresh_process_on_the_gpu(tmp_path):
    pytest.importorskip("transformers")
    args = ("--cuda", "--compiler", "inductor")
    saved = run_hf(tmp_path / "hf.cgaot", "Llama", *args, cache="a")
    loaded = run_hf(tmp_path / "hf.cgaot", "Llama", *args, cache="b")
    assert saved["loaded"] is False and loaded["loaded"] is True, (saved, loaded)
    assert loaded["dynamo_traces"] == 0 and loaded["warnings"] == []
    # the saver's capture_all put its kernels' tuning into the file: the loader runs its configs
    assert saved["tuned_kernels"] > 0 and loaded["tuned_kernels"] == saved["tuned_kernels"]
    both = (saved, loaded)  # capture_all (after the steps) leaves the caches as they were
    assert all(r["caches_before_capture_all"] == r["digests"][-1] for r in both), both
    assert loaded["digest"] == saved["digest"], both
    assert loaded["max_error"] < 1e-3 and loaded["cache_error"] < 1e-3
