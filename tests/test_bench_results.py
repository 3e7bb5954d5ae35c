"""A bench's result file after every finished run: a bench cut short leaves valid JSON with what it finished."""

import json

import pytest

from harness.result_file import write_result


def bench(path, num_runs: int, fail_at: int | None = None) -> None:
    """The shape of every bench loop: a run, its row written; after the last, the aggregates."""
    rows = []
    for i in range(num_runs):
        if i == fail_at:
            raise RuntimeError(f"run {i} crashed")
        rows.append({"run": i, "seconds": 1.5 * i})
        write_result(path, {"rows": rows}, is_complete=False)
    write_result(path, {"rows": rows, "mean_seconds": sum(r["seconds"] for r in rows) / len(rows)}, is_complete=True)


def test_a_bench_cut_short_keeps_the_runs_it_finished(tmp_path):
    path = tmp_path / "results" / "bench.json"  # its folder made on the first write
    with pytest.raises(RuntimeError):
        bench(path, num_runs=3, fail_at=2)
    result = json.loads(path.read_text())
    assert result == {"complete": False, "rows": [{"run": 0, "seconds": 0.0}, {"run": 1, "seconds": 1.5}]}
    assert [p.name for p in path.parent.iterdir()] == ["bench.json"]  # no temporary file left behind


def test_a_finished_bench_says_complete_with_its_aggregates(tmp_path):
    path = tmp_path / "bench.json"
    bench(path, num_runs=3)
    result = json.loads(path.read_text())
    assert result["complete"] is True and result["mean_seconds"] == 1.5 and len(result["rows"]) == 3


def test_a_result_that_does_not_encode_leaves_the_last_file_whole(tmp_path):
    path = tmp_path / "bench.json"
    write_result(path, {"rows": [1]}, is_complete=False)
    with pytest.raises(TypeError):
        write_result(path, {"rows": [1, object()]}, is_complete=False)
    assert json.loads(path.read_text()) == {"complete": False, "rows": [1]}
    with pytest.raises(ValueError):  # the flag is write_result's: a result may not carry its own
        write_result(path, {"complete": True}, is_complete=False)


def test_the_tests_margins_refuse_seeds_a_bench_cut_short_left(tmp_path, monkeypatch):
    from harness import learning_runs
    runs = [{"seed": 0, "eval_gain": 0.1, "reward_gain": 0.2}]
    monkeypatch.setattr(learning_runs, "RESULTS", tmp_path / "learning_seeds.json")
    write_result(learning_runs.RESULTS, {"configs": {"sync": {"runs": runs}}}, is_complete=False)
    with pytest.raises(AssertionError, match="unfinished"):
        learning_runs.margin("sync", "eval_gain")
    write_result(learning_runs.RESULTS, {"configs": {"sync": {"runs": runs}}}, is_complete=True)
    assert learning_runs.margin("sync", "eval_gain") == 0.05


def test_quoted_figures_come_from_finished_benches_only(tmp_path, monkeypatch):
    import test_quoted_figures as quoted
    monkeypatch.setattr(quoted, "RESULTS", tmp_path)
    rows = [{"shape": "policy", "num_params": 812_000}]
    write_result(tmp_path / quoted.WS_CPU, {"rows": rows}, is_complete=False)
    num_params = quoted.F(quoted.WS_CPU, quoted.ws_rows, {"shape": "policy"}, "num_params")
    with pytest.raises(AssertionError, match="unfinished"):
        quoted.resolve(num_params)
    write_result(tmp_path / quoted.WS_CPU, {"rows": rows}, is_complete=True)
    assert quoted.resolve(num_params) == 812_000
