"""The energy-per-token fit (proxy.measure.energy_fit) on synthetic GPUs whose truth is
known: a power step function sampled by a 100 ms energy counter, seen late."""

from __future__ import annotations

import random

import pytest

from proxy.measure.energy_fit import (
    Step,
    Work,
    best_fit,
    figures,
    fit_gpu,
    solve,
)

IDLE, PREFILL, DECODE = 60.0, 420.0, 280.0
KEY = ("sim", "m", "bf16")


def synthetic(n: int, seed: int = 1, lag: float = 0.0, period: float = 0.1, key=KEY):
    """`n` requests one after another: prefills of 0.05-0.3 s (prompt tokens at 5000/s),
    decodes of 20-60 tokens at 50/s, idle gaps between; the counter's steps every
    `period` s, timed `lag` s late. Returns (steps, works, true J per prompt token, true
    J per output token)."""
    rng = random.Random(seed)
    t = 1.0
    spans = []  # (start, stop, watts)
    works = []
    for _ in range(n):
        prompt = rng.randint(250, 1500)
        pre = prompt / 5000
        out = rng.randint(20, 60)
        sent, first = t, t + pre
        last = first + out / 50.0
        spans += [(sent, first, PREFILL), (first, last, DECODE)]
        works.append(Work(key, sent, first, last, last, prompt, out))
        t = last + rng.uniform(0.05, 0.5)
    end = t + 1.0

    def energy(a: float, b: float) -> float:
        busy = sum(max(0.0, min(b, y) - max(a, x)) * w for x, y, w in spans)
        idle = (b - a) - sum(max(0.0, min(b, y) - max(a, x)) for x, y, _ in spans)
        return busy + idle * IDLE

    steps = []
    a = 0.0
    while a + period <= end:
        b = a + period
        steps.append(Step(a + lag, b + lag, energy(a, b)))
        a = b
    return steps, works, PREFILL / 5000, DECODE / 50


def test_exact_data_gives_the_truth():
    steps, works, jp, jd = synthetic(40)
    sol = fit_gpu(steps, works)
    assert sol is not None
    got = dict(zip(sol.columns, sol.coef))
    assert got[("idle", "")] == pytest.approx(IDLE, rel=1e-6)
    assert got[(KEY, "prefill")] == pytest.approx(jp, rel=1e-6)
    assert got[(KEY, "decode")] == pytest.approx(jd, rel=1e-6)
    assert sol.requests[(KEY, "prefill")] == 40


def test_a_lagging_counter_is_found_and_undone():
    steps, works, jp, jd = synthetic(60, lag=0.07)
    plain = fit_gpu(steps, works)
    assert plain is not None
    best = best_fit(steps, works)
    assert best is not None
    assert best.shift == pytest.approx(0.07, abs=0.011)
    # from a neighbouring lag found before, only its neighbours are tried
    again = best_fit(steps, works, around=0.06)
    assert again is not None and again.shift == pytest.approx(0.07, abs=0.001)
    f = figures({"0": best}, {"0": {KEY}})[KEY]
    assert f["prefill"].joules_per_token == pytest.approx(jp, rel=0.03)
    assert f["decode"].joules_per_token == pytest.approx(jd, rel=0.03)
    # watts: joules per token x the phase's tokens per second
    assert f["prefill"].watts == pytest.approx(PREFILL, rel=0.03)
    assert f["decode"].watts == pytest.approx(DECODE, rel=0.03)
    # unshifted, the lag moves prefill energy into the decode after it
    unshifted = dict(zip(plain.columns, plain.coef))[(KEY, "prefill")]
    assert abs(unshifted / jp - 1) > 0.1


def test_noise_widens_the_interval_and_few_requests_are_unresolved():
    steps, works, jp, _ = synthetic(60)
    rng = random.Random(3)
    noisy = [Step(s.a, s.b, s.joules + rng.gauss(0, 8.0)) for s in steps]
    few = figures({"0": best_fit(noisy, works[:4])}, {"0": {KEY}})[KEY]["prefill"]
    assert few.unresolved == "4 requests so far: a figure needs at least 10"
    assert few.joules_per_token is None
    wide = figures({"0": best_fit(noisy, works[:14])}, {"0": {KEY}})[KEY]["prefill"]
    assert wide.unresolved is not None and "14 requests so far: the 95 % interval is ±" in (
        wide.unresolved
    )
    many = figures({"0": best_fit(noisy, works)}, {"0": {KEY}})[KEY]["prefill"]
    assert many.unresolved is None, many
    assert many.low < jp < many.high
    assert many.high - many.low <= 0.2 * many.joules_per_token
    assert many.requests == 60


