"""`python -m hybridrl.dashboard RUN_DIR [RUN_DIR ...] [--port N]`: serve the run dashboard on 127.0.0.1.

Each RUN_DIR is a run's trainer.default_local_dir, written with trainer.logger including jsonl (see
hybridrl/dashboard/__init__.py). Every directory is checked before the server starts; a bad one is one line naming
it, and exit code 2. The URL is printed once the server listens; Ctrl-C stops it.
"""
from __future__ import annotations

import argparse
import sys

from hybridrl.dashboard.run_files import RunDir, RunDirError
from hybridrl.dashboard.server import make_server

DEFAULT_PORT = 8300


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hybridrl.dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's trainer.default_local_dir")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0: any free port (the URL says which)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        runs = [RunDir(path) for path in args.run_dirs]
    except RunDirError as err:
        print(f"dashboard error: {err}", file=sys.stderr)
        sys.exit(2)
    server = make_server(runs, args.port)
    host, port = server.server_address[:2]
    print(f"dashboard: http://{host}:{port}/ ({len(runs)} run(s); Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
