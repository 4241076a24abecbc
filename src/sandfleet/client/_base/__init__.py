"""I/O-free core shared by `Client` and `AsyncClient`: request building and response decoding.

One module per concern: `wire` (the `Call`, bodies validated, answers decoded, resource paths),
`transport` (endpoints, fail-over, transport errors), `lane` (one-response calls on a unix
socket without httpx), `deadlines`, `commands` (a command's options,
`CommandOptions`, and the exec, process, session and run_code calls), `sandboxes` (creates and
their retries, forks, snapshots, fleet-wide calls), `files`, `terminal`, `node` (images, audit)
and `rl` (trajectories, verification). This package re-exports their names: `b.call_exec(...)`.

Each API call is described as a `Call` (method, path, params, body, expected model); the sync and
async clients only differ in how they send it. Transport errors and wire errors are mapped to the
`SandboxError` tree here, so both clients raise the same exceptions.

Deadlines. Every request waits at most the client's `timeout` for an answer unless its call takes a
`timeout=` of its own (image builds, imports, pushes and `pack` default to `BUILD_TIMEOUT`). A
command whose own timeout fits in the client's is run by the one-response exec endpoint, which gets
that timeout plus `EXEC_MARGIN` (so the daemon's `timed_out=true` answer wins); a command with no
timeout, or a longer one, is streamed, and there the client's timeout bounds *silence* (the daemon
sends a heartbeat every `HEARTBEAT_INTERVAL` seconds while nothing else happens), never less than
`MIN_SILENCE`. Calls that retry (create, create_many, fork, restore) keep to one deadline for all
their attempts.

Several gateways (`Client(["http://gw1:8600", "http://gw2:8600"])`, `sandfleet.ray.connect()`): calls
go to one; a transport failure there moves every later call to the next (`fail_over`), and the
call itself is sent there at once when that is safe (it never reached the first, or it is a read).
A create whose answer was lost is retried with its idempotency key, marked `RETRIED`, so whichever
gateway gets it asks the nodes which one holds the key (a first attempt is not marked: it costs
nothing extra, unless the caller says its key may have been used by another process, `key_reused`).
"""

from __future__ import annotations

