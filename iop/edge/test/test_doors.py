"""
Doors per source address (L{iop.edge.doors}, and the HTTP site that uses
them): an address over C{limits.max_http_connections_per_address} waits
unread in its own line, goes in as its own connections close, waits at
most until its header deadline, and never takes the place of a
connection from an address within its cap — even when the waiting fill
C{limits.max_http_connections}. With a Clock and string transports.
"""

from twisted.internet.address import IPv4Address, UNIXAddress
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.doors import EVICTED, FULL, LINE_FULL, WAITED_OUT, Doors
from iop.edge.http.site import EdgeSite
from iop.edge.limits import Limits
from iop.edge.test.test_http_limits import Recording

STRANGER, CALLER = "192.0.2.66", "198.51.100.7"


class Connection:
    """
    What the listener does with a ticket's callables, recorded.
    """

    def __init__(self, doors, host):
        self.entered = self.evicted = False
        self.ticket = doors.arrive(host, self.enter, self.evict)

    def enter(self):
        self.entered = True

    def evict(self):
        self.evicted = True


class DoorsTests(SynchronousTestCase):
    def setUp(self):
        self.reasons: list[str] = []
        self.doors = Doors(per_address=2, total=6, refused=self.reasons.append)

    def arrive(self, host):
        return Connection(self.doors, host)

    def test_over_the_cap_waits_then_goes_in_oldest_first(self):
        """
        An address's connections beyond its cap wait in its line; each of
        its connections that leaves lets the oldest waiting one in.
        """
        inside = [self.arrive(STRANGER) for _ in range(2)]
        first, second = self.arrive(STRANGER), self.arrive(STRANGER)
        self.assertEqual([c.ticket.inside for c in inside + [first, second]], [True, True, False, False])
        self.assertEqual((self.doors.waiting, self.doors.waits, self.doors.count), (2, 2, 4))
        self.doors.leave(inside[0].ticket)
        self.assertTrue(first.entered and first.ticket.inside)
        self.assertFalse(second.entered)
        self.assertEqual((self.doors.inside(STRANGER), self.doors.line(STRANGER)), (2, 1))

    def test_line_is_bounded(self):
        """
        An address's line holds as many as its cap: one more is refused
        at once, counted by reason.
        """
        for _ in range(4):
            self.arrive(STRANGER)
        self.assertIsNone(self.arrive(STRANGER).ticket)
        self.assertEqual(self.reasons, [LINE_FULL])

    def test_under_cap_address_takes_a_waiting_place(self):
        """
        With every place taken by an address within its cap and waiting
        ones of others, a newcomer from another address within its cap
        puts out the oldest waiting connection of the longest line.
        """
        a = [self.arrive("192.0.2.1") for _ in range(4)]
        b = [self.arrive("192.0.2.2") for _ in range(2)]
        caller = self.arrive(CALLER)
        self.assertTrue(caller.ticket.inside)
        self.assertTrue(a[2].evicted)
        self.assertFalse(a[3].evicted or any(c.evicted for c in b))
        self.assertEqual(self.reasons, [EVICTED])
        self.assertEqual((self.doors.count, self.doors.waiting), (6, 1))
        self.doors.leave(a[2].ticket)
        self.assertEqual(self.doors.count, 6)

    def test_newcomer_of_the_longest_line_is_refused(self):
        """
        When everything is taken, a newcomer who would wait in the longest
        line is refused instead of putting out one of its own.
        """
        for host in ("192.0.2.1", "192.0.2.2"):
            waiting = [self.arrive(host) for _ in range(3)][-1]
            self.assertFalse(waiting.ticket.inside)
        self.assertIsNone(self.arrive("192.0.2.1").ticket)
        self.assertEqual(self.reasons, [FULL])
        self.assertEqual(self.doors.waiting, 2)

    def test_newcomer_of_a_shorter_line_takes_the_longest_lines_place(self):
        """
        When everything is taken, a newcomer who would wait in a shorter
        line takes the place of the longest line's oldest.
        """
        a = [self.arrive("192.0.2.1") for _ in range(4)]
        b = [self.arrive("192.0.2.2") for _ in range(2)]
        third = self.arrive("192.0.2.2")
        self.assertFalse(third.ticket.inside)
        self.assertTrue(a[2].evicted)
        self.assertFalse(any(c.evicted for c in b) or a[3].evicted)
        self.assertEqual((self.doors.line("192.0.2.1"), self.doors.line("192.0.2.2")), (1, 1))

    def test_full_with_nobody_waiting(self):
        """
        When every place is taken by connections within their caps, a
        newcomer is refused.
        """
        for host in ("192.0.2.1", "192.0.2.2", "192.0.2.3"):
            self.arrive(host), self.arrive(host)
        self.assertIsNone(self.arrive(CALLER).ticket)
        self.assertEqual(self.reasons, [FULL])

    def test_waiting_one_leaves(self):
        """
        A waiting connection that leaves (its deadline, or its peer gave
        up) leaves its line; leaving twice counts once.
        """
        self.arrive(STRANGER), self.arrive(STRANGER)
        waiting = self.arrive(STRANGER)
        self.doors.leave(waiting.ticket)
        self.doors.leave(waiting.ticket)
        self.assertEqual((self.doors.count, self.doors.waiting, self.doors.line(STRANGER)), (2, 0, 0))

    def test_off(self):
        """
        With no per-address cap (0), nobody waits: only the total counts.
        """
        doors = Doors(per_address=0, total=3)
        tickets = [doors.arrive(STRANGER, lambda: None, lambda: None) for _ in range(4)]
        self.assertEqual([t is not None and t.inside for t in tickets], [True, True, True, False])

    def test_no_address(self):
        """
        A connection with no address to count by (a UNIX socket) is never
        held to a per-address cap.
        """
        tickets = [self.arrive(None).ticket for _ in range(4)]
        self.assertTrue(all(t.inside for t in tickets))


