"""
Every message the Edge and the Node put on the wire, built in one place.

The rest of iop never touches the generated L{iop.protocols.iop_pb2}: it
builds what it sends with the functions here (typed parameters, one per
kind of message, grouped as in C{iop.proto}), and reads what it receives
from the messages it is handed. For that reading this module also names
the message classes (for annotations and C{isinstance}), the envelope
(to parse a frame) and the enum constants, as plain C{int}s.

The generated module is untyped: to mypy the message classes are C{Any}.
"""

from collections.abc import Iterable

from iop.protocols import iop_pb2
from iop.protocols.iop_pb2 import AdapterConfig as AdapterConfig
from iop.protocols.iop_pb2 import CancelRequest as CancelRequest
from iop.protocols.iop_pb2 import CancelResponse as CancelResponse
from iop.protocols.iop_pb2 import ChatMessage as ChatMessage
from iop.protocols.iop_pb2 import ConfigRefresh as ConfigRefresh
from iop.protocols.iop_pb2 import EdgeDraining as EdgeDraining
from iop.protocols.iop_pb2 import Envelope as Envelope
from iop.protocols.iop_pb2 import NodeCommandRequest as NodeCommandRequest
from iop.protocols.iop_pb2 import NodeCommandResponse as NodeCommandResponse
from iop.protocols.iop_pb2 import NodeConfigPayload as NodeConfigPayload
from iop.protocols.iop_pb2 import NodeDraining as NodeDraining
from iop.protocols.iop_pb2 import NodeReadyRequest as NodeReadyRequest
from iop.protocols.iop_pb2 import NodeReadyResponse as NodeReadyResponse
from iop.protocols.iop_pb2 import Ping as Ping
from iop.protocols.iop_pb2 import Pong as Pong
from iop.protocols.iop_pb2 import ProviderTunnelFrame as ProviderTunnelFrame
from iop.protocols.iop_pb2 import ProviderTunnelRequest as ProviderTunnelRequest
from iop.protocols.iop_pb2 import ReconciledRun as ReconciledRun
from iop.protocols.iop_pb2 import RegisterRequest as RegisterRequest
from iop.protocols.iop_pb2 import RegisterResponse as RegisterResponse
from iop.protocols.iop_pb2 import RunError as RunError
from iop.protocols.iop_pb2 import RunEvent as RunEvent
from iop.protocols.iop_pb2 import RunReconcile as RunReconcile
from iop.protocols.iop_pb2 import RunRequest as RunRequest
from iop.protocols.iop_pb2 import RunResume as RunResume
from iop.protocols.iop_pb2 import ToolCall as ToolCall
from iop.protocols.iop_pb2 import Usage as Usage
from iop.protocols.iop_pb2 import WindowUpdate as WindowUpdate
from iop.run import clean_text

# ---- constants --------------------------------------------------------------

#: C{RegisterResponse.code} (the C{RejectCode} enum): see C{iop.proto}.
REJECT_NONE: int = iop_pb2.REJECT_NONE
UNKNOWN_TOKEN: int = iop_pb2.UNKNOWN_TOKEN
DUPLICATE_CONNECTION: int = iop_pb2.DUPLICATE_CONNECTION
CONFIG_BUILD_FAILED: int = iop_pb2.CONFIG_BUILD_FAILED
INCOMPATIBLE_VERSION: int = iop_pb2.INCOMPATIBLE_VERSION

#: C{CancelRequest.kind}: what a C{CancelRequest} asks for.
CANCEL_RUN: int = iop_pb2.CancelRequest.CANCEL_RUN
TERMINATE_SESSION: int = iop_pb2.CancelRequest.TERMINATE_SESSION
CANCEL_COMMAND: int = iop_pb2.CancelRequest.CANCEL_COMMAND


def reject_code_name(code: int) -> str:
    """
    The name of a C{RejectCode} (C{"UNKNOWN_TOKEN"}), or the number itself
    for a code this side does not know (a newer peer's).
    """
    if code in iop_pb2.RejectCode.values():
        name: str = iop_pb2.RejectCode.Name(code)
        return name
    return str(code)


# ---- registration and readiness ---------------------------------------------


def register_request(token: str, wire_version: int, node_version: str = "") -> RegisterRequest:
    """
    A Node's first message: its credentials and the wire version it speaks.
    """
    return iop_pb2.RegisterRequest(token=token, node_version=node_version, wire_version=wire_version)


