"""Fast NVML poller for tests/device/gpu_power_check.py, run as its own process (so the
load generator's Python threads cannot delay its reads, nor it theirs).

Every ``--interval`` seconds it reads GPU ``--gpu``: the instant and average power fields
and the energy field (one ``nvmlDeviceGetFieldValues`` call), ``nvmlDeviceGetPowerUsage``
and ``nvmlDeviceGetTotalEnergyConsumption``, each with the monotonic time just before the
call. A field or call the driver refuses is recorded with its NVML error and not asked
again. On SIGTERM/SIGINT, or after ``--max-seconds``, it writes ``OUT.bin`` (rows of
float64, NaN where nothing was read; columns in ``OUT.json``) and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from array import array

COLUMNS = [
    "t_fields",  # monotonic s, just before nvmlDeviceGetFieldValues
    "instant_w",  # NVML_FI_DEV_POWER_INSTANT
    "average_w",  # NVML_FI_DEV_POWER_AVERAGE
    "energy_field_mj",  # NVML_FI_DEV_ENERGY
    "t_usage",
    "usage_w",  # nvmlDeviceGetPowerUsage
    "t_counter",
    "counter_mj",  # nvmlDeviceGetTotalEnergyConsumption
    "t_end",  # after the last call of the row
    "instant_ts_us",  # the field value's own timestamp (NVML: µs since the epoch)
    "average_ts_us",
]
TS_COLUMN = {"instant_w": "instant_ts_us", "average_w": "average_ts_us"}
FIELDS = {
    "instant_w": ("NVML_FI_DEV_POWER_INSTANT", 186, 1e-3),
    "average_w": ("NVML_FI_DEV_POWER_AVERAGE", 185, 1e-3),
    "energy_field_mj": ("NVML_FI_DEV_ENERGY", 191, 1.0),
}


def _value(fv: object) -> float:
    v = fv.value  # type: ignore[attr-defined]
    vtype = int(getattr(fv, "valueType", 1))
    return float(
        {0: v.dVal, 1: v.uiVal, 2: v.ulVal, 3: v.ullVal, 4: v.sllVal, 5: v.siVal}.get(
            vtype, v.uiVal
        )
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--interval", type=float, default=0.001)
    ap.add_argument("--max-seconds", type=float, default=600.0)
    args = ap.parse_args()
    meta: dict = {
        "columns": COLUMNS,
        "errors": {},
        "started": time.monotonic(),
        "wall_minus_monotonic": time.time() - time.monotonic(),
    }
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rows = array("d")
    try:
        import pynvml as nvml

        meta["pynvml_file"] = getattr(nvml, "__file__", None)
        nvml.nvmlInit()
        h = nvml.nvmlDeviceGetHandleByIndex(args.gpu)
    except Exception as exc:
        meta["errors"]["init"] = f"{type(exc).__name__}: {exc}"
        _write(args.out, meta, rows)
        return 1
    fields = {col: int(getattr(nvml, name, fid)) for col, (name, fid, _) in FIELDS.items()}
    scale = {col: s for col, (_, _, s) in FIELDS.items()}
    use_usage = use_counter = True
    # which fields answer at all: ask each once, alone
    for col, fid in list(fields.items()):
        try:
            fv = nvml.nvmlDeviceGetFieldValues(h, [fid])[0]
            if int(fv.nvmlReturn) != 0:
                meta["errors"][col] = (
                    f"nvmlReturn {int(fv.nvmlReturn)}: {nvml.nvmlErrorString(int(fv.nvmlReturn))}"
                )
                del fields[col]
        except Exception as exc:
            meta["errors"][col] = f"{type(exc).__name__}: {exc}"
            del fields[col]
    ids = list(fields.values())
    cols = list(fields)
    with open(args.out + ".ready", "w", encoding="utf-8") as f:
        f.write(json.dumps(meta["errors"]))
    nan = math.nan
    interval = args.interval
    deadline = time.monotonic() + args.max_seconds
    next_t = time.monotonic()
    polls = 0
    mono = time.monotonic
    while not stop["now"]:
        now = mono()
        if now >= deadline:
            break
        row = [nan] * len(COLUMNS)
        row[0] = now
        if ids:
            try:
                got = nvml.nvmlDeviceGetFieldValues(h, ids)
                for col, fv in zip(cols, got):
                    if int(fv.nvmlReturn) == 0:
                        row[COLUMNS.index(col)] = _value(fv) * scale[col]
                        if col in TS_COLUMN:
                            row[COLUMNS.index(TS_COLUMN[col])] = float(
                                getattr(fv, "timestamp", nan)
                            )
            except Exception as exc:
                meta["errors"]["field_values"] = f"{type(exc).__name__}: {exc}"
                ids = []
        if use_usage:
            row[4] = mono()
            try:
                row[5] = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
            except Exception as exc:
                meta["errors"]["usage_w"] = f"{type(exc).__name__}: {exc}"
                use_usage = False
        if use_counter:
            row[6] = mono()
            try:
                row[7] = float(nvml.nvmlDeviceGetTotalEnergyConsumption(h))
            except Exception as exc:
                meta["errors"]["counter_mj"] = f"{type(exc).__name__}: {exc}"
                use_counter = False
        row[8] = mono()
        rows.extend(row)
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


def _write(out: str, meta: dict, rows: array) -> None:
    with open(out + ".bin", "wb") as f:
        rows.tofile(f)
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(meta, f)


if __name__ == "__main__":
    sys.exit(main())
