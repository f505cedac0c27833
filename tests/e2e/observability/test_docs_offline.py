"""``/phasewatch/docs`` works on a host with no internet: the page and every asset it names
are served by phasewatch itself (Swagger UI from the fastapi-offline package), and
headless Chromium, reaching the page through a ``?key=`` link on a keyed proxy, renders
the operations from nothing but the proxy's own origin."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import httpx
import pytest

from ...support.browser import Browser
from ...support.servers import start_proxy

KEY = "docs-offline-key-1234"


class Refs(HTMLParser):
    """Every src and href of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href") and value:
                self.refs.append(value)


@pytest.fixture(scope="module")
def keyed(sim):
    server = start_proxy(f"sim={sim.url}", args=["--api-key", KEY])
    yield server
    server.stop()


def test_the_docs_page_and_every_asset_it_names_come_from_phasewatch(keyed):
    auth = {"authorization": f"Bearer {KEY}"}
    page = httpx.get(keyed.url + "/phasewatch/docs", headers=auth)
    assert page.status_code == 200, page.text
    assert "cdn" not in page.text.lower()
    parser = Refs()
    parser.feed(page.text)
    # the stylesheet, the icon and the script (and the spec, named in the script)
    assert len(parser.refs) >= 3, parser.refs
    spec = re.search(r"url: '([^']+)'", page.text)
    assert spec is not None
    base = keyed.url + "/phasewatch/docs"
    for ref in [*parser.refs, spec.group(1)]:
        url = urljoin(base, ref)
        assert urlsplit(url).netloc == urlsplit(keyed.url).netloc, f"external asset {ref}"
        got = httpx.get(url, headers=auth)
        assert got.status_code == 200 and len(got.content) > 100, (ref, got.status_code)
        if ref.endswith(".css"):  # a stylesheet may name more files: none of them external
            assert not re.search(r"url\(\s*['\"]?(https?:)?//", got.text), ref
    css = httpx.get(keyed.url + "/phasewatch/docs/assets/swagger-ui.css", headers=auth)
    assert css.headers["content-type"].startswith("text/css")
    # only the bundle's files, no other file of the package or the disk
    for name in ("index.html", "..%2F__init__.py", "swagger-ui.js.map"):
        assert httpx.get(
            keyed.url + "/phasewatch/docs/assets/" + name, headers=auth
        ).status_code in (
            400,
            404,
        ), name
    # a content security policy that lets the browser fetch from this origin only
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "https:" not in csp and "*" not in csp


def test_chromium_renders_the_operations_from_the_proxy_alone(keyed):
    browser = Browser()
    try:
        # a ?key= link sets the page cookie; the page then fetches its spec with it
        page = browser.page(keyed.url + f"/phasewatch/docs?key={KEY}", 1200, 900)
        paths = page.wait(
            """(() => { const p = [...document.querySelectorAll('.opblock-summary-path')]
                        .map(e => e.textContent.trim()); return p.length >= 5 ? p : null; })()""",
            timeout=60,
        )
        assert "/phasewatch/api/summary" in paths and "/phasewatch/ready" in paths, paths
        assert page.eval("location.href") == keyed.url + "/phasewatch/docs"  # the key is gone
        origins = page.eval(
            "[location.href, ...performance.getEntriesByType('resource').map(e => e.name)]"
        )
        assert len(origins) >= 4, origins
        assert all(o.startswith(keyed.url + "/") for o in origins), origins
        page.close()
    finally:
        browser.close()
