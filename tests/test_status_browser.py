"""The status page in a real browser during a real demo run, then the HTML report.

Headless Chromium (Debian packages chromium and chromium-driver: `make browser-deps`) driven by
Selenium. The page must show progress moving while the run goes and 100% at the end; a
screenshot of each page is kept in tests/artifacts/.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.core.storage import ReadOnlyStorage
from dflash_pipeline.status.server import StatusServer
from dflash_pipeline.status.snapshot import RunSource, SnapshotBuilder
from tests.support.ci import skip_unless_ci

pytestmark = [pytest.mark.workflow, pytest.mark.browser]

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "tests" / "artifacts"
NUM_SHARDS = 2


def chromium_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser and driver:
        return browser, driver
    skip_unless_ci("headless Chromium is missing: run `make browser-deps` (Debian chromium + chromium-driver)")


@pytest.fixture
def browser():
    binary, driver_path = chromium_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1400",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def start_run(workflow) -> subprocess.Popen:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # The logger plugin is found by module name, as from an installed package.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "2", "--logger", "dflash"],
        cwd=workflow.root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # A process group of its own, so the test can pause the run and all its jobs at once.
        start_new_session=True,
    )


def shard_in_flight(run_root: Path) -> tuple[str, int] | None:
    """A generate or tokenize shard whose telemetry says running and whose output is not
    written yet. Read while the run is paused, the answer cannot change under the page."""
    for stage in ("generate", "tokenize"):
        for shard in range(NUM_SHARDS):
            if (run_root / layout.shard_key(stage, shard)).exists():
                continue
            telemetry = run_root / layout.progress_prefix(stage, shard) / "telemetry.json"
            try:
                record = json.loads(telemetry.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            if record.get("state") == "running":
                return stage, shard
    return None


# Read in one script call: the page re-renders its tables every poll, so element handles from
# separate calls can go stale in between.
READ_PAGE = r"""
const value = (node) => node.getAttribute("aria-valuenow");
return {
  overall: value(document.getElementById("overall-progress")),
  shards: [...document.querySelectorAll("tr.running-shard .bar")].map(value),
  evaluation: document.getElementById("evaluation").textContent,
  curvePoints: (document.querySelector("#chart-loss polyline")?.getAttribute("points") || "")
    .trim().split(/\s+/).filter(Boolean).length,
  segmentTaus: [...document.querySelectorAll("#segments tbody td.segment-tau")].map((cell) => cell.textContent),
  segmentTauDots: document.querySelectorAll("#chart-segment-tau circle").length,
  stages: Object.fromEntries([...document.querySelectorAll("#stages tbody tr")].map(
    (row) => [row.dataset.stage, row.querySelectorAll("td")[2].textContent])),
  runningStages: [...document.querySelectorAll("#stages tbody tr")]
    .filter((row) => row.querySelectorAll("td")[3].textContent !== "0").map((row) => row.dataset.stage),
  generationRate: document.getElementById("tokens-per-s").textContent,
  trainingRate: document.getElementById("training-tokens-per-s").textContent,
  state: document.getElementById("workflow-state").textContent,
  headline: Object.fromEntries([...document.querySelectorAll("#headline [data-key]")].map(
    (item) => [item.dataset.key, item.querySelector("dd").textContent])),
};
"""


def read_page(driver) -> dict:
    page = driver.execute_script(READ_PAGE)
    page["overall"] = float(page["overall"]) if page["overall"] else None
    return page


# How long to wait for the page to show what the run did: a bound for a hang only, far above
# the page's 2 s poll, so a loaded machine (a slow browser, a slow report) changes nothing.
PATIENCE_S = 600


def wait_for(read, done, poll_s: float = 0.5):
    """read() until done(value) holds or PATIENCE_S have gone; the last value either way
    (the assertions that follow say what was missing)."""
    deadline = time.monotonic() + PATIENCE_S
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(poll_s)
        value = read()
    return value


def test_status_page_follows_a_demo_run_to_100_percent_and_the_report_has_every_section(
    workflow, demo_model, tmp_path, browser, session_endpoint
):
    workflow.write_config(
        num_shards=NUM_SHARDS,
        target={"model": str(demo_model), "build_demo": False},
        gpu_lock_dir=str(tmp_path / "locks"),
        # What the page shows is this test's business, not the demo's answers: 24 prompts (some
        # held out for the evaluation) instead of the demo's 160, whose generation was most of
        # the run.
        dataset={"paths": [workflow.few_prompts(24)], "heldout_fraction": 0.25},
        # Telemetry every second: a generating shard's own bar moves too. A short training
        # (two segments of a few steps) keeps the run to a couple of minutes on two cores.
        generation={"telemetry_every_seconds": 1},
        # Each segment's τ in the loop on two held-out prompts (rule segment_tau).
        train={
            "segments": 2,
            "steps_per_segment": 6,
            "checkpoint_every_steps": 3,
            "metrics_every_seconds": 1,
            "segment_eval": {"prompts": 2, "max_new_tokens": 32},
        },
        # A few prompts; a drafter this short-trained is not held to the parity gate here.
        evaluate={"max_prompts": 2, "max_new_tokens": 32, "simulated_rows": 8, "parity_tolerance": 10.0},
        # A degenerate demo sample or two (CPU batching changes greedy output) is not this test's.
        tokenize={"max_degenerate_fraction": 0.5},
    )
    workflow.write_config(**session_endpoint)  # the page is the subject, not the engine's launch
    run_root = workflow.root / "results/demo"
    source = RunSource(
        ReadOnlyStorage.open(str(run_root)),
        num_shards=NUM_SHARDS,
        num_segments=2,
        events_file=workflow.root / "logs/snakemake-events.jsonl",
        workdir=workflow.root,
        evaluate_engine="transformers",  # the demo's: no serving engine measures τ
    )
    server = StatusServer(SnapshotBuilder(source), port=0, refresh_s=0.5).start()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    run = start_run(workflow)
    try:
        browser.get(server.url)
        seen_overall, seen_shards = [], []
        paused_on = None
        # The page while only a training segment runs, and while evaluate runs (each seen with
        # the run paused there, as the shard below).
        alone = {"train": None, "evaluate": None}
        watcher = SnapshotBuilder(source)
        while run.poll() is None:
            if any(v is None for v in alone.values()):
                os.killpg(run.pid, signal.SIGSTOP)
                try:
                    snap = watcher.build()
                    busy = {s["stage"] for s in snap["stages"] if s["running"]}
                    # A segment's rate comes with its first steps: paused before, it has none.
                    if busy == {"train"} and snap["throughput"]["training_tokens_per_s"] is None:
                        busy = set()
                    for stage in [k for k, v in alone.items() if v is None and busy == {k}]:
                        alone[stage] = wait_for(
                            lambda: read_page(browser),
                            lambda page, stage=stage: (
                                page["runningStages"] == [stage] and (stage != "train" or page["trainingRate"] != "–")
                            ),
                        )
                finally:
                    os.killpg(run.pid, signal.SIGCONT)
            page = read_page(browser)
            if page["overall"] is not None:
                seen_overall.append(page["overall"])
            seen_shards.extend(v for v in page["shards"] if v)
            if not seen_shards and paused_on is None and shard_in_flight(run_root):
                # A shard runs for a few seconds on two cores, so the page's 2 s poll could
                # miss it: pause the whole run while the shard is mid-flight (checked again once
                # paused) and wait for the page to draw its bar, then let the run go on.
                os.killpg(run.pid, signal.SIGSTOP)
                try:
                    paused_on = shard_in_flight(run_root)
                    if paused_on:
                        page = wait_for(lambda: read_page(browser), lambda page: any(page["shards"]))
                        seen_shards.extend(v for v in page["shards"] if v)
                        browser.save_screenshot(str(ARTIFACTS / "status-page-running.png"))
                finally:
                    os.killpg(run.pid, signal.SIGCONT)
            time.sleep(0.5)
        output = run.stdout.read()
        assert run.returncode == 0, output[-4000:]
        final = wait_for(
            lambda: read_page(browser), lambda page: page["overall"] == 100.0 and page["state"] == "finished"
        )
        browser.save_screenshot(str(ARTIFACTS / "status-page-finished.png"))
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        server.stop()

    # Only a training segment running: no generation rate, a training rate; the bar below 100%
    # while evaluate runs.
    assert alone["train"] and alone["evaluate"], alone
    assert alone["train"]["generationRate"] == "–" and alone["train"]["trainingRate"] != "–", alone["train"]
    assert alone["evaluate"]["overall"] < 100, alone["evaluate"]
    moving = sorted({v for v in seen_overall if 0 < v < 100})
    assert len(moving) >= 2, f"progress did not move during the run: {seen_overall}"
    assert seen_overall == sorted(seen_overall), "overall progress went backwards"
    assert paused_on or seen_shards, "no shard was seen in flight (the run's telemetry said none was running)"
    assert seen_shards, f"the page drew no progress bar for {paused_on}, paused mid-flight"
    assert final["overall"] == 100.0
    assert final["stages"] == {
        **{s: f"{NUM_SHARDS} / {NUM_SHARDS}" for s in ("prepare", "generate", "tokenize")},
        "train": "2 / 2",
        "export": "1 / 1",
        "evaluate": "1 / 1",
    }
    assert final["curvePoints"] == 12  # every optimizer step of both segments
    # τ per segment: each record a finite τ the loop can give, at its segment's last step, shown
    # in the segments table (as the page rounds it) and as a point of its chart.
    taus = [json.loads((run_root / layout.segment_tau_key(k)).read_text()) for k in (0, 1)]
    assert [r["step"] for r in taus] == [5, 11] and all(1 <= r["tau"] <= 8 for r in taus), taus
    assert final["segmentTaus"] == [as_the_page_rounds(r["tau"]) for r in taus], (final, taus)
    assert final["segmentTauDots"] == 2
    assert final["evaluation"].startswith("Evaluation (DFlash): acceptance length τ = ")
    assert final["state"] == "finished"
    # The headline strip: the loop's τ, the lossless check (greedy demo evaluation) and the
    # speed-up are measured; the demo configures no serving engine, so its τ is not configured.
    headline = final["headline"]
    assert float(headline["tau_loop"]) > 0, headline
    assert headline["lossless"].startswith("loop: passed: 2 prompts"), headline
    assert headline["speedup"].endswith("×") and headline["tau_engine"] == "not configured", headline
    assert headline["samples"] != "—" and headline["tokens"] != "—", headline

    workflow.snakemake("--report", "report.html")
    browser.get((workflow.root / "report.html").as_uri())

    def body_text() -> str:
        return browser.find_element("tag name", "body").text

    body = wait_for(body_text, lambda text: "6. Storage" in text)
    for section in (
        "Workflow",
        "1. Prompts",
        "2. Generation",
        "3. Tokenization",
        "4. Training",
        "5. Evaluation",
        "6. Storage",
    ):
        assert section in body, f"report section {section!r} missing"
    assert "data-quality gate" in body  # the workflow description page
    # Its headline table (rule report_headline), and that item first in the first category.
    assert "Headline figures" in body and "τ (loop)" in body and "lossless" in body, body[:2000]
    assert "speed-up (estimated)" in body and "loop: passed: 2 prompts" in body
    assert body.index("0. Headline") < body.index("1. Prompts")
    # The training figure draws each segment's τ beside the loss, labelled with its value.
    training_svg = (run_root / layout.report_key("training.svg")).read_text()
    for record in taus:
        assert f"τ {record['tau']:.2f}" in training_svg
    assert training_svg in embedded_svgs((workflow.root / "report.html").read_text())
    browser.find_element("xpath", "//*[normalize-space(text())='2. Generation']").click()
    body = wait_for(body_text, lambda text: "report-generation-lengths.svg" in text)
    assert "report-generation-lengths.svg" in body and "report-generation-finish.svg" in body
    browser.save_screenshot(str(ARTIFACTS / "report.png"))


def as_the_page_rounds(value: float) -> str:
    """fmtNum(value, 2) of the page: the double's exact value to 2 decimals, halves away from 0
    (Intl.NumberFormat's halfExpand), trailing zeros dropped."""
    from decimal import ROUND_HALF_UP, Decimal

    text = str(Decimal(value).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))
    return text.rstrip("0").rstrip(".")


