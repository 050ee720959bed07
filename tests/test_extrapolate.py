"""Offline plans for world sizes nothing here measured: the packaged TP=2 calibration extrapolated
(``fo_tune.calibrate.extrapolate``), the predict search's rows and report carrying its basis,
``fo-tune model check`` on such rows, and measuring searches refused where the GPUs are missing."""

from __future__ import annotations

import csv
import dataclasses
import io
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli import app
from cli_checks import (
    H200_KEY,
    assert_one_line_error,
    isolate_tables,
    run_report,
    tp2_only,
    with_all_gather_standin,
)
from fo_kernels.table import load_table
from fo_tune.calibrate.calibration import HostPoint, bus_factor, load_calibration, save_calibration
from fo_tune.calibrate.extrapolate import (
    NVLINK4_LINK_GBS,
    RING_HOP_LATENCY_MS,
    ExtrapolationError,
    extrapolate,
    ring_steps,
)

ROOT = Path(__file__).resolve().parents[1]
BASIS = f"extrapolated from world size 2 ({H200_KEY}) and NVLink facts"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate_tables(monkeypatch, tmp_path / "env")
    monkeypatch.chdir(tmp_path)  # default studies / reports land under tmp_path


def search(*args: str):
    return CliRunner().invoke(app, ["search", *args])


# ------------------------------------------------------------------------------ the extrapolation
@pytest.mark.parametrize("world", [4, 8])
def test_bus_bandwidth_carries_over_and_times_grow(h200, world):
    """At N the curves keep TP=2's asymptotic bus bandwidth (NVSwitch: every hop at the full link),
    so every point takes longer by the bus factor's growth and the ring's extra steps; the device
    key is the board's at N, and what one GPU measures is carried unchanged."""
    ext = extrapolate(h200, world)
    assert ext.world_size == ext.fingerprint.world_size == world
    assert ext.fingerprint.device_key == H200_KEY.replace("-w2-", f"-w{world}-")
    # (the packaged calibration's copy-engine terms at N peers come from a sibling GPU, which the
    # basis names)
    sibling = "copy-engine host and chunk-GEMM terms at N peers measured on nvidia-h100-80gb-hbm3"
    assert ext.basis.startswith(f"{BASIS}; all_gather from reduce_scatter's curve; {sibling}")
    assert {fit.collective for fit in h200.fits} == {"all_reduce", "reduce_scatter"}  # fits to carry
    for fit in h200.fits:
        new = ext.fit_for(fit.collective, fit.nccl_max_ctas)
        bus = new.bandwidth_gbs * bus_factor(fit.collective, world)
        assert bus == pytest.approx(fit.bandwidth_gbs * bus_factor(fit.collective, 2), rel=1e-6)
        assert bus <= 18 * NVLINK4_LINK_GBS
        extra = (ring_steps(fit.collective, world) - ring_steps(fit.collective, 2)) * RING_HOP_LATENCY_MS
        assert new.latency_ms == pytest.approx(fit.latency_ms + extra, abs=1e-6)
    before = {(p.collective, p.nccl_max_ctas, p.size_bytes): p.time_ms for p in h200.bandwidth}
    after = {(p.collective, p.nccl_max_ctas, p.size_bytes): p.time_ms for p in ext.bandwidth}
    assert before and all(after[key] > t for key, t in before.items())

    def curve(name: str) -> list:
        return sorted(
            (p.nccl_max_ctas, p.size_bytes, p.time_ms) for p in ext.bandwidth if p.collective == name
        )

    assert curve("all_gather") == curve("reduce_scatter") != []
    assert ext.gemm == h200.gemm and ext.interference == h200.interference
    assert ext.copy_engine is h200.copy_engine and ext.triton is h200.triton
    assert extrapolate(h200, 8).bandwidth[-1].time_ms > extrapolate(h200, 4).bandwidth[-1].time_ms