def adapter_config(name: str, type: str, max_concurrency: int, options_json: str = "") -> AdapterConfig:
    """
    One adapter of a Node's configuration; C{options_json} holds its
    type-specific keys as a JSON object.
    """
    return iop_pb2.AdapterConfig(name=name, type=type, max_concurrency=max_concurrency, options_json=options_json)


def node_config(
    node_id: str,
    adapters: Iterable[AdapterConfig],
    heartbeat_interval_sec: float,
    heartbeat_timeout_sec: float,
) -> NodeConfigPayload:
    """
    The configuration the Edge gives a Node: its adapters and heartbeat.
    """
    return iop_pb2.NodeConfigPayload(
        node_id=node_id,
        adapters=list(adapters),
        heartbeat_interval_sec=heartbeat_interval_sec,
        heartbeat_timeout_sec=heartbeat_timeout_sec,
    )


def register_accepted(config: NodeConfigPayload, wire_version: int) -> RegisterResponse:
    """
    The Edge accepts a registration and hands the Node its configuration.
    """
    return iop_pb2.RegisterResponse(accepted=True, config=config, wire_version=wire_version)


def register_refused(code: int, reason: str, wire_version: int = 0) -> RegisterResponse:
    """
    The Edge refuses a registration.

    @param code: a C{RejectCode}; it tells the Node whether to retry.
    @param wire_version: the Edge's version; 0 leaves it out, as an Edge
        that predates versioning did.
    """
    return iop_pb2.RegisterResponse(accepted=False, code=code, reason=reason, wire_version=wire_version)


def ready_request(node_id: str) -> NodeReadyRequest:
    """
    A registered Node says it is ready for work.
    """
    return iop_pb2.NodeReadyRequest(node_id=node_id)


def ready_response(ready: bool, reason: str = "") -> NodeReadyResponse:
    """
    The Edge's answer to a C{NodeReadyRequest}; C{reason} says why not.
    """
    return iop_pb2.NodeReadyResponse(ready=ready, reason=reason)


def config_refresh(config: NodeConfigPayload, request_id: str = "") -> ConfigRefresh:
    """
    A new configuration pushed to a ready Node; with a C{request_id} the
    Node acknowledges it (a C{NodeCommandResponse} of that id).
    """
    return iop_pb2.ConfigRefresh(config=config, request_id=request_id)


# ---- draining ------------------------------------------------------------------


def edge_draining(grace_sec: float, reason: str = "") -> EdgeDraining:
    """
    The Edge is shutting down: no new work, C{grace_sec} for the rest.
    """
    return iop_pb2.EdgeDraining(grace_sec=grace_sec, reason=reason)


def node_draining(grace_sec: float, reason: str = "") -> NodeDraining:
    """
    The Node is shutting down: no new leases, C{grace_sec} for the rest.
    """
    return iop_pb2.NodeDraining(grace_sec=grace_sec, reason=reason)


# ---- heartbeat -----------------------------------------------------------------


def ping(seq: int) -> Ping:
    """
    A heartbeat; the peer answers with the L{pong} of the same C{seq}.
    """
    return iop_pb2.Ping(seq=seq)


def pong(seq: int) -> Pong:
    """
    The answer to the L{ping} of C{seq}.
    """
    return iop_pb2.Pong(seq=seq)


# ---- runs ------------------------------------------------------------------------


def chat_message(
    role: str,
    content: str,
    *,
    name: str = "",
    tool_call_id: str = "",
    tool_calls_json: str = "",
    images: Iterable[str] = (),
) -> ChatMessage:
    """
    One message of a run's conversation: its text, and OpenAI's extras
    (an assistant's C{tool_calls} as a JSON list, image URLs).
    """
    return iop_pb2.ChatMessage(
        role=role,
        content=content,
        name=name,
        tool_call_id=tool_call_id,
        tool_calls_json=tool_calls_json,
        images=list(images),
    )


def run_request(
    run_id: str,
    adapter: str,
    messages: Iterable[ChatMessage],
    *,
    target: str = "",
    session_id: str = "",
    background: bool = False,
    options_json: str = "",
    caller: str = "",
    window_bytes: int = 0,
    traceparent: str = "",
) -> RunRequest:
    """
    Start a normalized run on adapter C{adapter}.

    @param options_json: extra generation parameters as a JSON object, or
        empty.
    @param caller: the name of the caller key that owns the run.
    @param window_bytes: the flow-control credit (0: unlimited).
    @param traceparent: the trace context to send to the provider (empty:
        none).
    """
    return iop_pb2.RunRequest(
        run_id=run_id,
        adapter=adapter,
        target=target,
        messages=list(messages),
        session_id=session_id,
        background=background,
        options_json=options_json,
        caller=caller,
        window_bytes=window_bytes,
        traceparent=traceparent,
    )


