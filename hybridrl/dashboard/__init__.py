"""The run dashboard: `python -m hybridrl.dashboard RUN_DIR [RUN_DIR ...]` serves a page on 127.0.0.1 that shows
what runs wrote (run_files.py): curves of every metric grouped by prefix, where each step's time goes, the rollouts
of any step, one validation question's answers over time, each run's summary and resolved config (the keys that
differ between runs highlighted). The page polls a JSON endpoint (server.py), so a running run's new steps appear
without a reload; it works as well on a finished run or on a run directory copied off a cluster.

Why plotly.js, served from the plotly wheel: the wheel ships plotly.min.js (4.8 MB of its 9.7 MB; plotly 7.1 needs
only narwhals and packaging besides), so the page works with no network, and plotly draws stacked bars, two y axes,
hover and zoom without code of ours. uPlot is smaller and faster but ships on npm only, not inside a Python package;
a dashboard framework (dash, panel, streamlit) brings a server stack and a React or Bokeh bundle for what a static
page with fetch() does here. 10,000 steps x 300 metrics (a 129 MB metrics.jsonl, written with Tracking), measured
in headless Chromium on the 2-core machine while other jobs held it at a load of about 25 (2026-12-06): drawing every
chart up front with a marker per point took 94 s to the first chart; now the server reads the file before it
listens (10 s; msgspec decodes the lines) and the page draws a chart only when it scrolls into view, as lines
without markers past 300 points: the first screen (12 charts) in 7.6 s, of which 3.5 s is loading plotly.js, and
the next screen in 1.2 s. Polling asks only for the rows a drawn chart lacks and extends its traces in place. The
server is the standard library's threading HTTP server: one user's browser, no dependency.

Nothing runs unless you start it: the trainer writes the files whether or not a dashboard reads them.
"""