def test_what_cannot_be_extrapolated_says_what_it_needs(h200):
    with pytest.raises(ExtrapolationError, match="at most 8 GPUs"):
        extrapolate(h200, 16)
    with pytest.raises(ExtrapolationError, match="world size 2 to 2: "):
        extrapolate(h200, 2)
    with pytest.raises(ExtrapolationError, match="itself extrapolated"):
        extrapolate(extrapolate(h200, 4), 8)
    pcie = dataclasses.replace(h200, fingerprint=dataclasses.replace(h200.fingerprint, interconnect="pcie"))
    with pytest.raises(ExtrapolationError, match="NVLink 4 GPUs on NVSwitch"):
        extrapolate(pcie, 4)


def test_the_basis_names_a_sibling_that_measured_the_copy_engine_at_n_peers(h200):
    """Copy-engine points merged from another GPU model of the same die (``measured_on``): the
    extrapolated basis says so, naming its device key; a calibration without them has no clause."""
    sibling = "nvidia-h100-80gb-hbm3-cc90-132sm-w1-single"
    h200 = tp2_only(h200)
    section = h200.copy_engine
    host = HostPoint(
        world=8, collective="all_reduce", chunks=2, ops=50.0, eager_ms=2.0, graph_ms=0.05, measured_on=sibling
    )
    merged = dataclasses.replace(h200, copy_engine=dataclasses.replace(section, host=[*section.host, host]))
    clause = f"; copy-engine host and chunk-GEMM terms at N peers measured on {sibling}"
    assert extrapolate(merged, 8).basis.endswith(clause)
    assert extrapolate(merged, 8).basis.startswith(BASIS)
    assert "measured on" not in extrapolate(h200, 8).basis
    gemm = dataclasses.replace(section.library_gemm[0], measured_on=sibling)
    only_gemm = dataclasses.replace(h200, copy_engine=dataclasses.replace(section, library_gemm=[gemm]))
    assert extrapolate(only_gemm, 4).basis.endswith(clause)


# ------------------------------------------------------------------------------ the predict search
# The TP=8 plan: a predicted reduce_scatter row at world size 8 from the packaged TP=2
# calibration (the tests add their --out and any other option).
TP8_PLAN = ("--mode", "predict", "--world-size", "8", "--shape", "8192x8192x3584", "-c", "reduce_scatter")


def test_tp8_plan_on_the_cpu_states_its_basis(tmp_path):
    """The issue's command: a TP=8 plan from the packaged TP=2 calibration, exit 0, its row, report
    and summary saying what it rests on."""
    out = tmp_path / "w8"
    r = search(*TP8_PLAN, "--out", str(out))
    assert r.exit_code == 0, r.output
    assert f"basis: {BASIS}" in " ".join(r.stdout.split())
    key = H200_KEY.replace("-w2-", "-w8-")
    table = load_table(out / "tables" / key / "reduce_scatter-w8-bfloat16.yaml")
    assert table.world_size == 8 and [row.basis.startswith(BASIS) for row in table.rows] == [True]
    assert table.rows[0].provenance["mode"] == "predict"
    report = run_report(out / "report" / "reduce_scatter-w8-bfloat16-predict")
    summary = yaml.safe_load((report / "summary.yaml").read_text())
    assert summary["request"]["basis"].startswith(BASIS)
    assert summary["shapes"][0]["row"]["basis"].startswith(BASIS)
    # `table show` says it too: once after the rows, and in the CSV's basis column
    path = out / "tables" / key / "reduce_scatter-w8-bfloat16.yaml"
    shown = CliRunner().invoke(app, ["table", "show", str(path)])
    assert shown.exit_code == 0, shown.output
    assert f"basis (1 row(s)): {BASIS}" in " ".join(shown.stdout.split())
    text = CliRunner().invoke(app, ["table", "show", str(path), "-f", "csv"]).stdout
    (row,) = csv.DictReader(io.StringIO(text))
    assert row["basis"] == table.rows[0].basis


