"""``fo-tune table`` on MoE tables (``moe-w<W>-<dtype>.yaml``): validate, show, lookup, diff and
list through the CLI, beside the dense tables, and what refuses to mix the two kinds."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from cli import app
from cli_checks import H200_KEY, assert_one_line_error, isolate_tables
from fo_kernels.errors import TableError
from fo_kernels.fingerprint import Fingerprint, current_fingerprint
from fo_kernels.moe.schedule import MoeProblem, MoeSchedule
from fo_kernels.moe.table import (
    MoeRow,
    MoeTable,
    MoeTableCache,
    load_moe_table,
    moe_table_path,
    save_moe_table,
)
from fo_kernels.schedule import Problem, Schedule
from fo_kernels.table import ScheduleTable, save_table
from fo_kernels.table import paths as table_paths
from fo_kernels.tile import Tile
from fo_tune.cli.errors import EXIT_BAD_INPUT, EXIT_FAILED

EXPERTS = (4096, 1536, 32, 8)  # H, I, E_local, k
SHAPE = dict(zip(("hidden", "intermediate", "experts", "top_k"), EXPERTS, strict=True))
TILE = Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
# The SM count of the H200 the packaged calibration (and so `search -c moe`'s table) is for.
H200_SMS = 132


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hermetic search path (env and user folders under tmp_path, no packaged tables), wide output."""
    isolate_tables(monkeypatch, tmp_path)
    monkeypatch.setattr(table_paths, "_packaged_table_dir", lambda: None)
    monkeypatch.setenv("COLUMNS", "250")


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def cpu_fp() -> Fingerprint:
    return current_fingerprint("cpu", 2)


def row(lo: int, hi: int, *, world: int = 2, dtype: str = "float32", **fields: Any) -> MoeRow:
    """A row of ``EXPERTS`` for tokens [lo, hi]; ``provenance`` and the schedule's fields in ``fields``."""
    provenance = fields.pop("provenance", {})
    problem = MoeProblem(**SHAPE, tokens_min=lo, tokens_max=hi)
    schedule = MoeSchedule(dtype=dtype, world_size=world, problem=problem, **fields)
    return MoeRow(schedule=schedule, provenance=provenance)


def write(path: Path, rows: list[MoeRow], fp: Fingerprint | None = None, dtype: str = "float32") -> Path:
    fp = fp or cpu_fp()
    save_moe_table(MoeTable(fingerprint=fp, world_size=fp.world_size, dtype=dtype, rows=rows), path)
    return path


def searched_table(runner: CliRunner, tmp_path: Path) -> Path:
    """The MoE table `fo-tune search -c moe` writes into $FO_TUNE_TABLE_DIR."""
    args = ["search", "-c", "moe", "--experts", ",".join(map(str, EXPERTS)), "--tokens", "1024,4096"]
    result = runner.invoke(app, [*args, "--table-dir", str(tmp_path / "tables"), "--json"])
    assert result.exit_code == 0, result.output
    path = Path(json.loads(result.stdout)["table"])
    assert path == moe_table_path(tmp_path / "tables", H200_KEY, 2, "bfloat16")
    return path


