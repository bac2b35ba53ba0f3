"""The board's energy counter through NVML (ctypes, no package needed), for the reference scripts: the joules a
reference step spends, beside the joules `tf bench`'s energy line measures for ours in the same run.

NVML comes from $TF_NVML, else libnvidia-ml.so.1, else libnvidia-ml.so (as tf_cuda::power loads it); the board is
the one torch's device runs on, found by its PCI address. Everything here fails soft: without NVML, or on a board
that hides its counter, `open_board` returns None and says why once, and the scripts leave the energy out.

    board = open_board(0)
    joules = joules_per_call(board, lambda: step(), step_ms)   # None without a board

Self-check on a machine without NVML: python3 tests/python/board_energy.py (prints why, exits 0).
"""

import ctypes
import math
import os
import sys
import time

WINDOW_MS = 2000.0  # NVML's counter moves in steps of tens of milliseconds: two seconds read it to about 1%
_NOT_SUPPORTED = 3


class Board:
    """One board's NVML handle: its energy counter (millijoules since the driver loaded) and power limit."""

    def __init__(self, lib, handle, bus_id):
        self._lib = lib
        self._handle = handle
        self.bus_id = bus_id

    def millijoules(self):
        value = ctypes.c_ulonglong(0)
        code = self._lib.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(value))
        return int(value.value) if code == 0 else None

    def limit_watts(self):
        value = ctypes.c_uint(0)
        code = self._lib.nvmlDeviceGetEnforcedPowerLimit(self._handle, ctypes.byref(value))
        return value.value / 1000.0 if code == 0 else None


def _load_nvml():
    explicit = os.environ.get("TF_NVML")
    names = [explicit] if explicit else ["libnvidia-ml.so.1", "libnvidia-ml.so"]
    reasons = []
    for name in names:
        try:
            return ctypes.CDLL(name), None
        except OSError as exc:
            reasons.append(f"{name}: {exc}")
    return None, "; ".join(reasons)


def _device_ids(device_index):
    """(NVML's PCI bus id text, NVML's UUID text) of torch's device `device_index`, each None where torch does not
    give it."""
    try:
        import torch

        props = torch.cuda.get_device_properties(device_index)
    except Exception:  # no torch or no CUDA
        return None, None
    try:
        bus_id = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except Exception:  # an older torch
        bus_id = None
    try:
        uuid = f"GPU-{props.uuid}"
    except Exception:
        uuid = None
    return bus_id, uuid


def open_board(device_index=0, say=print):
    """The board of torch's device `device_index`, or None (the reason said once through `say`)."""
    lib, why = _load_nvml()
    if lib is None:
        say(f"board energy: not measured (NVML could not be loaded: {why}; set TF_NVML to libnvidia-ml's path)")
        return None
    if lib.nvmlInit_v2() != 0:
        say("board energy: not measured (nvmlInit_v2 failed)")
        return None
    bus_id, uuid = _device_ids(device_index)
    handle = ctypes.c_void_p()
    code = -1
    if bus_id is not None:
        code = lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id.encode(), ctypes.byref(handle))
    if code != 0 and uuid is not None:
        code = lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle))
    if code != 0:
        say(f"board energy: not measured (no NVML board for torch's device {device_index}: PCI {bus_id}, "
            f"{uuid}, code {code})")
        return None
    board = Board(lib, handle, bus_id or uuid)
    probe = ctypes.c_ulonglong(0)
    code = lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(probe))
    if code != 0:
        reason = "the board does not expose its energy counter" if code == _NOT_SUPPORTED else f"code {code}"
        say(f"board energy: not measured ({reason})")
        return None
    return board


def joules_per_call(board, fn, call_ms, sync=None):
    """Joules the board spends per call of `fn` (calls of about `call_ms`), over about WINDOW_MS of calls run back to
    back and synchronized by `sync` (torch.cuda.synchronize by default); None without a board or a counter."""
    if board is None:
        return None
    if sync is None:
        import torch

        sync = torch.cuda.synchronize
    calls = max(3, math.ceil(WINDOW_MS / max(call_ms, 0.01)))
    sync()
    start = board.millijoules()
    for _ in range(calls):
        fn()
    sync()
    end = board.millijoules()
    if start is None or end is None:
        return None
    return max(end - start, 0) / 1000.0 / calls


def _self_check():
    board = open_board(0, say=lambda text: print(text, file=sys.stderr))
    if board is None:
        print("board_energy: no board here (see above); joules_per_call(None, ...) is", joules_per_call(None, None, 1.0))
        return 0
    t0 = time.perf_counter()
    j = joules_per_call(board, lambda: time.sleep(0.05), 50.0, sync=lambda: None)
    print(f"board {board.bus_id}: limit {board.limit_watts()} W; idle {j:.3f} J a 50 ms call "
          f"({time.perf_counter() - t0:.1f} s window)")
    return 0


if __name__ == "__main__":
    sys.exit(_self_check())
