"""What a user sees of a run: the episodes a real run logged (`agentrl train` of the calculator tool example, 12 steps,
as a subprocess: the learning guard's run) checked against the batches it trained on, and `agentrl view` on that run
dir: its API's refusals (TestClient), and the page in a real headless browser (Debian's chromium through its
chromedriver and selenium; no browser download) showing the curves, an episode's turns, and a new step as the run
writes it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.run.batch_files import batch_path, load_batch
from agentrl.run.episode_log import episodes_file, read_episodes
from agentrl.trainer import advantages as adv_lib
from tests.servers import free_port, wait_until_healthy

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.heavy, pytest.mark.slow]


@pytest.fixture(scope="module")
def tool_run(tool_example_run) -> Path:
    """The learning guard's run of examples/math_tools.yaml (tests/conftest.py): 12 RL steps, episodes logged and
    batches saved every step, validated at steps 0, 6 and 12."""
    run_dir, stdout = tool_example_run
    summary = "".join(stdout.split())  # the table wraps long paths
    assert f"viewer agentrl view {run_dir}".replace(" ", "") in summary, "the end-of-run summary names the viewer"
    return run_dir


def _model_runs(sample) -> list[list[int]]:
    """The sample's model tokens, one list per contiguous run (a turn)."""
    return [sample.token_ids[a:b] for a, b in adv_lib.segments(sample.loss_mask)]


def test_logged_episodes_are_the_trained_samples(tool_run):
    tool_calls = 0
    for step in (1, 2):
        batch = load_batch(batch_path(tool_run / "batches", step))
        seq = adv_lib.sequence_advantages(
            "grpo", [s.reward for s in batch], [s.group_id for s in batch], [s.episode_id for s in batch]
        )
        lines = [e for e in read_episodes(episodes_file(tool_run, step)) if e["phase"] == "train"]
        assert [e["picked"] for e in lines] == ["worst", "best", "random"]
        returns = [s.reward for s in batch]
        assert lines[0]["episode_return"] == min(returns) and lines[1]["episode_return"] == max(returns)
        for e in lines:
            (i,) = [i for i, s in enumerate(batch) if s.episode_id == e["episode_id"]]  # trajectory-wise: one
            sample = batch[i]
            assert e["episode_return"] == sample.reward and e["step"] == step
            assert [t["token_ids"] for t in e["turns"]] == _model_runs(sample), "the same tokens, turn by turn"
            for t in e["turns"]:
                assert len(t["tokens"]) == len(t["token_ids"]) == len(t["versions"]) == len(t["advantages"])
                assert t["advantages"] == pytest.approx([seq[i]] * len(t["token_ids"]), abs=1e-4)  # GRPO's own
                assert set(t["versions"]) <= {step - 2, step - 1}  # max_staleness 1
            assert e["turns"][-1]["done"] and not any(t["done"] for t in e["turns"][:-1])
            replies = [m for m in e["messages"] if m["role"] == "assistant"]
            assert [m["turn"] for m in replies] == list(range(len(e["turns"])))
            for k, m in enumerate(e["messages"]):
                for call in m.get("tool_calls", []):
                    if call.get("name") == "calculator":
                        tool_calls += 1
                        assert "expression" in call["arguments"] and e["messages"][k + 1]["role"] == "tool"
    assert tool_calls > 0, "the warm-started policy calls its calculator, and the log shows the calls"
    validation = [e for s in (0, 6) for e in read_episodes(episodes_file(tool_run, s)) if e["phase"] == "validation"]
    assert {e["step"] for e in validation} == {0, 6} and all("advantages" not in e["turns"][0] for e in validation)


