"""Tests of fo_tune.space: the shipped files, the choice of file per device, selections, validation."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from fo_kernels.errors import FoTuneError
from fo_kernels.tile import Tile
from fo_tune.space import (
    SearchSpace,
    SpaceError,
    SpaceNotFoundError,
    load_space,
    packaged_spaces_dir,
    space_for,
)

SHIPPED = sorted(packaged_spaces_dir().glob("*.yaml"))


def shipped_data(name: str = "hopper") -> dict[str, Any]:
    return yaml.safe_load((packaged_spaces_dir() / f"{name}.yaml").read_text(encoding="utf-8"))


def write(tmp_path: Path, data: Any, name: str = "space.yaml") -> Path:
    path = tmp_path / name
    path.write_text(
        data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False), encoding="utf-8"
    )
    return path


# ------------------------------------------------------------------------------ shipped files
def test_both_shipped_files_exist() -> None:
    assert {p.name for p in SHIPPED} >= {"hopper.yaml", "default.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_file_loads_and_round_trips(path: Path) -> None:
    space = load_space(path)
    assert space.source == str(path)
    assert all(isinstance(t, Tile) for t in space.tiles)
    again = SearchSpace.from_dict(space.to_dict(), source="again")
    assert again == space
    assert yaml.safe_load(yaml.safe_dump(space.to_dict())) == space.to_dict()


def test_hopper_tiles_include_the_measured_ones() -> None:
    space = load_space(packaged_spaces_dir() / "hopper.yaml")
    big = Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4)
    pingpong = Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=5, pingpong=True)
    first_two = space.tile_candidates(quick=True)
    assert first_two == [big, pingpong]  # the profile's best two
    assert sum(t.pingpong for t in space.tiles) == 2
    assert space.calibration.quick_tiles == 2


def test_default_tiles_have_no_warp_specialization() -> None:
    space = load_space(packaged_spaces_dir() / "default.yaml")
    assert not any(t.warp_specialize for t in space.tiles)
    assert space.sms_free == (0, 8, 16, 24) and space.nccl_max_ctas == (0, 8, 16)


@pytest.mark.parametrize(("capability", "name"), [("9.0", "hopper"), ("8.0", "default"), ("cpu", "default")])
def test_space_for_picks_the_file(capability: str, name: str) -> None:
    assert space_for(capability).name == name


def test_space_for_other_directory(tmp_path: Path) -> None:
    data = shipped_data()
    write(tmp_path, {**data, "name": "mine", "compute_capability": ["8.9"]}, "mine.yaml")
    with pytest.raises(SpaceNotFoundError, match="no catch-all"):
        space_for("8.0", directory=tmp_path)
    assert space_for("8.9", directory=tmp_path).name == "mine"
    write(tmp_path, {**data, "name": "other", "compute_capability": ["8.9", "*"]}, "other.yaml")
    assert space_for("8.0", directory=tmp_path).name == "other"
    with pytest.raises(SpaceError, match="both apply"):
        space_for("8.9", directory=tmp_path)


# ----------------------------------------------------------------------------------- selections
def test_quick_and_full_selections_on_gpu() -> None:
    space = space_for("9.0")
    assert space.tile_candidates() == list(space.tiles)
    assert len(space.tile_candidates(quick=True)) == 2
    assert space.message_sizes(quick=True) == [1 << 20, 1 << 24, 1 << 28]
    assert space.interference_sizes() == [1 << 24, 1 << 26]
    assert space.interference_sizes(quick=True) == [1 << 26]
    assert space.interference_sms_free() == list(space.sms_free)
    assert space.interference_sms_free(quick=True) == [16, 24]
    assert set(space.interference_sms_free(quick=True)) <= set(space.sms_free)
    assert space.gemm_shapes() == [
        (2048, 4096, 4096),
        (4096, 8192, 4096),
        (4096, 8192, 14336),
        (8192, 8192, 8192),
        (16384, 8192, 4096),
    ]
    assert space.gemm_shapes(quick=True) == [(4096, 8192, 4096)]
    assert space.interference_gemm() == (8192, 8192, 8192)
    assert space.caps() == [0, 8, 16, 24, 32]
    assert space.sms_free_candidates() == list(space.sms_free)


def test_a_dtype_with_its_own_tiles_tries_them_and_others_try_the_common_list() -> None:
    space = space_for("9.0")
    fp8 = space.tile_candidates(dtype="float8_e4m3fn")
    deep = Tile(block_m=128, block_n=256, block_k=128, group_m=8, num_warps=8, num_stages=3)
    assert fp8 == list(space.dtype_tiles["float8_e4m3fn"]) and fp8[0] == deep
    assert deep not in space.tiles  # 16-bit operands: 96 KiB a stage, too much for 3 stages
    assert space.tile_candidates(dtype="float8_e4m3fn", quick=True) == fp8[:2]
    for dtype in ("bfloat16", "float16", "float32", None):
        assert space.tile_candidates(dtype=dtype) == list(space.tiles)
    assert space.tile_candidates(dtype="float8_e4m3fn", cpu=True) == space.tile_candidates(cpu=True)


def test_a_space_without_dtype_tiles_writes_none(tmp_path: Path) -> None:
    data = shipped_data()
    del data["dtype_tiles"]
    space = load_space(write(tmp_path, data))
    assert space.dtype_tiles == {} and "dtype_tiles" not in space.to_dict()
    assert space.tile_candidates(dtype="float8_e4m3fn") == list(space.tiles)


@pytest.mark.parametrize("quick", [False, True])
def test_cpu_selection_is_tiny_and_ignores_quick(quick: bool) -> None:
    space = space_for("cpu")
    cpu = dict(quick=quick, cpu=True)
    assert space.tile_candidates(**cpu) == [
        Tile(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
    ]
    assert space.sms_free_candidates(cpu=True) == [0, 2] == space.interference_sms_free(**cpu)
    assert space.caps(cpu=True) == [0]
    assert space.message_sizes(**cpu) == [4096, 65536]
    assert space.interference_sizes(**cpu) == [65536]
    assert space.interference_gemm(cpu=True) == (64, 64, 64)
    assert space.gemm_shapes(**cpu) == [(64, 96, 64)]


def test_message_sizes_are_the_powers_of_two_in_range() -> None:
    sizes = space_for("9.0").message_sizes()
    assert sizes[0] == 262144 and sizes[-1] == 536870912
    assert all(b == 2 * a for a, b in itertools.pairwise(sizes))
    data = shipped_data()
    data["calibration"]["message_bytes"] = {"min": 1000, "max": 5000}
    assert SearchSpace.from_dict(data).message_sizes() == [1024, 2048, 4096]


# ----------------------------------------------------------------------------------- malformed
def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(data: dict[str, Any]) -> dict[str, Any]:
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return data

    return edit


def _drop(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda data: {k: v for k, v in data.items() if k != key}


MALFORMED = {
    "bad tile": (_set(("tiles", 2, "block_m"), 96), "tiles[2].block_m: must be a power of two"),
    "unknown tile key": (
        _set(("tiles", 0, "blk"), 1),
        "tiles[0].blk: unknown key; valid: block_m, block_n, block_k, group_m",
    ),
    "negative sms_free": (
        _set(("engines", "triton", "sms_free", 3), -4),
        "engines.triton.sms_free[3]: expected a non-negative integer, got -4",
    ),
    "bool cap": (
        _set(("engines", "triton", "nccl_max_ctas", 1), True),
        "engines.triton.nccl_max_ctas[1]: expected a non-negative integer",
    ),
    "unknown top-level key": (_set(("bogus",), 1), "bogus: unknown key; valid: schema_version"),
    "unknown layout": (
        _set(("engines", "triton", "layouts", 1), "diagonal"),
        "engines.triton.layouts[1]: 'diagonal' is not one of row_band",
    ),
    "unknown wait mode": (
        _set(("engines", "triton", "wait_modes"), ["poll"]),
        "engines.triton.wait_modes[0]: 'poll' is not one of",
    ),
    "bad signal kind": (
        _set(("engines", "triton", "signal", "kinds"), ["tile"]),
        "engines.triton.signal.kinds[0]: 'tile' is not one of band",
    ),
    "zero multiple": (
        _set(("engines", "triton", "signal", "multiples"), [0]),
        "engines.triton.signal.multiples[0]: expected a positive",
    ),
    "bad schema_version": (
        _set(("schema_version",), 7),
        "schema_version: 7 is not supported (supported: 1, 2)",
    ),
    "wrong kind": (
        _set(("kind",), "table"),
        "kind: 'table', not a search space; give one (search_spaces/hopper.yaml)",
    ),
    "min > max": (
        _set(("calibration", "message_bytes"), {"min": 1024, "max": 512}),
        "calibration.message_bytes: min 1024 > max 512",
    ),
    "empty tiles": (_set(("tiles",), []), "tiles: expected a non-empty list, got an empty list"),
    "missing key": (_drop("cpu"), "cpu: missing"),
    "bad shape": (
        _set(("calibration", "gemm_shapes", 1), [1, 2]),
        "calibration.gemm_shapes[1]: expected [M, N, K]",
    ),
    "zero max_groups": (
        _set(("engines", "triton", "grouping", "max_groups"), 0),
        "engines.triton.grouping.max_groups: expected a positive",
    ),
    "zero quick_tiles": (
        _set(("calibration", "quick_tiles"), 0),
        "calibration.quick_tiles: expected a positive",
    ),
    "too many quick_tiles": (_set(("calibration", "quick_tiles"), 99), "calibration.quick_tiles: 99 >"),
    "quick sms_free not in sms_free": (
        _set(("calibration", "quick_interference_sms_free"), [5]),
        "calibration.quick_interference_sms_free[0]: 5 is not one of sms_free",
    ),
    "unquoted capability": (_set(("compute_capability",), [9.0]), "compute_capability[0]: expected a quoted"),
    "duplicate cap": (
        _set(("engines", "triton", "nccl_max_ctas"), [0, 8, 8]),
        "engines.triton.nccl_max_ctas[2]: repeats engines.triton.nccl_max_ctas[1]",
    ),
    "cpu bad tile": (_set(("cpu", "tiles", 0, "num_warps"), 3), "cpu.tiles[0].num_warps: must be one of"),
    "bool num_warps": (
        _set(("tiles", 0, "num_warps"), True),
        "tiles[0].num_warps: expected a positive integer",
    ),
    "string warp_specialize": (
        _set(("tiles", 1, "warp_specialize"), "yes"),
        "tiles[1].warp_specialize: expected",
    ),
    "missing schema_version": (_drop("schema_version"), "schema_version: missing; expected 2"),
    "no power of two": (
        _set(("calibration", "message_bytes"), {"min": 600, "max": 1000}),
        "calibration.message_bytes: no power of two in [600, 1000]",
    ),
    "signal not a mapping": (
        _set(("engines", "triton", "signal"), [1, 2]),
        "engines.triton.signal: expected a mapping, got list",
    ),
    "unknown engine": (
        _set(("engines", "nvshmem"), {}),
        "engines.nvshmem: unknown engine; valid: triton, copy_engine",
    ),
    "engines not a mapping": (_set(("engines",), []), "engines: expected a mapping with at least one of"),
    "unknown copy-engine mode": (
        _set(("engines", "copy_engine", "exchange"), {"chunks": [2]}),
        "engines.copy_engine.exchange: unknown key; valid: ring, tiled",
    ),
    "too many chunks": (
        _set(("engines", "copy_engine", "ring", "chunks"), [2, 65]),
        "engines.copy_engine.ring.chunks[1]: 65 > 64",
    ),
    "one-chunk weighting": (
        _set(("engines", "copy_engine", "ring", "weights"), [[1]]),
        "engines.copy_engine.ring.weights[0]: expected a list of 2 to 64 chunk weights",
    ),
    "tiled without tiles": (
        _set(("engines", "copy_engine", "tiled"), {"chunks": [1]}),
        "engines.copy_engine.tiled.tiles: missing",
    ),
    "cpu unknown key": (_set(("cpu", "quick"), 1), "cpu.quick: unknown key; valid: tiles"),
    "unknown tile dtype": (
        _set(("dtype_tiles", "float8_e5m2"), [{"block_m": 64, "block_n": 64, "block_k": 128}]),
        "dtype_tiles.float8_e5m2: unknown operand dtype; valid: bfloat16, float16, float32, float8_e4m3fn",
    ),
    "bad dtype tile": (
        _set(("dtype_tiles", "float8_e4m3fn", 1, "block_k"), 96),
        "dtype_tiles.float8_e4m3fn[1].block_k: must be a power of two",
    ),
    "empty dtype tiles": (
        _set(("dtype_tiles", "float8_e4m3fn"), []),
        "dtype_tiles.float8_e4m3fn: expected a non-empty list",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_space_names_file_and_key(tmp_path: Path, case: str) -> None:
    edit, expected = MALFORMED[case]
    path = write(tmp_path, edit(copy.deepcopy(shipped_data())))
    with pytest.raises(SpaceError) as info:
        load_space(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert expected in message
    assert isinstance(info.value, (FoTuneError, ValueError))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("- just\n- a list\n", "(top level): expected a mapping, got list"),
        ("", "(top level): expected a mapping, got null"),
        ("schema_version: 1\ntiles: [unclosed\n", "not valid YAML"),
    ],
    ids=["non-mapping", "empty", "syntax error"],
)
def test_unparsable_documents(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SpaceError) as info:
        load_space(path)
    assert str(info.value).startswith(f"{path}: ") and expected in str(info.value)


def test_missing_file_is_also_file_not_found(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(SpaceNotFoundError) as info:
        load_space(path)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, SpaceError)
    assert str(info.value).startswith(str(path))
    with pytest.raises(SpaceNotFoundError, match=r"no search space for compute capability '9\.0'"):
        space_for("9.0", directory=tmp_path)
    with pytest.raises(SpaceNotFoundError, match="no such folder"):
        space_for("9.0", directory=tmp_path / "absent")


def test_space_for_reports_a_broken_file(tmp_path: Path) -> None:
    write(tmp_path, shipped_data("default"), "default.yaml")
    write(tmp_path, _set(("engines", "triton", "sms_free", 0), -1)(shipped_data()), "hopper.yaml")
    with pytest.raises(SpaceError, match=r"hopper\.yaml: engines\.triton\.sms_free\[0\]"):
        space_for("9.0", directory=tmp_path)


# ------------------------------------------------------------------------------------ schema 1
def _v1(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 document of the same space: the engines' keys at the top level (and no
    ``dtype_tiles``, a schema-2 key)."""
    triton = data["engines"]["triton"]
    kept = {key: value for key, value in data.items() if key not in ("engines", "dtype_tiles")}
    out = kept | {"schema_version": 1} | triton
    ce = data["engines"].get("copy_engine")
    if ce is not None:
        out["copy_engine_chunks"] = ce["ring"]["chunks"]
        out["copy_engine_weights"] = ce["ring"]["weights"]
        out["copy_engine_tiled_chunks"] = ce["tiled"]["chunks"]
        out["copy_engine_tiles"] = ce["tiled"]["tiles"]
    return out


