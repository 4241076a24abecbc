"""A Python kernel for E2B's code interpreter, copied into a sandbox and run there by its python3
(standard library only, Python 3.8 and later; sandfleet never imports it).

`serve SOCKET`: the kernel of one context: one namespace that every execution shares, serving one
execution at a time over a Unix socket. `run SOCKET`: one execution: its request (a JSON line) read
from stdin, the kernel's answer (E2B's NDJSON lines: stdout, stderr, result, error, then
number_of_executions and end_of_execution) copied to stdout as it comes. Exit 3: no kernel there.
"""

import ast
import base64
import datetime
import io
import itertools
import json
import linecache
import os
import socket
import sys
import time
import traceback

FORMATS = (  # IPython's rich representations, as E2B's results carry them
    ("_repr_html_", "html"),
    ("_repr_markdown_", "markdown"),
    ("_repr_svg_", "svg"),
    ("_repr_png_", "png"),
    ("_repr_jpeg_", "jpeg"),
    ("_repr_latex_", "latex"),
    ("_repr_json_", "json"),
    ("_repr_javascript_", "javascript"),
)


def _now():
    return datetime.datetime.now(datetime.UTC).isoformat()


class _Stream(io.TextIOBase):
    """Line-buffered, as Jupyter's streams come: whole lines as they end, the rest at a flush."""

    def __init__(self, emit, name):
        self._emit = emit
        self._name = name
        self._pending = ""

    def writable(self):
        return True

    def write(self, text):
        self._pending += text
        end = self._pending.rfind("\n") + 1
        if end:
            self._send(self._pending[:end])
            self._pending = self._pending[end:]
        return len(text)

    def flush(self):
        if self._pending:
            self._send(self._pending)
            self._pending = ""

    def _send(self, text):
        self._emit({"type": self._name, "text": text, "timestamp": _now()})


def _result(value, main):
    out = {"type": "result", "text": repr(value), "is_main_result": main}
    for method, name in FORMATS:
        fn = getattr(value, method, None)
        if callable(fn):
            try:
                got = fn()
            except Exception:
                continue
            if got is None:
                continue
            if isinstance(got, bytes):
                got = base64.b64encode(got).decode()
            out[name] = got
    return out


def _figures(emit):
    """Figures matplotlib holds after an execution, as PNG results (then closed)."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for number in plt.get_fignums():
        buf = io.BytesIO()
        plt.figure(number).savefig(buf, format="png")
        emit({"type": "result", "png": base64.b64encode(buf.getvalue()).decode(), "is_main_result": False})
    plt.close("all")


_CELLS = itertools.count(1)


def execute(request, namespace, emit):
    code = request.get("code", "")
    # A name of its own, its lines where tracebacks look (functions it defines are shown later too).
    name = f"<cell-{next(_CELLS)}>"
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    saved = dict(os.environ)
    os.environ.update(request.get("env_vars") or {})
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Stream(emit, "stdout"), _Stream(emit, "stderr")
    try:
        tree = ast.parse(code, name, "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, name, "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), name, "eval"), namespace)
            if value is not None:
                emit(_result(value, True))
        _figures(emit)
    except BaseException as exc:  # the cell's own error, SystemExit and KeyboardInterrupt too
        emit(
            {
                "type": "error",
                "name": type(exc).__name__,
                "value": str(exc),
                "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next)),
            }
        )
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = stdout, stderr
        os.environ.clear()
        os.environ.update(saved)


def serve(path):
    os.environ.setdefault("MPLBACKEND", "Agg")
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    count = 0
    try:
        os.unlink(path)
    except OSError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    try:
        os.unlink(path + ".starting")  # its first callers wait for the socket while this is there
    except OSError:
        pass
    while True:
        conn, _ = server.accept()
        with conn:
            stream = conn.makefile("rwb")

            def emit(obj, stream=stream):
                try:
                    stream.write((json.dumps(obj) + "\n").encode())
                    stream.flush()
                except OSError:  # the caller went away: the execution still runs to its end
                    pass

            try:
                request = json.loads(stream.readline() or b"{}")
            except ValueError as exc:
                emit({"type": "error", "name": "ValueError", "value": str(exc), "traceback": ""})
                continue
            count += 1
            execute(request, namespace, emit)
            emit({"type": "number_of_executions", "execution_count": count})
            emit({"type": "end_of_execution"})
            try:
                stream.close()
            except OSError:
                pass


def run(path, wait=10.0):
    request = sys.stdin.buffer.read().strip() + b"\n"
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + wait
    while True:
        try:
            conn.connect(path)
            break
        except OSError:
            if not os.path.exists(path + ".starting") or time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.02)  # a kernel just started: its socket comes
    conn.sendall(request)
    out = sys.stdout.buffer
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            break
        out.write(chunk)
        out.flush()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        run(sys.argv[2])