class HallTests(SynchronousTestCase):
    """
    The hall (the Node port's choice): beyond C{total}, newcomers wait in
    arrival order instead of being refused.
    """

    def setUp(self):
        self.reasons: list[str] = []
        self.doors = Doors(per_address=2, total=4, refused=self.reasons.append, line=4, hall=3)

    def arrive(self, host):
        return Connection(self.doors, host)

    def test_herd_gets_in_in_order(self):
        """
        One address's herd fills its places and line up to the total, then
        the hall; as connections leave, the hall's oldest move into the
        line, and the line's oldest go in. Beyond the hall: refused.
        """
        herd = [self.arrive(STRANGER) for _ in range(7)]
        self.assertEqual([c.ticket.inside for c in herd], [True, True] + [False] * 5)
        self.assertEqual([c.ticket.in_hall for c in herd], [False] * 4 + [True] * 3)
        self.assertEqual((self.doors.count, self.doors.in_hall, self.doors.waits), (4, 3, 5))
        self.assertIsNone(self.arrive(STRANGER).ticket)
        self.assertEqual(self.reasons, [FULL])
        self.doors.leave(herd[0].ticket)
        self.assertTrue(herd[2].entered)
        self.assertEqual((self.doors.line(STRANGER), self.doors.in_hall), (2, 2))
        self.assertFalse(herd[4].ticket.in_hall)
        for connection in herd[1:4]:
            self.doors.leave(connection.ticket)
        self.assertEqual([c.entered for c in herd[4:]], [True, True, False])
        self.assertEqual((self.doors.count, self.doors.in_hall), (3, 0))

    def test_within_cap_goes_before_the_hall(self):
        """
        A newcomer from an address within its cap takes a waiting place
        while others wait in the hall; the waiting in the hall stay.
        """
        herd = [self.arrive(STRANGER) for _ in range(6)]
        caller = self.arrive(CALLER)
        self.assertTrue(caller.ticket.inside)
        self.assertTrue(herd[2].evicted)
        self.assertEqual(self.reasons, [EVICTED])
        self.assertEqual(self.doors.in_hall, 2)

    def test_leaving_the_hall(self):
        """
        A connection that leaves the hall (its deadline, or its peer gave
        up) is forgotten; the others keep their order.
        """
        herd = [self.arrive(STRANGER) for _ in range(7)]
        self.doors.leave(herd[4].ticket)
        self.doors.leave(herd[4].ticket)
        self.assertEqual(self.doors.in_hall, 2)
        self.doors.leave(herd[0].ticket)
        self.assertFalse(herd[5].ticket.in_hall)
        self.assertTrue(herd[6].ticket.in_hall)


