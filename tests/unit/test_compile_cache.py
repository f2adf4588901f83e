"""Warm restart: a compile cache saved by one process is loaded by a fresh one (whose Inductor
cache holds no compiled graph), whose compiles become cache hits with eager's outputs; a changed
model misses, compiles anew and says so once; a file from another torch or not a cache is
refused."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cgcompile
from cgcompile.restart import compile_cache
from tests.support.fresh_process import ROOT, run_fresh


def run(cache: Path, *args: str, triton: Path | None = None) -> tuple[dict, str]:
    """tests/support/cache_run.py in a fresh process on the Inductor cache `cache` (no compiled
    graph in it) and the Triton cache `triton`."""
    stdout, stderr = run_fresh("tests.support.cache_run", list(args), cache, triton)
    return json.loads(stdout.strip().splitlines()[-1]), stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("cache")
    path = tmp / "mlp.cgcache"
    result, _ = run(tmp / "inductor", "save", str(path))
    return path, result


def test_a_saved_cache_makes_every_compile_of_a_fresh_process_a_hit(saved):
    path, first = saved
    assert first["misses"] > 0 and first["max_error"] < 1e-5  # the saving process compiled
    result, stderr = run(path.parent / "inductor", "load", str(path))
    assert result["loaded"] is True
    assert result["misses"] == 0 and result["hits"] == first["misses"]
    assert result["max_error"] < 1e-5
    # the report shows it: (hits, misses) of the graph's compile
    assert first["report_cache"] == [0, first["misses"]]
    assert result["report_cache"] == [first["misses"], 0]
    assert "lacked" not in stderr


def test_a_changed_model_compiles_anew_and_says_so_once(saved):
    path, _ = saved
    result, stderr = run(path.parent / "inductor", "load", str(path), "--changed")
    assert result["loaded"] is True and result["misses"] > 0
    assert result["max_error"] < 1e-5
    assert stderr.count("lacked") == 1, stderr[-2000:]


def _write(path: Path, header: dict) -> None:
    path.write_bytes(compile_cache.MAGIC + json.dumps(header).encode() + b"\n" + b"payload")


def test_a_cache_saved_with_another_torch_is_refused_with_the_reason(tmp_path, caplog):
    path = tmp_path / "old.cgcache"
    _write(path, {**compile_cache.process_header(), "torch": "2.9.0"})
    with caplog.at_level(logging.WARNING, logger="cgcompile.restart.compile_cache"):
        assert cgcompile.load_compile_cache(path) is False
    (record,) = [r for r in caplog.records if r.name == "cgcompile.restart.compile_cache"]
    assert "torch '2.9.0'" in record.getMessage() and torch.__version__ in record.getMessage()


def test_a_file_that_is_not_a_cache_is_refused_and_a_missing_one_is_no_error(tmp_path, caplog):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with caplog.at_level(logging.INFO, logger="cgcompile.restart.compile_cache"):
        assert cgcompile.load_compile_cache(path) is False
        assert cgcompile.load_compile_cache(tmp_path / "absent.cgcache") is False
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("cgcompile")]
    assert any("not a cgcompile compile cache" in m for m in messages)
    assert any("no compile cache at" in m for m in messages)


def test_saving_before_any_compile_says_what_to_do():
    code = "import cgcompile; cgcompile.save_compile_cache('x.cgcache')"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode != 0 and "call the compiled model" in proc.stderr
