"""The own pages behind ``--api-key``: every own route but the probes needs the key (the
docs and the OpenAPI spec too), the key is checked before any redirect, and redirects are
relative, never built from the ``Host`` header (raw sockets). Browsers get in with Basic
(any user name, the key as password), a ``?key=`` link or the login form, both of which
set an HttpOnly, SameSite=Strict cookie that is not the key and opens no relayed route;
the key is never logged."""

from __future__ import annotations

import base64
import re
from urllib.parse import urljoin

import httpx
import pytest

from proxy.core.access import Access

from ...support.hostile import connect, read_response
from ...support.servers import start_proxy

KEY = "first-hour-key-5678"
UNICODE_KEY = "schlüssel-ключ-9"


@pytest.fixture(scope="module")
def keyed(sim):
    server = start_proxy(f"sim={sim.url}", args=["--api-key", KEY, "--api-key", UNICODE_KEY])
    yield server
    server.stop()


def raw_get(url: str, path: str, *headers: str) -> tuple[int, dict[str, str], bytes]:
    s = connect(url)
    try:
        head = [f"GET {path} HTTP/1.1", "Host: evil.example", *headers, "Connection: close"]
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        data = read_response(s)
    finally:
        s.close()
    top, _, body = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        fields[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), fields, body


@pytest.mark.parametrize(
    "path",
    [
        "/phasewatch/docs",
        "/phasewatch/openapi.json",
        "/phasewatch/docs/",
        "/phasewatch/api/summary/",
        "/phasewatch/debug/",
        "/phasewatch/docs/assets/swagger-ui-bundle.js",
    ],
)
def test_every_own_route_but_the_probes_needs_the_key_before_any_redirect(keyed, path):
    status, fields, _ = raw_get(keyed.url, path)
    assert status == 401, (path, status, fields)
    assert "location" not in fields
    assert fields["www-authenticate"].startswith("Basic ")


def test_a_trailing_slash_redirects_relative_never_to_the_host_header(keyed):
    auth = "Authorization: Bearer " + KEY
    for path, target in (
        ("/phasewatch/docs/", "/phasewatch/docs"),
        ("/phasewatch/api/summary/", "/phasewatch/api/summary"),
        ("/phasewatch/health/", "/phasewatch/health"),  # a probe: no key needed
        ("/phasewatch/ready/?x=1", "/phasewatch/ready?x=1"),
    ):
        status, fields, _ = raw_get(keyed.url, path, auth)
        assert status == 307, (path, status)
        location = fields["location"]
        assert "evil.example" not in location and not location.startswith(("http", "//")), location
        assert urljoin("http://h" + path, location) == "http://h" + target, (path, location)
    # the probes stay open
    for path in ("/phasewatch/health", "/phasewatch/ready"):
        assert raw_get(keyed.url, path)[0] == 200


def test_a_key_link_sets_a_strict_httponly_cookie_that_opens_the_pages_only(keyed):
    with httpx.Client(base_url=keyed.url, follow_redirects=False) as c:
        assert c.get("/phasewatch/", params={"key": "wrong"}).status_code == 401
        r = c.get("/phasewatch/", params={"key": KEY, "tab": "x"})
        assert r.status_code == 303, r.text
        assert KEY not in r.headers["location"] and r.headers["location"] == "./?tab=x"
        cookie = r.headers["set-cookie"]
        attrs = {a.strip().split("=")[0].lower() for a in cookie.split(";")}
        assert {"httponly", "samesite", "path"} <= attrs and "SameSite=Strict" in cookie
        name, value = cookie.split(";")[0].split("=", 1)
        assert KEY not in value
        jar = {name: value}
    with httpx.Client(base_url=keyed.url, cookies=jar) as c:
        assert c.get("/phasewatch/api/summary").status_code == 200
        assert c.get("/phasewatch/docs").status_code == 200
        assert c.get("/phasewatch/").status_code == 200
        # the cookie is for the pages: a relayed route still wants the key itself
        assert c.get("/v1/models").status_code == 401
    # a key beyond ASCII, percent-encoded in the link as browsers send it
    r = httpx.get(keyed.url + "/phasewatch/docs", params={"key": UNICODE_KEY})
    assert r.status_code == 303 and r.headers["location"] == "./docs", r.text
    with httpx.Client(
        base_url=keyed.url, cookies={name: value[:-1] + ("1" if value.endswith("0") else "0")}
    ) as c:
        assert c.get("/phasewatch/api/summary").status_code == 401
    assert KEY not in keyed.log()


def test_the_login_form_and_basic_auth(keyed):
    page = httpx.get(keyed.url + "/phasewatch/", headers={"accept": "text/html"})
    assert page.status_code == 401 and page.headers["www-authenticate"].startswith("Basic")
    assert "any user name" in page.text and re.search(
        r'<form method="post" action="./login"', page.text
    )
    login = keyed.url + "/phasewatch/login"
    bad = httpx.post(login, data={"key": "nope"}, headers={"accept": "text/html"})
    assert bad.status_code == 401 and "not valid" in bad.text
    good = httpx.post(login, data={"key": KEY})
    assert good.status_code == 303 and good.headers["location"] == "./"
    assert "HttpOnly" in good.headers["set-cookie"]
    form = {"content-type": "application/x-www-form-urlencoded"}
    huge = httpx.post(login, content=b"key=" + b"x" * 100_000, headers=form)
    assert huge.status_code == 413
    basic = base64.b64encode(f"anyone:{KEY}".encode()).decode()
    assert (
        httpx.get(
            keyed.url + "/phasewatch/", headers={"authorization": "Basic " + basic}
        ).status_code
        == 200
    )
    assert KEY not in keyed.log()


def test_the_page_cookie_is_not_passed_to_the_engine():
    access = Access([KEY], {})
    headers = [(b"cookie", b"a=1; phasewatch_key=abc; b=2"), (b"x-other", b"y")]
    assert access.upstream_headers(headers, "u") == [(b"cookie", b"a=1; b=2"), (b"x-other", b"y")]
    only = [(b"cookie", b"phasewatch_key=abc")]
    assert access.upstream_headers(only, "u") == []