def test_tp4_plans_every_collective_with_both_engines(tmp_path):
    out = tmp_path / "w4"
    r = search(
        "--mode",
        "predict",
        "--world-size",
        "4",
        "--shape",
        "4096x8192x3584",
        "-c",
        "all_reduce,reduce_scatter,all_gather",
        "--out",
        str(out),
        "--json",
    )
    assert r.exit_code == 0, r.output
    import json

    runs = json.loads(r.stdout)["runs"]
    assert [run["request"]["collective"] for run in runs] == ["all_reduce", "reduce_scatter", "all_gather"]
    derived = "all_gather from reduce_scatter's curve"
    for run in runs:
        (shape,) = run["shapes"]
        collective = run["request"]["collective"]
        assert shape["engines"] == ["triton", "copy_engine"], collective
        assert shape["row"]["basis"].startswith(BASIS) and shape["baseline"]["source"] == "predicted"
        # the all_gather curve taken from reduce_scatter's is what the all_gather plan alone rests on
        for basis in (shape["row"]["basis"], run["request"]["basis"]):
            assert (derived in basis) == (collective == "all_gather"), (collective, basis)


def test_a_given_tp2_calibration_is_extrapolated_too(tmp_path, h200):
    cal = tmp_path / "cal.yaml"
    save_calibration(h200, cal)
    r = search(
        "--mode",
        "predict",
        "--world-size",
        "4",
        "--calibration",
        str(cal),
        "--shape",
        "4096x8192x3584",
        "--engine",
        "triton",
        "--out",
        str(tmp_path / "o"),
        "--json",
    )
    assert r.exit_code == 0, r.output
    assert '"basis": "extrapolated from world size 2' in r.stdout


def _commands(line: str) -> list[list[str]]:
    """The commands an error line gives between backticks, as argv lists."""
    return [shlex.split(c) for c in re.findall(r"`([^`]+)`", line)]


def _parse(argv: list[str]) -> None:
    """``argv`` (``fo-tune CMD ...``) through typer's parser, nothing run: a bad option raises."""
    import typer.main

    assert argv[0] == "fo-tune", argv
    command = typer.main.get_command(app).commands[argv[1]]
    command.make_context(argv[1], argv[2:])


def _gemm_profile_standin(cal, dtype: str):
    """What measuring ``dtype``'s GEMM profile on an H200 adds (a stand-in: the bfloat16 one)."""
    return dataclasses.replace(cal, gemm_dtypes={**cal.gemm_dtypes, dtype: cal.gemm})


@pytest.mark.parametrize(
    "world, args, added",
    [
        (8, ["--dtype", "float16", "-c", "reduce_scatter", "--shape", "8192x8192x3584"], "profile"),
        (2, ["--dtype", "float32", "-c", "reduce_scatter", "--shape", "8192x8192x3584"], "profile"),
        (8, ["--dtype", "float16", "-c", "moe", "--experts", "4096,1408,8,2", "--tokens", "128"], "profile"),
        (2, ["-c", "all_gather", "--shape", "4096x8192x4096"], "curve"),
    ],
)
def test_a_missing_measurement_names_commands_that_work(tmp_path, world, args, added):
    """A plan the packaged calibration cannot price (no GEMM profile in the dtype, at world size 8
    from an extrapolation whose device key names no file; no all_gather curve at world size 2)
    gives commands that parse and work: copy the packaged TP=2 file, measure into the copy
    (refused on the CPU, as the message says: it needs that GPU model), search with the copy."""
    request = ["--mode", "predict", "--world-size", str(world), *args, "--out", str(tmp_path / "o")]
    line = assert_one_line_error(search(*request))
    copy, measure, again, *merged = _commands(line)
    assert copy[0] == "cp" and Path(copy[1]).is_file() and copy[2] == f"{H200_KEY}.yaml", line
    assert "A machine without such" in line and "cannot measure it" in line, line
    subprocess.run(copy, check=True)
    own = Path(copy[2])
    # a profile also comes from `fo-tune profile` CSVs measured elsewhere, merged without a GPU
    assert len(merged) == (added == "profile"), line
    for argv in (measure, ["fo-tune", "search", *request, *again], *merged):
        _parse(argv)
    for argv in merged:
        assert "--from-profiles" in argv and argv[-2:] == ["--into", str(own)], line
    assert measure[-2:] == ["--into", str(own)] and again == ["--calibration", str(own)], line
    refused = CliRunner().invoke(app, measure[1:])  # this machine is not an H200
    assert "gpu_name differs" in assert_one_line_error(refused)
    # what the measurement on H200s adds (a stand-in), then the search
    cal = load_calibration(own)
    save_calibration(
        _gemm_profile_standin(cal, args[1]) if added == "profile" else with_all_gather_standin(cal), own
    )
    r = search(*request, *again)
    assert r.exit_code == 0, r.output


