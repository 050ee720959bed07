"""A fleet of search workers sharing one study storage: each records its decided rows there, and
`fo-tune table pull` writes the tables from every study (tests/pg_server.py starts a real
PostgreSQL server; SQLite is the one-machine case); a storage that cannot be opened is refused
before any work."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli import app
from cli_checks import H200_KEY, assert_one_line_error, isolate_tables, run_reports
from fo_kernels.table import load_table
from pg_server import postgres_server, server_blocker
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
# The workers of the fleet tests: (collective, what to search), each in its own process.
WORKERS = (
    ("all_reduce", ["--shape", "4096x8192x4096"]),
    ("reduce_scatter", ["--shape", "8192x8192x8192"]),
    ("all_reduce", ["--shape", "1x8192x4096", "--m-range", "512:2048"]),
)
# Seconds a worker may take (an offline search of one shape is ~3 s of CPU, mostly imports).
WORKER_TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_tables(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def pg_url() -> str:
    """A PostgreSQL server for this module (skipped, with the reason, where none can start)."""
    why = server_blocker()
    if why is not None:
        pytest.skip(why)
    with postgres_server() as url:
        yield url


def run_fleet(tmp_path: Path, storage: str) -> list[Path]:
    """Start the ``WORKERS`` at once against ``storage``, each with its own table folder and
    working folder; wait for all; returns their table folders."""
    procs, tables = [], []
    for i, (collective, args) in enumerate(WORKERS):
        work = tmp_path / f"worker{i}"
        work.mkdir()
        tables.append(work / "tables")
        cmd = [sys.executable, str(ROOT / "cli.py"), "search", "-c", collective, *args, "--storage", storage]
        env = {**os.environ, "FO_TUNE_TABLE_DIR": str(tables[-1]), "TRITON_INTERPRET": "1"}
        procs.append(
            subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outs = [p.communicate(timeout=WORKER_TIMEOUT_S)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return tables


def check_pulled(tables: list[Path], pulled: Path) -> None:
    """Every row each worker wrote into its own table is in the pulled table, unchanged."""
    seen = 0
    for folder in tables:
        for path in folder.glob("*/*.yaml"):
            mine = load_table(path)
            theirs = load_table(pulled / path.relative_to(folder))
            assert theirs.fingerprint.device_key == H200_KEY
            for row in mine.rows:
                assert row in theirs.rows, row.problem.describe()
                seen += 1
    ranges = [
        row
        for row in load_table(pulled / H200_KEY / "all_reduce-w2-bfloat16.yaml").rows
        if row.problem.is_range
    ]
    assert ranges and ranges[0].problem.m_min == 512 and ranges[-1].problem.m_max == 2048
    assert seen >= 4  # two exact rows and the M ranges


def pull(storage: str, table_dir: Path, *extra: str) -> CliRunner:
    return CliRunner().invoke(
        app, ["table", "pull", "--storage", storage, "--table-dir", str(table_dir), *extra]
    )


def test_three_workers_on_postgres_are_gathered_by_pull(tmp_path: Path, pg_url: str) -> None:
    tables = run_fleet(tmp_path, pg_url)
    result = pull(pg_url, tmp_path / "pulled")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("table ") == 2  # all_reduce (exact + M ranges), reduce_scatter
    check_pulled(tables, tmp_path / "pulled")
    # pulling again changes nothing; --json says what was written
    again = pull(pg_url, tmp_path / "pulled", "--json")
    data = json.loads(again.stdout)
    assert again.exit_code == 0 and {t["collective"] for t in data["tables"]} == {
        "all_reduce",
        "reduce_scatter",
    }
    assert "@127.0.0.1" in data["storage"]


def test_three_workers_on_sqlite_are_gathered_by_pull(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'fleet.db'}"
    tables = run_fleet(tmp_path, storage)
    result = pull(storage, tmp_path / "pulled")
    assert result.exit_code == 0, result.output
    check_pulled(tables, tmp_path / "pulled")
    # each worker's report is a folder of its own run, under the data folder (not the working one)
    for i in range(len(WORKERS)):
        assert not (tmp_path / f"worker{i}" / "results").exists()


def test_pull_keeps_measured_rows_over_predicted_ones(tmp_path: Path) -> None:
    """The merge rules hold for pulled rows: a measured row in the table stays."""
    storage = f"sqlite:///{tmp_path / 's.db'}"
    out = tmp_path / "o"
    r = CliRunner().invoke(
        app, ["search", "--shape", "4096x8192x4096", "--storage", storage, "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    packaged = ROOT / "results" / "tables" / H200_KEY / "all_reduce-w2-bfloat16.yaml"
    target = tmp_path / "t" / H200_KEY / "all_reduce-w2-bfloat16.yaml"
    target.parent.mkdir(parents=True)
    target.write_bytes(packaged.read_bytes())
    before = load_table(target)
    measured = before.find(4096, 8192, 4096)
    assert measured is not None and measured.provenance["mode"] != "predict"
    result = pull(storage, tmp_path / "t")
    assert result.exit_code == 0, result.output
    # the exact row and the M range [2897,5792] both hold M=4096: both keep it
    assert "kept 2 measured row(s)" in result.stdout
    assert load_table(target).find(4096, 8192, 4096) == measured
    assert load_table(target).rows == before.rows


def test_pull_from_an_empty_or_missing_storage(tmp_path: Path) -> None:
    line = assert_one_line_error(pull(f"sqlite:///{tmp_path / 'none.db'}", tmp_path / "t"))
    assert "does not exist" in line and not (tmp_path / "none.db").exists()
    journal = tmp_path / "j.log"
    journal.write_text("")
    result = pull(f"journal:{journal}", tmp_path / "t")
    assert result.exit_code == 0 and "nothing written" in result.stdout
    missing = assert_one_line_error(CliRunner().invoke(app, ["table", "pull"]))
    assert "--storage URL: missing; pass the study storage" in missing and "sqlite:///" in missing
    # a SQLite file Optuna never opened (it creates its tables on every open) is left as it is
    empty, foreign, junk = tmp_path / "empty.db", tmp_path / "other.db", tmp_path / "junk.db"
    empty.write_bytes(b"")
    with contextlib.closing(sqlite3.connect(foreign)) as db:
        db.execute("CREATE TABLE notes (text)")
        db.commit()
    junk.write_text("not a database\n" * 100)
    before = {p: p.read_bytes() for p in (empty, foreign, junk)}
    for file, says in (
        (empty, "is an empty file"),
        (foreign, "without Optuna's tables"),
        (junk, "not a SQLite"),
    ):
        line = assert_one_line_error(pull(f"sqlite:///{file}", tmp_path / "t"))
        assert says in line and "give the storage the workers used" in line, line
    assert {p: p.read_bytes() for p in before} == before and not (tmp_path / "t").exists()


@pytest.mark.skipif(not Path("/proc/version").is_file(), reason="needs /proc (Linux)")
def test_pull_from_a_journal_file_that_cannot_be_opened_is_one_line(tmp_path: Path) -> None:
    """/proc/version exists but takes no append, even from root: a StorageError, exit 2 and one line."""
    line = assert_one_line_error(pull("journal:/proc/version", tmp_path / "t"))
    assert "--storage journal:/proc/version: cannot open it" in line, line


# ---------------------------------------------------------------------------------- bad storages
@pytest.mark.parametrize(
    ("storage", "needle"),
    [
        ("sqlite:///{tmp}/no/such/folder/s.db", "does not exist"),
        ("journal:{tmp}/no/such/folder/s.log", "does not exist"),
        ("postgresql://nobody@127.0.0.1:{port}/x", "cannot open it"),
        # SQLAlchemy's default MySQL driver (mysqlclient) is no dependency of fo-tune's
        ("mysql://nobody@127.0.0.1:{port}/x", "no driver for mysql is installed (No module named 'MySQLdb')"),
        # no file: SQLite's in-memory database (the study would not outlive the process), a folder
        ("sqlite://", "names no file"),
        ("sqlite:///:memory:", "names no file"),
        ("journal:", "names no file"),
        ("journal:{tmp}", "is a folder"),
        ("sqlite:///{tmp}", "is a folder"),
        # a file that is not Optuna's journal (not JSON, and JSON records of no study)
        ("journal:{tmp}/notes.log", "not an Optuna journal file"),
        ("journal:{tmp}/records.log", "not an Optuna journal file"),
        ("sqlite:///{tmp}/notes.log", "file is not a database"),
    ],
)
def test_a_storage_that_cannot_be_opened_is_exit_2_before_any_work(
    tmp_path: Path, storage: str, needle: str
) -> None:
    port = free_port()  # a port nothing listens on
    (tmp_path / "notes.log").write_text("not a journal\n")
    (tmp_path / "records.log").write_text('{"op_code": 0, "worker_id": "w"}\n')
    url = storage.format(tmp=tmp_path, port=port)
    for mode in ([], ["--trials", "5"]):  # the enumerated predict search and the TPE one
        start = time.monotonic()
        result = CliRunner().invoke(app, ["search", "--shape", "4096x8192x4096", *mode, "--storage", url])
        line = assert_one_line_error(result)
        assert needle in line and "--storage" in line, line
        assert time.monotonic() - start < WORKER_TIMEOUT_S
    if "{port}" not in storage:  # the same refusal from pull, which reads the storage
        line = assert_one_line_error(pull(url, tmp_path / "pulled"))
        assert needle in line and "--storage" in line, line
    assert not (tmp_path / "no").exists()
    assert not list((tmp_path / "xdg").glob("fo-tune/search/*/*/*"))  # no report


def test_a_missing_postgres_driver_is_exit_2_naming_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("psycopg", "psycopg2") else real(name, *a),
    )
    line = assert_one_line_error(
        CliRunner().invoke(
            app, ["search", "--shape", "4096x8192x4096", "--storage", "postgresql://u:secret@db/x"]
        )
    )
    assert "postgres extra: pip install 'psycopg[binary]'" in line and "secret" not in line


def test_a_postgres_driver_that_does_not_import_is_one_line_naming_why_and_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """psycopg installed but not importable (no libpq: "no pq wrapper available"): the line gives
    the import's reason and the extra to install (it said "no driver for postgresql is installed
    (Failed to import DB access module ...); install it, or use postgresql://...")."""
    import importlib.machinery
    import importlib.util

    real = importlib.util.find_spec
    spec = importlib.machinery.ModuleSpec("psycopg", None)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            {"psycopg2": None, "psycopg": spec}[name] if name in ("psycopg", "psycopg2") else real(name, *a)
        ),
    )
    monkeypatch.setitem(sys.modules, "psycopg", None)  # its import fails
    url = "postgresql://u:secret@127.0.0.1:1/x"
    for cmd in (["search", "--shape", "4096x8192x4096"], ["table", "pull"]):
        line = assert_one_line_error(CliRunner().invoke(app, [*cmd, "--storage", url]))
        assert "the PostgreSQL driver does not import (import of psycopg halted" in line, line
        assert (
            line.endswith("install fo-tune's postgres extra: pip install 'psycopg[binary]'")
            and "secret" not in line
        ), line


