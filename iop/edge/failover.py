"""
Placing a caller's work again when its provider failed before the caller
saw a byte: which failures qualify, how many times, and where not to go
back to.

A L{Work} is one caller's request across its placements (attempts). Its
first attempt goes on the wire under the work's own id; a later one under
C{<id>-<n>}, so that a late frame of an abandoned attempt can never reach
the new one, while the caller keeps seeing one id.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from iop.edge.spec import RunSpec
from iop.edge.tenants import Ticket
from iop.run import CAPACITY_EXCEEDED, PROVIDER_ERROR, PROVIDER_TIMEOUT, PROVIDER_UNREACHABLE, RunFailure


def provider_failed(failure: RunFailure) -> bool:
    """
    Whether C{failure} (a L{iop.run.RunFailure} seen before any output) is
    the provider's own failure to serve: no connection, no answer, or an
    HTTP 5xx or 429 status. These feed the provider's health and may be
    retried elsewhere.
    """
    if failure.code in (PROVIDER_UNREACHABLE, PROVIDER_TIMEOUT):
        return True
    return failure.code == PROVIDER_ERROR and (failure.status >= 500 or failure.status == 429)


@dataclass(eq=False)
class Work:
    """
    @ivar retries: how many times a provider failure may be placed again
        (the model group's C{retries}; 0 for work sent to an adapter by
        name, which has nowhere else to go).
    @ivar avoid: the provider resources (keys) that already failed it.
    @ivar ticket: its L{iop.edge.tenants.Ticket} (tenant, estimated
        tokens), settled once when it ends.
    """

    spec: RunSpec
    listener_for: Callable[[str, str], Any]
    retries: int
    id: str | None = None
    attempts: int = 0
    refused_once: bool = False
    avoid: set[tuple[str, str]] = field(default_factory=set)
    ticket: Ticket | None = None

    def wire_id(self) -> str:
        """
        This attempt's id on the wire (the work has its id once placed).
        """
        assert self.id is not None
        return self.id if self.attempts <= 1 else f"{self.id}-{self.attempts}"

    def may_retry(self, failure: RunFailure) -> bool:
        """
        Whether an attempt that failed with C{failure} before any output
        should be placed again (and, if so, count it).
        """
        if failure.code == CAPACITY_EXCEEDED:
            # The Node's gate disagrees with the Edge's ledger: once.
            if self.refused_once:
                return False
            self.refused_once = True
            return True
        if provider_failed(failure) and self.retries > 0:
            self.retries -= 1
            return True
        return False
