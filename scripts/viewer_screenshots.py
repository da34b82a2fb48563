"""Screenshots of `agentrl view` for the README and the docs: the curves and one episode of RUN_DIR, as headless
chromium shows them (Debian's chromium and chromedriver, through selenium).

    python scripts/viewer_screenshots.py RUN_DIR OUT_DIR [--step N] [--pick best]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--step", type=int, help="the step whose episode to show (default: the newest)")
    p.add_argument("--pick", default="best", choices=["worst", "best", "random"])
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "agentrl", "view", str(args.run_dir), "--port", str(port)])
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(arg)
    driver = None
    try:
        for _ in range(100):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        driver.get(f"http://127.0.0.1:{port}/")
        time.sleep(3)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.out_dir / "viewer-curves.png"))
        driver.find_element(By.CSS_SELECTOR, '.tab[data-tab="episodes"]').click()
        time.sleep(1)
        if args.step is not None:
            Select(driver.find_element(By.ID, "step")).select_by_value(str(args.step))
            time.sleep(1)
        Select(driver.find_element(By.ID, "phase")).select_by_visible_text("train")
        time.sleep(1)
        for item in driver.find_elements(By.CSS_SELECTOR, "#episode-list li"):
            if item.find_element(By.CLASS_NAME, "why").text.lower() == args.pick:
                item.click()
        time.sleep(1)
        driver.save_screenshot(str(args.out_dir / "viewer-episode.png"))
        print(f"wrote {args.out_dir / 'viewer-curves.png'} and {args.out_dir / 'viewer-episode.png'}")
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
