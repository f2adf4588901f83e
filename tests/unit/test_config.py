"""CUDAGraphMode predicates, AttentionCGSupport order, and CompilationConfig.from_options."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgcompile.config import (
    AttentionCGSupport,
    CompilationConfig,
    CUDAGraphMode,
    default_capture_sizes,
)
from cgcompile.errors import CGCompileError, ConfigError

NONE = CUDAGraphMode.NONE
PIECEWISE = CUDAGraphMode.PIECEWISE
FULL = CUDAGraphMode.FULL
FULL_DECODE_ONLY = CUDAGraphMode.FULL_DECODE_ONLY
FULL_AND_PIECEWISE = CUDAGraphMode.FULL_AND_PIECEWISE

# mode: (decode_mode, mixed_mode, separate_routine, has_full, has_piecewise, needs_split)
PREDICATES = {
    NONE: (NONE, NONE, False, False, False, False),
    PIECEWISE: (PIECEWISE, PIECEWISE, False, False, True, True),
    FULL: (FULL, FULL, False, True, False, False),
    FULL_DECODE_ONLY: (FULL, NONE, True, True, False, False),
    FULL_AND_PIECEWISE: (FULL, PIECEWISE, True, True, True, True),
}


def test_predicate_table_covers_every_mode() -> None:
    assert set(PREDICATES) == set(CUDAGraphMode)


@pytest.mark.parametrize("mode", list(PREDICATES), ids=lambda m: m.name)
def test_mode_predicates(mode: CUDAGraphMode) -> None:
    got = (
        mode.decode_mode(),
        mode.mixed_mode(),
        mode.separate_routine(),
        mode.has_full_cudagraphs(),
        mode.has_piecewise_cudagraphs(),
        mode.requires_piecewise_compilation(),
    )
    assert got == PREDICATES[mode]


def test_valid_runtime_modes_are_none_piecewise_full() -> None:
    assert CUDAGraphMode.valid_runtime_modes() == {NONE, PIECEWISE, FULL}


@pytest.mark.parametrize(
    ("level", "value"),
    [
        (AttentionCGSupport.NEVER, 0),
        (AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, 1),
        (AttentionCGSupport.UNIFORM_BATCH, 2),
        (AttentionCGSupport.ALWAYS, 3),
    ],
    ids=lambda x: x.name if isinstance(x, AttentionCGSupport) else str(x),
)
def test_attention_support_values(level: AttentionCGSupport, value: int) -> None:
    assert int(level) == value


def test_attention_support_order() -> None:
    assert (
        AttentionCGSupport.ALWAYS
        > AttentionCGSupport.UNIFORM_BATCH
        > AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        > AttentionCGSupport.NEVER
    )
    assert min(AttentionCGSupport) == AttentionCGSupport.NEVER


# ---- from_options: defaults and normalisation --------------------------------------------


def _expected_default_sizes(max_size: int) -> list[int]:
    """The rule written out by hand: fine steps to 64, then 4 per doubling, step <= 256."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes += [80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    sizes += [640, 768, 896, 1024, 1280, 1536, 1792, 2048, *range(2304, 4097, 256)]
    sizes = [s for s in sizes if s <= max_size]
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


def test_from_options_defaults() -> None:
    config = CompilationConfig.from_options()
    assert config.cudagraph_mode == FULL_AND_PIECEWISE
    assert config.max_cudagraph_capture_size == 512
    assert list(config.cudagraph_capture_sizes) == _expected_default_sizes(512)


def test_default_sizes_for_512_has_23_entries() -> None:
    sizes = default_capture_sizes(512)
    assert len(sizes) == 23  # 1, 2, 4 + 8 multiples of 8 up to 64 + 4 per doubling x 3
    assert sizes[:5] == (1, 2, 4, 8, 16)
    assert sizes[-5:] == (256, 320, 384, 448, 512)


@pytest.mark.parametrize("max_size", [1, 3, 8, 100, 255, 256, 300, 512, 1000, 2048, 4096], ids=str)
def test_default_sizes_formula(max_size: int) -> None:
    assert list(default_capture_sizes(max_size)) == _expected_default_sizes(max_size)


@given(st.integers(1, 8192))
def test_default_sizes_pad_by_at_most_a_quarter_above_64(n: int) -> None:
    """Every batch of n tokens pads to the next size, at most 8 rows below 64 and at most a
    quarter of n above it (n up to the max): the padding waste the grid allows."""
    sizes = default_capture_sizes(8192)
    padded = min(s for s in sizes if s >= n)
    assert padded - n < (8 if n <= 64 else max(n / 4, 8))


def test_default_sizes_always_include_the_max() -> None:
    sizes = CompilationConfig.from_options({"max_cudagraph_capture_size": 300})
    assert sizes.cudagraph_capture_sizes[-3:] == (224, 256, 300)


@pytest.mark.parametrize(
    "text", ["piecewise", "PIECEWISE", "PieceWise", "full_and_piecewise"], ids=str
)
def test_mode_strings_are_case_insensitive(text: str) -> None:
    config = CompilationConfig.from_options({"cudagraph_mode": text})
    assert config.cudagraph_mode == CUDAGraphMode[text.upper()]


def test_user_sizes_are_deduplicated_sorted_and_set_the_max() -> None:
    config = CompilationConfig.from_options({"cudagraph_capture_sizes": [8, 1, 4, 8, 2, 1]})
    assert config.cudagraph_capture_sizes == (1, 2, 4, 8)
    assert config.max_cudagraph_capture_size == 8


