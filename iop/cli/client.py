"""
The command line's HTTP client for one Edge.

Synchronous on purpose (C{http.client}, no reactor): the command line is a
short-lived process that does one request at a time and prints as it
reads, so blocking calls keep each command a few straight lines, start in
milliseconds and need no event loop. Streams are read line by line as
they arrive.

Every failure becomes a L{CLIError} carrying one line for the operator and
the process exit status (the table is L{EXIT_CODES}).
"""

import enum
import http.client
import json
import socket
import ssl
import urllib.parse
from collections.abc import Iterator, Mapping
from email.utils import parsedate_to_datetime
from typing import Any

from iop.cli import sse

OK = 0
#: The Edge answered with an error or with what is not its JSON (a proxy's
#: page, a stream line that is not an object), or the work it ran failed.
FAILED = 1
#: Bad arguments (argparse's own status).
USAGE = 2
#: No connection to the Edge (refused, unknown host, timeout), or its
#: answer was cut short.
UNREACHABLE = 3
#: A missing or refused key (401/403).
AUTH = 4
#: The Edge does not know the node, run or model named.
NOT_FOUND = 5
#: The Edge does not serve this endpoint (an older Edge).
UNSUPPORTED = 6

EXIT_CODES = {
    OK: "success",
    FAILED: "the Edge answered with an error or an unreadable answer, or the run failed",
    USAGE: "bad arguments",
    UNREACHABLE: "the Edge is unreachable, or its answer was cut short",
    AUTH: "a key is missing or was refused (401/403)",
    NOT_FOUND: "unknown node, run or model (404)",
    UNSUPPORTED: "this Edge does not serve that endpoint",
}

DEFAULT_EDGE = "http://127.0.0.1:8080"


class _Default(enum.Enum):
    """
    The sentinel of L{EdgeClient.request}'s C{timeout}: the client's own
    (C{None} is a meaning of its own there, no timeout).
    """

    DEFAULT = enum.auto()


_DEFAULT = _Default.DEFAULT