# ------------------------------------------------------------------------------------ validate
def test_a_searched_moe_table_validates_and_shows(runner: CliRunner, tmp_path: Path) -> None:
    path = searched_table(runner, tmp_path)
    result = runner.invoke(app, ["table", "validate", str(path)])
    assert result.exit_code == 0, result.output
    assert f"OK {path}: 2 row(s), moe bfloat16 world size 2, {H200_KEY}" in result.stdout
    assert "note:" not in result.stdout and result.stderr == ""
    table = load_moe_table(path)
    for args in (["table", "show", str(path)], ["table", "show", "-c", "moe", "-k", H200_KEY]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        out = result.stdout
        assert str(path) in out and "moe bfloat16, world size 2, 2 row(s)" in out and "132 SMs" in out
        for r in table.rows:
            s = r.schedule
            bucket = f"{s.problem.tokens_min}..{s.problem.tokens_max}"
            line = next(
                line for line in out.splitlines() if line.startswith("4096, 1536, 32, 8") and bucket in line
            )
            assert "predicted" in line and (s.engine or "no overlap") in line
            assert f"{r.provenance['predicted_ms']:.4g}" in line
        # once per distinct basis (the copy engine's row adds its pushes' clause to the model's)
        bases = [r.provenance["basis"] for r in table.rows]
        for basis in set(bases):
            assert f"basis ({bases.count(basis)} row(s)): {basis}" in out
        assert all(b.startswith("all_to_all from the reduce_scatter curve") for b in bases)
        assert "calibration (2 row(s))" in out
    result = runner.invoke(app, ["table", "show", str(path), "--limit", "1"])  # the terminal view's cap
    assert result.exit_code == 0, result.output
    assert "0..1024" in result.stdout and "1025..4096" not in result.stdout
    assert "1 of 2 rows not shown (showing the first 1)" in result.stdout
    result = runner.invoke(app, ["table", "show", str(path), "-f", "csv"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [(r["tokens_min"], r["tokens_max"]) for r in rows] == [("0", "1024"), ("1025", "4096")]
    assert all(r["kind"] == "predicted" and r["file"] == str(path) for r in rows)
    result = runner.invoke(app, ["table", "show", str(path), "-f", "yaml"])
    assert result.exit_code == 0, result.output
    assert MoeTable.from_dict(yaml.safe_load(result.stdout)).to_dict() == table.to_dict()
    result = runner.invoke(app, ["table", "show", str(path), "--json"])
    assert result.exit_code == 0, result.output
    (shown,) = json.loads(result.stdout)["tables"]
    assert shown["path"] == str(path) and shown["fingerprint"]["device_key"] == H200_KEY
    assert [r.pop("kind") for r in shown["rows"]] == ["predicted", "predicted"]
    assert shown["rows"] == table.to_dict()["rows"]
    bases = [r.provenance["basis"] for r in table.rows]
    assert shown["bases"] == [{"basis": b, "rows": bases.count(b)} for b in dict.fromkeys(bases)]
    result = runner.invoke(app, ["table", "validate", str(path), "--json"])
    assert result.exit_code == 0 and result.stderr == "", result.output
    assert json.loads(result.stdout)["files"] == [
        {"path": str(path), "ok": True, "rows": 2, "problems": [], "note": None}
    ]


def test_validate_reports_moe_rows_the_runtime_cannot_run(runner: CliRunner, tmp_path: Path) -> None:
    h200 = dataclasses.replace(load_moe_table(searched_table(runner, tmp_path)).fingerprint)
    bad = write(
        tmp_path / "bad" / H200_KEY / "moe-w2-bfloat16.yaml",
        [
            row(0, 512, dtype="bfloat16"),
            row(513, 4096, dtype="bfloat16", engine="triton", tile=TILE, sms_free=H200_SMS),
        ],
        h200,
        dtype="bfloat16",
    )
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(bad)]))
    assert line.startswith(f"error: {bad}: row H 4096, I 1536, E_local 32, k 8, tokens [513, 4096]: sms_free")
    # the copy engine on a machine without peer access between the GPUs (a CPU's gloo)
    blocked = write(tmp_path / "blocked.yaml", [row(0, 512, engine="copy_engine", chunks=2)])
    good = searched_table(runner, tmp_path)
    result = runner.invoke(app, ["table", "validate", str(good), str(blocked), str(bad)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 2, lines
    assert (
        lines[0].startswith(f"error: {blocked}: row ") and "engine: copy_engine needs peer access" in lines[0]
    )
    assert f"OK {good}" in result.stdout and "2 problem(s) in 2 of 3 file(s)" in result.stdout
    assert f"note: {blocked}: lookup reads this table only as" in result.stdout
    # the same row passes where the SM count leaves a grid
    assert runner.invoke(app, ["table", "validate", str(bad), "--sm-count", "256"]).exit_code == 0


def test_validate_reports_a_row_of_more_slots_than_experts(runner: CliRunner, tmp_path: Path) -> None:
    """A row whose k exceeds its E = world x E_local experts (a shape the search and lookup
    refuse: a token picks k distinct experts) is a problem, whatever its engine."""
    problem = MoeProblem(hidden=64, intermediate=32, experts=2, top_k=5, tokens_min=0, tokens_max=64)
    odd = MoeRow(schedule=MoeSchedule(dtype="float32", world_size=2, problem=problem))
    path = write(tmp_path / "k.yaml", [row(0, 512), odd])
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert "row H 64, I 32, E_local 2, k 5, tokens [0, 64]: top_k: k = 5 is above the 4 experts" in line
    assert runner.invoke(app, ["table", "validate", str(write(path, [row(0, 512)]))]).exit_code == 0
    # a NaN in a row's provenance (the dense tables refuse it as they load): validated to pass
    write(path, [row(0, 512, provenance={"predicted_ms": float("nan")})])
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert "tokens [0, 512]: provenance.predicted_ms: not a finite number" in line, line


def test_validate_reports_overlapping_buckets_as_one_line(runner: CliRunner, tmp_path: Path) -> None:
    path = write(
        moe_table_path(tmp_path / "tables", cpu_fp().device_key, 2, "float32"), [row(0, 512), row(513, 900)]
    )
    path.write_text(path.read_text().replace('"tokens_min": 513', '"tokens_min": 500'))
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert (
        str(path) in line and "tokens [0, 512]" in line and "tokens [500, 900]" in line and "overlap" in line
    )
    assert "rows[0] and rows[1]" in line  # by their index in the file
    # the same bucket twice (a row line copied below the rows) is named as such, by both indices
    first = next(text for text in path.read_text().splitlines() if '"tokens_min": 0' in text)
    path.write_text(path.read_text().replace('"tokens_min": 500', '"tokens_min": 513') + first + "\n")
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert "rows[0] and rows[2] are both for" in line and "tokens [0, 512]" in line, line
    # a dense table under the MoE table's name is read as what its kind says, its name the problem
    dense = ScheduleTable(
        fingerprint=cpu_fp(), collective="all_reduce", world_size=2, dtype="float32", rows=[]
    )
    save_table(dense, path)
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(path)]))
    assert "a dense schedule table (kind 'fo-tune-schedule-table') under the MoE table's name" in line, line
    assert line.endswith(
        "lookup reads it for the calls its name says and refuses it; rename it to all_reduce-w2-float32.yaml"
    ), line


