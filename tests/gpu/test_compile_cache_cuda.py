"""Warm restart on the GPU: a compile cache saved by one process makes every compile of a fresh
process (empty Inductor and Triton caches) a cache hit, Triton kernels included, with real CUDA
graphs and eager's outputs."""

from __future__ import annotations

import pytest

from tests.unit.test_compile_cache import run

pytestmark = pytest.mark.cuda


def test_a_saved_cache_serves_a_fresh_process_on_the_gpu(tmp_path):
    path = tmp_path / "mlp.cgcache"
    first, _ = run(tmp_path / "a", "save", str(path), "--cuda", triton=tmp_path / "triton-a")
    assert first["misses"] > 0 and first["max_error"] < 1e-5
    result, stderr = run(tmp_path / "b", "load", str(path), "--cuda", triton=tmp_path / "triton-b")
    assert result["loaded"] is True
    assert result["misses"] == 0 and result["hits"] == first["misses"]
    assert result["max_error"] < 1e-5
    assert "lacked" not in stderr