from sandfleet.client._base.commands import (
    CommandOptions as CommandOptions,
)
from sandfleet.client._base.commands import (
    call_exec as call_exec,
)
from sandfleet.client._base.commands import (
    call_kill as call_kill,
)
from sandfleet.client._base.commands import (
    call_output as call_output,
)
from sandfleet.client._base.commands import (
    call_run_batch as call_run_batch,
)
from sandfleet.client._base.commands import (
    call_run_code as call_run_code,
)
from sandfleet.client._base.commands import (
    call_session_create as call_session_create,
)
from sandfleet.client._base.commands import (
    call_session_run as call_session_run,
)
from sandfleet.client._base.commands import (
    call_start as call_start,
)
from sandfleet.client._base.commands import (
    call_start_stream as call_start_stream,
)
from sandfleet.client._base.commands import (
    call_stdin as call_stdin,
)
from sandfleet.client._base.commands import (
    call_wait as call_wait,
)
from sandfleet.client._base.commands import (
    decode_event as decode_event,
)
from sandfleet.client._base.commands import (
    exec_body as exec_body,
)
from sandfleet.client._base.commands import (
    exec_event as exec_event,
)
from sandfleet.client._base.commands import (
    exit_result as exit_result,
)
from sandfleet.client._base.commands import (
    finished as finished,
)
from sandfleet.client._base.commands import (
    no_exit as no_exit,
)
from sandfleet.client._base.commands import (
    run_batch_item as run_batch_item,
)
from sandfleet.client._base.commands import (
    run_code_body as run_code_body,
)
from sandfleet.client._base.commands import (
    session_run_body as session_run_body,
)
from sandfleet.client._base.deadlines import (
    BACKOFF_FIRST as BACKOFF_FIRST,
)
from sandfleet.client._base.deadlines import (
    BACKOFF_MAX as BACKOFF_MAX,
)
from sandfleet.client._base.deadlines import (
    BUILD_TIMEOUT as BUILD_TIMEOUT,
)
from sandfleet.client._base.deadlines import (
    DEFAULT_TIMEOUT as DEFAULT_TIMEOUT,
)
from sandfleet.client._base.deadlines import (
    EXEC_MARGIN as EXEC_MARGIN,
)
from sandfleet.client._base.deadlines import (
    HEARTBEAT_INTERVAL as HEARTBEAT_INTERVAL,
)
from sandfleet.client._base.deadlines import (
    MIN_ATTEMPT as MIN_ATTEMPT,
)
from sandfleet.client._base.deadlines import (
    MIN_SILENCE as MIN_SILENCE,
)
from sandfleet.client._base.deadlines import (
    Deadline as Deadline,
)
from sandfleet.client._base.deadlines import (
    check_timeout as check_timeout,
)
from sandfleet.client._base.deadlines import (
    exec_timeout as exec_timeout,
)
from sandfleet.client._base.deadlines import (
    next_line as next_line,
)
from sandfleet.client._base.deadlines import (
    next_line_sync as next_line_sync,
)
from sandfleet.client._base.deadlines import (
    one_response as one_response,
)
from sandfleet.client._base.deadlines import (
    request_timeout as request_timeout,
)
from sandfleet.client._base.deadlines import (
    silence_limit as silence_limit,
)
from sandfleet.client._base.deadlines import (
    stream_deadline as stream_deadline,
)
from sandfleet.client._base.deadlines import (
    stream_timeouts as stream_timeouts,
)
from sandfleet.client._base.files import (
    call_download as call_download,
)
from sandfleet.client._base.files import (
    call_list_files as call_list_files,
)
from sandfleet.client._base.files import (
    call_mkdir as call_mkdir,
)
from sandfleet.client._base.files import (
    call_read as call_read,
)
from sandfleet.client._base.files import (
    call_remove as call_remove,
)
from sandfleet.client._base.files import (
    call_stat as call_stat,
)
from sandfleet.client._base.files import (
    call_upload as call_upload,
)
from sandfleet.client._base.files import (
    call_watch as call_watch,
)
from sandfleet.client._base.files import (
    call_write as call_write,
)
from sandfleet.client._base.files import (
    extract_tar as extract_tar,
)
from sandfleet.client._base.files import (
    file_event as file_event,
)
from sandfleet.client._base.files import (
    local_tar as local_tar,
)
from sandfleet.client._base.lane import (
    Answer as Answer,
)
from sandfleet.client._base.lane import (
    AsyncConnection as AsyncConnection,
)
from sandfleet.client._base.lane import (
    Connection as Connection,
)
from sandfleet.client._base.lane import (
    Lane as Lane,
)
from sandfleet.client._base.lane import (
    encode as encode,
)
from sandfleet.client._base.node import (
    audit_query as audit_query,
)
from sandfleet.client._base.node import (
    audit_record as audit_record,
)
from sandfleet.client._base.node import (
    build_event as build_event,
)
from sandfleet.client._base.node import (
    built as built,
)
from sandfleet.client._base.node import (
    call_audit as call_audit,
)
from sandfleet.client._base.node import (
    recipe_source as recipe_source,
)
from sandfleet.client._base.rl import (
    STEP_GRACE as STEP_GRACE,
)
from sandfleet.client._base.rl import (
    STEP_RETRY as STEP_RETRY,
)
from sandfleet.client._base.rl import (
    step_error as step_error,
)
from sandfleet.client._base.rl import (
    step_timeout as step_timeout,
)
from sandfleet.client._base.rl import (
    trajectory_path as trajectory_path,
)
from sandfleet.client._base.rl import (
    verify_request as verify_request,
)
from sandfleet.client._base.rl import (
    verify_timeout as verify_timeout,
)
from sandfleet.client._base.sandboxes import (
    RETRIED as RETRIED,
)
from sandfleet.client._base.sandboxes import (
    CreateAttempts as CreateAttempts,
)
from sandfleet.client._base.sandboxes import (
    call_create as call_create,
)
from sandfleet.client._base.sandboxes import (
    call_create_batch as call_create_batch,
)
from sandfleet.client._base.sandboxes import (
    call_expose as call_expose,
)
from sandfleet.client._base.sandboxes import (
    call_fork as call_fork,
)
from sandfleet.client._base.sandboxes import (
    call_job as call_job,
)
from sandfleet.client._base.sandboxes import (
    call_jobs as call_jobs,
)
from sandfleet.client._base.sandboxes import (
    call_labels as call_labels,
)
from sandfleet.client._base.sandboxes import (
    call_list as call_list,
)
from sandfleet.client._base.sandboxes import (
    call_pack as call_pack,
)
from sandfleet.client._base.sandboxes import (
    call_restore as call_restore,
)
from sandfleet.client._base.sandboxes import (
    call_set_lifetime as call_set_lifetime,
)
from sandfleet.client._base.sandboxes import (
    call_set_lifetimes as call_set_lifetimes,
)
from sandfleet.client._base.sandboxes import (
    call_set_network as call_set_network,
)
from sandfleet.client._base.sandboxes import (
    call_set_network_many as call_set_network_many,
)
from sandfleet.client._base.sandboxes import (
    call_snapshot as call_snapshot,
)
from sandfleet.client._base.sandboxes import (
    call_snapshots as call_snapshots,
)
from sandfleet.client._base.sandboxes import (
    exposed as exposed,
)
from sandfleet.client._base.sandboxes import (
    gather_bounded as gather_bounded,
)
from sandfleet.client._base.sandboxes import (
    gather_bounded_sync as gather_bounded_sync,
)
from sandfleet.client._base.sandboxes import (
    idempotency_key as idempotency_key,
)
from sandfleet.client._base.sandboxes import (
    in_project as in_project,
)
from sandfleet.client._base.sandboxes import (
    item_error as item_error,
)
from sandfleet.client._base.sandboxes import (
    network_policy as network_policy,
)
from sandfleet.client._base.sandboxes import (
    new_idempotency_key as new_idempotency_key,
)
from sandfleet.client._base.sandboxes import (
    retried as retried,
)
from sandfleet.client._base.sandboxes import (
    selector as selector,
)
from sandfleet.client._base.sandboxes import (
    spec_from as spec_from,
)
from sandfleet.client._base.terminal import (
    EXPECT_KEEP as EXPECT_KEEP,
)
from sandfleet.client._base.terminal import (
    EXPECT_OVERLAP as EXPECT_OVERLAP,
)
from sandfleet.client._base.terminal import (
    TERMINAL_BEARER as TERMINAL_BEARER,
)
from sandfleet.client._base.terminal import (
    TERMINAL_FRAME as TERMINAL_FRAME,
)
from sandfleet.client._base.terminal import (
    TERMINAL_OPEN_TIMEOUT as TERMINAL_OPEN_TIMEOUT,
)
from sandfleet.client._base.terminal import (
    TERMINAL_PROTOCOL as TERMINAL_PROTOCOL,
)
from sandfleet.client._base.terminal import (
    terminal_closed as terminal_closed,
)
from sandfleet.client._base.terminal import (
    terminal_credentials as terminal_credentials,
)
from sandfleet.client._base.terminal import (
    terminal_message as terminal_message,
)
from sandfleet.client._base.terminal import (
    terminal_origin_ok as terminal_origin_ok,
)
from sandfleet.client._base.terminal import (
    terminal_path as terminal_path,
)
from sandfleet.client._base.terminal import (
    terminal_resize as terminal_resize,
)
from sandfleet.client._base.terminal import (
    terminal_result as terminal_result,
)
from sandfleet.client._base.terminal import (
    terminal_start as terminal_start,
)
from sandfleet.client._base.transport import (
    DEFAULT_SOCKET as DEFAULT_SOCKET,
)
from sandfleet.client._base.transport import (
    FAILOVER_CONNECT as FAILOVER_CONNECT,
)
from sandfleet.client._base.transport import (
    TCP_OPTIONS as TCP_OPTIONS,
)
from sandfleet.client._base.transport import (
    Endpoint as Endpoint,
)
from sandfleet.client._base.transport import (
    Route as Route,
)
from sandfleet.client._base.transport import (
    fail_over as fail_over,
)
from sandfleet.client._base.transport import (
    map_transport_error as map_transport_error,
)
from sandfleet.client._base.transport import (
    raise_for as raise_for,
)
from sandfleet.client._base.transport import (
    request_sent as request_sent,
)
from sandfleet.client._base.transport import (
    transport_cause as transport_cause,
)
from sandfleet.client._base.wire import (
    UNSET as UNSET,
)
from sandfleet.client._base.wire import (
    Call as Call,
)
from sandfleet.client._base.wire import (
    Unset as Unset,
)
from sandfleet.client._base.wire import (
    as_bytes as as_bytes,
)
from sandfleet.client._base.wire import (
    decode as decode,
)
from sandfleet.client._base.wire import operation_call as operation_call
from sandfleet.client._base.wire import (
    process_path as process_path,
)
from sandfleet.client._base.wire import (
    sandbox_path as sandbox_path,
)
from sandfleet.client._base.wire import (
    session_path as session_path,
)
from sandfleet.client._base.wire import (
    snapshot_path as snapshot_path,
)
from sandfleet.client._base.wire import (
    validated as validated,
)
