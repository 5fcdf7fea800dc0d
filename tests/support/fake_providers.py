"""
Fake LLM providers for integration tests: an OpenAI-compatible server, a
vLLM flavour of it, and Ollama's native API, on 127.0.0.1.

    python tests/support/fake_providers.py KIND --port-file PATH [--delay-ms N]

KIND is C{openai}, C{vllm} or C{ollama}. The server listens on port 0,
writes the port to PATH (atomically) and prints C{PORT <n>} on stdout once
listening.

Answers are deterministic (fixed ids, C{created=0}, no timestamps) so a
test can compare the bytes relayed through a tunnel with the bytes of a
direct request. The reply to a chat request echoes the words of the last
user message, one chunk per word (whitespace kept, so the chunks
concatenate to the message).

Special models:

  - C{error-model}: HTTP 429 with an OpenAI error object (404 with
    C{{"error": ...}} for ollama).
  - C{slow*}: one chunk every C{--delay-ms} (default 50), and every
    connection close is logged on stdout. With C{max_tokens} (OpenAI) or
    C{options.num_predict} (ollama), exactly that many chunks are sent,
    cycling through the words, so a test can make a stream as long as it
    needs.

  - C{big-model} (OpenAI): a streamed body of C{max_tokens} pieces of
    64 KiB (SSE comment lines), written only as fast as the client reads
    (a pull producer), for backpressure tests.

Faults (OpenAI chat completions), one model each:

  - C{cut-model}: streamed, the role chunk and then the connection drops;
    not streamed, half of a body of announced length, then it drops.
  - C{stall-model}: streamed, the role chunk and one word, then silence
    (the connection stays open); not streamed, half a body, then silence.
  - C{silent-model}: nothing at all, not even headers.
  - C{malformed-model}: streamed, one word, then (50 ms later) an event
    that is not JSON, then the rest of a normal stream.
  - C{nodone-model}: streamed, a whole answer with its finish reason but
    no C{[DONE]}, and the connection stays open.
  - C{context-model}: HTTP 400 C{context_length_exceeded}.
  - C{busy-model}: HTTP 429 with C{Retry-After: 1}.

C{POST /_faults} with C{{"down": true}} makes every request (but those to
C{/_...}) answer 503 until C{{"down": false}}: an outage that recovers.

C{GET /_stats} answers C{{"active", "max_active", "closed_early",
"requests", "big_bytes"}}: requests in flight now, the most seen at once,
how many clients went away before their response finished, the total
(requests to C{/_stats} itself are not counted), and how many bytes of
C{big-model} bodies the server has handed to its sockets so far.
"""

import argparse
import json
import os
import re
import sys

from twisted.internet import reactor
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

WORD = re.compile(r"\S+\s*|\s+")
MODELS = ["fake-model", "slow-model", "error-model"]
REASONING = ["Thinking ", "it ", "over."]
ZERO_TIME = "1970-01-01T00:00:00Z"


def log(message):
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def dumps(data):
    return json.dumps(data, separators=(", ", ": "))