# ---------------------------------------------------------------------------------- reports, JSON
def test_each_run_has_its_own_report_and_json_summary(tmp_path: Path) -> None:
    runner = CliRunner()
    results = [runner.invoke(app, ["search", "--shape", "4096x8192x4096", "--json"]) for _ in range(2)]
    assert all(r.exit_code == 0 for r in results), [r.output for r in results]
    reports = []
    for r in results:
        data = json.loads(r.stdout)  # stdout is the JSON and nothing else
        (run,) = data["runs"]
        assert run["shapes"][0]["shape"] == "4096x8192x4096" and run["request"]["mode"] == "predict"
        reports.append(Path(run["report"]))
    name = tmp_path / "xdg" / "fo-tune" / "search" / H200_KEY / "all_reduce-w2-bfloat16-predict"
    assert run_reports(name) == sorted(reports)  # two runs, two folders, none replaced
    assert all((p / "summary.yaml").is_file() for p in reports)
    summary = yaml.safe_load((reports[0] / "summary.yaml").read_text())
    assert summary["request"]["storage"].endswith("fo-tune/studies/fo-tune.db")
    help_text = runner.invoke(app, ["search", "--help"], terminal_width=200).stdout
    assert "~/.local/share/fo-tune/search/" in " ".join(help_text.split())


