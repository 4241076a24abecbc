"""SandboxFusion's `POST /run_code`, served by the fncall tier, so a trainer written against
ByteDance's SandboxFusion (verl's `sandbox_fusion` reward and code tool) switches to sandfleet by
changing only the URL: `http://node:port/run_code`, or `/v1/fusion/run_code`.

The shape is SandboxFusion's: `status` Success (every step ran and exited 0) / Failed (a step exited
nonzero or ran out of time) / SandboxError (the call could not be run: verl scores it -1, never as
the program's fault), with `compile_result`/`run_result` of status Finished / TimeLimitExceeded /
Error. Python and bash without `fetch_files` run as plain calls on the warm interpreters; everything
else runs a small sh driver in the call, which compiles and runs under their own time limits and
reports on stderr after a per-call random marker (so nothing the program prints by chance is taken for
it; a program that forges it on purpose gains nothing it could not get by exiting 0). A language this
node cannot run is said so (SandboxError), never faked: the driver checks the toolchain is in the
workers' image, which `?image=` picks (a verl URL can carry the query).
"""

from __future__ import annotations

import base64
import secrets
import shlex
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sandfleet.daemon.api.common import Api, CheckedRoute
from sandfleet.errors import InvalidArgumentError, SandboxError
from sandfleet.models import MAX_REF, MAX_SESSION_COMMAND, MAX_STDIN, ExecResult, Resources, RunCodeRequest

# SandboxFusion's own list (its `Language`), plus the aliases people type.
FusionLanguage = Literal[
    "python", "python3", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "sh", "typescript",
    "sql", "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
    "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket",
]  # fmt: skip

DRIVER_DIR = ".sandfleet-fusion"  # in the call's scratch directory: the program text and build output
SLACK = 10.0  # seconds a driven call may take past compile_timeout + run_timeout (its own steps)
OUTPUT_LIMIT = 16 * 1024**2  # bytes kept per stream: SandboxFusion keeps all; the driver's report must fit


class _Lang(BaseModel):
    """How the driver runs one language: the program's file, an optional build, the run, and the
    tools that must be on the image's PATH for either."""

    source: str
    compile: str | None = None
    run: str
    tools: tuple[str, ...]


_SRC = f"{DRIVER_DIR}/main"
LANGS: dict[str, _Lang] = {
    "python": _Lang(source=f"{_SRC}.py", run=f"python3 {_SRC}.py", tools=("python3",)),
    "bash": _Lang(source=f"{_SRC}.sh", run=f"bash {_SRC}.sh", tools=("bash",)),
    "cpp": _Lang(source=f"{_SRC}.cpp", compile=f"g++ -std=c++17 -O2 -o {_SRC} {_SRC}.cpp", run=_SRC, tools=("g++",)),
    "go": _Lang(source=f"{_SRC}.go", compile=f"go build -o {_SRC} {_SRC}.go", run=_SRC, tools=("go",)),
    "rust": _Lang(source=f"{_SRC}.rs", compile=f"rustc -O -o {_SRC} {_SRC}.rs", run=_SRC, tools=("rustc",)),
    "nodejs": _Lang(source=f"{_SRC}.js", run=f"node {_SRC}.js", tools=("node",)),
    "perl": _Lang(source=f"{_SRC}.pl", run=f"perl {_SRC}.pl", tools=("perl",)),
    "ruby": _Lang(source=f"{_SRC}.rb", run=f"ruby {_SRC}.rb", tools=("ruby",)),
    "php": _Lang(source=f"{_SRC}.php", run=f"php {_SRC}.php", tools=("php",)),
    "lua": _Lang(source=f"{_SRC}.lua", run=f"lua {_SRC}.lua", tools=("lua",)),
    "R": _Lang(source=f"{_SRC}.R", run=f"Rscript {_SRC}.R", tools=("Rscript",)),
    "julia": _Lang(source=f"{_SRC}.jl", run=f"julia {_SRC}.jl", tools=("julia",)),
}
ALIASES = {"python3": "python", "sh": "bash"}


class FusionRunCodeRequest(BaseModel):
    """SandboxFusion's RunCodeRequest. Unknown fields are refused (SandboxFusion ignores them), so a
    misspelt `memory_limit_mb` is a 400 here instead of a silently unlimited call."""

    model_config = ConfigDict(extra="forbid")

    code: str = Field(max_length=MAX_SESSION_COMMAND, description="the program text")
    language: FusionLanguage = Field(description="SandboxFusion's language names (python3 and sh also accepted)")
    compile_timeout: float = Field(10, gt=0, le=3600, description="seconds for the build step of compiled languages")
    run_timeout: float = Field(10, gt=0, le=3600, description="seconds for the run")
    memory_limit_MB: int = Field(-1, le=1024**2, description="the worker's memory limit; <= 0: the pool's default")
    stdin: str | None = Field(None, max_length=MAX_STDIN, description="text fed to the program's standard input")
    files: dict[str, str | None] = Field(
        default_factory=dict, description="relative path -> base64 content, written to the working directory first"
    )
    fetch_files: list[str] = Field(
        default_factory=list, max_length=64, description="paths read back after the run (absent ones are left out)"
    )

    @field_validator("fetch_files")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        for name in v:
            if not name or len(name) > 4096 or "\0" in name:
                raise ValueError("a fetch_files entry is a path (non-empty, no NUL, at most 4096 characters)")
        return v


