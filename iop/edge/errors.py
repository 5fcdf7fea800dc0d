"""
L{ServiceError}: the one way the Edge service tells a caller surface that
a request failed. Surfaces map C{kind} to their own status codes (the HTTP
table is L{iop.edge.http.common.ERRORS_BY_KIND}); the service never
speaks HTTP.
"""


class ServiceError(Exception):
    """
    A caller-facing failure.

    @ivar kind: what went wrong, independent of any surface: C{invalid},
        C{unauthorized}, C{forbidden}, C{not_found}, C{method},
        C{too_large}, C{busy}, C{failed}, C{unavailable}, C{timeout}.
    @ivar code: a machine-readable reason (defaults to C{kind}), e.g.
        C{queue_timeout} or C{shutting_down}.
    @ivar status: the back end's own HTTP status, when the failure is one
        the provider reported; surfaces pass it on as it is.
    @ivar retry_after: whole seconds after which a retry may succeed
        (HTTP C{Retry-After}), when known.
    """

    def __init__(
        self,
        kind: str,
        message: str,
        code: str | None = None,
        status: int | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.code = code or kind
        self.status = status
        self.retry_after = retry_after
