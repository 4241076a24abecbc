"""SandboxFusion's /run_code on a real daemon, called over TCP the way verl calls it: with verl's own
client code (verl/utils/reward_score/sandbox_fusion, loaded from the installed wheel without
importing the `verl` package, which pulls in torch and ray), and with raw requests for the edges.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import requests

from sandfleet.daemon.api import fusion
from sandfleet.errors import InvalidArgumentError
from sandfleet.models import ExecResult

from conftest import Daemon, destroy_daemon, make_daemon

TOKEN = "fusion-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
VERL_MISSING = "verl is not installed: pip install --no-deps verl==0.9.1"


# -- the models and the plan, without a daemon ---------------------------------------------------


def test_request_model_is_sandboxfusions() -> None:
    req = fusion.FusionRunCodeRequest.model_validate({"code": "print(1)", "language": "python"})
    assert (req.compile_timeout, req.run_timeout, req.memory_limit_MB, req.stdin) == (10, 10, -1, None)
    assert (req.files, req.fetch_files) == ({}, [])
    for bad in (
        {"code": "x", "language": "python", "memory_limit_mb": 5},  # misspelt: refused, not ignored
        {"code": "x", "language": "cobol"},
        {"code": "x"},
        {"code": "x", "language": "python", "run_timeout": 0},
        {"code": "x", "language": "python", "fetch_files": ["a\0b"]},
    ):
        with pytest.raises(ValueError):
            fusion.FusionRunCodeRequest.model_validate(bad)


def test_plan_maps_the_request() -> None:
    b64 = base64.b64encode(b"data").decode()
    req = fusion.FusionRunCodeRequest(
        code="print(1)",
        language="python3",
        stdin="in",
        run_timeout=3,
        memory_limit_MB=256,
        files={"d/a.txt": b64, "skipped": None},
    )
    plan = fusion._plan(req, "python", "python")
    assert plan.marker is None  # nothing to fetch: a plain call on the warm interpreter
    call = plan.call
    assert (call.code, call.language, call.stdin, call.timeout, call.image) == ("print(1)", "python", "in", 3, "python")
    assert call.files_b64 == {"d/a.txt": b64} and call.resources and call.resources.memory == 256 * 1024**2
    assert fusion._plan(req.model_copy(update={"memory_limit_MB": -1}), "python", None).call.resources is None

    cpp = fusion._plan(req.model_copy(update={"language": "cpp", "compile_timeout": 7}), "cpp", None)
    assert cpp.marker and cpp.call.language == "bash" and cpp.call.timeout == 7 + 3 + fusion.SLACK
    assert base64.b64decode(cpp.call.files_b64[fusion.LANGS["cpp"].source]) == b"print(1)"
    assert "command -v g++" in cpp.call.code and "timeout -k 1 7 g++" in cpp.call.code

    for bad, why in (
        ({"memory_limit_MB": 8}, "at least 16MiB"),
        ({"files": {"../x": b64}}, "relative path"),
        ({"files": {"a": "not base64!"}}, "files_b64"),
        ({"files": {f"{fusion.DRIVER_DIR}/main.py": b64}}, "driver"),
    ):
        with pytest.raises(InvalidArgumentError, match=why):
            fusion._plan(req.model_copy(update=bad), "python", None)


def test_driven_report_is_read_back() -> None:
    req = fusion.FusionRunCodeRequest(code="x", language="cpp", run_timeout=2, compile_timeout=5, fetch_files=["o"])
    plan = fusion._Plan(req, "cpp", fusion._plan(req, "cpp", None).call, "MARK")
    enc = [base64.b64encode(s).decode() for s in (b"cout", b"cerr", b"file!")]

    def res(stderr: str, **kw: Any) -> ExecResult:
        return ExecResult(**{"exit_code": 0, "stdout": "out", "stderr": stderr, "duration": 1.0, **kw})

    ok = plan.answer(res(f"prog err\nMARK\ncompile 0 1500000 {enc[0]} {enc[1]}\nrun 0 250000\nfile 0 {enc[2]}\n"))
    assert ok.status == "Success" and ok.files == {"o": enc[2]}
    assert ok.compile_result and (ok.compile_result.stdout, ok.compile_result.execution_time) == ("cout", 1.5)
    assert ok.run_result and (ok.run_result.stdout, ok.run_result.stderr, ok.run_result.return_code) == (
        "out",
        "prog err",
        0,
    )
    tle = plan.answer(res("\nMARK\ncompile 0 1  \nrun 124 2000001\n"))
    assert tle.status == "Failed" and tle.run_result and tle.run_result.status == "TimeLimitExceeded"
    assert tle.run_result.return_code is None
    early = plan.answer(res("\nMARK\ncompile 0 1  \nrun 124 1000\n"))  # exit 124 of its own, within the limit
    assert early.run_result and (early.run_result.status, early.run_result.return_code) == ("Finished", 124)
    broken = plan.answer(res("\nMARK\ncompile 1 1  \n"))
    assert broken.status == "Failed" and broken.run_result is None
    assert broken.compile_result and broken.compile_result.return_code == 1
    missing = plan.answer(res("\nMARK\nunavailable g++\n"))
    assert missing.status == "SandboxError" and "language cpp is not available on this node" in missing.message
    assert plan.answer(res("\nMARK\nrun 0 x\n")).status == "SandboxError"
    lost = plan.answer(res("x" * 10, stderr_truncated=True))
    assert lost.status == "SandboxError" and "output limit" in lost.message


# -- a real daemon over TCP ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def node() -> Iterator[Daemon]:
    if os.geteuid() != 0:
        pytest.skip("the fncall tier needs root")
    port = _free_port()
    d = make_daemon("fusion", f'tcp = "127.0.0.1:{port}"\ntoken = "{TOKEN}"\n')
    d.tcp_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    d.start()
    yield d
    destroy_daemon(d)


@pytest.fixture(scope="module")
def url(node: Daemon) -> str:
    return f"{node.tcp_url}/run_code"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def http(node: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node.tcp_url, headers=AUTH, timeout=120) as c:  # type: ignore[attr-defined]
        yield c


def run(http: httpx.Client, path: str = "/run_code", **body: Any) -> dict[str, Any]:
    r = http.post(path, json={"language": "python", **body})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_python_calls(http: httpx.Client) -> None:
    ok = run(http, code="import sys; print('hi', sys.stdin.read(), __name__)", stdin="there", memory_limit_MB=1024)
    assert ok["status"] == "Success" and ok["message"] == "" and ok["compile_result"] is None
    rr = ok["run_result"]
    assert (rr["status"], rr["return_code"], rr["stdout"], rr["stderr"]) == ("Finished", 0, "hi there __main__\n", "")
    assert rr["execution_time"] >= 0

    syntax = run(http, code="def f(:\n  pass")
    assert syntax["status"] == "Failed" and syntax["run_result"]["return_code"] == 1
    assert "SyntaxError" in syntax["run_result"]["stderr"]

    exit3 = run(http, path="/v1/fusion/run_code", code="import sys; print('partial'); sys.exit(3)")
    assert exit3["status"] == "Failed"
    assert (exit3["run_result"]["status"], exit3["run_result"]["return_code"]) == ("Finished", 3)
    assert exit3["run_result"]["stdout"] == "partial\n"

    slow = run(http, code="import time; print('started', flush=True); time.sleep(30)", run_timeout=1)
    assert slow["status"] == "Failed"
    assert (slow["run_result"]["status"], slow["run_result"]["return_code"]) == ("TimeLimitExceeded", None)
    assert slow["run_result"]["stdout"] == "started\n" and slow["run_result"]["execution_time"] < 10

    killed = run(http, code="import os; os.kill(os.getpid(), 9)")
    assert killed["status"] == "Failed" and killed["run_result"]["return_code"] == -9


def test_bash_and_files(http: httpx.Client) -> None:
    sh = run(http, language="bash", code="read x; echo got $x; exit 2", stdin="7\n")
    assert sh["status"] == "Failed" and sh["run_result"]["stdout"] == "got 7\n"
    assert sh["run_result"]["return_code"] == 2
    assert run(http, language="sh", code="echo ok")["run_result"]["stdout"] == "ok\n"

    data = base64.b64encode(b"\x00\x01 bytes").decode()
    code = "import os; os.mkdir('out'); open('out/r.txt','w').write(open('in/d.bin','rb').read().hex()); print('done')"
    got = run(
        http,
        code=code,
        files={"in/d.bin": data, "ignored.txt": None},
        fetch_files=["out/r.txt", "in/d.bin", "absent.txt"],
        stdin="",
    )
    assert got["status"] == "Success", got
    assert got["run_result"]["stdout"] == "done\n" and got["run_result"]["stderr"] == ""
    assert base64.b64decode(got["files"]["out/r.txt"]) == b"\x00\x01 bytes".hex().encode()
    assert got["files"]["in/d.bin"] == data and "absent.txt" not in got["files"]

    killed = run(http, code="import os, sys; sys.stderr.write('e'); os.kill(os.getpid(), 9)", fetch_files=["x"])
    assert (killed["status"], killed["run_result"]["return_code"], killed["run_result"]["stderr"]) == (
        "Failed",
        -9,
        "e",
    )

    # the driver's own limit, and the program's stderr kept apart from its report
    slow = run(http, code="import sys, time; sys.stderr.write('e'); time.sleep(30)", run_timeout=1, fetch_files=["x"])
    assert slow["status"] == "Failed" and slow["run_result"]["status"] == "TimeLimitExceeded"
    assert slow["run_result"]["stderr"] == "e"


def test_other_languages_are_honest(http: httpx.Client) -> None:
    """The python image has no C++ toolchain or JVM: said so, never faked."""
    for lang in ("cpp", "java", "go_test"):
        r = run(http, language=lang, code="int main() { return 0; }")
        assert r["status"] == "SandboxError" and r["run_result"] is None, r
        assert r["message"].startswith(f"language {lang} is not available on this node"), r
    perl = run(http, language="perl", code="my $l = <STDIN>; print 'p', $l; exit 4", stdin="erl\n")
    if perl["status"] != "SandboxError":  # perl is in Debian's perl-base, if the image kept it
        assert (perl["status"], perl["run_result"]["stdout"], perl["run_result"]["return_code"]) == (
            "Failed",
            "perl\n",
            4,
        )


def test_bad_requests_are_typed_400s(http: httpx.Client) -> None:
    for body in (
        {"code": "x", "language": "cobol"},
        {"code": "x", "language": "python", "memory_limit_mb": 1024},
        {"code": "x", "language": "python", "memory_limit_MB": 8},
        {"code": "x", "language": "python", "files": {"/etc/x": "eA=="}},
        {"code": "x", "language": "python", "files": {"a": "%%%"}},
        {"language": "python"},
    ):
        r = http.post("/run_code", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument", (body, r.text)
    r = http.post("/run_code?image=no-such-image", json={"code": "x", "language": "python"})
    assert 400 <= r.status_code < 500 and "error" in r.json(), r.text
    assert httpx.post(str(http.base_url.join("/run_code")), json={"code": "x", "language": "python"}).status_code == 401


# -- verl's own client ---------------------------------------------------------------------------


class _Bearer:
    """verl posts with `requests.post` and no credentials; the daemon's TCP listener wants its token."""

    exceptions = requests.exceptions

    @staticmethod
    def post(url: str, headers: dict[str, str], **kw: Any) -> requests.Response:
        return requests.post(url, headers={**headers, **AUTH}, **kw)