def test_two_groups_on_one_gpu_are_told_apart():
    a_steps, a_works, jp, jd = synthetic(50, seed=1)
    other = ("sim", "m2", "int4")
    # the second group on the same GPU, later, drawing the same power for fewer tokens
    shift = a_steps[-1].b
    b_steps, b_works, _, _ = synthetic(50, seed=2, key=other)
    steps = a_steps + [Step(s.a + shift, s.b + shift, s.joules) for s in b_steps]
    works = a_works + [
        Work(
            other,
            w.sent + shift,
            w.first + shift,
            w.last + shift,
            w.end + shift,
            w.prompt_tokens // 2,
            w.output_tokens // 2,
        )
        for w in b_works
    ]
    f = figures({"0": fit_gpu(steps, works)}, {"0": {KEY, other}})
    assert f[KEY]["prefill"].joules_per_token == pytest.approx(jp, rel=0.02)
    assert f[other]["prefill"].joules_per_token == pytest.approx(2 * jp, rel=0.05)
    assert f[other]["decode"].joules_per_token == pytest.approx(2 * jd, rel=0.05)


def test_steps_under_an_unstreamed_request_are_left_out():
    steps, works, jp, _ = synthetic(40)
    # a request whose phases are unknown, drawing 900 W: its steps must not count
    blind = Work(KEY, steps[-1].b + 0.05, None, None, steps[-1].b + 2.0)
    more = [Step(steps[-1].b + 0.1 * i, steps[-1].b + 0.1 * (i + 1), 90.0) for i in range(20)]
    sol = fit_gpu(steps + more, works + [blind])
    assert sol is not None
    assert dict(zip(sol.columns, sol.coef))[(KEY, "prefill")] == pytest.approx(jp, rel=1e-6)


def test_what_the_data_cannot_determine_is_unresolved():
    assert fit_gpu([], []) is None
    steps, works, _, _ = synthetic(3)
    f = figures({"0": fit_gpu(steps[:5], works)}, {"0": {KEY}})[KEY]
    assert "too few" in (f["prefill"].unresolved or "")
    # a phase never seen on its own column: no decode tokens at all
    bare = [Work(KEY, w.sent, w.first, w.first, w.end, w.prompt_tokens, 0) for w in works]
    g = figures({"0": fit_gpu(steps, bare)}, {"0": {KEY}})[KEY]
    assert g["decode"].unresolved == "no decode seen yet"
    assert g["prefill"].as_dict() == {
        "unresolved": "3 requests so far: a figure needs at least 10",
        "requests": 3,
    }
    # a singular system (one column twice over) says so
    assert solve([({0: 1.0, 1: 1.0}, 2.0)] * 10, 2) is None


def test_a_batch_cheaper_per_token_gives_the_ratio_of_sums():
    """Decode alone (280 W, 50 tok/s) and four at once (300 W, 4 x 45 tok/s): the truth is
    all decode energy over all decode tokens. Plain least squares leans to the batched
    steps, which hold the most tokens; the weighted fit gives the ratio of sums."""
    spans, works = [], []
    t = 1.0
    for i in range(60):
        batch = 1 if i % 2 else 4
        first, last = t + 0.1 * batch, t + 0.1 * batch + 1.0
        spans += [(t, first, PREFILL), (first, last, DECODE if batch == 1 else 300.0)]
        works += [
            Work(KEY, t, first, last, last, 500, 50 if batch == 1 else 45) for _ in range(batch)
        ]
        t = last + 0.3
    steps = []
    for k in range(int(t / 0.1) + 2):
        a, b = 0.1 * k, 0.1 * (k + 1)
        busy = [(max(0.0, min(b, y) - max(a, x)), w) for x, y, w in spans]
        steps.append(
            Step(a, b, sum(d * w for d, w in busy) + IDLE * (0.1 - sum(d for d, _ in busy)))
        )
    # 1 s of decode each round: 30 rounds alone, 30 rounds of four
    truth = (30 * DECODE + 30 * 300.0) / (30 * 50 + 30 * 4 * 45)

    def decode(sol):
        assert sol is not None
        return sol.coef[sol.columns.index((KEY, "decode"))]

    assert abs(decode(fit_gpu(steps, works, weighted=False)) / truth - 1) > 0.08
    assert decode(fit_gpu(steps, works)) == pytest.approx(truth, rel=0.03)


# --- the feeding (proxy.services.power.fit) and the report's reading of its gauges ---------


class _Gpus:
    """GPU "0" serves every request; nothing in flight."""

    def serves(self, gpu, ex):
        return gpu == "0"

    def in_flight(self, gpu):
        return []


