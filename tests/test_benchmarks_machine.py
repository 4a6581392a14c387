"""The host description every benchmark result carries (benchmarks/machine.py)."""

import sys

import pytest

from benchmarks import machine


def test_cpu_share_is_the_split_of_the_time_between_two_readings():
    before = dict.fromkeys(machine._CPU_FIELDS, 100)
    after = {**before, "user": 160, "system": 120, "idle": 110, "steal": 110}
    share = machine.cpu_share(before, after)
    assert share["user"] == 0.6 and share["system"] == 0.2 and share["idle"] == 0.1 and share["steal"] == 0.1
    assert share["softirq"] == 0.0
    assert "loadavg_1m" in share


def test_cpu_share_without_a_reading_is_none():
    assert machine.cpu_share(None, machine.cpu_ticks()) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_cpu_ticks_reads_every_field_and_only_grows():
    a = machine.cpu_ticks()
    b = machine.cpu_ticks()
    assert set(a) == set(machine._CPU_FIELDS)
    assert all(b[k] >= a[k] for k in a)
