"""
`make demo`: start an Edge and a Node from conf/ on loopback, stream one
chat completion through /v1/chat/completions from the built-in echo back
end, end by printing `iop status` (the command line's view of the Edge),
and stop both.

The daemons run in .demo/ (their logs are there); the config files are
conf/edge.yaml and conf/node.yaml, unchanged, so what you see is exactly
what `twistd -n iop-edge --config conf/edge.yaml` gives you.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the process harness: tests/support/
from support.daemons import Daemon, sse_events, wait_for  # noqa: E402

HTTP = ("127.0.0.1", 8080)
EDGE_URL = f"http://{HTTP[0]}:{HTTP[1]}"
IOP = os.path.join(os.path.dirname(sys.executable), "iop")


def main():
    import http.client

    workdir = os.path.join(ROOT, ".demo")
    edge = Daemon("iop-edge", os.path.join(workdir, "edge"), os.path.join(ROOT, "conf", "edge.yaml"))
    node = Daemon("iop-node", os.path.join(workdir, "node"), os.path.join(ROOT, "conf", "node.yaml"))
    for daemon in (edge, node):
        os.makedirs(daemon.workdir, exist_ok=True)

    def status():
        conn = http.client.HTTPConnection(*HTTP, timeout=5)
        try:
            conn.request("GET", "/v1/status")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    try:
        print("starting iop-edge (conf/edge.yaml) and iop-node (conf/node.yaml)...")
        edge.start()
        wait_for(status, timeout=20, what="the Edge to listen on 127.0.0.1:8080")
        node.start()
        wait_for(lambda: status()["nodes"][0]["connected"], timeout=20, what="node-1 to connect")
        print("node-1 is connected and ready.\n")
        prompt = "Hello from iop: this completion streams word by word through the Edge and the Node."
        print(f"POST /v1/chat/completions  model=echo  stream=true\n> {prompt}\n")
        conn = http.client.HTTPConnection(*HTTP, timeout=30)
        body = {"model": "echo", "stream": True, "messages": [{"role": "user", "content": prompt}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        sys.stdout.write("< ")
        for payload in sse_events(response):
            if payload == "[DONE]":
                break
            for choice in json.loads(payload)["choices"]:
                sys.stdout.write(choice["delta"].get("content", ""))
                sys.stdout.flush()
        conn.close()
        print(
            f"\n\n$ iop status   (then the demo stops both daemons; their logs are in .demo/; the page is {EDGE_URL}/ui/)"
        )
        sys.stdout.flush()
        subprocess.run([IOP, "status", "--edge", EDGE_URL], check=True, timeout=30)
    except Exception:
        for daemon in (edge, node):
            if daemon.process is not None:
                print(f"--- {daemon.tapname} log ---\n{daemon.output()[-3000:]}")
        raise
    finally:
        codes = [daemon.stop() for daemon in (node, edge)]
        if any(code not in (0, None) for code in codes):
            print(f"\niop-node and iop-edge exited with status {codes[0]}, {codes[1]}; logs in .demo/")


if __name__ == "__main__":
    main()