class CLIError(Exception):
    """
    A failure the command line reports as one line and an exit status.
    """

    def __init__(self, message: str, exit_code: int = FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class Response:
    """
    A successful answer: C{status}, C{headers} (lower-case names) and the
    open C{http.client} response to read from (for streams).
    """

    def __init__(self, connection: http.client.HTTPConnection, raw: http.client.HTTPResponse) -> None:
        self.connection = connection
        self.raw = raw
        self.status = raw.status
        self.headers = {name.lower(): value for name, value in raw.getheaders()}

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip()

    def json(self) -> Any:
        """
        The body as JSON.

        @raise CLIError: L{UNREACHABLE} when the body is cut short (as when
            no answer came: C{--watch} retries it); L{FAILED} when it is not
            JSON, which is what a proxy or a wrong C{--edge} answers with.
        """
        try:
            text = self.raw.read()
        except (OSError, http.client.HTTPException) as e:
            raise CLIError(f"the Edge's answer was cut short: {_reason(e)}", UNREACHABLE) from None
        finally:
            self.close()
        try:
            return json.loads(text)
        except ValueError:
            kind = self.content_type or "no content type"
            raise CLIError(f"the Edge's answer is not JSON ({kind}): {excerpt(text)}", FAILED) from None

    def events(self) -> Iterator[sse.Event]:
        """
        The body as server-sent events (L{sse.Event}), as they arrive.
        """
        return sse.parse(self.raw)

    def edge_time(self) -> float | None:
        """
        The Edge's clock from the C{Date} header (so ages are measured on
        the Edge, not on this machine), or C{None}.
        """
        value = self.headers.get("date")
        if not value:
            return None
        try:
            return parsedate_to_datetime(value).timestamp()
        except (TypeError, ValueError):
            return None

    def close(self) -> None:
        self.connection.close()


class EdgeClient:
    """
    @param base_url: the Edge's HTTP address (C{http://host:port}, or
        C{https://...}, optionally with a path prefix).
    @param api_key: the caller key; the admin key stands in when absent
        (the Edge accepts an admin key wherever a caller key goes).
    @param admin_key: the key for admin endpoints (node commands, events).
    """

    def __init__(
        self,
        base_url: str = DEFAULT_EDGE,
        api_key: str | None = None,
        admin_key: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        if "://" not in base_url:
            base_url = "http://" + base_url
        usage = f"--edge {base_url!r}: expected http://host:port or https://host:port"
        try:
            # The port is read here, not when connecting: a port that is not
            # one (C{:abc}, C{:99999}) raises ValueError from urllib.
            parts = urllib.parse.urlsplit(base_url)
            port = parts.port
        except ValueError as e:
            raise CLIError(f"{usage} ({e})", USAGE) from None
        if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
            raise CLIError(usage, USAGE)
        self.base_url = base_url.rstrip("/")
        self._parts = parts
        self._host = parts.hostname
        self._prefix = parts.path.rstrip("/")
        self.api_key = api_key or None
        self.admin_key = admin_key or None
        self.timeout = timeout

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        port = self._parts.port
        if self._parts.scheme == "https":
            return http.client.HTTPSConnection(self._host, port, timeout=timeout, context=ssl.create_default_context())
        return http.client.HTTPConnection(self._host, port, timeout=timeout)

    def _key(self, admin: bool) -> str | None:
        if admin:
            if not self.admin_key:
                raise CLIError("this command needs an admin key: pass --admin-key or set IOP_ADMIN_KEY", AUTH)
            return self.admin_key
        return self.api_key or self.admin_key

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        admin: bool = False,
        headers: Mapping[str, str] | None = None,
        stream: bool = False,
        timeout: float | None | _Default = _DEFAULT,
    ) -> Response:
        """
        Send one request. @return: a L{Response} for a 2xx answer.

        @param timeout: seconds to wait for the answer's headers (default:
            the client's); C{None} waits as long as the Edge takes (its own
            deadlines apply). Connecting always uses the client's timeout.
        @param stream: the answer is a stream: once its headers arrive,
            reads wait as long as it takes (the connect and header wait
            still time out).
        @raise CLIError: unreachable, or any non-2xx answer.
        """
        query = {k: v for k, v in (params or {}).items() if v not in (None, "")}
        target = self._prefix + path + ("?" + urllib.parse.urlencode(query) if query else "")
        sent = {"accept": "application/json", **(headers or {})}
        key = self._key(admin)
        if key:
            sent["authorization"] = f"Bearer {key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            sent["content-type"] = "application/json"
        connection = self._connect(self.timeout)
        try:
            connection.connect()
        except OSError as e:
            connection.close()
            raise CLIError(f"cannot reach the Edge at {self.base_url}: {_reason(e)}", UNREACHABLE) from None
        try:
            if timeout is not _DEFAULT and connection.sock is not None:
                connection.sock.settimeout(timeout)
            connection.request(method, target, body=data, headers=sent)
            raw = connection.getresponse()
        except (OSError, http.client.HTTPException) as e:
            connection.close()
            raise CLIError(f"no answer from the Edge at {self.base_url}: {_reason(e)}", UNREACHABLE) from None
        if not 200 <= raw.status < 300:
            try:
                text = raw.read()
            except (OSError, http.client.HTTPException):
                text = b""
            connection.close()
            raise answer_error(method, path, raw.status, text)
        if stream and connection.sock is not None:
            connection.sock.settimeout(None)
        return Response(connection, raw)

    def get_json(self, path: str, params: Mapping[str, Any] | None = None, admin: bool = False) -> Any:
        return self.request("GET", path, params=params, admin=admin).json()

    def post_json(self, path: str, body: Any, admin: bool = False) -> Any:
        return self.request("POST", path, body=body, admin=admin).json()


def excerpt(text: str | bytes) -> str:
    """
    The start of an answer the command line cannot use, on one line
    (whitespace runs collapsed), so that an HTML page still makes a
    one-line error.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return " ".join(text.split())[:200]


def expect_object(value: Any, what: str) -> dict[str, Any]:
    """
    C{value} if it is a JSON object: anything else where the command line
    reads fields is a bad answer (L{FAILED}), not a traceback.

    @param what: the answer's name for the error line.
    """
    if not isinstance(value, dict):
        raise CLIError(f"{what} is not a JSON object: {excerpt(json.dumps(value))}", FAILED)
    return value


def parse_object(data: str, what: str) -> dict[str, Any]:
    """
    One line of a stream (an event's C{data}) as the JSON object it must
    be; one that is not ends the stream with a L{FAILED} line.
    """
    try:
        value = json.loads(data)
    except ValueError:
        raise CLIError(f"{what} is not JSON: {excerpt(data)}", FAILED) from None
    return expect_object(value, what)


def _reason(error: Exception) -> str:
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, socket.gaierror):
        return f"unknown host ({error.strerror})"
    if isinstance(error, TimeoutError | socket.timeout):
        return "timed out"
    return str(error) or type(error).__name__


def _error_fields(text: bytes) -> tuple[str, str]:
    try:
        error = json.loads(text).get("error") or {}
    except (ValueError, AttributeError):
        return "", ""
    if not isinstance(error, dict):
        return str(error), ""
    return str(error.get("message") or ""), str(error.get("code") or "")


def answer_error(method: str, path: str, status: int, text: bytes) -> CLIError:
    """
    The L{CLIError} for a non-2xx answer: one line with the Edge's own
    message, and the exit status of its class.
    """
    message, code = _error_fields(text)
    if (status == 404 and message.startswith("no such endpoint")) or status == 405:
        return CLIError(
            f"this Edge does not serve {method} {path.split('?')[0]} (an older Edge?): {message or status}", UNSUPPORTED
        )
    detail = message or excerpt(text) or http.client.responses.get(status, "")
    if status == 401:
        return CLIError(f"the Edge refused the API key (401): {detail}; pass --key or set IOP_API_KEY", AUTH)
    if status == 403:
        return CLIError(f"not allowed (403): {detail}; pass --admin-key or set IOP_ADMIN_KEY", AUTH)
    if status == 404:
        return CLIError(f"not found: {detail}", NOT_FOUND)
    suffix = f" [{code}]" if code else ""
    return CLIError(f"the Edge answered {status}: {detail}{suffix}", FAILED)
