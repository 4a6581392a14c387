"""How `uzip bench disagg` turns runs into its table (benchmarks/disagg_link.summarize)."""

import pytest

from benchmarks.disagg_link import summarize


def _run(mode, repeat, each_s, ttft_ms=1000.0):
    split = {"requests": len(each_s), "prefill_compute_s": 0.9, "kv_transfer_s": sorted(each_s)[len(each_s) // 2],
             "kv_after_send_start_s": sorted(each_s)[len(each_s) // 2], "kv_exposed_s": 0.05,
             "decode_start_s": 0.05, "raw_bytes": 13_000_000, "wire_bytes": 8_900_000 if mode == "on" else 13_000_000,
             "each": {"kv_after_send_start_s": each_s, "kv_transfer_s": each_s}}
    return {"rate": "1gbit", "input_len": 1024, "compression": mode, "repeat": repeat, "ttft_p50_ms": ttft_ms,
            "ttft_p99_ms": ttft_ms, "itl_p50_ms": 40.0, "output_throughput": 10.0, "split": split}


def test_sequential_table_gives_both_ratios_and_the_bar():
    # One odd compressed run: the median of the two run medians moves, the pooled median less.
    runs = [_run("on", 0, [0.080, 0.081, 0.082, 0.083, 0.084], 1100), _run("off", 0, [0.113] * 5, 1150),
            _run("off", 1, [0.114] * 5, 1150), _run("on", 1, [0.079, 0.080, 0.110, 0.111, 0.112], 1100)]
    (row,) = summarize(runs, overlap=False)
    assert row["transfer_ratio"] == pytest.approx(((0.082 + 0.110) / 2) / 0.1135)
    assert row["transfer_ratio_every_request"] == pytest.approx(0.0825 / 0.1135)
    assert row["bar_transfer_le_0_75"] is False  # judged on transfer_ratio: 0.85
    assert row["ttft_saved_ms"] == 50
    assert row["ttft_saved_predicted_ms"] == pytest.approx(1000 * (0.1135 - 0.096))
    assert row["on"]["wire_mb"] == pytest.approx(8.9)


def test_a_mode_without_completed_requests_is_an_error_row():
    runs = [_run("on", 0, [0.08] * 5), dict(_run("off", 0, [0.11] * 5), split={"requests": 0})]
    (row,) = summarize(runs, overlap=False)
    assert "error" in row and row["runs_without_requests"] == {"on": 0, "off": 1}
    assert "transfer_ratio_every_request" not in row
