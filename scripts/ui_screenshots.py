"""Screenshots of one finished run in the MLflow and Prefect UIs, for docs/img/ (docs/ui.md shows them).

Not part of the tests or the install: it needs a browser. On Debian/Ubuntu::

    apt-get install -y chromium
    python3 -m venv /tmp/shot && /tmp/shot/bin/pip install playwright

Then, with a run made against a Prefect server of your own and its MLflow store
served by ``bhfl ui`` (the steps are in docs/ui.md)::

    /tmp/shot/bin/python scripts/ui_screenshots.py --run-dir runs \
        --prefect http://127.0.0.1:4200 --mlflow http://127.0.0.1:5000

It reads the latest finished run's ``run.json`` (its MLflow ids) and asks the
Prefect API for the flow run of that folder, so the pages shown are those of one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flows.tracking.links import run_link, runs_link  # standard library only: no venv needed

WIDTH, HEIGHT = 1440, 900


def latest_run(run_dir: Path) -> Path:
    """The newest run folder with a finished ``run.json``."""
    records = sorted(run_dir.glob("*/*/run.json"), key=lambda p: p.stat().st_mtime)
    finished = [p.parent for p in records if json.loads(p.read_text()).get("status") == "finished"]
    if not finished:
        raise SystemExit(f"no finished run under {run_dir}")
    return finished[-1]


def prefect_api(ui: str, route: str, body: dict) -> list[dict]:
    """POST ``body`` to the Prefect server's ``/api/<route>``; its JSON answer."""
    request = urllib.request.Request(
        f"{ui}/api/{route}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request) as response:
        return json.load(response)


def prefect_flow_run(ui: str, run_path: Path) -> str:
    """The id of the newest ``bhfl-experiment`` flow run whose ``run_path`` parameter is ``run_path``."""
    body = {"flows": {"name": {"any_": ["bhfl-experiment"]}}, "sort": "START_TIME_DESC", "limit": 50}
    for run in prefect_api(ui, "flow_runs/filter", body):
        if run["parameters"].get("run_path") == str(run_path):
            return str(run["id"])
    raise SystemExit(f"no bhfl-experiment flow run for {run_path} on {ui}")


def shot(page: Page, url: str, out: Path, wait_for: str | None = None, settle_ms: int = 2500) -> None:
    page.goto(url, wait_until="load")  # both UIs poll their APIs: the network is never idle
    if wait_for is not None:
        page.get_by_text(wait_for).first.wait_for(timeout=30_000)
    page.wait_for_timeout(settle_ms)  # charts animate in
    close_assistant(page)
    page.screenshot(path=str(out))
    print(out)


def close_assistant(page: Page) -> None:
    """MLflow opens its assistant panel on a browser's first visit (then remembers it closed): close it."""
    close = page.locator('[data-component-id="mlflow.assistant.chat_panel.close"]')
    if close.count():
        close.first.click()
        page.wait_for_timeout(500)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=Path("runs"))
    parser.add_argument("--prefect", default="http://127.0.0.1:4200")
    parser.add_argument("--mlflow", default="http://127.0.0.1:5000")
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    parser.add_argument("--browser", default="/usr/bin/chromium")
    args = parser.parse_args()

    run_path = latest_run(args.run_dir.resolve())
    record = json.loads((run_path / "run.json").read_text())
    experiment_id, parent = record["experiment_id"], record["parent_run_id"]
    root = record["node_runs"]["root"]
    flow_run = prefect_flow_run(args.prefect, run_path)
    args.out.mkdir(parents=True, exist_ok=True)
    uri = args.mlflow  # the UI's address stands for the tracking server: the links are the CLI's own
    with sync_playwright() as play:
        browser = play.chromium.launch(executable_path=args.browser)
        page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        shot(page, runs_link(uri, experiment_id), args.out / "mlflow-runs.png", wait_for="Metrics")
        shot(page, run_link(uri, experiment_id, parent), args.out / "mlflow-parent.png", wait_for="root/union/accuracy")
        charts = run_link(uri, experiment_id, root).replace("?", "/model-metrics?")
        shot(page, charts, args.out / "mlflow-root-charts.png", wait_for="train", settle_ms=5000)
        report = run_link(uri, experiment_id, parent).replace("?", "/artifacts/report.html?")
        shot(page, report, args.out / "mlflow-report.png", settle_ms=4000)
        flow = f"{args.prefect}/runs/flow-run/{flow_run}"
        shot(page, flow, args.out / "prefect-flow-run.png", settle_ms=5000)
        artifact = prefect_api(args.prefect, "artifacts/filter", {"flow_runs": {"id": {"any_": [flow_run]}}})[0]
        shot(page, f"{args.prefect}/artifacts/artifact/{artifact['id']}", args.out / "prefect-artifact.png")
        page.goto(f"{args.prefect}/runs", wait_until="load")
        page.get_by_text("Hide subflows").click()  # the experiment, pipeline and sweep runs only
        page.wait_for_timeout(2500)
        page.screenshot(path=str(args.out / "prefect-runs.png"))
        browser.close()


if __name__ == "__main__":
    main()