def embedded_svgs(report_html: str) -> str:
    """The SVG figures a Snakemake report embeds (base64 data URIs), decoded and joined."""
    import base64
    import re

    found = re.findall(r"data:image/svg\+xml;(?:[a-z-]+=[^;]+;)*base64,([A-Za-z0-9+/=]+)", report_html)
    return "\n".join(base64.b64decode(data).decode() for data in found)


def test_page_draws_running_shards_failures_training_and_evaluation(browser, tmp_path):
    from dflash_pipeline.core import layout
    from dflash_pipeline.core.storage import LocalStorage
    from tests.test_status_server import TUNE_RESULT
    from tests.support.status_run import RUNNING_LOG, write_run

    root = tmp_path / "results/demo"
    events = write_run(LocalStorage(root), tmp_path)
    LocalStorage(root).write_text(layout.TUNE_RESULT, json.dumps(TUNE_RESULT))
    source = RunSource(ReadOnlyStorage.open(str(root)), num_shards=2, events_file=events, workdir=tmp_path)
    server = StatusServer(SnapshotBuilder(source), port=0).start()
    try:
        browser.get(server.url)

        def read_training():
            return browser.execute_script("""
                const line = document.querySelector("#chart-loss polyline");
                return {
                  shard: document.querySelector("tr.running-shard .bar")?.getAttribute("aria-valuenow"),
                  logs: [...document.querySelectorAll("pre.log")].map((p) => p.textContent),
                  points: line ? line.getAttribute("points").trim().split(/\\s+/).length : 0,
                  acceptPoints: document.querySelectorAll("#chart-accept polyline").length,
                  segments: document.querySelectorAll("#segments tbody tr").length,
                  evaluation: document.getElementById("evaluation").textContent,
                  algorithm: document.getElementById("training-algorithm").textContent,
                  tune: document.getElementById("tune").textContent,
                  headline: document.getElementById("headline").textContent,
                };""")

        page = wait_for(read_training, lambda page: page["points"], poll_s=0.3)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "status-page-training.png"))
    finally:
        server.stop()
    assert page["shard"] == "40"
    assert "\n".join(RUNNING_LOG) in page["logs"][0]
    assert any("87% degenerate" in log for log in page["logs"])
    assert (page["points"], page["acceptPoints"], page["segments"]) == (5, 1, 2)
    assert "τ = 2.5" in page["evaluation"] and "math: 2.7" in page["evaluation"]
    assert page["algorithm"] == "Drafter: DFlash" and "Evaluation (DFlash)" in page["evaluation"]
    # The headline strip: write_run's evaluation (τ 2.5, speed-up 2.1), no lossless check.
    assert "τ (loop)2.50" in page["headline"] and "speed-up (estimated)2.10×" in page["headline"]
    assert "lossless—" in page["headline"]
    assert page["tune"].startswith("Engine settings measured by tune: concurrency 128 with MTP, 2,345.6 tokens/s")