def test_schema_1_files_load_into_the_same_space(tmp_path: Path) -> None:
    new = load_space(packaged_spaces_dir() / "hopper.yaml")
    old = load_space(write(tmp_path, _v1(shipped_data())))
    assert old.schema_version == 1 and old.engines == new.engines and old.tiles == new.tiles
    assert SearchSpace.from_dict(old.to_dict()) == dataclasses.replace(new, source="", dtype_tiles={})
    # the bench's small space is still a schema-1 file
    small = load_space(packaged_spaces_dir() / "bench" / "h200_small.yaml")
    assert small.engine("copy_engine") is None and small.sms_free


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"copy_engine_exchange_chunks": [2]},
            "copy_engine_exchange_chunks: the copy engine's exchange mode was removed",
        ),
        ({"sms_free": [-1]}, "sms_free[0]: expected a non-negative integer"),
        ({"copy_engine_chunks": [0]}, "copy_engine_chunks[0]: expected a positive integer"),
    ],
)
def test_schema_1_errors_name_the_old_keys(tmp_path: Path, change: dict[str, Any], expected: str) -> None:
    data = _v1(shipped_data()) | change
    with pytest.raises(SpaceError) as info:
        load_space(write(tmp_path, data))
    assert expected in str(info.value)


def test_engine_sections_are_optional_and_name_their_engine() -> None:
    data = shipped_data()
    data["engines"] = {"copy_engine": data["engines"]["copy_engine"]}
    space = SearchSpace.from_dict(data)
    assert space.engine("triton") is None and space.sms_free == () and space.nccl_max_ctas == (0,)
    assert set(space.engine("copy_engine").modes) == {"ring", "tiled"}
    assert space_for("cpu").engine("copy_engine") is None  # default.yaml: no peer access assumed
