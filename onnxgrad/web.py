"""``onnxgrad web``: serve the browser trainer (web/) on this machine and print its URL.

    onnxgrad web [--port 8000] [--host 127.0.0.1] [--root DIR]
    python -m onnxgrad.web ...

The page is the folder ``web/`` of an onnxgrad checkout (beside the package; ``--root`` names
another); its JavaScript dependencies come from ``web/node_modules`` (``npm ci`` in web/), so
nothing is fetched from elsewhere at run time. Every response carries the cross-origin isolation
headers (COOP same-origin, COEP require-corp) that browsers ask before they give a page
SharedArrayBuffer, which onnxruntime-web's and TensorFlow.js's multi-threaded WASM builds need.
"""
from __future__ import annotations

import functools
import http.server
import os
import sys
import threading

ISOLATION_HEADERS = {
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Embedder-Policy": "require-corp",
    "Cross-Origin-Resource-Policy": "same-origin",
}
# what the browser must be told a file is (module scripts and streaming WASM compile check it)
MIME_TYPES = {".js": "text/javascript", ".mjs": "text/javascript", ".wasm": "application/wasm",
              ".json": "application/json", ".onnx": "application/octet-stream",
              ".bin": "application/octet-stream", ".html": "text/html; charset=utf-8",
              ".css": "text/css", ".map": "application/json"}


def default_root() -> str:
    """web/ beside the onnxgrad package (a checkout, or an editable install of one)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "web")


def check_root(root: str) -> str:
    """The page folder, or a ValueError that says what is missing and how to get it."""
    root = os.path.abspath(root)
    if not os.path.isfile(os.path.join(root, "index.html")):
        raise ValueError(f"{root}: no index.html: --root must name the web/ folder of an "
                         "onnxgrad checkout")
    ort = os.path.join(root, "node_modules", "onnxruntime-web", "dist")
    if not os.path.isdir(ort):
        raise ValueError(f"{root}: onnxruntime-web is not installed there: run `npm ci` in "
                         f"{root} first")
    return root


class Handler(http.server.SimpleHTTPRequestHandler):
    """Static files from the page folder (and the server's mounts), with isolation headers, no
    caching and quiet logs."""
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, **MIME_TYPES}

    def translate_path(self, path):
        for prefix, folder in self.server.mounts.items():  # URL prefix -> another folder
            if path.startswith(prefix):
                page, self.directory = self.directory, folder
                try:
                    return super().translate_path("/" + path[len(prefix):])
                finally:
                    self.directory = page
        return super().translate_path(path)

    def end_headers(self):
        for k, v in ISOLATION_HEADERS.items():
            self.send_header(k, v)
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, format, *args):  # noqa: A002  (the base class's name)
        if self.server.verbose:
            super().log_message(format, *args)


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    verbose = False
    mounts: dict[str, str] = {}

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'localhost' if host in ('127.0.0.1', '') else host}:{port}/"


def make_server(root: str | None = None, host: str = "127.0.0.1", port: int = 8000,
                verbose: bool = False, mounts: dict[str, str] | None = None) -> Server:
    """A server (not yet serving) for the page in ``root``; port 0 picks a free port.
    ``mounts`` serves other folders under URL prefixes ({"/data/": folder}: the benchmark's)."""
    root = check_root(root or default_root())
    srv = Server((host, port), functools.partial(Handler, directory=root))
    srv.verbose = verbose
    srv.mounts = {p: os.path.abspath(f) for p, f in (mounts or {}).items()}
    return srv


@functools.wraps(make_server)
def start(*args, **kw) -> Server:
    """make_server, serving on a daemon thread; call ``.shutdown()`` when done."""
    srv = make_server(*args, **kw)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def add_web_parser(subparsers):
    """Add ``web`` to an argparse subparsers object."""
    p = subparsers.add_parser(
        "web", help="serve the browser trainer on this machine",
        description="Serve the browser trainer (a page that trains exported train steps on "
        "onnxruntime-web in a Web Worker) on a local port and print its URL. Runs until "
        "interrupted.")
    add_arguments(p)
    p.set_defaults(func=cmd_web)
    return p


def add_arguments(p):
    p.add_argument("--port", type=int, default=8000, help="default 8000 (0: any free port)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--root", default=None, metavar="DIR",
                   help="the page folder (default: web/ of the checkout this package is in)")
    p.add_argument("--verbose", action="store_true", help="log each request")


def cmd_web(args, out) -> int:
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port {args.port} is not a port number")
    try:
        srv = make_server(args.root, args.host, args.port, args.verbose)
    except OSError as exc:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    print(f"serving the onnxgrad browser trainer at {srv.url} (Ctrl-C stops)", file=out,
          flush=True)
    with srv:
        try:
            srv.serve_forever()
        except KeyboardInterrupt:
            print("stopped", file=out)
    return 0


def main(argv=None) -> int:
    from .cli import main as cli_main
    return cli_main(["web", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
