"""Fast NVML poller for tests/device/gpu_power_check.py: one process per NVML read, so a
slow call (nvmlDeviceGetFieldValues and nvmlDeviceGetTotalEnergyConsumption take
milliseconds on some drivers) delays no other field, and the load generator's Python
threads delay none.

``--what`` picks the read: ``instant_w`` (NVML_FI_DEV_POWER_INSTANT), ``average_w``
(NVML_FI_DEV_POWER_AVERAGE), ``energy_field_mj`` (NVML_FI_DEV_ENERGY),
``usage_w`` (nvmlDeviceGetPowerUsage) or ``counter_mj``
(nvmlDeviceGetTotalEnergyConsumption). Every ``--interval`` seconds it records the
monotonic time before and after the call, the value and (fields) the value's own NVML
timestamp. A read the driver refuses is recorded with its NVML error, and the process
ends at once. ``OUT.ready`` says polling began (or was refused). On SIGTERM/SIGINT, or
after ``--max-seconds``, it writes ``OUT.bin`` (rows of float64, NaN where nothing was
read; the columns are listed in ``OUT.json``) and then ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from array import array
from typing import Any

COLUMNS = ["t", "value", "t_end", "ts_us"]
#: field reads: NVML constant name, its value where the bindings lack it, unit scale
FIELDS = {
    "instant_w": ("NVML_FI_DEV_POWER_INSTANT", 186, 1e-3),
    "average_w": ("NVML_FI_DEV_POWER_AVERAGE", 185, 1e-3),
    "energy_field_mj": ("NVML_FI_DEV_ENERGY", 191, 1.0),
}
WHAT = [*FIELDS, "usage_w", "counter_mj"]


def _value(fv: Any) -> float:
    v = fv.value
    vtype = int(getattr(fv, "valueType", 1))
    return float(
        {0: v.dVal, 1: v.uiVal, 2: v.ulVal, 3: v.ullVal, 4: v.sllVal, 5: v.siVal}.get(
            vtype, v.uiVal
        )
    )


def reader(nvml: Any, h: Any, what: str) -> Any:
    """A function returning (value, NVML timestamp or NaN); raises when refused."""
    if what == "usage_w":
        return lambda: (nvml.nvmlDeviceGetPowerUsage(h) / 1000.0, math.nan)
    if what == "counter_mj":
        return lambda: (float(nvml.nvmlDeviceGetTotalEnergyConsumption(h)), math.nan)
    name, fallback, scale = FIELDS[what]
    fid = int(getattr(nvml, name, fallback))

    def read() -> tuple[float, float]:
        fv = nvml.nvmlDeviceGetFieldValues(h, [fid])[0]
        ret = int(fv.nvmlReturn)
        if ret != 0:
            raise RuntimeError(f"nvmlReturn {ret}: {nvml.nvmlErrorString(ret)}")
        return _value(fv) * scale, float(getattr(fv, "timestamp", math.nan))

    return read


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--what", required=True, choices=WHAT)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--interval", type=float, default=0.001)
    ap.add_argument("--max-seconds", type=float, default=600.0)
    args = ap.parse_args()
    meta: dict = {
        "what": args.what,
        "columns": COLUMNS,
        "error": None,
        "started": time.monotonic(),
        "wall_minus_monotonic": time.time() - time.monotonic(),
    }
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:  # ahead of the load and phasewatch for the CPU, where allowed
        os.nice(-10)
        meta["nice"] = -10
    except OSError:
        meta["nice"] = 0
    rows = array("d")
    try:
        import pynvml as nvml

        meta["pynvml_file"] = getattr(nvml, "__file__", None)
        nvml.nvmlInit()
        h = nvml.nvmlDeviceGetHandleByIndex(args.gpu)
        read = reader(nvml, h, args.what)
        read()  # refused here: recorded, and nothing to poll
    except Exception as exc:
        meta["error"] = f"{type(exc).__name__}: {exc}"
        _ready(args.out, meta)
        _write(args.out, meta, rows)
        return 0
    _ready(args.out, meta)
    interval = args.interval
    mono = time.monotonic
    deadline = mono() + args.max_seconds
    next_t = mono()
    polls = 0
    while not stop["now"]:
        t0 = mono()
        if t0 >= deadline:
            break
        try:
            value, ts = read()
        except Exception as exc:
            meta["error"] = f"{type(exc).__name__}: {exc} (after {polls} reads)"
            break
        rows.extend((t0, value, mono(), ts))
        polls += 1
        next_t += interval
        delay = next_t - mono()
        if delay > 0:
            time.sleep(delay)
        elif delay < -0.05:  # fell behind (a slow call): do not burst to catch up
            next_t = mono()
    meta["polls"] = polls
    meta["stopped"] = mono()
    try:
        meta["name"] = str(nvml.nvmlDeviceGetName(h))
    except Exception as exc:
        meta["name"] = f"unknown ({type(exc).__name__})"
    _write(args.out, meta, rows)
    try:
        nvml.nvmlShutdown()
    except Exception:
        pass
    return 0


def _ready(out: str, meta: dict) -> None:
    with open(out + ".ready", "w", encoding="utf-8") as f:
        f.write(json.dumps({"error": meta["error"]}))


def _write(out: str, meta: dict, rows: array) -> None:
    with open(out + ".bin", "wb") as f:
        rows.tofile(f)
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(meta, f)


if __name__ == "__main__":
    sys.exit(main())
