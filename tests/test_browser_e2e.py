"""What a person sees, checked in a real browser: Playwright drives Debian's chromium (headless, no sandbox, no
background networking) against the real stack's MLflow and Prefect UIs after real evaluations.

Three checkpoints of one training job and one of another are evaluated (one problem each); the MLflow chart view of
the training-jobs experiment must draw both jobs' `math500.<slice>/accuracy` series with every step, and the Prefect UI must
show the parent flow run's shard flow runs and a shard's progress artifact. On failure, screenshots are saved in a
temporary folder whose path the failure message names.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.deployments import run_deployment

from cluster_helpers import children, flow_run, wait_final
from evaldag.tracking.names import JOBS_EXPERIMENT, charts_url

pytestmark = [pytest.mark.stack, pytest.mark.model]

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
JOBS = {"browser-job-a": (10, 20, 30), "browser-job-b": (20,)}


@pytest.fixture
def sync_api():
    """Playwright and chromium, checked before anything is evaluated: chromium must launch and render a page, not
    only exist (a browser whose libraries or sandbox fail would otherwise cost the evaluations first). Skipped where
    either is missing or chromium does not start, failed in CI (`.ci/run` installs both)."""
    why = None
    try:
        from playwright import sync_api as api
    except ImportError:
        api, why = None, "pip install playwright (the test extra)"
    if api is not None and not Path(CHROMIUM).is_file():
        why = f"{CHROMIUM} missing: apt-get install -y chromium"
    elif api is not None:
        why = _launch_problem(api)
    if why:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the browser test: {why}")
        pytest.skip(why)
    return api


def _launch_problem(api) -> str | None:
    """Why chromium does not launch and render a page with the test's arguments, or None when it does."""
    try:
        with api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS, timeout=60_000)
            try:
                pg = browser.new_page()
                pg.set_content("<p id='probe'>evaldag</p>")
                text = pg.text_content("#probe", timeout=10_000)
            finally:
                browser.close()
    except Exception as e:  # noqa: BLE001 - any failure to start or render is the reason to report
        return f"{CHROMIUM} does not launch: {type(e).__name__}: {str(e)[:500]}"
    return None if text == "evaldag" else f"{CHROMIUM} launched but rendered {text!r} for a test page"


@pytest.fixture
def evaluated(live_stack, sync_api):
    """The evaluations, and what the checks need from Prefect and MLflow, before the browser starts (Playwright's
    sync API runs an event loop, inside which Prefect's sync calls would hand back coroutines). All four are
    submitted at once; the gpu slot runs their shards one after another."""
    submitted = [run_deployment("eval/math500", parameters={"limit": 1, "num_shards": 1, "step": step,
                                                            "train_run": job, "sampling": {"max_new_tokens": 8}},
                                timeout=0)
                 for job, steps in JOBS.items() for step in steps]
    parents = [wait_final(fr.id, timeout=600) and flow_run(fr.id) for fr in submitted]
    for fr in parents:
        assert fr.state.is_completed(), fr.state
    # evaluations of the same checkpoint share the stored shards and launch none: check one that computed
    launched = [(fr, runs) for fr in parents if (runs := children(fr.id))]
    assert launched, "no evaluation started shard flow runs"
    exp = MlflowClient().get_experiment_by_name(JOBS_EXPERIMENT)
    return launched[0][0], launched[0][1], exp


@pytest.fixture
def page(evaluated, sync_api):
    """A fresh headless chromium page; a failed check saves a screenshot and names the folder."""
    shots = Path(tempfile.mkdtemp(prefix="evaldag-browser-"))
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        pg = browser.new_page(viewport={"width": 1600, "height": 1000})
        pg.shots = shots
        try:
            yield pg
        finally:
            browser.close()
    if not any(shots.iterdir()):          # nothing failed: nothing to keep
        shutil.rmtree(shots, ignore_errors=True)


def _see(pg, name: str, text: str | re.Pattern, what: str) -> None:
    """Wait for `text` on the page; a screenshot and a clear failure when it never shows."""
    try:
        pg.get_by_text(text).first.wait_for(timeout=30000)
    except Exception:
        _check(pg, name, False, what)


def _open_tab(pg, label: str) -> None:
    """Click one of the flow run page's tabs (Prefect's UI renders them as plain buttons, not role=tab)."""
    pg.get_by_text(label, exact=True).first.click()
    pg.wait_for_timeout(1000)


def _check(pg, name: str, ok: bool, what: str) -> None:
    if not ok:
        path = pg.shots / f"{name}.png"
        pg.screenshot(path=str(path), full_page=True)
        pytest.fail(f"{what}; screenshot: {path} (folder {pg.shots})")


def test_mlflow_and_prefect_uis_show_the_comparison_and_progress(live_stack, evaluated, page):
    parent, shards, exp = evaluated

    # MLflow: the training-jobs experiment's chart view, straight from the link evaldag prints
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    page.goto(charts_url(live_stack.mlflow_url, exp.experiment_id))
    # the job's run keeps one curve per kind of evaluation (evaldag.decisions.series): these one-problem, 8-token evaluations
    # are math500.limit1.tok8/accuracy. Other tests of the session log other jobs (aime24 sections may come first
    # and push this chart out of the rendered part of the page), so the chart search narrows the view to it.
    key = "math500.limit1.tok8/accuracy"
    search = page.get_by_placeholder("Search metric charts").first
    try:
        search.wait_for(timeout=30000)
    except Exception:
        _check(page, "mlflow-charts", False, "MLflow chart view has no chart search box")
    search.fill(key)
    _see(page, "mlflow-charts", re.compile("^" + re.escape(key)), f"MLflow chart view shows no {key} chart")
    try:
        page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length > 0", timeout=30000)
    except Exception:
        _check(page, "mlflow-charts", False, "MLflow chart view draws no chart")
    series = page.evaluate("""() => {
        const out = {};
        for (const el of document.querySelectorAll('.js-plotly-plot'))
            for (const t of (el.data || [])) if (t.name) (out[t.name] = out[t.name] || []).push(t.x);
        return out;
    }""")
    for job, steps in JOBS.items():
        # a trace is named after its run, possibly followed by the metric: "browser-job-a (math500...)"
        xs = [x for name, found in series.items() if name == job or name.startswith(job + " ") for x in found]
        _check(page, "mlflow-charts", bool(xs), f"no series for {job} in the MLflow charts ({sorted(series)})")
        _check(page, "mlflow-charts", all(sorted(x) == list(steps) for x in xs),
               f"{job}: steps {xs} in the charts, expected {list(steps)} in each")

    # Prefect: the last parent flow run, its progress artifact, its shard flow run, and the shard's progress artifact
    page.goto(f"{live_stack.prefect_url}/runs/flow-run/{parent.id}")
    _see(page, "prefect-parent", parent.name, f"the parent flow run {parent.name} not shown")
    _open_tab(page, "Subflow Runs")
    _see(page, "prefect-parent", shards[0].name, f"shard flow run {shards[0].name} not shown on the parent's page")
    _open_tab(page, "Artifacts")
    _see(page, "prefect-parent", re.compile(r"^progress-evaluation-"),
         "the parent's whole-evaluation progress artifact is not shown on its flow run page")
    page.goto(f"{live_stack.prefect_url}/runs/flow-run/{shards[0].id}")
    _see(page, "prefect-shard", shards[0].name, f"shard flow run {shards[0].name} has no page")
    _open_tab(page, "Artifacts")
    _see(page, "prefect-shard", "progress-math500-shard-0",
         "the shard's progress artifact is not shown on its flow run page")