def test_lookup_json_list_and_version(tmp_path: Path) -> None:
    runner = CliRunner()
    miss = json.loads(runner.invoke(app, ["table", "lookup", "-s", "4096x8192x4096", "--json"]).stdout)
    assert miss["row"]["overlap"] is False and H200_KEY in miss["other_device_keys"]
    assert f"-k {H200_KEY}" in miss["hint"]
    hit = json.loads(
        runner.invoke(app, ["table", "lookup", "-s", "4096x8192x4096", "-k", H200_KEY, "--json"]).stdout
    )
    assert hit["kind"] == "measured" and hit["row"]["engine"] == "copy_engine"
    # a device key given with -k that has no table (a typo) names the keys that have one
    typo = runner.invoke(app, ["table", "lookup", "-s", "4096x8192x4096", "-k", H200_KEY + "x", "--json"])
    typo_answer = json.loads(typo.stdout)
    assert typo.exit_code == 0 and H200_KEY in typo_answer["other_device_keys"], typo.stdout
    assert f"the device key {H200_KEY}x; tables exist for {H200_KEY}" in typo_answer["hint"], typo_answer
    listed = json.loads(runner.invoke(app, ["table", "list", "--json"]).stdout)["tables"]
    assert {(t["device_key"], t["collective"]) for t in listed} >= {
        (H200_KEY, "all_reduce"),
        (H200_KEY, "reduce_scatter"),
    }
    assert all(t["rows"] > 0 for t in listed)
    shown = runner.invoke(app, ["table", "list"])
    assert shown.exit_code == 0 and H200_KEY in shown.stdout and "-k DEVICE_KEY" in shown.stdout
    # -k with a key that has no table (a typo) says so and names the keys that have one
    typo = runner.invoke(app, ["table", "list", "-k", H200_KEY + "x"])
    said = " ".join(typo.stdout.split())
    assert typo.exit_code == 0 and f"no table for device key {H200_KEY}x" in said, typo.stdout
    assert f"tables exist for {H200_KEY}" in said, typo.stdout
    version = runner.invoke(app, ["--version"])
    assert version.exit_code == 0 and version.stdout.startswith("fo-tune ")


