"""The status-page login under attack, through a real proxy on loopback.

- A login post from another origin (``Origin: https://evil.example``, ``Sec-Fetch-Site:
  cross-site``, a ``text/plain`` form that needs no preflight) is refused before its key
  is read, and sets no cookie; the proxy's own page's post still logs in.
- Wrong keys are throttled per client address (``--max-key-failures``), through Bearer,
  the form and ``?key=`` alike: beyond the limit every key from that address gets 429
  unchecked, the right one too, while another address is not affected.
- The cookie expires (``--page-cookie-ttl``), does not survive a restart, and holds in
  every worker of one start.
- ``?key=`` on a relayed route never reaches the engine.
"""

from __future__ import annotations

import time

import httpx

from ...support.fake_engine import FakeEngine
from ...support.servers import sample, start_proxy, wait_for

KEY = "login-key-8231"
MODEL = "m"
FORM = {"content-type": "application/x-www-form-urlencoded"}


def keyed_metrics(proxy) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(proxy.url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def login(proxy, key: str = KEY, client: httpx.Client | None = None, **headers) -> httpx.Response:
    post = client.post if client is not None else httpx.post
    return post(
        proxy.url + "/phasewatch/login",
        content=f"key={key}".encode(),
        headers={**FORM, **{k.replace("_", "-"): v for k, v in headers.items()}},
        follow_redirects=False,
    )


def test_a_cross_origin_login_is_refused_and_sets_no_cookie():
    engine = FakeEngine(models=[MODEL]).start()
    proxy = start_proxy(f"e={engine.url}", args=["--api-key", KEY])
    try:
        own = proxy.url.replace("http://", "")
        hostile = [
            login(proxy, origin="https://evil.example"),
            login(proxy, origin="null"),
            login(proxy, origin=f"http://{own}.evil.example"),
            login(proxy, sec_fetch_site="cross-site"),
            login(proxy, sec_fetch_site="same-site", origin=f"http://{own}"),
            login(proxy, content_type="text/plain"),  # a form with no preflight, no Origin
            login(proxy, content_type="text/plain", origin="https://evil.example"),
        ]
        for r in hostile:
            assert r.status_code == 403, (r.request.headers, r.status_code)
            assert "set-cookie" not in r.headers
        counted = sample(keyed_metrics(proxy), "phasewatch_rejected_total", reason="login_origin")
        assert counted == len(hostile)
        # the proxy's own page: same-origin, the Origin its own
        ok = login(proxy, origin=f"http://{own}", sec_fetch_site="same-origin")
        assert ok.status_code == 303 and "set-cookie" in ok.headers
        assert login(proxy).status_code == 303  # no browser (no Origin): a form post
        assert KEY not in proxy.log()
    finally:
        proxy.stop()
        engine.stop()


def client_from(address: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30)


def test_wrong_keys_are_throttled_per_address_through_every_way_in():
    engine = FakeEngine(models=[MODEL]).start()
    proxy = start_proxy(f"e={engine.url}", args=["--api-key", KEY, "--max-key-failures", "10"])
    try:
        attacker = client_from("127.0.0.2")
        codes = []
        started = time.monotonic()
        for i in range(200):
            way = i % 3
            if way == 0:
                r = attacker.get(
                    proxy.url + "/v1/models", headers={"authorization": f"Bearer g{i}"}
                )
            elif way == 1:
                r = login(proxy, f"g{i}", attacker)
            else:
                r = attacker.get(proxy.url + "/phasewatch/", params={"key": f"g{i}"})
            codes.append(r.status_code)
        took = time.monotonic() - started
        checked = sum(1 for c in codes if c == 401)
        print(f"200 guesses in {took:.2f}s: {checked} checked, {codes.count(429)} refused (429)")
        # the bucket: 10, plus what refilled at 10 a minute while the guesses ran
        assert checked <= 10 + 1 + int(took / 6), codes
        assert codes.count(429) == 200 - checked and 429 in codes[:20]
        last = attacker.get(proxy.url + "/v1/models", headers={"authorization": "Bearer x"})
        assert 1 <= int(last.headers["retry-after"]) <= 6
        # the right key from that address is refused unchecked too
        right = attacker.get(proxy.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})
        assert right.status_code == 429
        # another address is not affected
        other = client_from("127.0.0.3")
        assert (
            other.get(
                proxy.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"}
            ).status_code
            == 200
        )
        assert (
            other.get(proxy.url + "/v1/models", headers={"authorization": "Bearer bad"}).status_code
            == 401
        )
        s = keyed_metrics(proxy)
        assert sample(s, "phasewatch_rejected_total", reason="key_guesses") >= 190
        lines = [x for x in proxy.log().splitlines() if "--max-key-failures" in x]
        assert len(lines) == 1 and "127.0.0.2" in lines[0]
        assert "g1" not in proxy.log()  # no guessed key logged
    finally:
        proxy.stop()
        engine.stop()


def test_the_page_cookie_expires_ends_with_a_restart_and_holds_in_every_worker():
    engine = FakeEngine(models=[MODEL]).start()
    short = start_proxy(f"e={engine.url}", args=["--api-key", KEY, "--page-cookie-ttl", "2"])
    workers = start_proxy(f"e={engine.url}", args=["--api-key", KEY, "--workers", "2"])
    try:
        r = login(short)
        assert "Max-Age=2;" in r.headers["set-cookie"]
        jar = dict([r.headers["set-cookie"].split(";")[0].split("=", 1)])
        page = short.url + "/phasewatch/api/summary"
        assert httpx.get(page, cookies=jar).status_code == 200
        wait_for(lambda: httpx.get(page, cookies=jar).status_code == 401, what="cookie expiry")
        # every worker of one start takes the cookie (new connections spread over them)
        r = login(workers)
        jar = dict([r.headers["set-cookie"].split(";")[0].split("=", 1)])
        codes = {
            httpx.get(workers.url + "/phasewatch/api/summary", cookies=jar).status_code
            for _ in range(30)
        }
        assert codes == {200}
        # a restart ends it
        workers.stop()
        again = start_proxy(f"e={engine.url}", args=["--api-key", KEY])
        try:
            assert httpx.get(again.url + "/phasewatch/api/summary", cookies=jar).status_code == 401
        finally:
            again.stop()
    finally:
        short.stop()
        workers.stop()
        engine.stop()


def test_a_key_in_the_query_never_reaches_the_engine():
    engine = FakeEngine(models=[MODEL]).start()
    proxy = start_proxy(f"e={engine.url}", args=["--api-key", KEY])
    try:
        auth = {"authorization": f"Bearer {KEY}"}
        for query in (f"key={KEY}&x=1", f"x=1&k%65y={KEY}", f"key={KEY}&key=2&x=1"):
            r = httpx.post(
                proxy.url + "/v1/chat/completions?" + query,
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                headers=auth,
            )
            assert r.status_code == 200
            target = engine.posts()[-1].target
            assert KEY not in target and "key" not in target and "x=1" in target, target
    finally:
        proxy.stop()
        engine.stop()