def _exchange(w: Work, stream: bool = True):
    from types import SimpleNamespace

    marks = SimpleNamespace(t_sent=w.sent, t_first=w.first, t_last=w.last, t_end=w.end)
    ex = SimpleNamespace(
        marks=marks,
        prepared=SimpleNamespace(stream=stream),
        upstream_name=w.key[0],
        model_label=w.key[1],
        precision=w.key[2],
    )
    f = SimpleNamespace(
        prompt_tokens=w.prompt_tokens,
        processed_prompt_tokens=None,
        completion_tokens=w.output_tokens + 1,
    )
    return ex, f


def fed(n: int):
    from proxy.measure.metrics import Metrics
    from proxy.services.power.fit import EnergyFitter

    steps, works, jp, jd = synthetic(n)
    fitter = EnergyFitter(Metrics(), _Gpus(), clock=lambda: steps[-1].b)
    for s in steps:
        fitter.on_step("0", s.a, s.b, s.joules)
    for w in works:
        fitter.on_request(*_exchange(w))
    return fitter, steps, jp, jd


def test_the_fitter_serves_rows_and_gauges_and_the_report_reads_them_back():
    from proxy.measure.summary import Samples
    from proxy.tools.report import energy_from_gauges

    fitter, steps, jp, jd = fed(40)
    fitter.figures = fitter.fit(fitter._snapshot(steps[-1].b))
    fitter._publish(fitter.figures)
    (row,) = fitter.rows()
    assert (row["upstream"], row["model"], row["precision"]) == KEY
    assert row["prefill"]["joules_per_token"] == pytest.approx(jp, rel=1e-3)
    assert row["decode"]["joules_per_token"] == pytest.approx(jd, rel=1e-3)
    assert row["prefill"]["watts"] == pytest.approx(PREFILL, rel=1e-3)
    assert row["prefill"]["requests"] == 40 and row["unattributed_joules"] == 0.0
    # energy of requests phasewatch did not relay, as the ledger counts it: the row's
    # upstream's, never another upstream's
    other = fitter.metrics.gpu_unattributed_energy_joules_total
    other.labels(*KEY, "0", "not_relayed").inc(12.5)
    other.labels("elsewhere", KEY[1], KEY[2], "7", "not_relayed").inc(99.0)
    assert fitter.rows()[0]["unattributed_joules"] == 12.5
    (back,) = energy_from_gauges(Samples.from_registry(fitter.metrics.registry))
    assert back["prefill"] == pytest.approx(row["prefill"])
    assert back["decode"] == pytest.approx(row["decode"])


def test_an_unstreamed_request_and_a_full_book_leave_their_steps_out(monkeypatch):
    import proxy.services.power.fit as fit

    monkeypatch.setattr(fit, "MAX_WORKS", 30)
    fitter, steps, jp, _ = fed(40)
    snap_steps, snap_works = fitter._snapshot(steps[-1].b)["0"]
    assert len(snap_works) == 30
    # the steps of the 10 requests dropped are left out with them
    assert snap_steps[0].a >= snap_works[0].sent - 0.5
    figs = fitter.fit({"0": (snap_steps, snap_works)})
    assert figs[KEY]["prefill"].joules_per_token == pytest.approx(jp, rel=1e-3)
    # a request not streamed: its phases are unknown, it blocks its steps
    ex, f = _exchange(Work(KEY, 1.0, 1.1, 1.5, 1.5, 100, 10), stream=False)
    fitter.on_request(ex, f)
    assert fitter.works["0"][-1].first is None


def test_steps_the_engine_shared_with_others_are_left_out():
    """A step in which the engine also ran requests this process did not relay (another
    replica's, a direct client's) holds work the fit cannot see: it is left out, and
    what the fit finds on the rest is the truth still."""
    from proxy.measure.metrics import Metrics
    from proxy.services.power.fit import EnergyFitter

    steps, works, jp, jd = synthetic(40)
    fitter = EnergyFitter(Metrics(), _Gpus(), clock=lambda: steps[-1].b)
    for i, s in enumerate(steps):
        shared = i % 3 == 0
        # a shared step carries others' energy on top of ours
        fitter.on_step("0", s.a, s.b, s.joules * (3.0 if shared else 1.0), shared)
    for w in works:
        fitter.on_request(*_exchange(w))
    kept, _ = fitter._snapshot(steps[-1].b)["0"]
    assert fitter.shared_steps == len(range(0, len(steps), 3))
    assert len(kept) == len(steps) - fitter.shared_steps
    figs = fitter.fit(fitter._snapshot(steps[-1].b))
    assert figs[KEY]["prefill"].joules_per_token == pytest.approx(jp, rel=1e-3)
    assert figs[KEY]["decode"].joules_per_token == pytest.approx(jd, rel=1e-3)