def test_lookup_takes_the_world_size_of_the_device_key(tmp_path: Path) -> None:
    """The README's TP=8 plan, then its lookup (and table show) with -k the TP=8 key and no
    --world-size: the world size is the key's (lookup answered overlap: false from no file at all,
    looking for w2 rows under a w8 key); a --world-size the key contradicts is exit 2, one line; a
    -k key without a table names the keys that have one."""
    runner = CliRunner()
    plan = ["search", "--mode", "predict", "-w", "8", "-s", "8192x8192x3584", "-c", "reduce_scatter"]
    assert runner.invoke(app, plan).exit_code == 0
    key8 = H200_KEY.replace("-w2-", "-w8-")
    call = ["table", "lookup", "-s", "8192x8192x3584", "-c", "reduce_scatter", "--json"]
    hit = json.loads(runner.invoke(app, [*call, "-k", key8]).stdout)
    assert hit["kind"] == "predicted" and hit["source"].endswith("reduce_scatter-w8-bfloat16.yaml"), hit
    line = assert_one_line_error(runner.invoke(app, [*call, "-k", key8, "-w", "2"]))
    assert "is for world size 8; pass -w 8" in line, line
    miss = json.loads(runner.invoke(app, [*call, "-k", "no-such-key"]).stdout)
    assert miss["row"]["overlap"] is False and key8 in miss["other_device_keys"]
    assert "no table for the device key no-such-key" in miss["hint"]
    # this machine's key at world size 8 has no table: the example key is the w8 one, not the w2 one
    here = json.loads(runner.invoke(app, [*call, "-w", "8"]).stdout)
    assert here["hint"].endswith(f"e.g. -k {key8}") and H200_KEY in here["other_device_keys"], here
    other = json.loads(runner.invoke(app, [*call, "-k", key8, "-d", "float16"]).stdout)
    # the key has tables, of another dtype: they are named, and no other key is suggested
    assert "it holds reduce_scatter-w8-bfloat16.yaml" in other["hint"] and "other_device_keys" not in other
    shown = runner.invoke(app, ["table", "show", "-c", "reduce_scatter", "-k", key8])
    assert shown.exit_code == 0 and "reduce_scatter-w8-bfloat16.yaml" in shown.stdout, shown.output
    line = assert_one_line_error(runner.invoke(app, ["table", "show", "-k", key8, "-w", "4"]))
    assert "is for world size 8" in line, line