@pytest.fixture(scope="module")
def verl() -> ModuleType:
    """verl/utils/reward_score/sandbox_fusion as a package of its own: its code imports only requests."""
    spec = importlib.util.find_spec("verl")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(VERL_MISSING)
    pkg = Path(list(spec.submodule_search_locations)[0]) / "utils" / "reward_score" / "sandbox_fusion"
    name = "verl_sandbox_fusion"
    pspec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    assert pspec and pspec.loader
    mod = importlib.util.module_from_spec(pspec)
    sys.modules[name] = mod
    pspec.loader.exec_module(mod)
    mod.utils.requests = _Bearer  # type: ignore[attr-defined]
    return mod


def test_verl_languages_are_all_accepted(verl: ModuleType) -> None:
    for lang in verl.utils.SUPPORTED_LANGUAGES:
        fusion.FusionRunCodeRequest(code="", language=lang)


def test_verl_check_correctness(verl: ModuleType, url: str) -> None:
    sq = "n = int(input())\nprint(n * n)\n"
    in_outs = {"inputs": ["3\n", "4\n"], "outputs": ["9\n", "15\n"]}
    results, meta = verl.utils.check_correctness(url, in_outs, sq, timeout=5)
    assert results == [True, False], meta
    assert [m["status"] for m in meta] == ["success", "wrong_answer"] and meta[0]["stdout"] == "9\n"

    results, meta = verl.utils.check_correctness(url, in_outs, "print(int(input()) ** 2 +", timeout=5)
    assert results == [-2, -2] and meta[0]["status"] == "runtime_error" and "SyntaxError" in meta[0]["stderr"]

    results, meta = verl.utils.check_correctness(url, in_outs, "import sys; sys.exit(1)", timeout=5)
    assert results == [-2, -2] and meta[0]["exit_code"] == 1

    results, meta = verl.utils.check_correctness(url, in_outs, "while True: pass", timeout=1)
    assert results == [-3, -3] and meta[0]["status"] == "timeout"

    fn = {"fn_name": "add", "inputs": ["1\n2", "[1]\n[2]"], "outputs": ["3", "[1, 2]"]}
    results, meta = verl.utils.check_correctness(url, fn, "def add(a, b):\n    return a + b\n", timeout=5)
    assert results == [True, True], meta

    asserts = {"inputs": ["", ""], "outputs": [None, None], "assert_case": ["assert f(2) == 4", "assert f(3) == 6"]}
    results, _ = verl.utils.check_correctness(url, asserts, "def f(x):\n    return x * 2\n", timeout=5)
    assert results == [True, True]
    results, _ = verl.utils.check_correctness(url, asserts, "def f(x):\n    return x + 2\n", timeout=5)
    assert results == [True, -2]


def test_verl_compute_score_and_tool_call(verl: ModuleType, url: str) -> None:
    completion = "Here:\n```python\nprint(sum(map(int, input().split())))\n```"
    score, meta = verl.compute_score(url, None, 1024, completion, {"inputs": ["1 2", "5 5"], "outputs": ["3", "10"]})
    assert score == 1.0, meta

    # what SandboxFusionTool.execute_code does with the model's code
    status, meta = verl.utils._process_single_case(0, None, None, url, "print('tool'); 1/0", 30, 1024, "python")
    assert (status, meta["run_status"], meta["stdout"]) == (-2, "Finished", "tool\n")
    assert "ZeroDivisionError" in meta["stderr"]
    status, meta = verl.utils._process_single_case(0, None, None, url, "echo $((6*7))", 30, 1024, "bash")
    assert (status, meta["stdout"]) == (True, "42\n")

    status, meta = verl.utils._process_single_case(0, "", "x", url, "int main(){}", 5, 1024, "cpp")
    assert (status, meta["status"]) == (-1, "sandbox_error")
    assert "not available on this node" in meta["api_response"]["message"]
