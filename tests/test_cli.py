"""Tests of ``pipeloom schedule``: what it prints must be what the library computes.

Most tests call :func:`pipeloom.tools.cli.main` in-process (fast, and capsys
sees the output); a few run the real command as a subprocess to prove the
entry points and exit codes work outside pytest too.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeloom.schedules import (
    SCHEDULE_NAMES,
    Costs,
    ScheduleConfigError,
    dumps_csv,
    format_grid,
    generate,
    load_csv,
    loads_csv,
    lower,
    simulate,
)
from pipeloom.tools.cli import main

REPO = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["schedule", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _lists(actions: object) -> dict[int, list[str]]:
    return {r: [str(a) for a in acts] for r, acts in actions.items()}  # type: ignore[attr-defined]


# ---------------------------------------------------------------- show


def test_show_prints_header_and_grid(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "show", "ZBVZeroBubble", "--ranks", "4", "--microbatches", "8")
    assert code == 0, err
    header, grid = out.split("\n", 1)
    assert header.startswith("ZBVZeroBubble: 4 ranks, 8 stages (2 per rank, v placement), 8 microbatches")
    expected = generate("ZBVZeroBubble", num_ranks=4, num_microbatches=8)
    assert grid.rstrip("\n") == format_grid(expected)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_show_every_named_schedule(capsys: pytest.CaptureFixture[str], name: str) -> None:
    code, out, err = run(capsys, "show", name, "--ranks", "4", "--microbatches", "8")
    assert code == 0, err
    assert out.startswith(f"{name}: 4 ranks")
    assert "rank 3 |" in out


def test_show_lowered_and_fsdp(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "Interleaved1F1B", "-p", "2", "-m", "4", "--lowered")
    assert code == 0
    assert "SEND_F" in out and "RECV_B" in out and "lowered" in out.splitlines()[0]
    assert "UNSHARD" not in out
    code, out, _ = run(capsys, "show", "Interleaved1F1B", "-p", "2", "-m", "4", "--lowered", "--fsdp")
    assert code == 0
    assert "UNSHARD" in out and "RESHARD" in out


def test_show_max_steps(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "GPipe", "--ranks", "2", "--microbatches", "16", "--max-steps", "4")
    assert code == 0
    assert "(steps 0..3 of" in out


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("lowered", [False, True], ids=["compute", "lowered"])
def test_export_round_trips_through_load_csv(capsys: pytest.CaptureFixture[str], name: str, lowered: bool) -> None:
    args = ["export", name, "--ranks", "4", "--microbatches", "8"] + (["--lowered"] if lowered else [])
    code, out, err = run(capsys, *args)
    assert code == 0, err
    expected = generate(name, num_ranks=4, num_microbatches=8)
    if lowered:
        expected = lower(expected)
    loaded = loads_csv(out, num_ranks=4)
    assert _lists(loaded.actions) == _lists(expected.actions)
    assert loaded.stage_to_rank == tuple(expected.stage_to_rank)
    assert loaded.lowered is lowered
    assert out == dumps_csv(expected)


def test_export_to_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    code, out, err = run(capsys, "export", "DualPipeV", "--ranks", "2", "--microbatches", "4", "-o", str(path))
    assert code == 0
    assert out == ""
    assert str(path) in err
    expected = generate("DualPipeV", num_ranks=2, num_microbatches=4)
    assert _lists(load_csv(path).actions) == _lists(expected.actions)


def test_export_stages_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "export", "Interleaved1F1B", "-p", "2", "-m", "4", "-v", "3")
    assert code == 0
    assert loads_csv(out).num_stages == 6


# ---------------------------------------------------------------- check


def _write_lowered(tmp_path: Path, name: str = "1F1B", ranks: int = 2, microbatches: int = 4) -> tuple[Path, str]:
    text = dumps_csv(lower(generate(name, num_ranks=ranks, num_microbatches=microbatches)))
    path = tmp_path / f"{name}.csv"
    path.write_text(text)
    return path, text


def test_check_valid_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path, _ = _write_lowered(tmp_path)
    code, out, err = run(capsys, "check", str(path))
    assert code == 0, out + err
    assert out.startswith(f"valid: {path}: 2 ranks, 2 stages")
    code, out, _ = run(capsys, "check", str(path), "--ranks", "2")
    assert code == 0


def test_check_valid_compute_only_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "zbv.csv"
    path.write_text(dumps_csv(generate("ZBVZeroBubble", num_ranks=4, num_microbatches=8)))
    code, out, _ = run(capsys, "check", str(path))
    assert code == 0
    assert "compute-only" in out


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_exported_fsdp_schedules_check_valid(capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.csv"
    code, _, err = run(capsys, "export", name, "-p", "4", "-m", "8", "--lowered", "--fsdp", "-o", str(path))
    assert code == 0, err
    code, out, err = run(capsys, "check", str(path), "--ranks", "4")
    assert code == 0, out + err
    assert out.startswith(f"valid: {path}: 4 ranks")


@pytest.mark.parametrize("name", ["Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_csv_written_by_torch_checks_and_simulates_like_ours(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    path = tmp_path / "torch.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)  # what torch's _dump_csv does, bubbles as empty cells
        for row in vis.get_schedule_ops(name, 4, 8, 2, with_comms=True):
            writer.writerow(row)
    code, out, err = run(capsys, "check", str(path))
    assert code == 0, out + err
    code, out, err = run(capsys, "simulate", str(path), "--json")
    assert code == 0, err
    ours = simulate(lower(generate(name, num_ranks=4, num_microbatches=8)), Costs())
    assert json.loads(out)["makespan"] == pytest.approx(ours.makespan)


def test_check_broken_file_lists_problems(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path, text = _write_lowered(tmp_path)
    # Rank 1 never receives microbatch 2's activation: its 1F2 can never run.
    broken = text.replace("1RECV_F2,", "", 1)
    assert broken != text
    path.write_text(broken)
    code, out, err = run(capsys, "check", str(path))
    assert code == 1
    assert err == ""
    assert out.startswith(f"invalid: {path}:")
    problem_lines = [line for line in out.splitlines() if line.startswith("  rank ")]
    assert problem_lines
    assert any("2" in line for line in problem_lines)
    assert ">>" in out  # the grid points at the first problem


def test_check_compute_only_missing_backward(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "gpipe.csv"
    path.write_text("0F0,0F1,0B1\n1F0,1F1,1B1,1B0\n")
    code, out, _ = run(capsys, "check", str(path))
    assert code == 1
    assert "0B0" in out or "microbatch 0" in out


def test_check_malformed_file_exits_2_with_the_cell(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0F1\n1F0,1F1,1F0x\n")
    code, out, err = run(capsys, "check", str(path))
    assert code == 2
    assert out == ""
    assert "row 2 (rank 1), column 3" in err
    assert "'1F0x'" in err
    assert "Traceback" not in err


def test_check_missing_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "nope.csv"
    code, _, err = run(capsys, "check", str(path))
    assert code == 2
    assert str(path) in err and "No such file" in err


def test_check_wrong_rank_count_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path, _ = _write_lowered(tmp_path)
    code, _, err = run(capsys, "check", str(path), "--ranks", "3")
    assert code == 2
    assert "expected 3" in err


def test_check_stage_on_two_ranks_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "two.csv"
    path.write_text("0F0,1F0\n1B0,0B0\n")
    code, _, err = run(capsys, "check", str(path))
    assert code == 2
    assert "a stage lives on exactly one rank" in err


# ---------------------------------------------------------------- simulate


def test_simulate_named_schedule_matches_the_library(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "simulate", "ZBVZeroBubble", "--ranks", "4", "--microbatches", "8", "--json")
    assert code == 0, err
    data = json.loads(out)
    schedule = lower(generate("ZBVZeroBubble", num_ranks=4, num_microbatches=8))
    result = simulate(schedule, Costs())
    assert data["makespan"] == pytest.approx(result.makespan)
    assert data["num_ranks"] == 4 and data["num_stages"] == 8 and data["num_microbatches"] == 8
    assert data["lowered"] is True
    for row in data["ranks"]:
        r = row["rank"]
        assert row["busy"] == pytest.approx(result.busy[r])
        assert row["idle"] == pytest.approx(result.idle[r])
        assert row["bubble_fraction"] == pytest.approx(result.bubble_fraction[r])
        assert row["peak_live_activations"] == result.peak_live_activations[r]
    assert [row["rank"] for row in data["ranks"]] == [0, 1, 2, 3]
    total_idle = sum(row["idle"] for row in data["ranks"])
    assert data["bubble_fraction"] == pytest.approx(total_idle / (4 * result.makespan))


def test_simulate_with_costs(capsys: pytest.CaptureFixture[str]) -> None:
    spec = "F=1,B=2,I=1,W=1"
    code, out, err = run(capsys, "simulate", "1F1B", "-p", "4", "-m", "8", "--costs", spec, "--json")
    assert code == 0, err
    expected = simulate(lower(generate("1F1B", num_ranks=4, num_microbatches=8)), Costs.parse(spec))
    assert json.loads(out)["makespan"] == pytest.approx(expected.makespan)


def test_simulate_early_receives_matches_the_library(capsys: pytest.CaptureFixture[str]) -> None:
    spec = "latency=0.5"
    costs = Costs.parse(spec)
    expected = {
        placement: simulate(
            lower(generate("ZBVZeroBubble", num_ranks=4, num_microbatches=8), recv_placement=placement, costs=costs), costs
        ).makespan
        for placement in ("late", "early")
    }
    for placement in ("late", "early"):
        code, out, err = run(capsys, "simulate", "ZBVZeroBubble", "-p", "4", "-m", "8", "--costs", spec, "--recv", placement, "--json")
        assert code == 0, err
        assert json.loads(out)["makespan"] == pytest.approx(expected[placement])
    # Posting receives early hides the latency when receives are posted in list order.
    assert expected["early"] < expected["late"]


def test_export_early_receives(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "export", "Interleaved1F1B", "-p", "4", "-m", "8", "--recv", "early")
    assert code == 0, err
    expected = lower(generate("Interleaved1F1B", num_ranks=4, num_microbatches=8), recv_placement="early")
    assert out == dumps_csv(expected)
    assert out != dumps_csv(lower(generate("Interleaved1F1B", num_ranks=4, num_microbatches=8)))


def test_simulate_csv_rejects_generator_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path, _ = _write_lowered(tmp_path)
    code, _, err = run(capsys, "simulate", str(path), "--recv", "early")
    assert code == 2
    assert "apply to a NAME" in err


def test_simulate_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "simulate", "Interleaved1F1B", "--ranks", "2", "--microbatches", "4")
    assert code == 0, err
    result = simulate(lower(generate("Interleaved1F1B", num_ranks=2, num_microbatches=4)), Costs())
    lines = out.splitlines()
    assert lines[0].startswith("Interleaved1F1B: 2 ranks, 4 stages")
    assert any(line.startswith("makespan: ") for line in lines)
    makespan_line = next(line for line in lines if line.startswith("makespan: "))
    assert float(makespan_line.split()[1]) == pytest.approx(result.makespan)
    assert any(line.startswith("bubble: ") and "overall" in line for line in lines)
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["rank"])
    table = lines[header : header + 3]
    assert table[0].split() == ["rank", "busy", "idle", "bubble", "peak", "activations"]
    assert len({len(line) for line in table}) == 1  # aligned
    assert table[1].split()[0] == "0" and table[2].split()[0] == "1"
    assert int(table[1].split()[-1]) == result.peak_live_activations[0]


def test_simulate_csv_as_loaded(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "zbv.csv"
    compute_only = generate("ZBVZeroBubble", num_ranks=2, num_microbatches=4)
    path.write_text(dumps_csv(compute_only))
    code, out, err = run(capsys, "simulate", str(path), "--json")
    assert code == 0, err
    expected = simulate(load_csv(path), Costs())
    assert json.loads(out)["makespan"] == pytest.approx(expected.makespan)
    assert json.loads(out)["lowered"] is False


def test_simulate_name_needs_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "simulate", "1F1B", "--ranks", "4")
    assert code == 2
    assert "--microbatches" in err


def test_simulate_bad_costs_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["schedule", "simulate", "1F1B", "-p", "2", "-m", "4", "--costs", "F=fast"])
    assert info.value.code == 2
    assert "--costs" in capsys.readouterr().err


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("command", ["show", "export", "simulate"])
def test_unknown_schedule_name_exits_2(capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, out, err = run(capsys, command, "NoSuchSchedule", "--ranks", "4", "--microbatches", "8")
    assert code == 2
    assert out == ""
    assert "NoSuchSchedule" in err
    assert "Traceback" not in err


def test_rejected_config_exits_2_naming_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ScheduleConfigError) as info:
        generate("DualPipeV", num_ranks=4, num_microbatches=2)
    code, out, err = run(capsys, "show", "DualPipeV", "--ranks", "4", "--microbatches", "2")
    assert code == 2
    assert out == ""
    assert str(info.value) in err
    assert "DualPipeV" in err and "microbatch" in err


def test_missing_required_arguments_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["schedule", "show", "1F1B", "--ranks", "4"])
    assert info.value.code == 2
    assert "--microbatches" in capsys.readouterr().err


def test_non_positive_sizes_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["schedule", "show", "1F1B", "--ranks", "0", "--microbatches", "4"])
    assert info.value.code == 2
    assert "positive integer" in capsys.readouterr().err


# ---------------------------------------------------------------- real processes


def test_module_entry_point_as_a_subprocess(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pipeloom.tools.cli", "schedule"]
    shown = subprocess.run([*cmd, "show", "ZBVZeroBubble", "--ranks", "4", "--microbatches", "8"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("ZBVZeroBubble: 4 ranks")

    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0UNSHARD3\n")
    checked = subprocess.run([*cmd, "check", str(bad)], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 2
    assert "Traceback" not in checked.stderr
    assert "row 1 (rank 0), column 2" in checked.stderr

    unknown = subprocess.run([*cmd, "show", "Nope", "-p", "2", "-m", "2"], capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2
    assert "Traceback" not in unknown.stderr and "Nope" in unknown.stderr


def test_console_script_pipes_into_check(tmp_path: Path) -> None:
    exe = shutil.which("pipeloom")
    if exe is None:
        pytest.skip("the pipeloom console script is not on PATH (package not installed)")
    path = tmp_path / "dualpipev.csv"
    exported = subprocess.run([exe, "schedule", "export", "DualPipeV", "-p", "4", "-m", "8", "--lowered", "-o", str(path)],
                              capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    checked = subprocess.run([exe, "schedule", "check", str(path)], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.startswith("valid: ")


def test_export_into_a_closed_pipe_is_quiet() -> None:
    """``pipeloom schedule export ... | head`` must not print a traceback or an error."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeloom.tools.cli", "schedule", "export", "DualPipeV", "-p", "32", "-m", "128", "--lowered"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0
    assert "Traceback" not in err and "error" not in err
