"""
What a request did, for its access log line (L{iop.edge.http.site}): the
surfaces note the model, the node and provider it went to and the tokens
it cost on the request as they learn them.
"""

from twisted.web.server import Request

from iop.run import Usage


def note(request: Request, **fields: object) -> None:
    """
    Add C{fields} to what the access log says about C{request}.
    """
    notes = getattr(request, "notes", None)
    if notes is not None:
        notes.update(fields)


def note_usage(request: Request, usage: Usage | None) -> None:
    """
    Add a reported L{iop.run.Usage} (if any) to the access log's notes.
    """
    if usage is not None:
        note(request, tokens_in=usage.input_tokens, tokens_out=usage.output_tokens)
