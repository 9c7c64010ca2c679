"""The search page at ``/`` of `hpcfed search serve`, in a real headless browser (Chromium from the
system's packages, driven by Selenium): it types a query, sees the results grouped by site with label
names and texts, applies a filter, keeps a screenshot, and shows a ``<script>`` query and a 100 KB
query as text. Skips, saying why, where no browser or driver can be found (.ci/run installs them)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from search_data import EVENTS, write_message_sites
from test_service import Service

pytestmark = pytest.mark.usefixtures("own_keys")  # index keys in a temporary folder
WAIT = 90  # seconds: the shared machine may be slow to start a browser


def _browser() -> Any:
    """A headless Chromium driven by Selenium, or a skip naming what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install "
                                                                 "'hpcfed[browser]'; .ci/run does)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no Chromium or chromedriver on PATH (apt-get install chromium chromium-driver; .ci/run does)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,1400"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    browser = _browser()
    run = tmp_path_factory.mktemp("page")
    write_message_sites(run, [200, 150])
    service = Service([str(run), "--exact"])
    try:
        browser.get(service.url + "/")
        yield browser, service.url
    finally:
        browser.quit()
        service.stop()


def _search(browser: Any, query: str, *, kind: str = "id", typed: bool = True, k: int = 10, **filters: str) -> str:
    """Fill the form, submit, wait for the status line to change; returns it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.ui import WebDriverWait

    box = browser.find_element(By.ID, "query")
    box.clear()
    if typed:
        box.send_keys(query)
    else:  # 100 KB: set at once, as a paste would (typing it key by key takes minutes)
        browser.execute_script("arguments[0].value = arguments[1];", box, query)
    Select(browser.find_element(By.ID, "kind")).select_by_value(kind)
    browser.find_element(By.ID, "k").clear()
    browser.find_element(By.ID, "k").send_keys(str(k))
    Select(browser.find_element(By.ID, "f-site")).select_by_value(filters.get("site", ""))
    for name in ("label", "from", "to", "other"):
        field = browser.find_element(By.ID, f"f-{name}")
        field.clear()
        field.send_keys(filters.get(name, ""))
    browser.execute_script("document.getElementById('status').textContent = '';")
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, WAIT).until(lambda b: b.find_element(By.ID, "status").text not in ("", "searching ..."))
    return str(browser.find_element(By.ID, "status").text)


def _hits(browser: Any) -> list[tuple[str, str, str, str]]:
    """(section's site, id, label shown, text) of every hit on the page, read in one script: one WebDriver
    round trip, not four per hit (400 of them for k = 100 outran the test's time limit on a loaded machine)."""
    rows = browser.execute_script(
        "return [...document.querySelectorAll('section.site')].flatMap(s => [...s.querySelectorAll('.hit')]"
        ".map(h => [s.dataset.site, ...['.id', '.label', '.doc'].map(c => h.querySelector(c).innerText.trim())]));")
    return [(str(site), str(hit_id), str(label), str(text)) for site, hit_id, label, text in rows]


def test_a_query_shows_results_by_site_then_a_filter_narrows_them(page: tuple[Any, str], tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    browser, _ = page
    assert _search(browser, "m0-5", k=100) == "100 results"
    hits = _hits(browser)
    assert len(hits) == 100 and {site for site, *_ in hits} == {"0", "1"}
    assert all(hit_id.startswith(f"m{site}-") for site, hit_id, *_ in hits)  # grouped under their site
    assert all(label in EVENTS and text.startswith("message ") for _, _, label, text in hits)
    assert browser.find_element(By.ID, "json").get_attribute("href").startswith("blob:")
    assert _search(browser, "m0-5", site="1", label="fire") == "10 results"
    narrowed = _hits(browser)
    assert {(site, label) for site, _, label, _ in narrowed} == {("1", "fire")}
    shot = Path(os.environ.get("HPCFED_ARTIFACTS") or tmp_path) / "search-page.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "'colour': no site's export carries that attribute" in _search(browser, "m0-5", other="colour=red")


def test_a_script_tag_and_a_100_kb_query_are_shown_as_text(page: tuple[Any, str]) -> None:
    from selenium.webdriver.common.by import By

    browser, _ = page
    attack = "<script>window.pwned=1</script><img src=x onerror=\"window.pwned=2\"><b>bold</b>"
    error = _search(browser, attack)  # an id no site holds: the error names it, as text
    echo = browser.find_element(By.ID, "echo")
    assert echo.get_attribute("textContent") == attack and attack in error
    assert not echo.find_elements(By.XPATH, "./*") and not browser.find_elements(By.CSS_SELECTOR, "#status *")
    assert browser.execute_script("return window.pwned === undefined")
    assert browser.execute_script("return document.querySelectorAll('b:not(.id), script[src], img').length") == 0
    huge = ("<i>x</i>" + "y" * 992) * 100  # 100 KB
    status = _search(browser, huge, kind="text", typed=False)
    assert status  # the service refuses it (too long, or no text model): the page says so, and lives on
    assert echo.get_attribute("textContent") == huge and not echo.find_elements(By.XPATH, "./*")
    assert browser.execute_script("return document.querySelectorAll('i').length") == 0
    assert _search(browser, "m1-3") == "10 results"