def usage(
    input_tokens: int,
    output_tokens: int,
    reasoning_tokens: int | None = None,
    cached_input_tokens: int | None = None,
) -> Usage:
    """
    Token counts; a breakdown count of C{None} stays absent on the wire
    ("not reported"), never zero.
    """
    return iop_pb2.Usage(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        reasoning_tokens=reasoning_tokens,
        cached_input_tokens=cached_input_tokens,
    )


def run_error(code: str, message: str, status: int = 0, deadline: str = "", retry_after_sec: float = 0.0) -> RunError:
    """
    Why a run or tunnel failed; C{status} is the provider's HTTP status or
    a process exit code (0: none); C{deadline}, which deadline a
    C{provider_timeout} missed; C{retry_after_sec}, the provider's
    C{Retry-After} (0: none).
    """
    # What a provider said goes into these: text UTF-8 cannot carry is
    # cleaned and a status out of range dropped, so that a failure can
    # always be told.
    return iop_pb2.RunError(
        code=clean_text(code),
        message=clean_text(message),
        status=status if -_INT32_MAX - 1 <= status <= _INT32_MAX else 0,
        deadline=deadline,
        retry_after_sec=retry_after_sec,
    )


_INT32_MAX = 2**31 - 1


def tool_call(id: str, name: str, arguments: str) -> ToolCall:
    """
    A tool call the model made; C{arguments} is a JSON text.
    """
    return iop_pb2.ToolCall(id=id, name=name, arguments=arguments)


def run_event(
    run_id: str,
    seq: int,
    type: str,
    *,
    text: str = "",
    usage: Usage | None = None,
    error: RunError | None = None,
    finish_reason: str = "",
    tool_call: ToolCall | None = None,
    first_byte_ms: float = 0.0,
) -> RunEvent:
    """
    Event C{seq} of run C{run_id} (C{start}, C{delta}, ..., C{complete});
    the parts left C{None} are absent. C{first_byte_ms}, on the first
    event only: the Node's time from the request to it.
    """
    return iop_pb2.RunEvent(
        run_id=run_id,
        seq=seq,
        type=type,
        text=text,
        usage=usage,
        error=error,
        finish_reason=finish_reason,
        tool_call=tool_call,
        first_byte_ms=first_byte_ms,
    )


def run_resume(run_id: str, after_seq: int) -> RunResume:
    """
    Re-attach a background run to this connection from event C{after_seq}
    on.
    """
    return iop_pb2.RunResume(run_id=run_id, after_seq=after_seq)


def reconciled_run(
    run_id: str, adapter: str, target: str, status: str, last_seq: int, caller: str, started_at: float = 0.0
) -> ReconciledRun:
    """
    One background run a Node kept across a lost link, as it reports it
    (C{started_at}: when the Node took it, seconds since the epoch).
    """
    return iop_pb2.ReconciledRun(
        run_id=run_id,
        adapter=adapter,
        target=target,
        status=status,
        last_seq=last_seq,
        caller=caller,
        started_at=started_at,
    )


def run_reconcile(runs: Iterable[ReconciledRun]) -> RunReconcile:
    """
    The background runs a Node kept (possibly none), sent before its ready.
    """
    return iop_pb2.RunReconcile(runs=list(runs))


# ---- cancelling ------------------------------------------------------------------


def cancel_run(run_id: str, error_code: str = "", error_message: str = "") -> CancelRequest:
    """
    Cancel run or tunnel C{run_id}; with C{error_code}, it ends with that
    error (the one the Edge ended it with already) instead of cancelled.
    """
    return iop_pb2.CancelRequest(kind=CANCEL_RUN, run_id=run_id, error_code=error_code, error_message=error_message)


def terminate_session(request_id: str, adapter: str, target: str, session_id: str, caller: str) -> CancelRequest:
    """
    End a logical session of an adapter; answered by a L{cancel_response}
    of C{request_id}.

    @param caller: the name of the caller key asking, which may end only
        its own sessions; empty for an admin key, which may end any.
    """
    return iop_pb2.CancelRequest(
        kind=TERMINATE_SESSION,
        adapter=adapter,
        target=target,
        session_id=session_id,
        request_id=request_id,
        caller=caller,
    )


