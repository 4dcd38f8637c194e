"""Each step's GPU clock, and what holds it down, read through NVML, so a step's time says whether its
GPU ran at full speed.

Why: on the device's H100 (2026-12-07), 120-step runs of the TE grid's MBS 4 configs slowed by up to
14 % from their first steps to their last while their data loader waited 0.04 % of the time, and the
same configs' 16-step rows, recorded on other H100s, ran 13-47 % faster. A GPU at its power limit, or
hot, lowers its SM clock, and a screen of a few seconds may end before it does. The clock at the end
of each step, with NVML's reasons for holding it below the maximum (its "clock event reasons"), tell
that apart from the code and the host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pynvml
import torch

log = logging.getLogger(__name__)

HOLDING_REASONS: dict[str, int] = {
    "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
}
"""NVML's reasons that lower the SM clock for a cause outside the program (power, heat, the board's
own slowdown), by NVML's names. The others (idle, application clocks, sync boost, display) say
nothing about a training step's speed."""


@dataclass(frozen=True, slots=True)
class ClockReading:
    sm_clock_mhz: float
    held_by: tuple[str, ...]
    """The :data:`HOLDING_REASONS` active when read."""


def held_by(reasons: int) -> tuple[str, ...]:
    """The names of the :data:`HOLDING_REASONS` set in NVML's bitmask ``reasons``."""
    return tuple(name for name, bit in HOLDING_REASONS.items() if reasons & bit)


_handles: dict[str, object | None] = {}
"""NVML's handle of each CUDA device this process read (by UUID), ``None`` where NVML cannot read
it. A process that runs many bursts (kept ranks) opens it once."""


def read_clock(device: torch.device) -> ClockReading | None:
    """The SM clock of ``device`` now, and what holds it down; ``None`` on the CPU or where NVML
    cannot read the device (no driver library, a device it does not list, a driver without these
    calls), said once in the log: a measurement's instrument never fails the training it watches."""
    if device.type != "cuda":
        return None
    uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}"  # NVML names devices as CUDA does, not by index
    try:
        if uuid not in _handles:
            pynvml.nvmlInit()
            _handles[uuid] = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        handle = _handles[uuid]
        if handle is None:
            return None
        return ClockReading(sm_clock_mhz=float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
                            held_by=held_by(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)))
    except pynvml.NVMLError as error:
        log.warning("NVML cannot read %s (%s): steps are recorded without its clock", uuid, error)
        _handles[uuid] = None
        return None
