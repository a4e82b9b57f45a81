"""Look at a sweep's runs in the MLflow UI, as a new user would, with a real headless Chromium.

Runs a 2-job sweep with ``logger=mlflow`` (skipped with ``--store``), starts ``mlflow ui`` on 127.0.0.1 over
the sweep's SQLite store, saves a screenshot of the sweep's experiment (its runs table) and of one run, and stops
the server. Needs ``pip install -e ".[mlflow]"`` and a Chromium (``apt-get install chromium``).

    python scripts/mlflow_ui_screenshot.py --out /tmp/ui            # in an empty directory: it runs the sweep there
    python scripts/mlflow_ui_screenshot.py --store outputs/mlflow.db --out /tmp/ui   # an existing store
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"error: {url} did not answer in {timeout_s:.0f} s")


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise SystemExit("error: no Chromium found: apt-get install chromium")


def screenshot(browser: str, url: str, png: Path) -> None:
    """A headless Chromium's screenshot of ``url`` after its scripts ran (the UI is a single-page app)."""
    args = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    args += ["--window-size=1600,1000", "--virtual-time-budget=30000", f"--screenshot={png}", url]
    subprocess.run(args, check=True, capture_output=True, timeout=300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="an existing MLflow SQLite file (default: run a 2-job sweep here)")
    parser.add_argument("--out", default=".", help="where the PNGs go")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.store is None:
        sweep = ["-m", "logger=mlflow", "seed=0,1", "trainer.max_epochs=3", "hydra.sweep.dir=multirun/ui"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, str(ROOT / "train.py"), *sweep], check=True, env=env)
        args.store = "outputs/mlflow.db"
    store = f"sqlite:///{Path(args.store).absolute()}"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    experiments = [e for e in client.search_experiments() if e.name.startswith("dpddp sweep")]
    if not experiments:
        raise SystemExit(f"error: no sweep experiment in {args.store}")
    experiment = experiments[-1]
    runs = client.search_runs([experiment.experiment_id])
    port = free_port()
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store, "--host", "127.0.0.1"]
    quiet = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-runner workers: a UI only
    server = subprocess.Popen([*command, "--port", str(port)], start_new_session=True, env=quiet)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(f"{base}/health", timeout_s=300)  # a minute or two on a busy small machine
        browser = chromium()
        shots = {
            "runs": f"{base}/#/experiments/{experiment.experiment_id}/runs",
            "run": f"{base}/#/experiments/{experiment.experiment_id}/runs/{runs[0].info.run_id}",
        }
        for name, url in shots.items():
            screenshot(browser, url, out / f"mlflow_{name}.png")
            print(f"{name}: {out / f'mlflow_{name}.png'} ({url})")
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its workers: its own session
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    print(f"experiment {experiment.name!r}: {len(runs)} runs: {', '.join(r.info.run_name for r in runs)}")


if __name__ == "__main__":
    main()
