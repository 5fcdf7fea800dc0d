"""
Conversions between wire messages and the plain data classes that the
rest of the code uses (L{iop.run}), kept in one place so
that "absent is not zero" for the usage breakdown holds everywhere.
"""

from typing import Any

from iop.protocols import messages
from iop.run import RunEventData, RunFailure, ToolCall, Usage

_BREAKDOWN = ("reasoning_tokens", "cached_input_tokens")


def usage_to_wire(usage: Usage) -> messages.Usage:
    return messages.usage(usage.input_tokens, usage.output_tokens, usage.reasoning_tokens, usage.cached_input_tokens)


def usage_from_wire(message: messages.Usage) -> Usage:
    usage = Usage(input_tokens=message.input_tokens, output_tokens=message.output_tokens)
    for name in _BREAKDOWN:
        if message.HasField(name):
            setattr(usage, name, getattr(message, name))
    return usage


def usage_to_json(usage: Usage) -> dict[str, int]:
    """
    A JSON object with only the fields the provider reported.
    """
    result = {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}
    for name in _BREAKDOWN:
        value = getattr(usage, name)
        if value is not None:
            result[name] = value
    return result


def event_details_json(event: RunEventData) -> dict[str, Any]:
    """
    What an event carries besides its type and text, as JSON, each only
    when set: C{tool_call} (C{id}, C{name}, C{arguments}),
    C{finish_reason}, C{usage} (L{usage_to_json}), C{error} (C{code},
    C{message}, and C{status} when it has one). The shape of the native
    API's events and of the Node store's rows.
    """
    details: dict[str, Any] = {}
    if event.tool_call is not None:
        call = event.tool_call
        details["tool_call"] = {"id": call.id, "name": call.name, "arguments": call.arguments}
    if event.finish_reason:
        details["finish_reason"] = event.finish_reason
    if event.usage is not None:
        details["usage"] = usage_to_json(event.usage)
    if event.error is not None:
        error: dict[str, Any] = {"code": event.error.code, "message": event.error.message}
        if event.error.status:
            error["status"] = event.error.status
        details["error"] = error
    return details


def failure_to_wire(failure: RunFailure) -> messages.RunError:
    return messages.run_error(failure.code, failure.message, failure.status, failure.deadline, failure.retry_after_sec)


def failure_from_wire(message: messages.RunError) -> RunFailure:
    return RunFailure(
        code=message.code,
        message=message.message,
        status=message.status,
        deadline=message.deadline,
        retry_after_sec=message.retry_after_sec,
    )


def event_to_wire(run_id: str, seq: int, event: RunEventData, first_byte_ms: float = 0.0) -> messages.RunEvent:
    call = event.tool_call
    return messages.run_event(
        run_id,
        seq,
        event.type,
        text=event.text,
        usage=None if event.usage is None else usage_to_wire(event.usage),
        error=None if event.error is None else failure_to_wire(event.error),
        finish_reason=event.finish_reason or "",
        tool_call=None if call is None else messages.tool_call(call.id, call.name, call.arguments),
        first_byte_ms=first_byte_ms,
    )


def event_from_wire(message: messages.RunEvent) -> RunEventData:
    return RunEventData(
        type=message.type,
        text=message.text,
        usage=usage_from_wire(message.usage) if message.HasField("usage") else None,
        error=failure_from_wire(message.error) if message.HasField("error") else None,
        finish_reason=message.finish_reason or None,
        tool_call=(
            ToolCall(message.tool_call.id, message.tool_call.name, message.tool_call.arguments)
            if message.HasField("tool_call")
            else None
        ),
    )
