"""The dashboard's HTTP server: the page, plotly's JavaScript from its Python package, and the JSON the page polls.

Routes (GET; ``run`` is the run's index in the command line's order):
  /                        the page (page.html)
  /plotly.min.js           plotly.js as the plotly wheel ships it: nothing is fetched from the internet
  /api/runs                every run's overview (rows, metric names, summary, checkpoints, dumped steps); polled
  /api/metrics?run=&keys=a,b&since=N   the named metrics' rows from row N on (the page asks for what it draws)
  /api/rollouts?run=&step=  the samples trainer.rollout_data_dir dumped at that step
  /api/validation?run=     the validation samples the run kept, every validation step
  /api/configs             the runs' resolved configs as key paths, and the keys that differ between runs
A request naming a run, step or metric that does not exist answers 404 with ``{"error": "..."}`` naming it.

stdlib's ThreadingHTTPServer on 127.0.0.1 is enough for one person's browser and keeps the install light.
"""
from __future__ import annotations

import importlib.resources
import json
import logging
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from hybridrl.dashboard.run_files import RunDir, RunDirError, compare_configs

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


def plotly_js() -> bytes:
    return importlib.resources.files("plotly").joinpath("package_data", "plotly.min.js").read_bytes()


def page_html() -> bytes:
    return importlib.resources.files("hybridrl.dashboard").joinpath("page.html").read_bytes()


class NotFound(Exception):
    """A request for something the runs do not have; answered 404 with the message."""


class Dashboard:
    """The runs being shown, and the answers to the page's API requests."""

    def __init__(self, runs: list[RunDir]):
        self.runs = runs

    def run(self, query: dict) -> RunDir:
        index = _int_param(query, "run")
        if not 0 <= index < len(self.runs):
            raise NotFound(f"run={index}: expected 0..{len(self.runs) - 1}")
        return self.runs[index]

    def answer(self, route: str, query: dict):
        if route == "/api/runs":
            return [run.overview() for run in self.runs]
        if route == "/api/metrics":
            keys = [key for key in _param(query, "keys").split(",") if key]
            try:
                return self.run(query).metrics.series(keys, _int_param(query, "since"))
            except KeyError as err:
                raise NotFound(err.args[0]) from err
        if route == "/api/rollouts":
            try:
                return self.run(query).dump("rollout_data_dir", _int_param(query, "step"))
            except KeyError as err:
                raise NotFound(err.args[0]) from err
        if route == "/api/validation":
            return self.run(query).validation_answers()
        if route == "/api/configs":
            return compare_configs([run.config() for run in self.runs])
        raise NotFound(f"no route {route}")


def _param(query: dict, name: str) -> str:
    if name not in query:
        raise NotFound(f"expected the query parameter {name!r}")
    return query[name][0]


def _int_param(query: dict, name: str) -> int:
    value = _param(query, name)
    try:
        return int(value)
    except ValueError as err:
        raise NotFound(f"{name}={value!r}: expected an integer") from err


def make_handler(dashboard: Dashboard, static: dict[str, tuple[str, bytes]]):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            url = urlparse(self.path)
            if url.path in static:
                content_type, body = static[url.path]
                self._send(HTTPStatus.OK, content_type, body)
                return
            try:
                body = json.dumps(dashboard.answer(url.path, parse_qs(url.query)))
                self._send(HTTPStatus.OK, "application/json", body.encode())
            except NotFound as err:
                self._send(HTTPStatus.NOT_FOUND, "application/json", json.dumps({"error": str(err)}).encode())
            except RunDirError as err:  # a damaged file: the page shows the message, the server goes on
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "application/json",
                           json.dumps({"error": str(err)}).encode())

        def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # one line per request would drown the terminal
            logger.debug(format, *args)

    return Handler


def make_server(runs: list[RunDir], port: int) -> ThreadingHTTPServer:
    """The server on 127.0.0.1:``port`` (0: a free port; ``server.server_address`` says which)."""
    static = {"/": ("text/html; charset=utf-8", page_html()),
              "/plotly.min.js": ("text/javascript", plotly_js())}
    return ThreadingHTTPServer((HOST, port), make_handler(Dashboard(runs), static))
