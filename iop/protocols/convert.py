"""
Conversions between wire messages and the plain data classes that the
rest of the code uses (L{iop.run}), kept in one place so
that "absent is not zero" for the usage breakdown holds everywhere.
"""

from iop.protocols import iop_pb2
from iop.run import RunEventData, RunFailure, ToolCall, Usage

_BREAKDOWN = ("reasoning_tokens", "cached_input_tokens")


def usage_to_wire(usage):
    message = iop_pb2.Usage(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens)
    for name in _BREAKDOWN:
        value = getattr(usage, name)
        if value is not None:
            setattr(message, name, value)
    return message


def usage_from_wire(message):
    usage = Usage(input_tokens=message.input_tokens, output_tokens=message.output_tokens)
    for name in _BREAKDOWN:
        if message.HasField(name):
            setattr(usage, name, getattr(message, name))
    return usage


def usage_to_json(usage):
    """
    A JSON object with only the fields the provider reported.
    """
    result = {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}
    for name in _BREAKDOWN:
        value = getattr(usage, name)
        if value is not None:
            result[name] = value
    return result


def failure_to_wire(failure):
    return iop_pb2.RunError(
        code=failure.code,
        message=failure.message,
        status=failure.status,
        deadline=failure.deadline,
        retry_after_sec=failure.retry_after_sec,
    )


def failure_from_wire(message):
    return RunFailure(
        code=message.code,
        message=message.message,
        status=message.status,
        deadline=message.deadline,
        retry_after_sec=message.retry_after_sec,
    )


def event_to_wire(run_id, seq, event):
    message = iop_pb2.RunEvent(
        run_id=run_id, seq=seq, type=event.type, text=event.text, finish_reason=event.finish_reason or ""
    )
    if event.usage is not None:
        message.usage.CopyFrom(usage_to_wire(event.usage))
    if event.error is not None:
        message.error.CopyFrom(failure_to_wire(event.error))
    if event.tool_call is not None:
        call = event.tool_call
        message.tool_call.CopyFrom(iop_pb2.ToolCall(id=call.id, name=call.name, arguments=call.arguments))
    return message


def event_from_wire(message):
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
