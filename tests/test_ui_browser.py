"""
The status page in a real headless browser (Debian's chromium through
selenium and chromedriver) against real daemons: the page asks for the
caller key, shows the connected node and its provider, follows in_use up
while a slow stream runs and back to 0 when it ends, lists the run, and
fits a phone's width. Screenshots go to the test's temp folder (and to
$IOP_SCREENSHOT_DIR when set, which is how docs/status-page.png is made).

Skipped, saying why, only where no browser is installed; .ci/run installs
one so CI always runs it.
"""

import http.client
import json
import os
import shutil
import threading

import pytest
from support.daemons import echo_node, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="no headless browser: install Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
)

TEXT = " ".join(f"word{n}" for n in range(20))


@pytest.fixture
def browser(tmp_path, monkeypatch):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    # Never let selenium look for a driver on the network: ours is given.
    monkeypatch.setenv("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,1000",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver, tmp_path, name):
    path = tmp_path / name
    driver.save_screenshot(str(path))
    extra = os.environ.get("IOP_SCREENSHOT_DIR")
    if extra:
        shutil.copy(path, os.path.join(extra, name))
    return path


def slow_run(edge, done):
    """
    One streamed native run read to its end (in a thread), with the key.
    """
    conn = http.client.HTTPConnection("127.0.0.1", edge.http_port, timeout=30)
    try:
        body = json.dumps({"model": "echo-model", "input": TEXT, "stream": True})
        conn.request("POST", "/v1/runs", body, {"content-type": "application/json", "authorization": "Bearer caller"})
        done["body"] = conn.getresponse().read()
    finally:
        conn.close()


#: Makes the page read each state as an Edge of a cluster would answer it:
#: node-2 held by edge-b, two requests waiting on node-1's echo adapter.
CLUSTER_VIEW = """
const real = window.fetch.bind(window);
window.fetch = async (url, init) => {
  const response = await real(url, init);
  const data = await response.json();
  data.status.cluster = {edge_id: "edge-a", edges: []};
  for (const node of data.status.nodes) node.edge = node.id === "node-2" ? "edge-b" : "edge-a";
  data.status.direct_queues = [{name: "node-1/echo", queued: 2}];
  return new Response(JSON.stringify(data), {status: response.status, headers: {"content-type": "application/json"}});
};
"""


def test_status_page_live(launch, browser, tmp_path):
    """
    The page asks for the key, then shows node-1 ready with its echo
    provider; in_use goes to 1 while a slow stream runs and back to 0
    after it; the run is listed complete; nothing overflows a phone's
    width.
    """
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    edge = launch.edge(
        {
            "nodes": [echo_node("node-1", "tok-1", delay_ms=150), echo_node("node-2", "tok-2")],
            "model_groups": [{"name": "echo-model", "providers": [{"node": "node-1", "provider": "echo"}]}],
            "api_keys": ["caller"],
            "admin_keys": ["adm"],
        }
    )
    launch.node(edge.node_port, "tok-1")
    wait_for(lambda: edge.status_with("caller")["nodes"][0]["connected"], what="node-1 to connect")
    # The page redraws every 1.5 s: an element read between two redraws
    # may be gone, so every read goes through a wait that retries it.
    wait = WebDriverWait(browser, 15, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,))

    def text(selector):
        return browser.find_element(By.CSS_SELECTOR, selector).text

    browser.get(edge.base_url + "/")
    assert browser.current_url.endswith("/ui/")
    wait.until(lambda d: d.find_element(By.ID, "key-form").is_displayed())
    browser.find_element(By.ID, "key-input").send_keys("caller")
    browser.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()

    node = wait.until(lambda d: text('[data-node="node-1"][data-state="ready"]'))
    assert not browser.find_element(By.ID, "key-form").is_displayed()
    assert "generation 1" in node
    assert wait.until(lambda d: text('[data-node="node-2"][data-state="offline"]'))
    normal = '[data-provider="node-1/echo"] [data-in-use="normal"]'
    wait.until(lambda d: text(normal) == "0")

    done = {}
    runner = threading.Thread(target=slow_run, args=(edge, done), daemon=True)
    runner.start()
    try:
        wait.until(lambda d: text(normal) == "1")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#runs [data-run] .badge.running"))
        screenshot(browser, tmp_path, "status-page.png")
    finally:
        runner.join(timeout=30)
    assert b'"complete"' in done.get("body", b"")
    wait.until(lambda d: text(normal) == "0")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#runs [data-run] .badge.complete"))
    assert browser.find_element(By.ID, "live").get_attribute("data-state") == "live"

    # In a cluster a node held by another Edge is shown so, not offline,
    # and work waiting for a node's adapter named directly is queued too
    # (both read from the Edge's own answer, amended as a cluster's is).
    browser.execute_script(CLUSTER_VIEW)
    wait.until(lambda d: text('[data-node="node-2"][data-state="elsewhere"]'))
    assert "connected to Edge edge-b" in text('[data-node="node-2"] .meta')
    wait.until(lambda d: text("#sum-queued") == "2")
    assert text("#sum-nodes") == "2 / 2"
    assert text('#groups [data-group="node-1/echo"]').split()[-1] == "2"

    browser.set_window_size(390, 844)
    wait.until(lambda d: d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth"))
    screenshot(browser, tmp_path, "status-page-phone.png")
    assert (tmp_path / "status-page.png").stat().st_size > 10_000