def test_a_table_under_the_other_kinds_name_says_the_name_to_give_it(
    runner: CliRunner, tmp_path: Path
) -> None:
    """An MoE table copied to a dense table's name, and a dense one to the MoE table's: every
    command that reads it names the file and the name it belongs under: lookup and a search into
    it exit 2 (the file is the user's to fix), list exits 1 (its help: "1 when some file is not"
    good) after listing the rest; the dense read said "collective: missing", the MoE read the
    kinds, neither what to do."""
    key = cpu_fp().device_key
    folder = tmp_path / "tables" / key
    moe = write(folder / "all_reduce-w2-float32.yaml", [row(0, 64)])
    for args, code in (
        (["table", "lookup", "-s", "64x96x48", "-d", "float32", "-k", key], EXIT_BAD_INPUT),
        (["table", "list"], EXIT_FAILED),
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == code, (args, result.output)
        line = next(line for line in result.stderr.splitlines() if str(moe) in line)
        assert "an MoE table" in line and "rename it to moe-w2-float32.yaml" in line, line
    result = runner.invoke(app, ["table", "validate", str(moe)])  # its rows checked, its name the problem
    line = assert_one_line_error(result)
    assert "an MoE table (kind 'fo-tune-moe-schedule-table') under a dense table's name" in line, line
    assert line.endswith("refuses it; rename it to moe-w2-float32.yaml"), line
    assert "move or rename the files named" in result.stdout and "fix the rows" not in result.stdout
    moe.unlink()
    dense = folder / "moe-w2-float32.yaml"
    save_table(
        ScheduleTable(fingerprint=cpu_fp(), collective="all_reduce", world_size=2, dtype="float32"), dense
    )
    args = ["table", "lookup", "--experts", ",".join(map(str, EXPERTS)), "--tokens", "64", "-d", "float32"]
    line = assert_one_line_error(runner.invoke(app, [*args, "-k", key]))
    assert str(dense) in line and "rename it to all_reduce-w2-float32.yaml" in line, line
    # a search into it says so before it plans (one line, no progress first)
    target = tmp_path / "tables" / H200_KEY / "moe-w2-bfloat16.yaml"
    target.parent.mkdir(parents=True)
    dense.rename(target)
    search = ["search", "-c", "moe", "--experts", ",".join(map(str, EXPERTS)), "--tokens", "64"]
    # the search and validate say where it belongs: the name, and the folder of its own device key
    home = f"move it to {folder / 'all_reduce-w2-float32.yaml'}"
    line = assert_one_line_error(runner.invoke(app, [*search, "--table-dir", str(tmp_path / "tables")]))
    assert str(target) in line and line.endswith(home), line
    line = assert_one_line_error(runner.invoke(app, ["table", "validate", str(target)]))
    assert "under the MoE table's name; its fingerprint is device key " in line, line
    assert line.endswith(home), line


# ------------------------------------------------------------------------------------ lookup
def test_lookup_takes_the_row_the_runtime_takes(runner: CliRunner, tmp_path: Path) -> None:
    """A predicted row in $FO_TUNE_TABLE_DIR (the first folder) and a measured one in the user folder
    both cover 300 tokens: the runtime takes the measured one, and so does lookup."""
    fp = cpu_fp()
    env = write(
        moe_table_path(tmp_path / "tables", fp.device_key, 2, "float32"),
        [row(0, 512, provenance={"mode": "predict"}), row(513, 4096, engine="triton", tile=TILE)],
    )
    user = write(
        moe_table_path(tmp_path / "xdg" / "fo-tune" / "tables", fp.device_key, 2, "float32"),
        [row(256, 1024, engine="triton", tile=TILE, sms_free=2, provenance={"measured_ms": 1.5})],
    )
    args = ["table", "lookup", "--experts", ",".join(map(str, EXPERTS)), "-d", "float32", "-k", fp.device_key]
    cache = MoeTableCache()
    for tokens, source in ((300, user), (2000, env), (100, env)):
        result = runner.invoke(app, [*args, "--tokens", str(tokens), "--json"])
        assert result.exit_code == 0, result.output
        answer = json.loads(result.stdout)
        runtime = cache.lookup(EXPERTS, tokens, dtype="float32", world_size=2, device="cpu")
        assert runtime is not None
        assert answer["source"] == str(source)
        data = {k: v for k, v in answer["row"].items() if k != "provenance"}
        assert MoeSchedule.from_dict({**data, "dtype": "float32", "world_size": 2}) == runtime
    assert answer["kind"] == "predicted"
    result = runner.invoke(app, [*args, "--tokens", "5000"])
    assert result.exit_code == 0, result.output
    answer = yaml.safe_load(result.stdout)
    assert cache.lookup(EXPERTS, 5000, dtype="float32", world_size=2, device="cpu") is None
    assert answer["source"].startswith("no table row") and answer["row"]["engine"] is None
    assert answer["searched"] == [str(env), str(user)] and answer["row"]["problem"]["tokens"] == 5000
    # a CPU-tuned MoE table copied into the H200's folder: refused as the runtime refuses it, naming
    # both device keys and where the table belongs (lookup printed its row as if it were the H200's)
    copied = write(moe_table_path(tmp_path / "tables", H200_KEY, 2, "float32"), [row(0, 4096)])
    line = assert_one_line_error(runner.invoke(app, [*args[:-1], H200_KEY, "--tokens", "300"]))
    assert f"table {copied} sits in the folder of device key {H200_KEY}" in line, line
    assert f"its fingerprint is device key {fp.device_key}" in line and f"-k {fp.device_key}" in line


def test_lookup_miss_suggests_a_key_of_the_world_size_first(runner: CliRunner, tmp_path: Path) -> None:
    """On a machine without the tables' GPU, a w8 lookup's hint names the w8 key first (the w2
    key sorts before it), so the example it gives runs with the same -w."""
    searched_table(runner, tmp_path)  # the w2 key's table
    args = ["search", "-c", "moe", "--experts", ",".join(map(str, EXPERTS)), "--tokens", "1024", "-w", "8"]
    assert runner.invoke(app, [*args, "--table-dir", str(tmp_path / "tables")]).exit_code == 0
    key8 = H200_KEY.replace("-w2-", "-w8-")
    lookup = ["table", "lookup", "--experts", ",".join(map(str, EXPERTS)), "--tokens", "100", "-w", "8"]
    miss = json.loads(runner.invoke(app, [*lookup, "--json"]).stdout)
    assert miss["other_device_keys"] == [key8, H200_KEY] and miss["hint"].endswith(f"e.g. -k {key8}"), miss
    hit = json.loads(runner.invoke(app, [*lookup, "-k", key8, "--json"]).stdout)
    assert hit["kind"] == "predicted" and hit["row"]["problem"]["tokens_max"] == 1024, hit


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--experts", "4096,1536,32,8"], "--tokens T"),
        (["--tokens", "5"], "--experts H,I,E_LOCAL,K"),
        (["--experts", "4096,1536,32", "--tokens", "5"], "expected H,I,E_local,k"),
        (["--experts", "4096,1536,32,8", "--tokens", "5", "-s", "64x64x64"], "--shape is a dense call's"),
        (["--experts", "4096,1536,32,8", "--tokens", "5", "-c", "all_reduce"], "not -c all_reduce"),
        # a dense call with a stray MoE option: the option is named, not the dense call's --shape
        (["--tokens", "5", "-c", "all_reduce", "-s", "64x64x64"], "--tokens looks an MoE call up (-c moe)"),
        (["--experts", "4096,1536,32,8", "--tokens", "-1"], "--tokens must be >= 0"),
        # a list (what search -c moe takes) was typer's raw "Input should be a valid integer"
        (["--experts", "4096,1536,32,8", "--tokens", "4,5"], "--tokens '4,5': expected one integer >= 0"),
        # a call whose rows T x k pass int32 cannot run (it answered the no-overlap path, exit 0)
        (["--experts", "4096,1536,32,8", "--tokens", "99999999999"], "is above 2147483647"),
        # k distinct experts of E = world x E_local: a k above E was looked up (a call no router makes)
        (["--experts", "4096,1536,4,9", "--tokens", "5"], "k = 9 is above the 8 experts at the default"),
        (
            ["--experts", "4096,1536,1,3", "--tokens", "5", "-w", "2"],
            "k = 3 is above the 2 experts at --world-size 2",
        ),
        (
            ["--experts", "4096,1536,1,3", "--tokens", "5", "-k", "gpu-cc90-132sm-w2-nvlink18"],
            "at -k's world size 2",
        ),
        (["--experts", "4096,1536,32,0", "--tokens", "5"], "four integers >= 1"),
        (["--experts", "4096,1536,0,2", "--tokens", "5"], "four integers >= 1"),
        (["--experts", "0,1536,32,2", "--tokens", "5"], "four integers >= 1"),
        (["--experts", "4096,-1536,32,2", "--tokens", "5"], "four integers >= 1"),
        (
            ["--experts", "4096,1536,32,2", "--tokens", "5", "--dtype", "float8_e4m3fn"],
            "-c moe --dtype float8_e4m3fn: the MoE FFN runs bfloat16, float16, float32",
        ),
    ],
)
def test_moe_lookup_bad_input_is_one_line(runner: CliRunner, args: list[str], needle: str) -> None:
    line = assert_one_line_error(runner.invoke(app, ["table", "lookup", *args]))
    assert needle in line, line


