"""tests/device/gpu_power_check.py end to end without a GPU: its dry run puts the stand-in
engine, a real ``phasewatch serve`` and the 1 ms NVML poll behind the stand-in NVML of
tests/device/fake_nvml, whose sensor is known (idle and load watts, 100 ms refresh), so
the check's figures are checked against that truth. Without torch the load is a
sleep-based schedule: the fake sensor follows the announced schedule either way."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from ...support.servers import ROOT

SCRIPT = ROOT / "tests" / "device" / "gpu_power_check.py"
# the stand-in NVML, loaded under its own name: its constants are the sensor's truth
_spec = importlib.util.spec_from_file_location(
    "fake_pynvml", SCRIPT.parent / "fake_nvml" / "pynvml.py"
)
assert _spec is not None and _spec.loader is not None
fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake)


def _run(tmp_path, *args, **env_extra):
    out = tmp_path / "gpu_power.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_extra)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.exists(), proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def _near(got, want, rel):
    assert got is not None and abs(got - want) <= rel * want, (got, want)


def test_dry_run_measures_the_fake_sensor_and_phasewatch(tmp_path):
    proc, data = _run(tmp_path, "--dry-run", "--quick", "--budget", "200")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert data["status"] == "ok"
    assert data["env"]["phasewatch_from_this_tree"] is True
    assert "gpu_power_check: ok" in proc.stdout

    sq = data["square"]
    assert not sq["poll"]["errors"]
    assert all(v < 0.01 for v in sq["poll"]["poll_interval_median_s"].values())
    for name in ("instant_w", "average_w", "usage_w", "counter_w"):
        _near(sq["fields"][name]["refresh_period_s"], fake.REFRESH, 0.2)
    _near(sq["idle_w"]["counter_w"], fake.IDLE_W, 0.05)
    summary = sq["energy"]["summary"]
    for kind in ("compute", "memory"):
        # the counter's energy over a padded window is the burst's whole energy
        _near(summary[f"{kind}_2s"]["truth_mean_w"], fake.IDLE_W + fake.LOAD_W[kind], 0.05)
        # the schedule fit recovers a burst shorter than a few refreshes, which a window
        # read of the counter cannot
        _near(summary[f"{kind}_0.3s"]["fit_mean_w"], fake.IDLE_W + fake.LOAD_W[kind], 0.03)
        # the instant field answers within a refresh and its window; the 1 s mean lags
        lag = sq["fields"]["instant_w"]["lag"][kind]
        assert lag["rise_to_50pct_s"] <= fake.REFRESH + fake.WINDOW + 0.03
        assert sq["fields"]["usage_w"]["lag"][kind]["rise_to_50pct_s"] > lag["rise_to_50pct_s"]
        # a burst shorter than the mean's second never reaches its step there
        peak = sq["fields"]["usage_w"]["lag"][kind]["peak_fraction_of_step_by_burst_s"]["0.1"]
        assert peak < 0.3

    # 20 ms pulses: the 1 s mean never shows one, the instant field about as often as a
    # pulse overlaps its window; the counter holds every pulse's energy
    vis = sq["pulse_visibility"]
    assert vis["usage_w"]["seen_fraction"] == 0
    assert 0.1 <= vis["instant_w"]["seen_fraction"] <= 0.8
    pulse_j = sum(p["t1"] - p["t0"] for p in sq["pulses"]) * fake.LOAD_W["compute"]
    _near(vis["counter_excess_j"], pulse_j, 0.1)
    profile = sq["sensor_profile"]
    assert profile["usage_w"]["looks_like"] == "1 s mean"
    assert profile["instant_w"]["looks_like"] == "instant or short window"

    pw = data["phasewatch"]
    assert "error" not in pw, pw.get("traceback")
    assert [r["status"] for r in pw["requests"]] == [200, 200]
    for r in pw["requests"]:  # every token through the proxy, usage asked of the engine
        assert r["done"] and r["chunks"] == r["tokens"]
        assert r["engine"]["usage_requested"] is True
    ref = pw["reference_per_request"]
    assert len(ref) == 2
    for row in ref:  # the reference over the engine's own phase windows: the fake's watts
        _near(row["prefill_ref_w"], fake.IDLE_W + fake.LOAD_W["compute"], 0.03)
        _near(row["decode_ref_w"], fake.IDLE_W + fake.LOAD_W["memory"], 0.03)
    assert pw["phasewatch_phase_power"]["decode"]["reference_mean_w"] is not None
    assert pw["energy"]["counter_j"] > 0
    assert pw["energy"]["phasewatch_gpu_energy_j"] is not None
    conc = pw["concurrent"]
    assert [r["status"] for r in conc["requests"]] == [200, 200]
    assert all(r["engine"] is not None for r in conc["requests"])  # matched by completion id
    assert conc["energy"]["counter_j"] > 0
    assert any(m["name"].startswith("phasewatch_gpu_energy_joules") for m in pw["metrics_delta"])


def test_without_a_gpu_it_says_so_in_the_json(tmp_path):
    env_has_torch = subprocess.run(
        [sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
        capture_output=True,
    )
    if env_has_torch.returncode == 0:  # a GPU host: the real run is the device check's
        return
    proc, data = _run(tmp_path, "--budget", "60")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert data["status"] == "no GPU"
    assert data["reason"]
    assert "square" not in data


def test_a_read_the_driver_refuses_is_recorded_and_the_rest_measured(tmp_path):
    proc, data = _run(
        tmp_path,
        "--dry-run",
        "--quick",
        "--skip",
        "phasewatch",
        FAKE_NVML_UNSUPPORTED=f"{fake.NVML_FI_DEV_POWER_INSTANT},counter",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sq = data["square"]
    errors = sq["poll"]["errors"]
    assert "Not Supported" in errors["instant_w"] and "Not Supported" in errors["counter_mj"]
    assert set(sq["fields"]) == {"average_w", "usage_w"}
    _near(sq["fields"]["usage_w"]["refresh_period_s"], fake.REFRESH, 0.2)
    assert "no energy counter" in sq["energy"]["error"]
