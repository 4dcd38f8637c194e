"""The GPU clock each step records (trainables/gpu_clock.py): NVML's reasons read by name, and no
reading where there is no GPU."""

from __future__ import annotations

import pynvml
import torch

from autotune.bursts import gpu_clock_summary
from trainables.gpu_clock import HOLDING_REASONS, held_by, read_clock


def test_nvml_reasons_that_hold_the_clock_down_are_named_and_the_others_left_out() -> None:
    reasons = (pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
               | pynvml.nvmlClocksEventReasonGpuIdle | pynvml.nvmlClocksEventReasonApplicationsClocksSetting)
    assert held_by(reasons) == ("sw_power_cap", "hw_thermal_slowdown")
    assert held_by(pynvml.nvmlClocksEventReasonNone) == ()
    assert held_by(pynvml.nvmlClocksEventReasonAll) == tuple(HOLDING_REASONS)


def test_a_cpu_step_reads_no_clock() -> None:
    assert read_clock(torch.device("cpu")) is None


def test_a_clock_summary_counts_only_the_steps_that_read_a_clock() -> None:
    steps = [(1980.0, ()), (1755.0, ("sw_power_cap",)), (None, ()), (1755.0, ("sw_power_cap", "hw_slowdown"))]
    summary = gpu_clock_summary(steps)
    assert summary == {"sm_clock_mhz": (1980.0 + 2 * 1755.0) / 3, "held_share": 2 / 3,
                       "held_by": ["hw_slowdown", "sw_power_cap"]}
    assert gpu_clock_summary([(None, ()), (None, ())]) is None  # the CPU: nothing to summarize


def test_a_gpu_nvml_cannot_read_records_no_clock_and_says_so_once(monkeypatch, caplog) -> None:
    """This box has no NVIDIA driver, so NVML's library is missing: what a container without it
    does. The step must go on without a clock (only the device's properties are stood in for)."""
    import types

    import trainables.gpu_clock as gpu_clock

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid="0000-test"))
    monkeypatch.setattr(gpu_clock, "_handles", {})
    with caplog.at_level("WARNING", logger="trainables.gpu_clock"):
        assert read_clock(torch.device("cuda", 0)) is None
        assert read_clock(torch.device("cuda", 0)) is None
    assert [r.getMessage() for r in caplog.records] == [
        "NVML cannot read GPU-0000-test (NVML Shared Library Not Found): steps are recorded without its clock"]
