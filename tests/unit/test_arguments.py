"""Public functions reject bad arguments with a ConfigError that says what to pass:
mark_dynamic_batch, batch_hint, set_forward_context, register_attention_op."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cgcompile
from cgcompile import CUDAGraphMode, batch_hint, set_forward_context
from cgcompile.errors import ConfigError, ConfigTypeError


def _error(*tensors: object, error: type[ConfigError] = ConfigError, **kwargs: object) -> str:
    with pytest.raises(error) as info:
        cgcompile.mark_dynamic_batch(*tensors, **kwargs)  # type: ignore[arg-type]
    return str(info.value)


def test_dim_beyond_the_tensor() -> None:
    message = _error(torch.randn(3, 4), dim=5)
    assert "tensor 0 of shape (3, 4) has no dim 5" in message


def test_zero_dim_tensor_has_no_batch_dim() -> None:
    message = _error(torch.randn(3), torch.tensor(1.0))
    assert "tensor 1 of shape () has no dim 0" in message
    assert "0-d" in message


def test_tensors_disagreeing_on_the_batch() -> None:
    message = _error(torch.randn(3, 4), torch.randn(4))
    assert "disagree on the batch size (dim 0)" in message
    assert "[(3, 4), (4,)]" in message


@pytest.mark.parametrize(("dim", "error"), [(-1, ConfigError), ("0", ConfigTypeError)], ids=str)
def test_bad_dim(dim: object, error: type[ConfigError]) -> None:
    message = _error(torch.randn(3), dim=dim, error=error)
    assert f"dim must be an int >= 0, got {dim!r}" in message


def test_non_tensor_is_a_type_error() -> None:
    message = _error(torch.randn(3), [1, 2, 3], error=ConfigTypeError)
    assert "takes tensors, got list as argument 1" in message


def test_unbacked_must_be_a_bool() -> None:
    assert "unbacked must be True or False" in _error(torch.randn(3), unbacked="yes")


def test_huge_hint_is_refused() -> None:
    message = _error(torch.randn(3), hint=2**40)
    assert "hint must be a positive int <= 65536" in message
    assert str(2**40) in message


def test_numpy_dim_and_hint_are_ints() -> None:
    x = torch.randn(3, 4)
    cgcompile.mark_dynamic_batch(x, dim=np.int64(0), hint=np.int64(8))
    assert x._dynamo_dynamic_indices == {0}


def test_bad_arguments_mark_nothing() -> None:
    x = torch.randn(3, 4)
    _error(x, torch.randn(5, 4))
    assert not getattr(x, "_dynamo_dynamic_indices", None)


# ---- batch_hint, set_forward_context, register_attention_op ----------------------------------


def test_batch_hint_mode_names_in_any_case() -> None:
    with batch_hint(invalid_modes={"full", "Piecewise"}) as hint:
        assert hint.invalid_modes == {CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"invalid_modes": "FULL"}, "invalid_modes must be a list"),
        ({"invalid_modes": {"fullest"}}, "invalid_modes must be one of"),
        ({"num_reqs": "3"}, "num_reqs must be >= 1, got '3'"),
        ({"uniform_decode": "yes"}, "uniform_decode must be True or False"),
        ({"has_lora": None}, "has_lora must be True or False"),
    ],
    ids=["modes-str", "modes-unknown", "num-reqs-str", "uniform-str", "lora-none"],
)
def test_batch_hint_bad_arguments(kwargs: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        with batch_hint(**kwargs):
            pass


def test_batch_hint_numpy_num_reqs() -> None:
    with batch_hint(num_reqs=np.int64(4)) as hint:
        assert hint.num_reqs == 4 and type(hint.num_reqs) is int


def test_set_forward_context_mode_name_in_any_case() -> None:
    with set_forward_context("piecewise", num_tokens=np.int64(8)) as ctx:
        assert ctx.cudagraph_runtime_mode is CUDAGraphMode.PIECEWISE
        assert ctx.batch_descriptor == cgcompile.BatchDescriptor(8)


@pytest.mark.parametrize("num_tokens", ["8", 0, 2.5], ids=str)
def test_set_forward_context_bad_num_tokens(num_tokens: object) -> None:
    with pytest.raises(ConfigError, match="num_tokens must be a positive int"):
        with set_forward_context("FULL", num_tokens=num_tokens):  # type: ignore[arg-type]
            pass


@pytest.mark.parametrize(
    ("op", "error"),
    [(None, ConfigTypeError), (b"a::b", ConfigTypeError), ("attention", ConfigError)],
    ids=["none", "bytes", "no-namespace"],
)
def test_register_attention_op_bad_op(op: object, error: type[ConfigError]) -> None:
    with pytest.raises(error, match="register_attention_op: op takes 'ns::op'"):
        cgcompile.register_attention_op(op, "ALWAYS")