def test_no_plan_beyond_one_nvswitch_board(tmp_path, h200):
    r = search("--mode", "predict", "--world-size", "16", "--shape", "8192x8192x3584")
    assert "no packaged calibration for world size 16" in assert_one_line_error(r)
    # world size 1 has nothing to plan (it named a calibration of one GPU to measure)
    r = search("--mode", "predict", "--world-size", "1", "--shape", "8192x8192x3584")
    assert "--world-size 1 has no collective to overlap" in assert_one_line_error(r)
    # the same answers with a TP=2 calibration given: a whole sentence saying what to run, and
    # no calibration of one GPU to measure
    cal = tmp_path / "cal.yaml"
    save_calibration(h200, cal)
    r = search(
        "--mode", "predict", "--world-size", "16", "--shape", "8192x8192x3584", "--calibration", str(cal)
    )
    line = assert_one_line_error(r)
    assert "cannot extrapolate a calibration of world size 2 to 16" in line, line
    assert "`fo-tune calibrate --world-size 16`" in line, line
    r = search(
        "--mode", "predict", "--world-size", "1", "--shape", "8192x8192x3584", "--calibration", str(cal)
    )
    assert "--world-size 1 has no collective to overlap" in assert_one_line_error(r)


# ------------------------------------------------------------------------------ measuring searches
def test_offline_plans_take_the_packaged_h200_beside_this_machines_calibration(tmp_path, monkeypatch, h200):
    """In a checkout installed in place the packaged calibrations' folder is results/calibration,
    where `fo-tune calibrate` writes this machine's: one there whose key sorts first (a CPU's) leaves
    the offline plans (TP=2 and extrapolated) and `fo-tune model check` on the packaged H200 x2 one."""
    root = tmp_path / "calibration"
    save_calibration(h200, root / H200_KEY / "tp2" / "calibration.yaml")
    for world in (2, 4):
        mine = root / "cpu-x86_64-cccpu-8sm-w2-gloo" / f"tp{world}"
        mine.mkdir(parents=True)
        (mine / "calibration.yaml").write_text("this machine's calibration, not a deployment's\n")
    monkeypatch.setattr("fo_tune.calibrate.find.packaged_root", lambda: root)
    for world in ("2", "4"):
        r = search("--mode", "predict", "-w", world, "--shape", "4096x8192x3584", "--out", str(tmp_path))
        assert r.exit_code == 0, r.output
        assert f"nvidia-h200-cc90-132sm-w{world}-nvlink18" in r.stdout
    r = CliRunner().invoke(app, ["model", "check"])
    assert r.exit_code == 0, r.output
    assert "MAPE" in r.stdout


@pytest.mark.parametrize("mode", ["measure", "hybrid"])
def test_measuring_without_the_gpus_is_refused(monkeypatch, mode):
    monkeypatch.setattr("fo_tune.ranks.backend.visible_gpus", lambda: 2)
    r = search("--mode", mode, "--world-size", "8", "--shape", "8192x8192x3584")
    line = assert_one_line_error(r)
    assert f"--mode {mode} at world size 8" in line and "8-GPU machine" in line and "--mode predict" in line