# ------------------------------------------------------------------------------------ diff, list
def test_diff_two_moe_tables(runner: CliRunner, tmp_path: Path) -> None:
    a = write(
        tmp_path / "a.yaml",
        [
            row(0, 512, engine="copy_engine", chunks=2, provenance={"measured_ms": 1.0}),
            row(513, 4096),
            row(4097, 8192, engine="triton", tile=TILE),
        ],
    )
    b = write(
        tmp_path / "b.yaml",
        [
            row(0, 512, engine="copy_engine", chunks=4, provenance={"measured_ms": 0.8}),
            row(513, 2048),
            row(4097, 8192, engine="triton", tile=TILE, provenance={"predicted_ms": 2.0}),
        ],
        dataclasses.replace(cpu_fp(), torch="0.0.1"),
    )
    result = runner.invoke(app, ["table", "diff", str(a), str(b)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "header fingerprint.torch" in out and "-> 0.0.1" in out
    line = next(line for line in out.splitlines() if "tokens [0, 512]" in line)
    assert "changed" in line and "chunks 2 -> 4" in line and "0.8" in line
    assert "only in A" in out and "only in B" in out and "tokens [4097, 8192]" not in out
    assert "1 changed, 1 only in A, 1 only in B, 1 same" in out
    assert "tokens [4097, 8192]" in runner.invoke(app, ["table", "diff", str(a), str(b), "--same"]).stdout
    assert runner.invoke(app, ["table", "diff", str(a), str(b), "--exit-code"]).exit_code == 1
    same = runner.invoke(app, ["table", "diff", str(a), str(a), "--exit-code"])
    assert same.exit_code == 0 and "no differences in 3 row(s)" in same.stdout
    c = write(tmp_path / "c.yaml", [row(0, 512, engine="triton", tile=TILE)])
    result = runner.invoke(app, ["table", "diff", str(a), str(c)])
    line = next(line for line in result.stdout.splitlines() if "tokens [0, 512]" in line)
    assert "engine copy_engine -> triton" in line and "chunks" not in line


def test_diff_refuses_an_moe_and_a_dense_table(runner: CliRunner, tmp_path: Path) -> None:
    moe = write(tmp_path / "moe-w2-float32.yaml", [row(0, 512)])
    problem = Problem(m=64, n=96, k=48)
    dense = tmp_path / "all_reduce-w2-float32.yaml"
    schedule = Schedule(collective="all_reduce", dtype="float32", world_size=2, problem=problem)
    save_table(
        ScheduleTable(
            fingerprint=cpu_fp(), collective="all_reduce", world_size=2, dtype="float32", rows=[schedule]
        ),
        dense,
    )
    for args in ([str(moe), str(dense)], [str(dense), str(moe)]):
        line = assert_one_line_error(runner.invoke(app, ["table", "diff", *args]))
        assert f"{moe} is an MoE table and {dense} a dense one" in line, line


def test_list_and_help_name_the_moe_table(runner: CliRunner, tmp_path: Path) -> None:
    path = searched_table(runner, tmp_path)
    result = runner.invoke(app, ["table", "list"])
    assert result.exit_code == 0, result.output
    assert "moe" in result.stdout and "--experts H,I,E_LOCAL,K --tokens T" in result.stdout
    listed = json.loads(runner.invoke(app, ["table", "list", "--json"]).stdout)["tables"]
    assert [(t["collective"], t["path"]) for t in listed] == [("moe", str(path))]
    for command, words in {
        (): ("moe-w<world>-<dtype>.yaml",),
        ("validate",): ("sms_free", "peer access"),
        ("lookup",): ("--experts", "--tokens", "no-overlap path"),
        ("pull",): ("records no study",),
    }.items():
        result = runner.invoke(app, ["table", *command, "--help"])
        assert result.exit_code == 0, result.output
        text = " ".join(result.output.split())
        for word in words:
            assert word in text, (command, word)


def test_search_moe_merges_around_a_hand_written_bucket_that_starts_at_one_token(
    runner: CliRunner, tmp_path: Path
) -> None:
    """A hand-written row (a measured one, to the merge) for tokens [1, 512]: the search's
    predicted row for [0, 1024] goes in over [513, 1024], the token 0 it would keep alone is no
    bucket (a bucket holds up to at least 1 token), and an exact row's new bucket [1, 4096] over
    a row of [0, 1024] leaves that row nothing (both merges raised "problem.tokens_max: must be
    >= 1, got 0", the search's rows lost)."""
    h200 = searched_table(runner, tmp_path).parent
    path = moe_table_path(tmp_path / "tables", H200_KEY, 2, "bfloat16")
    fp = load_moe_table(path).fingerprint
    write(path, [row(1, 512, dtype="bfloat16", provenance={"source": "by hand"})], fp, dtype="bfloat16")
    args = ["search", "-c", "moe", "--experts", ",".join(map(str, EXPERTS)), "--tokens", "1024"]
    result = runner.invoke(app, [*args, "--table-dir", str(h200.parent)])
    assert result.exit_code == 0, result.output
    table = load_moe_table(path)
    spans = [(r.schedule.problem.tokens_min, r.schedule.problem.tokens_max, r.kind) for r in table.rows]
    assert spans == [(1, 512, "measured"), (513, 1024, "predicted")], spans
    wide = MoeTable(fingerprint=fp, world_size=2, dtype="bfloat16", rows=[row(0, 1024, dtype="bfloat16")])
    wide.upsert(row(1, 4096, dtype="bfloat16"))
    assert [(r.schedule.problem.tokens_min, r.schedule.problem.tokens_max) for r in wide.rows] == [(1, 4096)]


def test_search_moe_refuses_a_storage(runner: CliRunner) -> None:
    """An MoE search records no study, so `table pull` has no MoE rows to write: --storage is refused."""
    args = ["search", "-c", "moe", "--experts", "4096,1536,32,8", "--storage", "sqlite:///nowhere.db"]
    line = assert_one_line_error(runner.invoke(app, args))
    assert "--storage" in line and "records no study" in line


# ------------------------------------------------------------------------------- fleet scale
def _wide_table(count: int) -> MoeTable:
    """``count`` rows over 16 experts' shapes (hidden 1024, 1088, ...), 16 tokens each, every third
    one measured."""
    per = count // 16
    rows = []
    for i in range(count):
        lo = (i % per) * 16
        problem = MoeProblem(**{**SHAPE, "hidden": 1024 + 64 * (i // per)}, tokens_min=lo, tokens_max=lo + 15)
        schedule = MoeSchedule(dtype="float32", world_size=2, problem=problem)
        rows.append(MoeRow(schedule=schedule, provenance={"mode": "predict"} if i % 3 else {}))
    return MoeTable(fingerprint=cpu_fp(), world_size=2, dtype="float32", rows=rows)


def test_moe_lookups_bisect_and_build_only_the_rows_they_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40's bars for the MoE table too: the runtime's first lookup reads every row's problem
    but builds only the row it takes, and a lookup bisects (log n problems read, not n)."""
    from fo_kernels.moe import table as moe_table

    table = _wide_table(4096)
    save_moe_table(table, moe_table_path(tmp_path / "tables", cpu_fp().device_key, 2, "float32"))
    built = []
    from_dict = MoeSchedule.from_dict.__func__
    monkeypatch.setattr(
        MoeSchedule, "from_dict", classmethod(lambda cls, d: built.append(1) or from_dict(cls, d))
    )
    keys_read = []
    experts_key = moe_table.experts_key
    monkeypatch.setattr(moe_table, "experts_key", lambda p: keys_read.append(1) or experts_key(p))
    cache = MoeTableCache()
    last = (1024 + 64 * 15, *EXPERTS[1:])
    found = cache.lookup(last, 255 * 16 + 3, dtype="float32", world_size=2, device="cpu")
    assert found is not None and found.problem.tokens_min == 255 * 16, found
    assert cache.lookup(last, 10**6, dtype="float32", world_size=2, device="cpu") is None
    assert len(built) <= 2, f"{len(built)} rows built for two lookups"
    keys_read.clear()
    assert table.find_row(last, 255 * 16 + 3) is table.rows[-1]
    assert table.find_row((1, 1, 1, 1), 3) is None and table.find_row(last, 10**6) is None
    assert len(keys_read) <= 3 * 16, f"{len(keys_read)} problems read for three finds in 4096 rows"


def test_the_runtime_refuses_overlapping_moe_rows_naming_both(tmp_path: Path) -> None:
    """The runtime's view of a file (rows built on first use) refuses what loading refuses: two rows
    over one token, named by their index in the file; and a malformed row it takes, by its index."""
    fp = cpu_fp()
    path = write(moe_table_path(tmp_path / "tables", fp.device_key, 2, "float32"), [row(0, 15), row(16, 31)])
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines, lines[-2].replace('"tokens_max": 15', '"tokens_max": 16')]) + "\n")
    cache = MoeTableCache()
    with pytest.raises(TableError, match=r"rows\[0\] and rows\[2\] overlap"):
        cache.lookup(EXPERTS, 3, dtype="float32", world_size=2, device="cpu")
    path.write_text(
        "\n".join([*lines[:-1], lines[-1].replace('"engine": null', '"engine": "nonsense"')]) + "\n"
    )
    assert cache.lookup(EXPERTS, 3, dtype="float32", world_size=2, device="cpu") is not None
    with pytest.raises(TableError, match=r"rows\[1\]: engine: 'nonsense'"):
        cache.lookup(EXPERTS, 20, dtype="float32", world_size=2, device="cpu")


def test_merging_many_moe_rows_reads_each_row_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A search's rows merged into a large MoE table are grouped once (an upsert per row read every
    row of the table each time: 9 s for 64 rows into 100,000), with the result an upsert per row gives."""
    from fo_kernels.moe import table as moe_table
    from fo_tune.tables.merge import merge_moe_into

    table = _wide_table(1024)  # 64 rows of 16 tokens per experts' shape
    new = []
    for i in range(100):  # each over parts of three rows of one shape
        problem = MoeProblem(
            **{**SHAPE, "hidden": 1024 + 64 * (i % 16)}, tokens_min=8 * i, tokens_max=8 * i + 40
        )
        schedule = MoeSchedule(dtype="float32", world_size=2, problem=problem)
        new.append(MoeRow(schedule=schedule, provenance={"mode": "predict"}))
    expected = _wide_table(1024)
    for one in new:
        expected.upsert(one, measured_first=True)
    reads = []
    experts_key = moe_table.experts_key
    monkeypatch.setattr(moe_table, "experts_key", lambda p: reads.append(1) or experts_key(p))
    merged = merge_moe_into(table, new)
    assert merged.rows == expected.rows
    assert merged.rows != _wide_table(1024).rows
    assert len(reads) <= 10 * (1024 + 100), f"{len(reads)} experts' shapes read"


def test_moe_rows_and_tables_refuse_what_is_not_a_schedule_or_a_row() -> None:
    """A row of no MoeSchedule (None, its dict) and a table given schedules for rows raise
    TableError naming what they got, when made (not an AttributeError at the first use)."""
    problem = MoeProblem(hidden=8, intermediate=4, experts=2, top_k=2, tokens_max=16)
    schedule = MoeSchedule(dtype="float32", world_size=2, problem=problem)
    for bad, got in ((None, "NoneType"), (schedule.to_dict(), "dict")):
        with pytest.raises(TableError, match=rf"^schedule: expected a fo_kernels.MoeSchedule, got {got}"):
            MoeRow(schedule=bad)
    fp = current_fingerprint("cpu", 2)
    with pytest.raises(
        TableError, match=r"^rows\[0\]: expected a fo_kernels.MoeRow\(schedule=\.\.\.\), got Moe"
    ):
        MoeTable(fingerprint=fp, world_size=2, dtype="float32", rows=[schedule])
    assert MoeTable(fingerprint=fp, world_size=2, dtype="float32", rows=[MoeRow(schedule=schedule)]).rows


def test_a_moe_table_removed_as_the_runtime_reads_it_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table removed between the runtime's look at the file and its read (a merge replacing it, a
    user deleting it) is no table for that call, as in the dense lookup, where the MoE call raised
    TableNotFoundError inside the user's step; written again, a later call reads it."""
    from fo_kernels.moe import table as moe_table

    path = write(moe_table_path(tmp_path / "tables", cpu_fp().device_key, 2, "float32"), [row(0, 4096)])
    text = path.read_text()
    read = moe_table.read_table_text

    def removed_as_read(p: Path) -> str:
        p.unlink()
        return read(p)

    monkeypatch.setattr(moe_table, "read_table_text", removed_as_read)
    cache = MoeTableCache()
    assert cache.lookup(EXPERTS, 300, dtype="float32", world_size=2, device="cpu") is None
    monkeypatch.setattr(moe_table, "read_table_text", read)
    path.write_text(text)
    assert cache.lookup(EXPERTS, 301, dtype="float32", world_size=2, device="cpu") is not None
