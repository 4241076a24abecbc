"""The kernel of E2B's code interpreter, copied into a sandbox and run there by its python3
(sandfleet never imports it; it needs only the standard library, Python 3.8 and later).

Where the image has IPython (E2B's code-interpreter template), a cell runs in IPython's shell as in
E2B's Jupyter kernel: magics, shell forms, display(), its formatters (with E2B's `data` and `chart`),
matplotlib's inline figures. Without it, the cell runs as Python, and IPython's shell forms are
served as Jupyter's kernel serves them (agent code sends them: `!pip install ...`): a line `!cmd`
runs cmd in a shell, its output in the cell's stdout, never raising (its status in `_exit_code`);
`name = !cmd` keeps its output's lines; `%pip ...` is pip of the kernel's python; `%cd DIR`
changes the kernel's directory; a cell opening with `%%bash` or `%%sh` is a script; `{expression}`
in a command is the expression's value. Code that parses as Python is never rewritten. A bash
context runs each cell as a bash script. A caller that goes away interrupts its cell.

`serve SOCKET [CWD [LANGUAGE]]`: the kernel of one context: one namespace that every execution
shares, serving one execution at a time over a Unix socket. `run SOCKET`: one execution: its
request (a JSON line) read from stdin, the kernel's answer (E2B's NDJSON lines: stdout, stderr,
result, error, then number_of_executions and end_of_execution) copied to stdout as it comes. Exit
3: no kernel there.
"""

import ast
import base64
import datetime
import io
import itertools
import json
import linecache
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
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
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


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
    out = {"type": "result", "text": _unquoted(repr(value)), "is_main_result": main}
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
SHELL = "__sandfleet_shell__"  # the kernel's shell helper, as the rewritten code names it
_LINE = re.compile(r"^([ \t]*)(?:([A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]*)?(!(?!=)|%pip\b|%cd\b)(.*)$")
_BRACES = re.compile(r"\{([^{}]+)\}")


def _expand(command, namespace):
    """IPython's `{expression}` in a command; the command as written if one does not evaluate."""
    try:
        return _BRACES.sub(lambda m: str(eval(m.group(1), namespace)), command)
    except Exception:
        return command


def _shell(namespace):
    def run(command, capture=False, expand=True):
        command = _expand(command, namespace) if expand else command
        sh = shutil.which("bash") or "/bin/sh"
        proc = subprocess.Popen(
            command,
            shell=True,
            executable=sh,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own group: an interrupt ends all it started
        )
        lines = []
        try:
            for raw in proc.stdout:
                line = raw.decode("utf-8", "replace")
                if capture:
                    lines.append(line.rstrip("\n"))
                else:
                    sys.stdout.write(line)
            namespace["_exit_code"] = proc.wait()
        except BaseException:  # the cell interrupted: the command goes with it, never left running
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
            raise
        finally:
            proc.stdout.close()
        return lines if capture else None

    return run


def _cd(path):
    os.chdir(os.path.expanduser(path.strip().strip("'\"") or "~"))
    sys.stdout.write(os.getcwd() + "\n")


def ipython_forms(code):
    """The cell with IPython's shell forms as calls of the kernel's helper (None: there are none)."""
    lines = code.split("\n")
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is not None and lines[first].strip() in ("%%bash", "%%sh"):
        return f"{SHELL}({chr(10).join(lines[first + 1 :])!r})"
    changed = False
    for i, line in enumerate(lines):
        m = _LINE.match(line)
        if m is None:
            continue
        indent, target, form, rest = m.groups()
        if form == "%cd":
            call = f"{SHELL}.cd({rest!r})"
        else:
            command = rest if form == "!" else shlex.quote(sys.executable) + " -m pip" + rest
            call = f"{SHELL}({command!r}, {target is not None})"
        lines[i] = f"{indent}{target} = {call}" if target else indent + call
        changed = True
    return "\n".join(lines) if changed else None


