"""
The floor of the relay on this machine: the same four processes in
series as the tunnel (caller -> Edge -> Node -> provider), built from the
same libraries (twisted.web's server, one Int32StringReceiver link,
twisted.web's client with a persistent pool and the Node's body producer
for a body in memory) and doing nothing else: no
authentication, admission, placement, leases, JSON, checks, metrics or
logs. What it reaches against direct is what no relay on this stack and
this machine can beat. L{relay} measures it as its C{floor} path, beside
the real tunnel in the same run.

Its two roles, one process each, started by L{start}:

    floor.py edge --http-port-file F --node-port-file G
    floor.py node --edge-port P --provider URL
"""

import argparse
import contextlib
import itertools
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from support.daemons import wait_for  # noqa: E402

# Frames on the link: one type byte, an 8-byte request number, the rest.
REQUEST, HEAD, DATA, END = b"R", b"H", b"D", b"E"


def _frame(kind, number, payload=b""):
    return kind + number.to_bytes(8, "big") + payload


def serve_edge(http_port_file, node_port_file):
    """
    The floor Edge: each POST's body goes to the one Node as a frame;
    the Node's frames come back as the answer's status, body and end.
    """
    from twisted.internet import reactor
    from twisted.internet.protocol import Factory
    from twisted.protocols.basic import Int32StringReceiver
    from twisted.web import resource, server

    waiting = {}
    link = []

    class NodeLink(Int32StringReceiver):
        MAX_LENGTH = 64 * 1024 * 1024

        def connectionMade(self):
            self.transport.setTcpNoDelay(True)  # as the real link: no event waits for an ACK
            link.append(self)
            # The HTTP port is told only now: no request finds no Node.
            publish(http_port_file, http)

        def stringReceived(self, frame):
            kind, number, payload = frame[:1], int.from_bytes(frame[1:9], "big"), frame[9:]
            request = waiting.get(number)
            if request is None:
                return
            if kind == HEAD:
                request.setResponseCode(int(payload))
                request.setHeader(b"content-type", b"text/event-stream")
            elif kind == DATA:
                request.write(payload)
            else:
                del waiting[number]
                request.finish()

    class Relay(resource.Resource):
        isLeaf = True
        numbers = itertools.count(1)

        def render_POST(self, request):
            number = next(self.numbers)
            waiting[number] = request
            link[0].sendString(_frame(REQUEST, number, request.content.read()))
            request.notifyFinish().addErrback(lambda _: waiting.pop(number, None))
            return server.NOT_DONE_YET

    http = reactor.listenTCP(0, server.Site(Relay()), backlog=1024, interface="127.0.0.1")
    publish(node_port_file, reactor.listenTCP(0, Factory.forProtocol(NodeLink), interface="127.0.0.1"))
    reactor.run()


def publish(path, port):
    """
    Write C{port}'s number to C{path} whole (a reader never sees half).
    """
    with open(path + ".tmp", "w") as f:
        f.write(str(port.getHost().port))
    os.rename(path + ".tmp", path)


def serve_node(edge_port, provider):
    """
    The floor Node: each request frame becomes a POST to the provider
    (its body as it came), whose status and body bytes go back as frames.
    """
    from twisted.internet import reactor
    from twisted.internet.error import ReactorNotRunning
    from twisted.internet.protocol import ClientFactory, Protocol
    from twisted.protocols.basic import Int32StringReceiver
    from twisted.web.client import Agent, HTTPConnectionPool
    from twisted.web.http_headers import Headers

    # (Not product logic: Twisted's own body producer would cost the
    # provider a second send and wake-up, and the floor would be no floor.)
    from iop.httpclient import BytesBody

    agent = Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=True))
    headers = Headers({b"content-type": [b"application/json"]})

    class Relayed(Protocol):
        def __init__(self, link, number):
            self.link, self.number = link, number

        def dataReceived(self, data):
            self.link.sendString(_frame(DATA, self.number, data))

        def connectionLost(self, reason):
            self.link.sendString(_frame(END, self.number))

    class EdgeLink(Int32StringReceiver):
        MAX_LENGTH = 64 * 1024 * 1024

        def connectionMade(self):
            self.transport.setTcpNoDelay(True)

        def stringReceived(self, frame):
            number, body = int.from_bytes(frame[1:9], "big"), frame[9:]
            answer = agent.request(b"POST", provider.encode(), headers, BytesBody(body))

            def head(response):
                self.sendString(_frame(HEAD, number, str(response.code).encode()))
                response.deliverBody(Relayed(self, number))

            answer.addCallbacks(head, lambda _: self.sendString(_frame(END, number)))

    def lost(*_):
        # The Edge went away: so does this Node (unless it is stopping already).
        with contextlib.suppress(ReactorNotRunning):
            reactor.stop()

    factory = ClientFactory.forProtocol(EdgeLink)
    factory.clientConnectionLost = factory.clientConnectionFailed = lost
    reactor.connectTCP("127.0.0.1", edge_port, factory)
    reactor.run()


def start(workdir, provider_url):
    """
    Start the floor Edge and Node. @return: C{(processes, http_port)}.
    """
    http_file, node_file = os.path.join(workdir, "floor-http.port"), os.path.join(workdir, "floor-node.port")
    me = os.path.abspath(__file__)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    edge = subprocess.Popen(
        [sys.executable, me, "edge", "--http-port-file", http_file, "--node-port-file", node_file], **quiet
    )
    processes = [edge]
    try:
        wait_for(lambda: os.path.exists(node_file), what="floor edge")
        node_port = int(open(node_file).read())
        node = subprocess.Popen(
            [sys.executable, me, "node", "--edge-port", str(node_port), "--provider", provider_url], **quiet
        )
        processes.append(node)
        wait_for(lambda: os.path.exists(http_file), what="floor node linked")
        return processes, int(open(http_file).read())
    except BaseException:
        stop(processes)
        raise


def stop(processes):
    """
    Stop the floor's processes (SIGTERM, then SIGKILL after 10 s).
    """
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    edge = sub.add_parser("edge")
    edge.add_argument("--http-port-file", required=True)
    edge.add_argument("--node-port-file", required=True)
    node = sub.add_parser("node")
    node.add_argument("--edge-port", type=int, required=True)
    node.add_argument("--provider", required=True)
    args = p.parse_args(argv)
    if args.role == "edge":
        serve_edge(args.http_port_file, args.node_port_file)
    else:
        serve_node(args.edge_port, args.provider)
    return 0


if __name__ == "__main__":
    sys.exit(main())