LIMITS = Limits(header_timeout_sec=10, max_http_connections=6, max_http_connections_per_address=2)


class SiteDoorsTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.resource = Recording()
        self.site = EdgeSite(self.resource, limits=LIMITS, reactor=self.clock)

    def connect(self, host):
        """
        @return: the protocol and its transport; C{(None, None)} for a
            connection refused at the doors (the port closes it).
        """
        protocol = self.site.buildProtocol(IPv4Address("TCP", host, 40000))
        if protocol is None:
            return None, None
        transport = StringTransport()
        protocol.makeConnection(transport)
        return protocol, transport

    def test_waiting_connection_is_not_read(self):
        """
        An address's connection over its cap is paused (not read), and is
        read once one of that address's connections closes: its request,
        sent while it waited, is then served.
        """
        first, _ = self.connect(STRANGER)
        self.connect(STRANGER)
        waiting, transport = self.connect(STRANGER)
        self.assertEqual(transport.producerState, "paused")
        self.assertEqual(self.site.doors.waiting, 1)
        first.connectionLost(None)
        self.assertEqual(transport.producerState, "producing")
        waiting.dataReceived(b"GET /x HTTP/1.1\r\nHost: e\r\n\r\n")
        self.assertEqual(len(self.resource.held), 1)

    def test_waiting_until_the_header_deadline(self):
        """
        A waiting connection that does not get in is closed at its header
        deadline, counted as C{address_wait_timeout}, and leaves its line.
        """
        self.connect(STRANGER)
        self.connect(STRANGER)
        _, transport = self.connect(STRANGER)
        self.clock.advance(9.9)
        self.assertFalse(transport.disconnected)
        self.clock.advance(0.1)
        self.assertTrue(transport.disconnected)
        self.assertEqual(self.site.refused[WAITED_OUT], 1)
        self.assertEqual(self.site.doors.waiting, 0)

    def test_caller_is_served_while_a_stranger_fills_every_place(self):
        """
        A stranger holding every connection the site allows (its cap
        inside, the rest waiting) does not keep another address out: the
        caller's connection takes a waiting place, is read and served;
        the stranger's extra connections are refused or put out.
        """
        stranger = [self.connect(STRANGER) for _ in range(4)]
        other = [self.connect("192.0.2.1") for _ in range(2)]
        protocol, transport = self.connect(CALLER)
        self.assertIsNotNone(protocol)
        self.assertEqual(transport.producerState, "producing")
        protocol.dataReceived(b"GET /x HTTP/1.1\r\nHost: e\r\n\r\n")
        self.assertEqual(len(self.resource.held), 1)
        self.assertTrue(stranger[2][1].disconnected)
        self.assertFalse(any(t.disconnected for _, t in other))
        refused, _ = self.connect(STRANGER)
        self.assertIsNone(refused)
        self.assertEqual(self.site.refused[EVICTED], 1)
        self.assertEqual(self.site.refused[LINE_FULL] + self.site.refused[FULL], 1)

    def test_unix_socket_has_no_per_address_cap(self):
        """
        Connections on a UNIX socket have no address to count by: only
        C{max_http_connections} holds them.
        """
        for _ in range(3):
            protocol = self.site.buildProtocol(UNIXAddress(None))
            assert protocol is not None
            transport = StringTransport()
            protocol.makeConnection(transport)
            self.assertEqual(transport.producerState, "producing")

    def test_per_address_off_for_peers(self):
        """
        The site other Edges forward to has no per-address cap.
        """
        site = EdgeSite(self.resource, limits=LIMITS, per_address=False, reactor=self.clock)
        for _ in range(5):
            protocol = site.buildProtocol(IPv4Address("TCP", STRANGER, 40000))
            assert protocol is not None
            transport = StringTransport()
            protocol.makeConnection(transport)
            self.assertEqual(transport.producerState, "producing")
