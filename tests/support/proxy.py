"""
A loopback TCP proxy that can freeze: while frozen it accepts and holds
connections but moves no bytes and sends no FIN or RST, exactly like a
cut network cable. Used to prove that heartbeats notice a dead link.
"""

import select
import socket
import threading


class FreezableProxy:
    def __init__(self, target_port, listen_port=0):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", listen_port))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.frozen = threading.Event()
        self.closed = threading.Event()
        self.pairs = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def freeze(self):
        self.frozen.set()

    def heal(self):
        """
        Unfreeze; connections held during the freeze are dropped (their
        ends have given up on them), new ones flow.
        """
        with self._lock:
            stale, self.pairs = self.pairs, []
        for a, b in stale:
            _close(a)
            _close(b)
        self.frozen.clear()

    def close(self):
        self.closed.set()
        _close(self.listener)
        self.heal()

    def _accept(self):
        while not self.closed.is_set():
            try:
                readable, _, _ = select.select([self.listener], [], [], 0.1)
                if not readable:
                    continue
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self.pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a, b):
        peer = {a: b, b: a}
        try:
            while not self.closed.is_set():
                if self.frozen.is_set():
                    self.closed.wait(0.05)
                    continue
                readable, _, _ = select.select([a, b], [], [], 0.05)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    peer[sock].sendall(data)
        except (OSError, ValueError):
            # ValueError: heal() closed the sockets under us.
            return
        finally:
            _close(a)
            _close(b)


def _close(sock):
    try:
        sock.close()
    except OSError:
        pass
