"""`infersim dashboard`: this process becomes the Streamlit server of dashboard/app.py."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from sim.config.errors import ConfigError


def dashboard(port: int) -> None:
    """Serve the Streamlit dashboard (dashboard/app.py) on `port`: this process becomes the Streamlit server."""
    missing = [m for m in ("streamlit", "plotly") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"the dashboard needs {' and '.join(missing)}: pip install 'infersim[dashboard]'",
                          "dashboard")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    args = [sys.executable, "-m", "streamlit", "run", str(root / "dashboard" / "app.py"), "--server.port", str(port),
            "--server.headless", "true", "--server.fileWatcherType", "none", "--browser.gatherUsageStats", "false",
            "--browser.serverAddress", "localhost",  # no look-up of this machine's external address
            "--client.toolbarMode", "viewer"]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, args, env)  # one process: stopping `infersim dashboard` stops the server