class FusionCommandResult(BaseModel):
    """One step (build or run), as SandboxFusion's CommandRunResult."""

    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = Field(None, description="none when the step ran out of time; -N: killed by signal N")
    stdout: str | None = None
    stderr: str | None = None


class FusionRunCodeResponse(BaseModel):
    """SandboxFusion's RunCodeResponse."""

    status: Literal["Success", "Failed", "SandboxError"]
    message: str = ""
    compile_result: FusionCommandResult | None = None
    run_result: FusionCommandResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict, description="fetched path -> base64 content")


def router(api: Api) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute, tags=["fusion"])
    node, tenancy = api.node, api.tenancy

    async def run_code(
        req: FusionRunCodeRequest,
        image: Annotated[str | None, Query(max_length=MAX_REF, description="the workers' image (name:tag)")] = None,
    ) -> FusionRunCodeResponse:
        """SandboxFusion's run_code on a pooled fncall worker: a verl `sandbox_fusion.url` works unchanged."""
        language = ALIASES.get(req.language, req.language)
        if language not in LANGS:
            return _sandbox_error(f"language {req.language} is not available on this node")
        plan = _plan(req, language, image)
        try:
            result = await node.calls.run(tenancy.placed_call(plan.call))
        except SandboxError as exc:
            if exc.http_status < 429:  # the caller's mistake (a bad image, ...): a typed 4xx, as elsewhere
                raise
            return _sandbox_error(f"{exc.code}: {exc.message}")
        return plan.answer(result)

    for name in ("fusion_run_code", "fusion_run_code_v1"):
        api.route(r, name, response_model=FusionRunCodeResponse)(run_code)
    return r


def _sandbox_error(message: str) -> FusionRunCodeResponse:
    return FusionRunCodeResponse(status="SandboxError", message=message)


class _Plan:
    """The fncall call for one request, and how to read its result back into SandboxFusion's shape."""

    def __init__(self, req: FusionRunCodeRequest, language: str, call: RunCodeRequest, marker: str | None) -> None:
        self.req, self.language, self.call, self.marker = req, language, call, marker

    def answer(self, res: ExecResult) -> FusionRunCodeResponse:
        if self.marker is None:  # a plain call: the result is the run's
            run = _step(res.exit_code, res.signal, res.duration, res.timed_out, res.stdout, res.stderr)
            return _response(None, run, {}, oom=res.oom_killed)
        return self._driven(res)

    def _driven(self, res: ExecResult) -> FusionRunCodeResponse:
        """Split the driver's report (after the marker, at the end of stderr) from the program's own stderr."""
        head, sep, report = res.stderr.rpartition(f"\n{self.marker}\n")
        if not sep:
            if res.timed_out:  # the whole call ran out of time (the steps' own limits did not fire)
                return _response(None, _step(0, None, res.duration, True, res.stdout, res.stderr), {})
            why = "its stderr was cut at the output limit" if res.stderr_truncated else f"exit {res.exit_code}"
            return _sandbox_error(f"the run's report was lost ({why})")
        try:
            return self._read(report, head, res)
        except (ValueError, IndexError):  # a line past the report (a straggler of the program's)
            return _sandbox_error("the run's report was unreadable")

    def _read(self, report: str, head: str, res: ExecResult) -> FusionRunCodeResponse:
        compiled: FusionCommandResult | None = None
        run: FusionCommandResult | None = None
        files: dict[str, str] = {}
        for line in report.splitlines():
            kind, _, rest = line.partition(" ")
            f = rest.split(" ")
            if kind == "unavailable":
                return _sandbox_error(
                    f"language {self.req.language} is not available on this node "
                    f"(no {rest} in image {self.call.image or 'python'})"
                )
            if kind in ("compile", "run") and len(f) == (4 if kind == "compile" else 2):
                rc, us = int(f[0]), int(f[1])
                limit = self.req.compile_timeout if kind == "compile" else self.req.run_timeout
                tle = _timed_out(rc, us, limit)
                if kind == "compile":
                    out, err = (base64.b64decode(x).decode("utf-8", "replace") for x in f[2:])
                    compiled = _step(_exit_code(rc), None, us / 1e6, tle, out, err)
                else:
                    run = _step(_exit_code(rc), None, us / 1e6, tle, res.stdout, head)
            elif kind == "file" and len(f) == 2:
                files[self.req.fetch_files[int(f[0])]] = f[1]
        return _response(compiled, run, files, oom=res.oom_killed)


def _exit_code(rc: int) -> int:
    """The shell reports a death by signal N as 128+N; SandboxFusion (Popen) as -N. An exit(137) of
    the program's own reads as -9 too: both are nonzero, which is all verl looks at."""
    return -(rc - 128) if 128 < rc < 160 else rc


