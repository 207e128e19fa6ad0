"""The dashboard in a real browser: `infersim dashboard --port N` in a subprocess, headless Chromium (Debian's
chromium and chromium-driver, driven by selenium) loads What-if, picks a scenario, changes a widget, simulates, and
the page shows the result and no error; then a long run is cancelled. The screenshot is kept as a test artefact
(runs/artifacts/, or $INFERSIM_ARTIFACTS)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from sim.config import environment

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = environment.artifacts_dir(ROOT / "runs" / "artifacts")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WAIT_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    port = free_port()
    sibling = Path(sys.executable).with_name("infersim")  # the console script of this Python's install
    cli = str(sibling) if sibling.exists() else shutil.which("infersim") or "infersim"
    log = tmp_path / "dashboard.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([cli, "dashboard", "--port", str(port)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://localhost:{port}"
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                urllib.request.urlopen(f"{url}/_stcore/health", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the dashboard did not start: {log.read_text()[-2000:]}")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@pytest.fixture
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1600,1700"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def by_label(driver, label: str):
    return driver.find_element(By.CSS_SELECTOR, f"input[aria-label='{label}']")


def button(driver, text: str):
    return driver.find_element(By.XPATH, f"//button[.//p[normalize-space()='{text}']]")


def metric(driver, label: str) -> str:
    box = driver.find_element(By.XPATH, f"//div[@data-testid='stMetric'][.//p[normalize-space()='{label}']]")
    return box.find_element(By.CSS_SELECTOR, "[data-testid='stMetricValue']").text


def expected_throughput(rate: float) -> str:
    """What the simulator itself says for the picked scenario at `rate`: the page must show the same."""
    import yaml

    from infersim.api import simulate_data

    data = yaml.safe_load((ROOT / "scenarios" / "static_vs_continuous_continuous.yaml").read_text())
    data["workload"]["arrival"]["rate"] = rate
    return f"{simulate_data(data, ROOT / 'scenarios').report['throughput']['requests_per_s']:.3g}"


def test_whatif_in_a_browser(server, browser):
    wait = WebDriverWait(browser, WAIT_S)
    browser.get(server)
    wait.until(EC.element_to_be_clickable((By.XPATH, "//button[.//p[normalize-space()='Simulate']]")))
    pick = by_label(browser, "Start from a scenario")
    pick.click()
    pick.send_keys("static_vs_continuous_continuous")
    pick.send_keys(Keys.ENTER)
    wait.until(lambda d: by_label(d, "Start from a scenario").get_attribute("value").endswith("continuous.yaml"))
    browser.find_element(By.XPATH, "//*[@role='tab'][.//p[normalize-space()='Workload']]").click()
    rate = wait.until(EC.visibility_of_element_located((By.CSS_SELECTOR, "input[aria-label='Rate (requests/s)']")))
    assert rate.get_attribute("value") == "1"
    rate.send_keys(Keys.CONTROL, "a")
    rate.send_keys("6", Keys.ENTER)  # Enter commits the value: the Simulate click below sends it
    button(browser, "Simulate").click()
    wait.until(EC.presence_of_element_located((By.XPATH, "//div[@data-testid='stMetric']")))
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, "[data-testid='stProgress']"))
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")) >= 2)
    assert metric(browser, "Completed") == "600"
    assert metric(browser, "TTFT p90").endswith(" s")
    assert metric(browser, "Throughput, req/s") == expected_throughput(6.0)  # 4.89 at 6 requests/s offered
    assert browser.find_element(By.CSS_SELECTOR, "input[aria-label='Rate (requests/s)']").get_attribute("value") == "6"
    assert not browser.find_elements(By.CSS_SELECTOR, "[data-testid='stException']")
    assert not browser.find_elements(By.XPATH, "//div[@data-testid='stAlertContentError']")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard-whatif.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000

    # a long run (200,000 requests, ~20 s) stops at Cancel
    count = by_label(browser, "Number of requests")
    count.send_keys(Keys.CONTROL, "a")
    count.send_keys("200000", Keys.ENTER)
    button(browser, "Simulate").click()
    cancel = wait.until(EC.element_to_be_clickable((By.XPATH, "//button[.//p[normalize-space()='Cancel']]")))
    t0 = time.monotonic()
    cancel.click()
    wait.until(EC.text_to_be_present_in_element((By.CSS_SELECTOR, "[data-testid='stMain']"), "Cancelled."))
    assert time.monotonic() - t0 < 10
    assert not browser.find_elements(By.CSS_SELECTOR, "[data-testid='stException']")