# A workflow of one rule that writes the headline table, with the pipeline's own report page:
# Snakemake's real report template around it, in seconds rather than a demo run.
HEADLINE_WORKFLOW = """
from dflash_pipeline.report import headline

configfile: "config.yaml"
report: {workflow_rst!r}

rule report_headline:
    output:
        report("report-headline.html", category="0. Headline"),
    run:
        figures = headline.headline(
            {{"overall": {{"tau": 3.74, "speedup_estimate": 2.1}}}}, samples=160, tokens=40000
        )
        headline.write_headline_table(figures, output[0])
"""

# The front page's heading and the τ rows, as the window shows them (viewport coordinates).
READ_HEADLINE = r"""
const box = (node) => {
  if (!node) return null;
  const r = node.getBoundingClientRect();
  return {top: r.top, bottom: r.bottom, text: node.textContent.trim()};
};
return {
  height: window.innerHeight,
  title: box(document.querySelector("h1.title")),
  tauLoop: box(document.querySelector("td.headline-tau_loop")),
  tauEngine: box(document.querySelector("td.headline-tau_engine")),
};
"""


@pytest.mark.parametrize("width, height", [(1366, 768), (1400, 900)])
def test_the_report_front_page_shows_its_heading_and_tau_rows_on_a_laptop_screen(tmp_path, browser, width, height):
    """Snakemake's report pane centres its content vertically, so a front page taller than the
    window once had its heading and headline table above the pane's top, out of scrolling's
    reach. At laptop window sizes both must be inside the window as the report opens."""
    (tmp_path / "Snakefile").write_text(HEADLINE_WORKFLOW.format(workflow_rst=str(REPO / "report/workflow.rst")))
    (tmp_path / "config.yaml").write_text(json.dumps({"run": "demo", "num_shards": 2, "target": {"model": "m"}}))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    for args in (["--cores", "1"], ["--report", "report.html"]):
        done = subprocess.run(
            [sys.executable, "-m", "snakemake", *args], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
    browser.set_window_size(width, height)
    browser.get((tmp_path / "report.html").as_uri())
    page = wait_for(lambda: browser.execute_script(READ_HEADLINE), lambda page: page["tauEngine"] is not None)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"report-front-{width}x{height}.png"))
    assert page["title"] and page["title"]["text"] == "DFlash drafter pipeline", page
    assert (page["tauLoop"]["text"], page["tauEngine"]["text"]) == ("3.74", "not measured yet"), page
    for name in ("title", "tauLoop", "tauEngine"):
        assert page[name]["top"] >= 0 and page[name]["bottom"] <= page["height"], (name, page)