def last_user_text(messages):
    for message in reversed(messages or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content") or ""
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return content
    return ""


def pieces(text, count=None):
    """
    The words of C{text}; with C{count}, exactly that many, cycling.
    """
    words = WORD.findall(text) or ["ok"]
    if count is None:
        return words
    return [words[i % len(words)] for i in range(count)]


class Stats:
    def __init__(self):
        self.active = 0
        self.max_active = 0
        self.closed_early = 0
        self.requests = 0
        self.big_bytes = 0

    def begin(self, request):
        """
        Count a request in; count it out when it finishes or its client
        goes away.
        """
        self.requests += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        number = self.requests

        def finished(_):
            self.active -= 1

        def lost(_):
            self.active -= 1
            self.closed_early += 1
            log(f"CLOSED request={number} path={request.path.decode()} early=true")

        request.notifyFinish().addCallbacks(finished, lost)
        return number

    def json(self):
        return {
            "active": self.active,
            "max_active": self.max_active,
            "closed_early": self.closed_early,
            "requests": self.requests,
            "big_bytes": self.big_bytes,
        }


class Stream:
    """
    Writes a list of byte strings, at once or one per delay; stops if the
    client goes away.
    """

    def __init__(self, request, parts, delay, slow, number):
        self.request = request
        self.parts = list(parts)
        self.delay = delay
        self.slow = slow
        self.number = number
        self.gone = False
        self.call = None
        request.notifyFinish().addErrback(self.lost)

    def lost(self, _):
        self.gone = True
        if self.call is not None and self.call.active():
            self.call.cancel()

    def start(self):
        if not self.slow:
            for part in self.parts:
                self.request.write(part)
            self.request.finish()
            return
        self.next()

    def next(self):
        self.call = None
        if self.gone:
            return
        if not self.parts:
            self.request.finish()
            log(f"CLOSED request={self.number} path={self.request.path.decode()} early=false")
            return
        self.request.write(self.parts.pop(0))
        # The last part ([DONE] or the done line) follows without a pause.
        delay = self.delay if len(self.parts) > 1 else 0
        self.call = reactor.callLater(delay, self.next)


BIG_PIECE = b": " + b"x" * (64 * 1024 - 4) + b"\n\n"


class BigStream:
    """
    C{count} 64 KiB pieces, each written when the transport asks for more
    (an C{IPullProducer}): the server never runs ahead of its client.
    """

    def __init__(self, request, count, stats):
        self.request = request
        self.left = count
        self.stats = stats
        self.gone = False
        request.notifyFinish().addErrback(self.lost)

    def lost(self, _):
        self.gone = True

    def start(self):
        self.request.registerProducer(self, False)

    def resumeProducing(self):
        if self.gone:
            return
        if self.left <= 0:
            self.request.unregisterProducer()
            self.request.write(b"data: [DONE]\n\n")
            self.request.finish()
            return
        self.left -= 1
        self.stats.big_bytes += len(BIG_PIECE)
        self.request.write(BIG_PIECE)

    def stopProducing(self):
        self.gone = True


class Provider(Resource):
    """
    Routes by exact path; subclasses fill C{routes}.
    """

    isLeaf = True

    def __init__(self, kind, delay):
        super().__init__()
        self.kind = kind
        self.delay = delay
        self.stats = Stats()
        #: The last requests (method, path, headers), for tests: /_requests.
        self.seen = []
        #: Every request answers 503 (POST /_faults).
        self.down = False

    def render(self, request):
        path = request.path.decode()
        method = request.method.decode()
        if path == "/_stats":
            return self.json(request, 200, self.stats.json())
        if path == "/_requests":
            return self.json(request, 200, self.seen)
        if path == "/_faults":
            self.down = bool(json.loads(request.content.read() or b"{}").get("down"))
            return self.json(request, 200, {"down": self.down})
        if self.down:
            return self.json(request, 503, {"error": {"message": "the fake is down", "type": "unavailable"}})
        headers = [[k.decode(), v.decode()] for k, vs in request.requestHeaders.getAllRawHeaders() for v in vs]
        seen = {"method": method, "path": path, "headers": headers}
        self.seen = (self.seen + [seen])[-20:]
        number = self.stats.begin(request)
        handler = self.routes().get((method, path))
        if handler is None:
            return self.json(request, 404, {"error": f"no route {method} {path}"})
        try:
            body = json.loads(request.content.read() or b"{}")
        except ValueError:
            return self.json(request, 400, {"error": "request body is not JSON"})
        seen["body"] = body
        return handler(request, body, number)

    def json(self, request, status, data):
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/json")
        return dumps(data).encode()

    def stream(self, request, content_type, parts, model, number):
        request.setResponseCode(200)
        request.setHeader(b"content-type", content_type)
        Stream(request, parts, self.delay, model.startswith("slow"), number).start()
        return NOT_DONE_YET


class OpenAI(Provider):
    """
    C{POST /v1/chat/completions} and C{GET /v1/models}; the C{vllm} kind
    adds reasoning deltas and the usage breakdown.
    """

    def routes(self):
        return {
            ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/embeddings"): self.embeddings,
            ("POST", "/v1/responses"): self.responses,
            ("GET", "/v1/models"): self.models,
        }

    def completions(self, request, body, number):
        """
        Legacy completions: the prompt's words back, streamed as SSE
        C{text_completion} chunks or as one document.
        """
        model = body.get("model") or "fake-model"
        words = pieces(body.get("prompt") if isinstance(body.get("prompt"), str) else "")
        if not body.get("stream"):
            choice = {"index": 0, "text": "".join(words), "finish_reason": "stop", "logprobs": None}
            document = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": 0,
                "model": model,
                "choices": [choice],
            }
            return self.json(request, 200, document)
        parts = [
            b"data: "
            + dumps(
                {
                    "id": "cmpl-fake",
                    "object": "text_completion",
                    "created": 0,
                    "model": model,
                    "choices": [{"index": 0, "text": w, "finish_reason": None}],
                }
            ).encode()
            + b"\n\n"
            for w in words
        ]
        parts.append(b"data: [DONE]\n\n")
        return self.stream(request, b"text/event-stream", parts, model, number)

    def embeddings(self, request, body, number):
        """
        One small vector per input, from the input's length.
        """
        inputs = body.get("input")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        data = [
            {"object": "embedding", "index": i, "embedding": [float(len(str(text))), 0.5, -0.25]}
            for i, text in enumerate(inputs)
        ]
        usage = {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}
        return self.json(request, 200, {"object": "list", "data": data, "model": body.get("model"), "usage": usage})

    def responses(self, request, body, number):
        """
        The Responses API: the input's words back, as typed SSE events
        when streamed, or one C{response} document.
        """
        model = body.get("model") or "fake-model"
        words = pieces(body.get("input") if isinstance(body.get("input"), str) else "")
        output = [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "".join(words)}]}
        ]
        document = {"id": "resp_fake", "object": "response", "model": model, "status": "completed", "output": output}
        if not body.get("stream"):
            return self.json(request, 200, document)

        def event(kind, **data):
            return f"event: {kind}\ndata: ".encode() + dumps(dict(type=kind, **data)).encode() + b"\n\n"

        parts = [event("response.created", response=dict(document, status="in_progress", output=[]))]
        parts += [event("response.output_text.delta", delta=w) for w in words]
        parts.append(event("response.completed", response=document))
        return self.stream(request, b"text/event-stream", parts, model, number)

    def models(self, request, body, number):
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in MODELS]
        return self.json(request, 200, {"object": "list", "data": data})

    def usage(self, prompt, words, reasoning):
        usage = {"prompt_tokens": prompt, "completion_tokens": len(words) + len(reasoning)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if self.kind == "vllm":
            usage["prompt_tokens_details"] = {"cached_tokens": prompt // 2}
            usage["completion_tokens_details"] = {"reasoning_tokens": len(reasoning)}
        return usage

    def chat(self, request, body, number):
        model = body.get("model") or "fake-model"
        if model == "error-model":
            error = {"message": "rate limited by fake", "type": "rate_limit_error", "param": None, "code": None}
            return self.json(request, 429, {"error": error})
        fault = FAULTS.get(model)
        if fault is not None:
            return fault(request, body)
        if model == "big-model" and body.get("stream"):
            request.setResponseCode(200)
            request.setHeader(b"content-type", b"text/event-stream")
            BigStream(request, int(body.get("max_tokens") or 16), self.stats).start()
            return NOT_DONE_YET
        text = last_user_text(body.get("messages"))
        limit = body.get("max_tokens") if model.startswith("slow") else None
        words = pieces(text, limit if isinstance(limit, int) else None)
        reasoning = REASONING if self.kind == "vllm" else []
        usage = self.usage(len(text.split()), words, reasoning)
        if not body.get("stream"):
            message = {"role": "assistant", "content": "".join(words)}
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            return self.json(
                request,
                200,
                {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "created": 0,
                    "model": model,
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": usage,
                },
            )

        def chunk(delta, finish=None, choices=True, **extra):
            data = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model}
            data["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else []
            data.update(extra)
            return b"data: " + dumps(data).encode() + b"\n\n"

        parts = [chunk({"role": "assistant", "content": ""})]
        parts += [chunk({"reasoning_content": r}) for r in reasoning]
        parts += [chunk({"content": w}) for w in words]
        parts.append(chunk({}, finish="stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            parts.append(chunk(None, choices=False, usage=usage))
        parts.append(b"data: [DONE]\n\n")
        return self.stream(request, b"text/event-stream; charset=utf-8", parts, model, number)


ROLE_EVENT = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
WORD_EVENT = b'data: {"choices": [{"index": 0, "delta": {"content": "partial "}, "finish_reason": null}]}\n\n'
FINISH_EVENT = b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n'
WHOLE_BODY = dumps(
    {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": "fault",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "a whole answer"}, "finish_reason": "stop"}
        ],
    }
).encode()


def _event_stream(request):
    request.setResponseCode(200)
    request.setHeader(b"content-type", b"text/event-stream")


def _half_body(request):
    """
    Half of a JSON answer whose whole length is announced.
    """
    request.setResponseCode(200)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"content-length", str(len(WHOLE_BODY)).encode())
    request.write(WHOLE_BODY[: len(WHOLE_BODY) // 2])


def cut(request, body):
    if body.get("stream"):
        _event_stream(request)
        request.write(ROLE_EVENT)
    else:
        _half_body(request)
    # What was written goes out first, then the connection drops.
    reactor.callLater(0.05, request.channel.transport.loseConnection)
    return NOT_DONE_YET


def stall(request, body):
    if body.get("stream"):
        _event_stream(request)
        request.write(ROLE_EVENT + WORD_EVENT)
    else:
        _half_body(request)
    return NOT_DONE_YET


def silent(request, body):
    return NOT_DONE_YET


def malformed(request, body):
    _event_stream(request)
    request.write(ROLE_EVENT + WORD_EVENT)

    def rest():
        request.write(b"data: {this is not json\n\n" + FINISH_EVENT + b"data: [DONE]\n\n")
        request.finish()

    reactor.callLater(0.05, rest)
    return NOT_DONE_YET


def nodone(request, body):
    _event_stream(request)
    request.write(ROLE_EVENT + WORD_EVENT + FINISH_EVENT)
    return NOT_DONE_YET


def context(request, body):
    request.setResponseCode(400)
    request.setHeader(b"content-type", b"application/json")
    error = {"message": "This model's maximum context length is 8 tokens.", "type": "invalid_request_error"}
    return dumps({"error": dict(error, param="messages", code="context_length_exceeded")}).encode()


def busy(request, body):
    request.setResponseCode(429)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"retry-after", b"1")
    return dumps({"error": {"message": "busy, retry after 1 s", "type": "rate_limit_error"}}).encode()


FAULTS = {
    "cut-model": cut,
    "stall-model": stall,
    "silent-model": silent,
    "malformed-model": malformed,
    "nodone-model": nodone,
    "context-model": context,
    "busy-model": busy,
}


class Ollama(Provider):
    """
    Ollama's native API: C{/api/chat} (NDJSON), C{/api/tags}, C{/api/ps},
    C{/api/show}, C{/api/pull}, C{/api/delete}.
    """

    def routes(self):
        return {
            ("POST", "/api/chat"): self.chat,
            ("GET", "/api/tags"): self.tags,
            ("GET", "/api/ps"): self.ps,
            ("POST", "/api/show"): self.show,
            ("POST", "/api/pull"): self.pull,
            ("DELETE", "/api/delete"): self.delete,
            ("POST", "/api/embed"): self.embed,
        }

    def details(self):
        return {"format": "gguf", "family": "fake", "parameter_size": "1B", "quantization_level": "Q4_0"}

    def tags(self, request, body, number):
        models = [
            {
                "name": f"{m}:latest",
                "model": f"{m}:latest",
                "modified_at": ZERO_TIME,
                "size": 0,
                "digest": "0" * 64,
                "details": self.details(),
            }
            for m in MODELS
        ]
        return self.json(request, 200, {"models": models})

    def ps(self, request, body, number):
        return self.json(request, 200, {"models": []})

    def known(self, request, body):
        model = body.get("model") or ""
        if model.split(":")[0] in MODELS and model != "error-model":
            return None
        return self.json(request, 404, {"error": f"model '{model}' not found"})

    def show(self, request, body, number):
        return self.known(request, body) or self.json(
            request,
            200,
            {
                "modelfile": "",
                "parameters": "",
                "template": "{{ .Prompt }}",
                "details": self.details(),
                "model_info": {},
            },
        )

    def embed(self, request, body, number):
        """
        Ollama's /api/embed: one vector per input.
        """
        missing = self.known(request, body)
        if missing:
            return missing
        inputs = body.get("input")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        vectors = [[float(len(str(text))), 0.5, -0.25] for text in inputs]
        return self.json(
            request, 200, {"model": body.get("model"), "embeddings": vectors, "prompt_eval_count": 2 * len(inputs)}
        )

    def pull(self, request, body, number):
        """
        Like Ollama: with C{stream} (its default) NDJSON status lines, a
        pulling line per tenth of the model, then C{success}; one per
        delay for a C{slow-*} model, and stopping if the client goes away.
        """
        model = body.get("model") or ""
        if body.get("stream") is False:
            return self.json(request, 200, {"status": "success"})
        lines = [{"status": "pulling manifest"}]
        lines += [
            {"status": "pulling 0123", "digest": "sha256:0123", "total": 100, "completed": 10 * i} for i in range(1, 11)
        ]
        lines += [{"status": "success"}]
        parts = [dumps(line).encode() + b"\n" for line in lines]
        return self.stream(request, b"application/x-ndjson", parts, model, number)

    def delete(self, request, body, number):
        missing = self.known(request, body)
        if missing:
            return missing
        request.setResponseCode(200)
        return b""

    def chat(self, request, body, number):
        model = body.get("model") or "fake-model"
        if model == "error-model":
            return self.json(request, 404, {"error": 'model "error-model" not found, try pulling it first'})
        messages = body.get("messages") or []
        text = last_user_text(messages)
        limit = (body.get("options") or {}).get("num_predict")
        words = pieces(text)
        reason = "stop"
        if isinstance(limit, int) and limit < len(words):
            words, reason = words[:limit], "length"
        tools = body.get("tools") or []
        if messages and messages[-1].get("role") == "tool":
            # After a tool's result: the answer quotes it.
            words = pieces(f"the tool said {messages[-1].get('content', '')}")
        elif tools:
            # With tools and a question: call the first tool with the question.
            function = tools[0].get("function", {}).get("name", "tool")
            call = {"function": {"name": function, "arguments": {"question": text}}}
            words = []

        def line(content="", thinking=None, done=False, tool_calls=None, **extra):
            message = {"role": "assistant", "content": content}
            if thinking is not None:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            data = {"model": model, "created_at": ZERO_TIME, "message": message, "done": done}
            data.update(extra)
            return dumps(data).encode() + b"\n"

        final = line(
            done=True,
            done_reason=reason,
            total_duration=0,
            load_duration=0,
            prompt_eval_count=len(text.split()),
            prompt_eval_duration=0,
            eval_count=len(words) + len(REASONING),
            eval_duration=0,
        )
        if not body.get("stream", True):
            data = json.loads(final)
            data["message"] = {"role": "assistant", "content": "".join(words), "thinking": "".join(REASONING)}
            return self.json(request, 200, data)
        parts = [line(thinking=r) for r in REASONING] + [line(w) for w in words]
        if tools and not words:
            parts.append(line(tool_calls=[call]))
        parts.append(final)
        return self.stream(request, b"application/x-ndjson", parts, model, number)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["openai", "vllm", "ollama"])
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--delay-ms", type=int, default=50)
    parser.add_argument("--port", type=int, default=0, help="listen here (default: a free port)")
    args = parser.parse_args(argv)
    delay = max(args.delay_ms, 0) / 1000.0
    resource = Ollama(args.kind, delay) if args.kind == "ollama" else OpenAI(args.kind, delay)
    site = Site(resource)
    site.noisy = False
    port = reactor.listenTCP(args.port, site, interface="127.0.0.1")
    number = port.getHost().port
    partial = args.port_file + ".tmp"
    with open(partial, "w") as f:
        f.write(f"{number}\n")
    os.replace(partial, args.port_file)
    log(f"PORT {number}")
    reactor.run()


if __name__ == "__main__":
    main()