def _timed_out(rc: int, micros: int, limit: float) -> bool:
    """GNU timeout exits 124 (or 137 when it had to SIGKILL): that, once the limit has passed."""
    return rc in (124, 137) and micros >= limit * 1e6


def _step(
    rc: int, signal: int | None, seconds: float, timed_out: bool, stdout: str, stderr: str
) -> FusionCommandResult:
    if timed_out:
        return FusionCommandResult(status="TimeLimitExceeded", execution_time=seconds, stdout=stdout, stderr=stderr)
    code = -signal if signal else rc  # a signal as Popen reports it, as SandboxFusion does
    return FusionCommandResult(
        status="Finished", execution_time=seconds, return_code=code, stdout=stdout, stderr=stderr
    )


def _response(
    compiled: FusionCommandResult | None, run: FusionCommandResult | None, files: dict[str, str], *, oom: bool = False
) -> FusionRunCodeResponse:
    """Success only when every step that ran finished with 0; a build that failed leaves no run."""
    steps = [s for s in (compiled, run) if s is not None]
    ok = run is not None and all(s.status == "Finished" and s.return_code == 0 for s in steps)
    message = "the memory limit was hit (OOM-killed)" if oom else ""
    return FusionRunCodeResponse(
        status="Success" if ok else "Failed", message=message, compile_result=compiled, run_result=run, files=files
    )


def _plan(req: FusionRunCodeRequest, language: str, image: str | None) -> _Plan:
    """The fncall call: the plain one for python and bash with nothing to fetch, else the driver."""
    files: dict[str, str] = {}
    for name, content in req.files.items():
        if content is None:  # SandboxFusion skips these
            continue
        if name == DRIVER_DIR or name.startswith(f"{DRIVER_DIR}/"):
            raise InvalidArgumentError(f"files: {DRIVER_DIR}/ is the driver's")
        files[name] = content

    def call(code: str, lang: Literal["python", "bash"], timeout: float) -> RunCodeRequest:
        resources = Resources(memory=req.memory_limit_MB * 1024**2) if req.memory_limit_MB > 0 else None
        return RunCodeRequest(
            code=code,
            language=lang,
            files_b64=files,
            stdin=req.stdin,
            timeout=timeout,
            image=image,
            resources=resources,
            output_limit=OUTPUT_LIMIT,
        )

    try:
        if language in ("python", "bash") and not req.fetch_files:
            return _Plan(
                req, language, call(req.code, "bash" if language == "bash" else "python", req.run_timeout), None
            )
        lang = LANGS[language]
        marker = f"sandfleet-fusion-{secrets.token_hex(16)}"
        files[lang.source] = base64.b64encode(req.code.encode()).decode()
        driven = call(_driver(lang, marker, req), "bash", min(3600.0, req.compile_timeout + req.run_timeout + SLACK))
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InvalidArgumentError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"[:500]) from None
    return _Plan(req, language, driven, marker)


def _driver(lang: _Lang, marker: str, req: FusionRunCodeRequest) -> str:
    """The sh script of a driven call: check the tools, build (output kept aside), run (its stdin and
    streams are the call's), then the report on stderr: `compile RC MICROS B64OUT B64ERR`,
    `run RC MICROS`, `file INDEX B64`, or `unavailable TOOL`."""
    q = shlex.quote
    lines = [
        f"M={q(marker)}",
        "now() { date +%s%N; }",
        "report() { printf '\\n%s\\n' \"$M\" >&2; }",
        *(
            f"command -v {q(t)} >/dev/null 2>&1 || {{ report; printf 'unavailable %s\\n' {q(t)} >&2; exit 0; }}"
            for t in lang.tools
        ),
        "crc=; rrc=",
    ]
    if lang.compile:
        lines += [
            f"t0=$(now); {{ timeout -k 1 {req.compile_timeout:g} {lang.compile} "
            f">{DRIVER_DIR}/c.out 2>{DRIVER_DIR}/c.err </dev/null; crc=$?; }} 2>/dev/null",
            "ct=$(( ($(now) - t0) / 1000 ))",
        ]
    lines += [
        'if [ -z "$crc" ] || [ "$crc" -eq 0 ]; then',
        # the step's stderr is the call's (fd 3); the shell's own "Killed" notice goes nowhere
        f"  t0=$(now); {{ timeout -k 1 {req.run_timeout:g} {lang.run} 2>&3 3>&-; rrc=$?; }} 3>&2 2>/dev/null",
        "  rt=$(( ($(now) - t0) / 1000 ))",
        "fi",
        "{",
        "  report",
        '  [ -n "$crc" ] && printf \'compile %s %s %s %s\\n\' "$crc" "$ct" '
        f'"$(base64 -w0 {DRIVER_DIR}/c.out)" "$(base64 -w0 {DRIVER_DIR}/c.err)"',
        '  [ -n "$rrc" ] && printf \'run %s %s\\n\' "$rrc" "$rt"',
        *(
            f"  [ -f {q(name)} ] && printf 'file {i} %s\\n' \"$(base64 -w0 < {q(name)})\""
            for i, name in enumerate(req.fetch_files)
        ),
        "} >&2",
        "exit 0",
    ]
    return "\n".join(lines) + "\n"