def test_without_a_mode_too_few_gpus_plan_offline(monkeypatch, tmp_path):
    monkeypatch.setattr("fo_tune.ranks.backend.visible_gpus", lambda: 1)
    r = search(
        "--world-size", "4", "--shape", "4096x8192x3584", "--engine", "triton", "--out", str(tmp_path / "o")
    )
    assert r.exit_code == 0, r.output
    assert "w4, predict" in " ".join(r.stdout.split()) and f"basis: {BASIS}" in " ".join(r.stdout.split())


def test_search_help_says_what_a_plan_at_3_to_8_rests_on():
    """The help names the extrapolation a predict search at 3-8 GPUs reads, and that all_gather
    then plans from reduce_scatter's curve (the packaged TP=2 calibration has no all_gather one)."""
    r = CliRunner().invoke(app, ["search", "--help"], env={"COLUMNS": "400"})
    text = " ".join(r.output.replace("│", " ").split())
    assert "at 3-8 the packaged TP=2 one extrapolated" in text and "stating that basis" in text
    assert "at 3-8 its extrapolation takes reduce_scatter's curve" in text


# ------------------------------------------------------------------------------ model check
def test_model_check_says_extrapolated_rows_have_no_measured_error(tmp_path):
    out = tmp_path / "w8"
    assert search(*TP8_PLAN, "--engine", "triton", "--out", str(out)).exit_code == 0
    (table,) = (out / "tables").glob("*/*.yaml")
    r = CliRunner().invoke(app, ["model", "check", str(table)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert f"1 predicted row(s) rest on: {BASIS}" in text and "no measured error yet" in text
    assert "MAPE" not in text
    shipped = ROOT / "results" / "tables" / H200_KEY / "reduce_scatter-w2-bfloat16.yaml"
    r = CliRunner().invoke(app, ["model", "check", str(table), str(shipped)])
    assert r.exit_code == 0, r.output
    assert "no measured error yet" in r.stdout and "MAPE" in r.stdout
    # the search's report: its predicted trials rest on the same basis; its summary is no table
    (report,) = (out / "report").glob("*/*")
    r = CliRunner().invoke(app, ["model", "check", str(report)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert f"report {report}: " in text and f"predicted trial(s) rest on: {BASIS}" in text, text
    assert "no measured error yet" in text and "MAPE" not in text
    line = assert_one_line_error(CliRunner().invoke(app, ["model", "check", str(report / "summary.yaml")]))
    assert f"is a search report's summary, not a table; pass its folder {report}" in line, line


def test_model_check_names_real_files_for_measured_rows_in_another_dtype(tmp_path, h200):
    """An fp8 TP=8 plan's rows: the commands that measure such rows write a calibration of the 8
    GPUs into a folder and add the fp8 GEMM profile to that file, which the search then reads."""
    fp8, key = "float8_e4m3fn", H200_KEY.replace("-w2-", "-w8-")
    row = {
        "problem": {"m": 8192, "n": 8192, "k": 3584},
        "engine": "copy_engine",
        "settings": {"mode": "ring", "weights": [2, 1]},
        "provenance": {"source": "fo-tune search", "mode": "predict", "predicted_ms": 0.5},
        "basis": BASIS,
    }
    fingerprint = {**h200.fingerprint.to_dict(), "device_key": key, "world_size": 8}
    table = tmp_path / f"reduce_scatter-w8-{fp8}.yaml"
    table.write_text(
        yaml.safe_dump(
            {
                "schema_version": 2,
                "kind": "fo-tune-schedule-table",
                "fingerprint": fingerprint,
                "collective": "reduce_scatter",
                "world_size": 8,
                "dtype": fp8,
                "rows": [row],
            }
        )
    )
    r = CliRunner().invoke(app, ["model", "check", str(table)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    into = "calibration-w8/calibration.yaml"
    assert (
        "measured rows come from `fo-tune calibrate --world-size 8 --out calibration-w8`, then "
        f"`fo-tune calibrate --world-size 1 --only gemm --dtype {fp8} --into {into}` and "
        f"`fo-tune search --world-size 8 --dtype {fp8} --calibration {into}` on 8 GPUs"
    ) in text, text
    assert "CALIBRATION.yaml" not in text
