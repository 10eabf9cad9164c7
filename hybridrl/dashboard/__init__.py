"""The run dashboard: `python -m hybridrl.dashboard RUN_DIR [RUN_DIR ...]` serves a page on 127.0.0.1 that shows
what runs wrote (run_files.py): curves of every metric grouped by prefix, where each step's time goes, the rollouts
of any step, one validation question's answers over time, each run's summary and resolved config (the keys that
differ between runs highlighted). The page polls a JSON endpoint (server.py), so a running run's new steps appear
without a reload; it works as well on a finished run or on a run directory copied off a cluster.

Why plotly.js, served from the plotly wheel: the wheel ships plotly.min.js (4.8 MB of its 9.7 MB; plotly 7.1 needs
only narwhals and packaging besides), so the page works with no network, and plotly draws stacked bars, two y axes,
hover and zoom without code of ours. uPlot is smaller and faster but ships on npm only, not inside a Python package;
a dashboard framework (dash, panel, streamlit) brings a server stack and a React or Bokeh bundle for what a static
page with fetch() does here. To stay fast with 10,000 steps x 300 metrics the page fetches and draws a chart only
when it scrolls into view, asks the server only for the rows it has not drawn, and extends the drawn traces in
place (measured in the README's dashboard section). The server is the standard library's threading HTTP server:
one reader, no dependency.

Nothing runs unless you start it: the trainer writes the files whether or not a dashboard reads them.
"""