def _plain(emit_to):
    """The engine of an image without IPython: the cell run as Python, the shell forms rewritten."""
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    shell = _shell(namespace)
    shell.cd = _cd
    namespace[SHELL] = shell
    os.environ.setdefault("MPLBACKEND", "Agg")

    def run(code):
        emit = emit_to[0]
        code = textwrap.dedent(code)  # a cell written indented (IPython drops the first line's indent)
        # A name of its own, its lines where tracebacks look (functions it defines are shown later too).
        name = f"<cell-{next(_CELLS)}>"
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        try:
            try:
                tree = ast.parse(code, name, "exec")
            except SyntaxError:
                rewritten = ipython_forms(code)
                if rewritten is None:
                    raise
                tree = ast.parse(rewritten, name, "exec")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, name, "exec"), namespace)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), name, "eval"), namespace)
                if value is not None:
                    emit(_result(value, True))
            _figures(emit)
        except BaseException as exc:  # the cell's own error, SystemExit and KeyboardInterrupt too
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
            emit({"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": tb})

    return run


def _ipython(emit_to):
    """The engine of an image with IPython (E2B's code-interpreter template has it): its shell runs
    the cell, as Jupyter's kernel does (magics, shell forms, display(), formatters, matplotlib's
    inline figures), and what it displays or fails with goes out as E2B's lines."""
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    class Hook(DisplayHook):  # the cell's value: the main result
        def write_output_prompt(self):
            pass

        def write_format_data(self, format_dict, md_dict=None):
            emit_to[0](_formatted(format_dict, True))

    class Publisher(DisplayPublisher):  # display(): more results
        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
            emit_to[0](_formatted(dict(data), False))

        def clear_output(self, wait=False):
            pass

    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    shell = InteractiveShell.instance(displayhook_class=Hook, display_pub_class=Publisher)
    shell.colors = "nocolor"  # as E2B's kernel: tracebacks without ANSI colours
    shell.display_formatter.formatters["text/plain"].max_seq_length = 0

    def failed(etype, evalue, stb):
        name = getattr(etype, "__name__", str(etype))
        emit_to[0]({"type": "error", "name": name, "value": str(evalue), "traceback": "\n".join(stb)})

    shell._showtraceback = failed
    # `!cmd` line by line into the cell's stdout, as the plain engine runs it (IPython's own goes
    # through a terminal: CRLF endings, all output at once), expanded by IPython's own rules.
    system = _shell(shell.user_ns)
    shell.system = lambda command: system(shell.var_expand(command, depth=1), expand=False)
    _formatters(shell)

    def run(code):
        shell.run_cell(code, store_history=True)

    return run


def _formatters(shell):
    """What E2B's template adds to IPython's display: a DataFrame's columns (`data`), a figure's
    chart (`chart`, by e2b_charts), lists and dicts as JSON, and PIL images shown or saved."""
    from IPython.core.formatters import BaseFormatter

    class Data(BaseFormatter):
        format_type = "e2b/data"
        print_method = "_repr_e2b_data_"
        _return_type = (dict, str)

        def __call__(self, obj):
            pandas = sys.modules.get("pandas")
            if pandas is None or not isinstance(obj, pandas.DataFrame):
                return super().__call__(obj)
            columns = obj.to_dict(orient="list")
            return {
                k: [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in vs] for k, vs in columns.items()
            }

    class Chart(BaseFormatter):
        format_type = "e2b/chart"
        print_method = "_repr_e2b_chart_"
        _return_type = (dict, str)

        def __call__(self, obj):
            figure = getattr(sys.modules.get("matplotlib.figure"), "Figure", None)
            if figure is None or not isinstance(obj, figure):
                return super().__call__(obj)
            try:
                from e2b_charts import chart_figure_to_dict

                return chart_figure_to_dict(obj)
            except Exception:
                return {}

    formatters = shell.display_formatter.formatters
    formatters["e2b/data"] = Data(parent=shell.display_formatter)
    formatters["e2b/chart"] = Chart(parent=shell.display_formatter)
    json_formatter = formatters["application/json"]
    json_formatter.enabled = True
    for kind in (list, dict):
        json_formatter.for_type(kind, _plain_json)
    try:
        from PIL import Image, ImageShow
    except ImportError:
        return
    from IPython.display import display

    ImageShow.UnixViewer.show_file = lambda self, path, **options: 0  # no viewer here: display() shows it
    save = Image.Image.save

    def saved(image, fp, format=None, **params):
        if isinstance(fp, str):
            display(image)
        return save(image, fp, format, **params)

    Image.Image.save = saved


