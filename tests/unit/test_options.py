"""Every bad option value raises one of our errors naming key, value and fix; validate early."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cgcompile
from cgcompile.config import AttentionCGSupport, CompilationConfig, CUDAGraphMode
from cgcompile.errors import CGCompileError, ConfigError, ConfigTypeError
from cgcompile.options import MAX_CAPTURE_SIZE
from tests.support.models import silly_closed_form, silly_model


def _error(options: object, error: type[ConfigError] = ConfigError) -> str:
    with pytest.raises(error) as info:
        cgcompile.validate_options(options)  # type: ignore[arg-type]
    return str(info.value)


def test_config_type_error_is_a_config_error_and_a_type_error() -> None:
    assert issubclass(ConfigTypeError, ConfigError)
    assert issubclass(ConfigTypeError, TypeError)


@pytest.mark.parametrize(
    "options", ["x", ["x"], 5, ("a", "b")], ids=["str", "list", "int", "tuple"]
)
def test_options_that_are_not_a_dict(options: object) -> None:
    message = _error(options, ConfigTypeError)
    assert "options must be a dict" in message
    assert repr(options) in message
    assert "cudagraph_mode" in message  # the example of what to pass


def test_non_string_option_name() -> None:
    message = _error({1: 2, "cudagraph_mode": "FULL"}, ConfigTypeError)
    assert "option names must be strings, got [1]" in message
    assert "max_cudagraph_capture_size" in message  # the valid names


@pytest.mark.parametrize(
    "options",
    [
        {"max_cudagraph_capture_size": 2**40},
        {"cudagraph_capture_sizes": [1, 2**40]},
        {"compile_sizes": [1, 2**40]},
        {"max_num_reqs": 2**40},
        {"uniform_decode_query_len": 2**40},
    ],
    ids=["max", "sizes", "compile-sizes", "max-num-reqs", "query-len"],
)
def test_huge_sizes_are_refused_before_allocating(options: dict) -> None:
    message = _error(options)
    (key,) = options
    assert key in message
    assert str(2**40) in message
    assert str(MAX_CAPTURE_SIZE) in message


def test_largest_allowed_capture_size_is_accepted() -> None:
    config = cgcompile.validate_options({"cudagraph_capture_sizes": [1, MAX_CAPTURE_SIZE]})
    assert config.max_cudagraph_capture_size == MAX_CAPTURE_SIZE


def test_num_warmups_is_bounded() -> None:
    message = _error({"num_warmups": 10**9})
    assert "num_warmups" in message and str(10**9) in message and "e.g. 1" in message


@pytest.mark.parametrize(
    ("op", "error"),
    [
        (1, ConfigTypeError),
        (None, ConfigTypeError),
        (b"a::b", ConfigTypeError),
        ([1], ConfigTypeError),
    ],
    ids=["int", "none", "bytes", "list"],
)
def test_bad_splitting_op_entries_fail_at_validation(op: object, error: type) -> None:
    message = _error({"splitting_ops": [op]}, error)
    assert "splitting_ops" in message
    assert repr(op) in message
    assert "ns::op" in message


def test_bytes_splitting_op_suggests_the_string() -> None:
    assert "pass 'a::b'" in _error({"splitting_ops": [b"a::b"]})


@pytest.mark.parametrize(
    ("key", "text", "expected"),
    [
        ("graph_runtime", "Simulated", "simulated"),
        ("graph_runtime", "AUTO", "auto"),
        ("compiler", "Inductor", "inductor"),
        ("compiler", "EAGER", "eager"),
    ],
    ids=str,
)
def test_choice_strings_are_case_insensitive(key: str, text: str, expected: str) -> None:
    assert getattr(cgcompile.validate_options({key: text}), key) == expected


@pytest.mark.parametrize(
    ("key", "value"), [("compiler", 1), ("graph_runtime", None), ("cudagraph_mode", 2)], ids=str
)
def test_non_string_choice_is_a_type_error(key: str, value: object) -> None:
    message = _error({key: value}, ConfigTypeError)
    assert key in message and repr(value) in message and "any case" in message


@pytest.mark.parametrize("integer", [np.int64, np.int32, np.uint16, int], ids=lambda t: t.__name__)
def test_numpy_ints_are_ints(integer: type) -> None:
    config = cgcompile.validate_options(
        {
            "cudagraph_capture_sizes": [integer(8), integer(1), integer(4)],
            "compile_sizes": [integer(4)],
            "max_num_reqs": integer(4),
            "num_warmups": integer(2),
        }
    )
    assert config.cudagraph_capture_sizes == (1, 4, 8)
    assert type(config.cudagraph_capture_sizes[0]) is int
    assert type(config.max_cudagraph_capture_size) is int
    assert (config.compile_sizes, config.max_num_reqs, config.num_warmups) == ((4,), 4, 2)


@pytest.mark.parametrize("key", ["max_cudagraph_capture_size", "num_warmups", "max_num_reqs"])
@pytest.mark.parametrize("value", [True, np.bool_(True), torch.tensor(True)], ids=str)
def test_bools_are_not_ints(key: str, value: object) -> None:
    message = _error({key: value}, ConfigTypeError)
    assert key in message


def test_bool_capture_size_is_not_an_int() -> None:
    assert "[1, True]" in _error({"cudagraph_capture_sizes": [1, True]}, ConfigTypeError)


def test_constructor_normalises_like_from_options() -> None:
    config = CompilationConfig(
        cudagraph_mode="piecewise",  # type: ignore[arg-type]
        cudagraph_capture_sizes=[np.int64(8), 1],  # type: ignore[arg-type]
        max_cudagraph_capture_size=8,
        compiler="Eager",  # type: ignore[arg-type]
    )
    assert config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert config.cudagraph_capture_sizes == (1, 8)
    assert config.compiler == "eager"


def test_constructor_rejects_what_from_options_rejects() -> None:
    with pytest.raises(ConfigError, match="cudagraph_mode"):
        CompilationConfig(cudagraph_mode="fullest")  # type: ignore[arg-type]


def test_validate_options_ignores_keys_torch_compile_consumes() -> None:
    options = {"cudagraph_mode": "FULL", "guard_filter_fn": lambda guards: [], "use_aoti": False}
    assert cgcompile.validate_options(options).cudagraph_mode == CUDAGraphMode.FULL
    assert "guard_filter_fn" in options  # the caller's dict is left as it was


def test_validate_options_is_public() -> None:
    assert "validate_options" in cgcompile.__all__
    assert cgcompile.validate_options() == CompilationConfig.from_options()


def test_error_raised_by_validate_options_is_the_one_the_backend_raises() -> None:
    options = {"cudagraph_capture_sizes": [1, 2**40]}
    message = _error(options)
    f = torch.compile(lambda x: x + 1, backend="cudagraph_modes", options=options)
    with pytest.raises(Exception, match="cudagraph_capture_sizes") as info:
        f(torch.randn(2))  # only now, inside Dynamo's BackendCompilerFailed
    assert isinstance(getattr(info.value, "inner_exception", None), ConfigError)
    assert message in str(info.value)


# ---- any options dict: a valid config or one of our errors, never another exception ----------

KEYS = [f.name for f in dataclasses.fields(CompilationConfig)]
WORDS = [
    *(m.name for m in CUDAGraphMode),
    *(m.name for m in AttentionCGSupport),
    *("inductor", "eager", "auto", "cuda", "simulated", "silly::attention", "aten::add.Tensor"),
]


def _any_case(word: str) -> st.SearchStrategy[str]:
    flips = st.lists(st.booleans(), min_size=len(word), max_size=len(word))
    return flips.map(
        lambda up: "".join(c.upper() if u else c.lower() for c, u in zip(word, up, strict=True))
    )


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-4, 600),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(WORDS).flatmap(_any_case),
    st.binary(max_size=6),
    st.integers(0, 2**31 - 1).map(np.int64),
    st.integers(0, 255).map(np.uint8),
    st.sampled_from([np.bool_(True), torch.tensor(3), torch.tensor(True), torch.ones(2)]),
    st.sampled_from([torch.ops.aten.add.Tensor, torch.ops.aten.mul, abs]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=4), inner, max_size=3),
    ),
    max_leaves=8,
)
SIZES = st.integers(1, 600) | st.integers(1, 600).map(np.int64)
NEAR_VALID = {  # values that mostly pass, so one bad field at a time is what gets checked
    "cudagraph_mode": st.sampled_from([m.name for m in CUDAGraphMode]).flatmap(_any_case),
    "splitting_ops": st.none() | st.lists(st.sampled_from(WORDS[-2:] + [torch.ops.aten.mul])),
    "cudagraph_capture_sizes": st.lists(SIZES, min_size=1, max_size=5),
    "max_cudagraph_capture_size": SIZES,
    "max_num_reqs": st.none() | SIZES,
    "uniform_decode_query_len": st.integers(1, 4),
    "compile_sizes": st.lists(SIZES, max_size=3),
    "compiler": st.sampled_from(["inductor", "eager"]).flatmap(_any_case),
    "use_inductor_graph_partition": st.booleans(),
    "num_warmups": st.integers(0, 3),
    "graph_runtime": st.sampled_from(["auto", "cuda", "simulated"]).flatmap(_any_case),
    "attention_cg_support": st.none()
    | st.sampled_from([m.name for m in AttentionCGSupport]).flatmap(_any_case),
}
FIELDS = st.fixed_dictionaries(
    {}, optional={key: st.one_of(near, near, near, VALUES) for key, near in NEAR_VALID.items()}
)
OPTIONS = st.one_of(
    FIELDS,
    FIELDS,
    st.dictionaries(
        st.sampled_from(KEYS) | st.text(max_size=6) | st.integers(), VALUES, max_size=4
    ),
    VALUES,
)


def _assert_normalised(config: CompilationConfig) -> None:
    for sizes in (config.cudagraph_capture_sizes, config.compile_sizes):
        assert type(sizes) is tuple and list(sizes) == sorted(set(sizes))
        assert all(type(s) is int and 1 <= s <= MAX_CAPTURE_SIZE for s in sizes)
    assert type(config.max_cudagraph_capture_size) is int
    assert isinstance(config.cudagraph_mode, CUDAGraphMode)
    assert config.attention_cg_support is None or isinstance(
        config.attention_cg_support, AttentionCGSupport
    )
    assert config.compiler in ("inductor", "eager")
    assert config.graph_runtime in ("auto", "cuda", "simulated")
    assert dataclasses.replace(config) == config  # normalising twice changes nothing


def _assert_valid(config: CompilationConfig) -> None:
    _assert_normalised(config)
    sizes = config.cudagraph_capture_sizes
    assert sizes and config.max_cudagraph_capture_size == sizes[-1]


@given(options=OPTIONS)
def test_any_options_give_a_valid_config_or_our_error(options: object) -> None:
    try:
        config = cgcompile.validate_options(options)  # type: ignore[arg-type]
    except CGCompileError:
        return
    _assert_valid(config)


@given(fields=FIELDS)
def test_any_constructor_fields_give_a_config_or_our_error(fields: dict) -> None:
    try:
        config = CompilationConfig(**fields)
    except CGCompileError:
        return
    _assert_normalised(config)


# ---- splitting ops that name nothing torch knows are warned about at compile time ------------


def _compile_and_run(splitting_ops: list[str], caplog: pytest.LogCaptureFixture) -> str:
    f = torch.compile(
        silly_model,
        backend="cudagraph_modes",
        options={"graph_runtime": "simulated", "compiler": "eager", "splitting_ops": splitting_ops},
    )
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        torch.testing.assert_close(f(torch.ones(4)), silly_closed_form(torch.ones(4)))
    return caplog.text


def test_unknown_splitting_op_warns_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    text = _compile_and_run(["silly::attention", "nosuch::op"], caplog)
    assert "splitting_ops ['nosuch::op'] name no op that torch knows" in text


@pytest.mark.parametrize(
    "ops",
    [["silly::attention"], ["silly::attention.default", "aten::mul.Tensor"], ["aten::sin"]],
    ids=["called", "overloads", "known-not-called"],
)
def test_known_splitting_ops_do_not_warn(ops: list[str], caplog: pytest.LogCaptureFixture) -> None:
    assert "name no op" not in _compile_and_run(ops, caplog)


def test_unknown_overload_of_a_known_op_warns(caplog: pytest.LogCaptureFixture) -> None:
    assert "['aten::mul.nosuch']" in _compile_and_run(["aten::mul.nosuch"], caplog)