def test_the_episodes_reach_tensorboard_as_text(tool_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tool_run / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = acc.Tensors("episodes/train/math/text_summary")
    assert [t.step for t in texts] == list(range(1, 13))
    assert "calculator" in texts[0].tensor_proto.string_val[0].decode()


def test_the_api_refuses_paths_outside_the_run_dir_and_bad_parameters(tool_run, tmp_path):
    from fastapi.testclient import TestClient

    from agentrl.viewer.server import build_app

    outside = tmp_path / "secret.txt"
    outside.write_text("not the run's")
    link = tool_run / "link-out"
    link.symlink_to(outside)
    try:
        client = TestClient(build_app(tool_run))
        assert client.get("/api/files/config.yaml").text.startswith("name: math_tools")
        for bad in ("..%2F..%2Fsecret.txt", "%2E%2E/%2E%2E/etc/passwd", "link-out", "%2Fetc%2Fpasswd"):
            res = client.get(f"/api/files/{bad}")
            assert res.status_code == 403, (bad, res.status_code)
        assert client.get("/api/files/no-such-file").status_code == 404
        for url in ("/api/episodes/-1", "/api/episodes/x", "/api/episodes/1?phase=bogus", "/api/metrics?since=-3",
                    "/api/metrics?since=abc"):  # fmt: skip
            assert client.get(url).status_code == 422, url
        assert client.get("/api/episodes/99").status_code == 404
        assert [e["phase"] for e in client.get("/api/episodes/6?phase=validation").json()] == ["validation"] * 3
        rows = client.get("/api/metrics?since=0").json()
        assert rows["next"] == len(rows["rows"]) and {r["step"] for r in rows["rows"]} >= set(range(13))
        assert client.get(f"/api/metrics?since={rows['next']}").json() == {"rows": [], "next": rows["next"]}

        guarded = TestClient(build_app(tool_run, token="s3cret"))
        assert guarded.get("/api/steps").status_code == 401
        assert guarded.get("/api/steps", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert guarded.get("/api/steps", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert guarded.get("/?token=s3cret").status_code == 200
    finally:
        link.unlink()


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=options)


def _wait(what: str, check, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = check()
        except Exception:  # the element is not there yet (or was just redrawn)
            got = None
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"the page did not show {what} within {timeout_s:.0f} s")


def test_the_page_shows_curves_episodes_and_a_new_step_as_the_run_writes_it(tool_run, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    # The run as it stood after step 1: its files up to then; step 2 arrives while the page is open.
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(tool_run / "config.yaml", live / "config.yaml")
    rows = (tool_run / "metrics.jsonl").read_text().splitlines(keepends=True)
    early = [r for r in rows if json.loads(r)["step"] <= 1]
    (live / "metrics.jsonl").write_text("".join(early))
    (live / "episodes").mkdir()
    for step in (0, 1):
        shutil.copy(episodes_file(tool_run, step), episodes_file(live, step))

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "agentrl", "view", str(live), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    driver = None
    try:
        wait_until_healthy(server, f"http://127.0.0.1:{port}")
        driver = _browser()
        driver.get(f"http://127.0.0.1:{port}/")
        panel = _wait("the held-out success panel", lambda: driver.find_element(
            By.CSS_SELECTOR, '.panel[data-title="held-out success"] path[data-series="val/success"]'))  # fmt: skip
        assert panel.get_attribute("d").startswith("M")
        titles = [p.get_attribute("data-title") for p in driver.find_elements(By.CSS_SELECTOR, ".panel")]
        assert {"training success", "episode return", "loss"} <= set(titles)

        driver.find_element(By.CSS_SELECTOR, '.tab[data-tab="episodes"]').click()
        step = Select(driver.find_element(By.ID, "step"))
        _wait("step 1 selected", lambda: step.first_selected_option.text == "step 1")
        Select(driver.find_element(By.ID, "phase")).select_by_visible_text("train")
        items = _wait("the picked episodes", lambda: driver.find_elements(By.CSS_SELECTOR, "#episode-list li"))
        assert [i.find_element(By.CLASS_NAME, "why").text.lower() for i in items] == ["worst", "best", "random"]
        items[1].click()
        best = next(e for e in read_episodes(episodes_file(tool_run, 1)) if e["picked"] == "best")
        _wait("the best episode", lambda: best["episode_id"] in driver.find_element(By.ID, "episode-head").text)
        turns = driver.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")
        assert len(turns) == len(best["turns"])
        tokens = turns[0].find_elements(By.CSS_SELECTOR, ".tok")
        assert len(tokens) == len(best["turns"][0]["token_ids"])
        assert "advantage" in tokens[0].get_attribute("title")
        roles = [m.find_element(By.CLASS_NAME, "role").text.lower() for m in driver.find_elements(
            By.CSS_SELECTOR, "#messages .message")]  # fmt: skip
        assert roles == [m["role"] for m in best["messages"]]
        assert driver.find_element(By.ID, "turn-pos").text == f"turn 1 of {len(best['turns'])}"
        driver.find_element(By.ID, "next-turn").click()
        assert driver.find_element(By.CSS_SELECTOR, ".message.current").get_attribute("data-turn") == "1"

        # The run writes step 2 (its metrics, then its episodes): the page shows it without a reload.
        with (live / "metrics.jsonl").open("a") as f:
            f.writelines(r for r in rows if json.loads(r)["step"] == 2)
        shutil.copy(episodes_file(tool_run, 2), episodes_file(live, 2))
        _wait("step 2", lambda: "step 2" in [o.text for o in Select(driver.find_element(By.ID, "step")).options])
        _wait("step 2 selected", lambda: Select(driver.find_element(By.ID, "step")).first_selected_option.text
              == "step 2")  # fmt: skip
        driver.find_element(By.CSS_SELECTOR, '.tab[data-tab="curves"]').click()
        legend = driver.find_element(By.CSS_SELECTOR, '.panel[data-title="loss"] .legend').text
        shown_rows = [row for row in map(json.loads, rows) if row["step"] <= 2]  # what the live run dir holds
        last_loss = [row for row in shown_rows if "train/loss" in row][-1]["train/loss"]
        shown = float(legend.split("train/loss ")[1].split()[0])  # the legend's latest value (4 significant digits)
        assert shown == pytest.approx(last_loss, rel=1e-3)
        driver.find_element(By.CSS_SELECTOR, '.tab[data-tab="config"]').click()
        assert "name: math_tools" in driver.find_element(By.ID, "config-text").text
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)