def test_pull_and_moe_search_refuse_a_table_dir_they_cannot_write(tmp_path: Path) -> None:
    """A --table-dir that is a file: `table pull` and `search -c moe` are exit 2 with one line naming
    the path (not an internal error, NotADirectoryError, exit 1), and pull writes none of its
    tables."""
    runner = CliRunner()
    db = f"sqlite:///{tmp_path / 'fleet.db'}"
    plan = ["search", "--mode", "predict", "-s", "4096x8192x4096", "--storage", db]
    assert runner.invoke(app, plan).exit_code == 0
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = assert_one_line_error(
        runner.invoke(app, ["table", "pull", "--storage", db, "--table-dir", str(blocker)])
    )
    assert f"{blocker} is a file, not a folder" in line, line
    moe = ["search", "-c", "moe", "--experts", "4096,1536,16,8", "--tokens", "512"]
    line = assert_one_line_error(runner.invoke(app, [*moe, "--table-dir", str(blocker / "t")]))
    assert f"{blocker} is a file, not a folder" in line, line
    # a folder where the table file goes: the message names the table file, not an --out
    taken = tmp_path / "taken"
    (taken / H200_KEY / "all_reduce-w2-bfloat16.yaml").mkdir(parents=True)
    line = assert_one_line_error(runner.invoke(app, [*plan, "--table-dir", str(taken)]))
    assert line.startswith("error: table file ") and "is a folder" in line, line
    line = assert_one_line_error(
        runner.invoke(app, ["table", "pull", "--storage", db, "--table-dir", str(taken)])
    )
    assert line.startswith("error: table file ") and "is a folder" in line, line


def test_pull_refuses_a_malformed_table_before_it_writes_any(tmp_path: Path) -> None:
    """A table under --table-dir with a duplicate row: `table pull` is one line naming it and
    writes none of the storage's tables (not even those merged before that one)."""
    runner = CliRunner()
    db = f"sqlite:///{tmp_path / 'fleet.db'}"
    plan = ["search", "--mode", "predict", "-s", "4096x8192x4096", "--storage", db, "--table-dir"]
    assert runner.invoke(app, [*plan, str(tmp_path / "w"), "-c", "all_reduce,reduce_scatter"]).exit_code == 0
    root = tmp_path / "t"
    bad = root / H200_KEY / "reduce_scatter-w2-bfloat16.yaml"
    bad.parent.mkdir(parents=True)
    text = (tmp_path / "w" / H200_KEY / bad.name).read_text()
    bad.write_text(text + text[text.index("\n- ") + 1 :])  # its one row twice
    line = assert_one_line_error(pull(db, root))
    assert str(bad) in line and "rows[0] and rows[1]" in line, line
    assert sorted(p.name for p in (root / H200_KEY).glob("*.yaml")) == [bad.name]


@pytest.mark.parametrize("damage", ["row of another table", "fingerprint of another world size"])
def test_pull_refuses_a_record_of_mixed_tables_before_it_writes_any(tmp_path: Path, damage: str) -> None:
    """A record whose rows are not one table's (a row stating another collective, or a fingerprint
    of another world size than its rows'): `table pull` is one line naming the study and writes
    none of the storage's tables (not even those of records read before it)."""
    import dataclasses

    import optuna

    from fo_kernels.fingerprint import make_device_key

    url = f"sqlite:///{tmp_path / 's.db'}"
    record_packaged(url, "all_reduce")
    table = load_table(ROOT / "results" / "tables" / H200_KEY / "reduce_scatter-w2-bfloat16.yaml")
    fp = table.fingerprint
    header = ("dtype", "world_size")
    rows = [{k: v for k, v in r.to_dict().items() if k not in header} for r in table.rows[:2]]
    if damage == "row of another table":
        rows[1]["collective"] = "all_gather"
    else:
        key = make_device_key(fp.gpu_name, fp.compute_capability, fp.sm_count, 4, fp.interconnect)
        fp = dataclasses.replace(fp, world_size=4, device_key=key)
    record = {
        "kind": "fo-tune-table-rows",
        "schema_version": 1,
        "fingerprint": fp.to_dict(),
        "collective": "reduce_scatter",
        "world_size": 2,
        "dtype": "bfloat16",
        "rows": rows,
        "trials": 1,
        "recorded": "2999-01-01T00:00:00+00:00",  # (read after the good record)
        "host": "h",
    }
    optuna.create_study(study_name="mixed", storage=url).set_user_attr("fo_tune_table_rows:x", record)
    line = assert_one_line_error(pull(url, tmp_path / "t"))
    assert "study 'mixed'" in line, line
    assert not (tmp_path / "t").exists() or not list((tmp_path / "t").rglob("*.yaml"))