def _plain_json(obj):
    try:
        return json.loads(json.dumps(obj, default=str))
    except (TypeError, ValueError):
        return None


_FIELDS = {  # Jupyter's MIME types, as E2B's results name them
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


def _formatted(data, main):
    out = {"type": "result", "is_main_result": main}
    extra = {}
    for kind, value in data.items():
        field = _FIELDS.get(kind)
        if field is None:
            extra[kind] = value
        elif field == "text":
            out["text"] = _unquoted(value)
        else:
            out[field] = value
    if extra:
        out["extra"] = extra
    return out


def _unquoted(text):
    """A string's plain text without its one pair of quotes, as E2B's results give it."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


RUNNING = [False]  # an execution is on: a SIGINT (its caller went away) interrupts it


def _interrupted(signum, frame):
    if RUNNING[0]:
        raise KeyboardInterrupt


def _watch(conn, done):
    """The caller's end closing while its cell runs (a client that timed out): interrupt the cell,
    as E2B's server interrupts its kernel, so the next execution is not queued behind it. `done`:
    this execution's end (a late wake-up never interrupts the next one)."""
    try:
        while conn.recv(4096):
            pass
    except OSError:
        pass
    if not done.is_set():
        os.kill(os.getpid(), signal.SIGINT)


def execute(request, run, emit_to, emit):
    emit_to[0] = emit
    env = request.get("env_vars") or {}
    # Only the execution's own variables are put back after it: what the cell sets (os.environ,
    # %env) stays, as in Jupyter.
    before = {k: os.environ.get(k) for k in env} if isinstance(env, dict) else {}
    try:
        os.environ.update(env)
    except (TypeError, ValueError) as exc:  # a NUL or "=" in a name: the execution's error, not the kernel's
        _put_back(before)
        emit({"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": ""})
        return
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Stream(emit, "stdout"), _Stream(emit, "stderr")
    RUNNING[0] = True
    try:
        run(request.get("code", ""))
    except KeyboardInterrupt:  # one that came past the engine's own handling
        emit({"type": "error", "name": "KeyboardInterrupt", "value": "", "traceback": ""})
    finally:
        RUNNING[0] = False
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = stdout, stderr
        _put_back(before)


def _put_back(before):
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _bash(emit_to):
    """A bash context's engine: each cell a bash script, its output (stderr too) as stdout."""
    system = _shell({})

    def run(code):
        system(code, expand=False)

    return run


def serve(path, language="python"):
    emit_to = [lambda obj: None]
    if language == "bash":
        run = _bash(emit_to)
    else:
        try:
            run = _ipython(emit_to)
        except ImportError:
            run = _plain(emit_to)
    signal.signal(signal.SIGINT, _interrupted)
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
                    stream.write((json.dumps(obj, default=str) + "\n").encode())
                    stream.flush()
                except OSError:  # the caller went away: the execution is interrupted (_watch)
                    pass

            try:
                request = json.loads(stream.readline() or b"{}")
                if not isinstance(request, dict):
                    raise ValueError("a request is a JSON object")
            except (OSError, ValueError) as exc:
                emit({"type": "error", "name": "ValueError", "value": str(exc), "traceback": ""})
                _close(stream)
                continue
            count += 1
            done = threading.Event()
            watcher = threading.Thread(target=_watch, args=(conn, done), daemon=True)
            watcher.start()
            try:
                execute(request, run, emit_to, emit)
            except KeyboardInterrupt:  # an interrupt landing as the execution ended: too late, ignored
                pass
            done.set()
            emit({"type": "number_of_executions", "execution_count": count})
            emit({"type": "end_of_execution"})
            try:
                conn.shutdown(socket.SHUT_RDWR)  # ends the watcher
            except OSError:
                pass
            watcher.join(5)
            _close(stream)


def _close(stream):
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
    if sys.argv[1] == "serve":  # serve SOCKET [CWD [LANGUAGE]]
        serve(sys.argv[2], sys.argv[4] if len(sys.argv) > 4 else "python")
    else:
        run(sys.argv[2])
