"""How per-interval records become per-rank figures and run totals."""
from __future__ import annotations

import json

import pytest

from launcher.rank.metrics import (IntervalRecord, JsonlSink, build_summary, format_bytes, format_summary_table,
                              summarize_rank)


def record(rank=0, step=10, steps=5, step_time_s=0.5, samples_per_sec=16.0, peak=1000, rss=2000, voxels=None):
    return IntervalRecord(rank=rank, host="h", device="CPU:0", step=step, steps=steps, step_time_s=step_time_s,
                          samples_per_sec=samples_per_sec, voxels_per_sec=voxels, peak_memory_bytes=peak,
                          host_rss_bytes=rss, loss=1.0, learning_rate=0.1, end_time_s=1.7e9 + step)


def test_rank_throughput_is_total_samples_over_total_time_not_a_mean_of_rates():
    # 10 steps at 8 samples/step: 5 steps taking 1 s each, then 5 steps taking 0.25 s each.
    records = [record(steps=5, step_time_s=1.0, samples_per_sec=8.0),
               record(step=15, steps=5, step_time_s=0.25, samples_per_sec=32.0, peak=3000, rss=1000)]
    summary = summarize_rank(0, "h", "CPU:0", records, 2.5, 1.5, "abc")
    assert summary.samples_per_sec == pytest.approx(80 / 6.25)  # not (8 + 32) / 2
    assert summary.step_time_s == pytest.approx(0.625)
    assert summary.measured_steps == 10
    assert summary.peak_memory_bytes == 3000 and summary.host_rss_bytes == 2000


def test_voxel_rate_follows_the_sample_rate():
    records = [record(samples_per_sec=2.0, voxels=2.0 * 32**3)]
    assert summarize_rank(0, "h", "CPU:0", records, 1, 1, "x").voxels_per_sec == pytest.approx(2.0 * 32**3)


def test_summary_totals_are_sums_over_ranks_and_sync_is_checked():
    ranks = [summarize_rank(r, "h", "CPU:0", [record(rank=r, samples_per_sec=10.0 + r, peak=100 * (r + 1))],
                            2.0, 1.0, "same") for r in (1, 0)]
    summary = build_summary(ranks, {"model": "resnet50"})
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert summary["total_samples_per_sec"] == pytest.approx(21.0)
    assert summary["total_peak_memory_bytes"] == 300 and summary["max_peak_memory_bytes"] == 200
    assert summary["weights_in_sync"] is True and summary["model"] == "resnet50"
    ranks[0].weights_sha256 = "different"
    assert build_summary(ranks, {})["weights_in_sync"] is False


def test_the_printed_table_has_a_row_per_rank_and_the_total():
    ranks = [summarize_rank(r, "h", "CPU:0", [record(rank=r)], 2.0, 1.0, "s") for r in (0, 1)]
    table = format_summary_table(build_summary(ranks, {}))
    assert "32.00" in table  # the total of two ranks at 16 samples/s
    assert table.count("CPU:0") == 2 and "weights identical on all ranks: yes" in table


def test_jsonl_sink_writes_one_object_per_record(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.write([record(rank=0), record(rank=1)])
    sink.close()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["rank"] for r in rows] == [0, 1]
    assert set(rows[0]) >= {"rank", "step", "samples_per_sec", "step_time_s", "peak_memory_bytes", "device"}


@pytest.mark.parametrize("n, text", [(512, "512 B"), (1536, "1.50 KiB"), (5 * 2**30, "5.00 GiB"), (None, "-")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_cpu_peak_memory_is_real_and_reset_each_interval():
    import tensorflow as tf  # tests/conftest.py set TF_CPU_ALLOCATOR_USE_BFC=true before this

    from launcher.rank.metrics import DeviceMemoryMonitor

    monitor = DeviceMemoryMonitor("CPU:0")
    # Earlier tests in this process may hold memory: measure relative to what is in use now.
    in_use = tf.config.experimental.get_memory_info("CPU:0")["current"]
    monitor.reset()
    block = tf.ones([16, 1024, 1024])  # 64 MiB
    float(tf.reduce_sum(block))
    assert monitor.peak_bytes() >= in_use + 64 * 2**20
    del block
    monitor.reset()  # the next interval starts from what is in use, not from the old peak
    assert monitor.peak_bytes() < in_use + 64 * 2**20