def cancel_command(request_id: str) -> CancelRequest:
    """
    Abort node command C{request_id}: the Edge gave up on it.
    """
    return iop_pb2.CancelRequest(kind=CANCEL_COMMAND, request_id=request_id)


def cancel_response(request_id: str, ok: bool, reason: str = "", code: str = "") -> CancelResponse:
    """
    The Node's answer to a L{terminate_session}; C{code} says why not.
    """
    return iop_pb2.CancelResponse(request_id=request_id, ok=ok, reason=reason, code=code)


# ---- node commands ---------------------------------------------------------------


def command_request(
    request_id: str, command: str, adapter: str = "", args_json: str = "", stream: bool = False
) -> NodeCommandRequest:
    """
    Ask a Node to run command C{command} (with its arguments as a JSON
    object); with C{stream} it sends progress as it happens.
    """
    return iop_pb2.NodeCommandRequest(
        request_id=request_id, command=command, adapter=adapter, args_json=args_json, stream=stream
    )


def command_result(request_id: str, result_json: str, progress: bool = False) -> NodeCommandResponse:
    """
    A command's JSON result, or with C{progress} one update before it.
    """
    return iop_pb2.NodeCommandResponse(request_id=request_id, ok=True, result_json=result_json, progress=progress)


def command_error(request_id: str, code: str, error: str) -> NodeCommandResponse:
    """
    A command failed: C{code} says how (C{unknown_command}, C{refused}, ...).
    """
    return iop_pb2.NodeCommandResponse(request_id=request_id, ok=False, code=code, error=error)


# ---- provider tunnels --------------------------------------------------------------


def _headers(pairs: Iterable[tuple[str, str]]) -> list[iop_pb2.Header]:
    return [iop_pb2.Header(name=name, value=value) for name, value in pairs]


def tunnel_request(
    tunnel_id: str,
    adapter: str,
    method: str,
    path: str,
    headers: Iterable[tuple[str, str]],
    body: bytes,
    *,
    caller: str = "",
    window_bytes: int = 0,
) -> ProviderTunnelRequest:
    """
    Relay one raw HTTP request to an adapter's provider.

    @param caller: the name of the caller key that opened the tunnel.
    @param window_bytes: the flow-control credit (0: unlimited).
    """
    return iop_pb2.ProviderTunnelRequest(
        tunnel_id=tunnel_id,
        adapter=adapter,
        method=method,
        path=path,
        headers=_headers(headers),
        body=body,
        caller=caller,
        window_bytes=window_bytes,
    )


def tunnel_body(tunnel_id: str, seq: int, body: bytes) -> Envelope:
    """
    Frame C{seq} of a tunnel's response carrying a piece of its body, built
    in its C{Envelope} (what L{iop.protocols.wire.WireProtocol.send} sends
    as it is): the one frame of a stream's bulk, spared being built and
    then copied into an envelope.
    """
    env = iop_pb2.Envelope()
    frame = env.provider_tunnel_frame
    frame.tunnel_id = tunnel_id
    frame.seq = seq
    frame.body = body
    return env


def tunnel_frame(
    tunnel_id: str,
    seq: int,
    *,
    status: int | None = None,
    headers: Iterable[tuple[str, str]] | None = None,
    body: bytes | None = None,
    end: bool = False,
    error: RunError | None = None,
    usage: Usage | None = None,
    metadata_json: str | None = None,
    first_byte_ms: float = 0.0,
) -> ProviderTunnelFrame:
    """
    Frame C{seq} of a tunnel's response. A frame carries one part (they
    are a C{oneof}): the status, the headers, a piece of the body, the
    end, an error, observed usage or metadata (a JSON object); the status
    frame also C{first_byte_ms}, the Node's time from the request to the
    provider's answer.
    """
    return iop_pb2.ProviderTunnelFrame(
        tunnel_id=tunnel_id,
        seq=seq,
        status=status,
        headers=None if headers is None else iop_pb2.TunnelHeaders(headers=_headers(headers)),
        body=body,
        end=iop_pb2.TunnelEnd() if end else None,
        error=error,
        usage=usage,
        metadata_json=metadata_json,
        first_byte_ms=first_byte_ms,
    )


# ---- flow control ----------------------------------------------------------------


def window_update(stream_id: str, size: int) -> WindowUpdate:
    """
    Grant run or tunnel C{stream_id} C{size} more bytes of credit.
    """
    return iop_pb2.WindowUpdate(id=stream_id, bytes=size)