def test_a_worker_that_finishes_last_records_the_best_of_every_workers_trials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two predicted TPE workers on one study, the second finishing while the first runs: the
    first records last, and its row is the best of both workers' trials (it recorded the best of
    its own run's only, worse than the row the study's trials hold)."""
    import optuna

    storage = f"sqlite:///{tmp_path / 'fleet.db'}"
    runner = CliRunner()
    search = ["search", "-s", "4096x8192x4096", "--storage", storage, "--trials"]
    real = optuna.study.Study.optimize
    second: list[object] = []

    def optimize_then_let_another_worker_finish(study: optuna.study.Study, *a: object, **kw: object) -> None:
        real(study, *a, **kw)
        if not second:  # the first worker's trials ran (in memory); the second worker runs all of its
            second.append(None)
            other = runner.invoke(app, [*search, "30", "--table-dir", str(tmp_path / "second")])
            second[0] = other

    monkeypatch.setattr(optuna.study.Study, "optimize", optimize_then_let_another_worker_finish)
    first = runner.invoke(app, [*search, "1", "--table-dir", str(tmp_path / "first")])
    assert first.exit_code == 0 and second[0].exit_code == 0, (first.output, second[0].output)
    monkeypatch.undo()
    name = f"{H200_KEY}/all_reduce-w2-bfloat16.yaml"
    best = load_table(tmp_path / "second" / name).rows[0]
    assert pull(storage, tmp_path / "pulled").exit_code == 0
    (pulled,) = load_table(tmp_path / "pulled" / name).rows
    assert best.overlap and pulled.provenance.get("predicted_ms") == best.provenance["predicted_ms"], pulled
    assert (pulled.engine, pulled.settings) == (best.engine, best.settings)
    assert load_table(tmp_path / "first" / name).rows[0].settings == best.settings


@pytest.mark.parametrize(
    ("kind", "method"), [("sqlite", "set_study_user_attr"), ("journal", "set_trial_state_values")]
)
def test_a_storage_that_fails_during_the_search_is_one_line_saying_how_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, method: str
) -> None:
    """The storage stops answering mid-search (its server stopped): Optuna's StorageInternalError,
    chained from the driver's error as a dropped PostgreSQL connection raises it, is exit 2 and one
    line naming the driver's reason (not "internal error: UnboundLocalError ... please report it",
    Optuna's own error inside a trial, nor "internal error: StorageInternalError" as a row is
    recorded); the progress shown before it stays on stderr."""
    import optuna
    import sqlalchemy.exc

    storages = {"sqlite": optuna.storages.RDBStorage, "journal": optuna.storages.JournalStorage}

    def gone(*_a: object, **_kw: object) -> None:
        try:
            raise sqlalchemy.exc.OperationalError("INSERT", {}, Exception("server closed the connection"))
        except sqlalchemy.exc.OperationalError as exc:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from exc

    monkeypatch.setattr(storages[kind], method, gone)
    url = f"sqlite:///{tmp_path / 's.db'}" if kind == "sqlite" else f"journal:{tmp_path / 's.log'}"
    result = CliRunner().invoke(app, ["search", "-s", "4096x8192x4096", "--trials", "3", "--storage", url])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert "the storage failed during the search (" in line and "server closed the connection" in line, line
    assert line.endswith("run the same command to resume"), line


# ------------------------------------------------------------------- records of workers on one study
def test_pull_keeps_per_study_the_record_decided_from_most_trials(tmp_path: Path) -> None:
    """Workers sharing one study each record what they decided: the one that decided from 30 trials
    records first, one that read the study before those trials were stored (5) records later. Pull
    keeps the rows from 30 trials (the later record replaced the study's only record); among records
    from equally many trials the latest wins; a record under the single key ``ROWS_ATTR`` (no trial
    count, as one key per study held it) is read, as decided from none."""
    import dataclasses
    import datetime as dt

    import optuna

    from fo_kernels.schedule import Problem
    from fo_tune.search.storage import close_storage, open_storage
    from fo_tune.tables.stored import ROWS_ATTR, record_rows

    packaged = load_table(ROOT / "results" / "tables" / H200_KEY / "all_reduce-w2-bfloat16.yaml")
    row = next(r for r in packaged.rows if not r.problem.is_range)
    fp = packaged.fingerprint

    def decided(m: int, mark: str) -> list:
        problem = Problem(m=m, n=row.problem.n, k=row.problem.k)
        return [dataclasses.replace(row, problem=problem, provenance={**row.provenance, "decided": mark})]

    def single_key(m: int, mark: str) -> dict:
        header = ("collective", "dtype", "world_size")
        return {
            "kind": "fo-tune-table-rows",
            "schema_version": 1,
            "fingerprint": fp.to_dict(),
            "collective": row.collective,
            "world_size": row.world_size,
            "dtype": row.dtype,
            "rows": [{k: v for k, v in r.to_dict().items() if k not in header} for r in decided(m, mark)],
            "recorded": dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds"),
            "host": "h",
        }

    url = f"sqlite:///{tmp_path / 's.db'}"
    storage = open_storage(url, create_folder=True)
    shared = "all_reduce-w2-bfloat16-shared"
    record_rows(storage, shared, fp, decided(1000, "from 30"), trials=30)
    record_rows(storage, shared, fp, decided(1000, "from 5, later"), trials=5)
    optuna.load_study(study_name=shared, storage=storage).set_user_attr(ROWS_ATTR, single_key(1000, "none"))
    optuna.create_study(study_name="single", storage=storage).set_user_attr(
        ROWS_ATTR, single_key(2000, "one")
    )
    close_storage(storage)

    def pulled() -> dict[int | None, str]:
        result = pull(url, tmp_path / "t")
        assert result.exit_code == 0 and "2 row(s) from 2 studies" in result.stdout, result.output
        table = load_table(tmp_path / "t" / H200_KEY / "all_reduce-w2-bfloat16.yaml")
        return {r.problem.m: r.provenance["decided"] for r in table.rows}

    assert pulled() == {1000: "from 30", 2000: "one"}
    storage = open_storage(url)  # a record from as many trials, later: it replaces the row
    record_rows(storage, shared, fp, decided(1000, "from 30, later"), trials=30)
    close_storage(storage)
    assert pulled() == {1000: "from 30, later", 2000: "one"}
    # a record's NaN (an interquartile range of one sample) is left out of the row pulled, as the
    # search leaves it out of the rows it writes: the table refuses one (pull was exit 2)
    storage = open_storage(url)
    unmeasured = {**row.provenance, "decided": "nan", "iqr_ms": float("nan")}
    record_rows(
        storage, shared, fp, [dataclasses.replace(decided(1000, "nan")[0], provenance=unmeasured)], trials=40
    )
    close_storage(storage)
    assert pulled() == {1000: "nan", 2000: "one"}
    table = load_table(tmp_path / "t" / H200_KEY / "all_reduce-w2-bfloat16.yaml")
    assert "iqr_ms" not in table.find(1000, row.problem.n, row.problem.k).provenance


def test_a_worker_that_decided_from_fewer_trials_but_records_later_leaves_the_better_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two predicted TPE workers on one study: the first decides from its one trial, then, before it
    records, the second runs 30 trials (the first's included) and records. The first records last;
    pull takes the second's row (not the first's, as it would if a record replaced the study's only
    one)."""
    import fo_tune.tables.stored as stored

    storage = f"sqlite:///{tmp_path / 'fleet.db'}"
    runner = CliRunner()
    search = ["search", "-s", "4096x8192x4096", "--storage", storage, "--trials"]
    real = stored.record_rows
    second: list = []

    def let_another_worker_finish_first(*args: object, **kwargs: object) -> object:
        if not second:  # the first worker decided; the second runs all of its trials and records
            second.append(None)
            second[0] = runner.invoke(app, [*search, "30", "--table-dir", str(tmp_path / "second")])
        return real(*args, **kwargs)

    monkeypatch.setattr(stored, "record_rows", let_another_worker_finish_first)
    first = runner.invoke(app, [*search, "1", "--table-dir", str(tmp_path / "first")])
    assert first.exit_code == 0 and second[0].exit_code == 0, (first.output, second[0].output)
    monkeypatch.undo()
    name = f"{H200_KEY}/all_reduce-w2-bfloat16.yaml"
    (mine,), (best,) = (load_table(tmp_path / who / name).rows for who in ("first", "second"))
    assert not mine.overlap and best.overlap, (mine, best)  # one trial found no gain, 30 found one
    assert pull(storage, tmp_path / "pulled").exit_code == 0
    (pulled,) = load_table(tmp_path / "pulled" / name).rows
    assert (pulled.engine, pulled.settings, pulled.provenance) == (
        best.engine,
        best.settings,
        best.provenance,
    )


# ------------------------------------------------------------------------------ pull's refusals
def record_packaged(url: str, *collectives: str) -> None:
    """A storage at ``url`` whose studies record the first exact row of each packaged table named
    (``collectives``), one study each, in that order: the records a fleet's workers leave."""
    from fo_tune.search.storage import close_storage, open_storage
    from fo_tune.tables.stored import record_rows

    storage = open_storage(url, create_folder=True)
    for collective in collectives:
        table = load_table(ROOT / "results" / "tables" / H200_KEY / f"{collective}-w2-bfloat16.yaml")
        row = next(r for r in table.rows if not r.problem.is_range)
        record_rows(storage, f"{collective}-study", table.fingerprint, [row], trials=1)
    close_storage(storage)


@pytest.mark.parametrize("kind", ["sqlite-raw", "sqlite-optuna", "journal"])
def test_a_storage_that_fails_during_the_pull_is_one_line_and_writes_no_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The storage opens, then fails as pull reads its studies (its server stopped, the connection
    dropped, the journal file's disk went away): exit 2, one line saying to pull again, and no table
    file written or changed (not "internal error: OperationalError ..." nor "... StorageInternalError",
    exit 1)."""
    import optuna
    import sqlalchemy.exc

    url = f"journal:{tmp_path / 's.log'}" if kind == "journal" else f"sqlite:///{tmp_path / 's.db'}"
    record_packaged(url, "all_reduce", "reduce_scatter")
    existing = tmp_path / "t" / H200_KEY / "all_reduce-w2-bfloat16.yaml"
    existing.parent.mkdir(parents=True)
    existing.write_bytes((ROOT / "results" / "tables" / H200_KEY / existing.name).read_bytes())
    before = existing.read_bytes()

    def gone(*_a: object) -> None:
        if kind == "journal":
            raise OSError(5, "Input/output error")
        closed = sqlalchemy.exc.OperationalError("SELECT", {}, Exception("server closed the connection"))
        if kind == "sqlite-raw":
            raise closed
        try:
            raise closed
        except sqlalchemy.exc.OperationalError as exc:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from exc

    storages = {"journal": optuna.storages.JournalStorage}
    monkeypatch.setattr(storages.get(kind, optuna.storages.RDBStorage), "get_all_studies", gone)
    line = assert_one_line_error(pull(url, tmp_path / "t"))
    assert "the storage failed during the pull (" in line, line
    assert "server closed the connection" in line or "Input/output error" in line, line
    assert line.endswith("no table was written: once it answers again, run the pull again"), line
    assert sorted(p.name for p in (tmp_path / "t" / H200_KEY).iterdir()) == [existing.name]
    assert existing.read_bytes() == before


def test_a_storage_server_that_never_answers_is_one_line_before_pull_writes_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PostgreSQL URL whose port takes the connection and never answers (a server hung, a
    firewall that drops packets): exit 2, one line, after the connect timeout (libpq's shortest, 2 s)."""
    import socket

    import fo_tune.search.storage as storage

    monkeypatch.setattr(storage, "CONNECT_TIMEOUT_S", 1)
    with socket.socket() as s:  # listens, never accepts: the handshake completes, no answer comes
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        start = time.monotonic()
        line = assert_one_line_error(pull(f"postgresql://u@127.0.0.1:{s.getsockname()[1]}/x", tmp_path / "t"))
    assert "cannot open it" in line and time.monotonic() - start < 30, line
    assert not (tmp_path / "t").exists()


def test_pull_refuses_its_table_dir_or_a_table_of_others_rows_before_it_reads_or_writes(
    tmp_path: Path,
) -> None:
    """A --table-dir that is a file is exit 2 before the storage is read, even one whose studies
    record nothing (not "nothing written", exit 0); a table file holding another table's rows
    stops the pull before any table is written (not even those merged before that one)."""
    import optuna

    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    optuna.create_study(study_name="no-record", storage=empty)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = assert_one_line_error(pull(empty, blocker))
    assert f"{blocker} is a file, not a folder" in line, line
    said = pull(empty, tmp_path / "t")
    assert said.exit_code == 0 and "holds 1 study, none records table rows yet" in said.stdout, said.output
    url = f"sqlite:///{tmp_path / 's.db'}"
    record_packaged(url, "all_reduce", "reduce_scatter")  # all_reduce's table is merged first
    wrong = tmp_path / "t" / H200_KEY / "reduce_scatter-w2-bfloat16.yaml"
    wrong.parent.mkdir(parents=True)
    wrong.write_bytes((ROOT / "results" / "tables" / H200_KEY / "all_reduce-w2-bfloat16.yaml").read_bytes())
    line = assert_one_line_error(pull(url, tmp_path / "t"))
    assert str(wrong) in line and "holds all_reduce world size 2 bfloat16 rows" in line, line
    assert [p.name for p in wrong.parent.glob("*.yaml")] == [wrong.name]