def test_user_sizes_with_matching_max_are_accepted() -> None:
    config = CompilationConfig.from_options(
        {"cudagraph_capture_sizes": [4, 16], "max_cudagraph_capture_size": 16}
    )
    assert config.cudagraph_capture_sizes == (4, 16)


# ---- from_options: errors name the key, the bad value and what is valid ------------------


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, CGCompileError)


def _error(options: dict) -> str:
    with pytest.raises(ConfigError) as info:
        CompilationConfig.from_options(options)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_unknown_key_lists_valid_keys() -> None:
    message = _error({"cuda_graph_mode": "FULL"})
    assert "cuda_graph_mode" in message
    assert "cudagraph_mode" in message.replace("cuda_graph_mode", "")
    assert "max_cudagraph_capture_size" in message


def test_unknown_mode_string() -> None:
    message = _error({"cudagraph_mode": "FULLEST"})
    assert "cudagraph_mode" in message
    assert "FULLEST" in message
    for mode in CUDAGraphMode:
        assert mode.name in message


@pytest.mark.parametrize("key", ["cudagraph_capture_sizes", "compile_sizes"])
@pytest.mark.parametrize(
    "sizes",
    [[0], [1, -1], [2.5], ["4"], [1, "4"], [True]],
    ids=["zero", "negative", "float", "str", "int-and-str", "bool"],
)
def test_bad_sizes(key: str, sizes: list) -> None:
    message = _error({key: sizes})
    assert key in message
    assert repr(sizes[-1]) in message
    assert "positive ints" in message


def test_empty_capture_sizes() -> None:
    message = _error({"cudagraph_capture_sizes": []})
    assert "cudagraph_capture_sizes" in message
    assert "NONE" in message


@pytest.mark.parametrize("max_size", [4, 16], ids=["max-below-largest", "max-above-largest"])
def test_max_disagreeing_with_sizes(max_size: int) -> None:
    message = _error({"cudagraph_capture_sizes": [1, 2, 8], "max_cudagraph_capture_size": max_size})
    assert f"max_cudagraph_capture_size={max_size}" in message
    assert "[1, 2, 8]" in message


@pytest.mark.parametrize("max_size", [0, -8, 8.0], ids=["zero", "negative", "float"])
def test_bad_max_capture_size(max_size: object) -> None:
    message = _error({"max_cudagraph_capture_size": max_size})
    assert "max_cudagraph_capture_size" in message
    assert repr(max_size) in message
    assert ">= 1" in message


@pytest.mark.parametrize("q", [0, -1], ids=str)
def test_uniform_decode_query_len_below_one(q: int) -> None:
    message = _error({"uniform_decode_query_len": q})
    assert "uniform_decode_query_len" in message
    assert repr(q) in message
    assert ">= 1" in message


@pytest.mark.parametrize("support", ["NEVER", "never", AttentionCGSupport.NEVER], ids=str)
def test_full_with_never_support_suggests_piecewise(support: object) -> None:
    message = _error({"cudagraph_mode": "FULL", "attention_cg_support": support})
    assert "attention_cg_support=NEVER" in message
    assert "PIECEWISE" in message


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_never_support_is_allowed_for_modes_that_can_downgrade(mode: str) -> None:
    config = CompilationConfig.from_options(
        {"cudagraph_mode": mode, "attention_cg_support": "NEVER"}
    )
    assert config.attention_cg_support == AttentionCGSupport.NEVER


def test_unknown_attention_support() -> None:
    message = _error({"attention_cg_support": "SOMETIMES"})
    assert "attention_cg_support" in message
    assert "SOMETIMES" in message
    assert "UNIFORM_BATCH" in message


@pytest.mark.parametrize(
    ("key", "value", "valid"),
    [
        ("compiler", "tvm", ["inductor", "eager"]),
        ("graph_runtime", "opencl", ["auto", "cuda", "simulated"]),
    ],
    ids=["compiler", "graph_runtime"],
)
def test_bad_choice(key: str, value: str, valid: list[str]) -> None:
    message = _error({key: value})
    assert key in message
    assert repr(value) in message
    for choice in valid:
        assert repr(choice) in message


@pytest.mark.parametrize(
    "op", ["attention", "silly:attention", "silly::", "::attention", "silly::attention.a.b"]
)
def test_bad_splitting_op_string(op: str) -> None:
    message = _error({"splitting_ops": [op]})
    assert "splitting_ops" in message
    assert repr(op) in message
    assert "ns::op" in message


@pytest.mark.parametrize("op", ["silly::attention", "aten::_scaled_dot_product.default"])
def test_good_splitting_op_string(op: str) -> None:
    config = CompilationConfig.from_options({"splitting_ops": [op]})
    assert config.splitting_ops == (op,)


def test_splitting_ops_must_be_a_list() -> None:
    message = _error({"splitting_ops": "silly::attention"})
    assert "splitting_ops" in message
    assert "list" in message


@pytest.mark.parametrize("value", [True, False, None], ids=str)
def test_graph_partition_takes_true_false_or_none(value: object) -> None:
    config = CompilationConfig.from_options({"use_inductor_graph_partition": value})
    assert config.use_inductor_graph_partition is value


@pytest.mark.parametrize("value", [1, 0, "yes"], ids=str)
def test_graph_partition_rejects_other_values(value: object) -> None:
    message = _error({"use_inductor_graph_partition": value})
    assert "use_inductor_graph_partition must be True, False or None" in message
    assert repr(value) in message
