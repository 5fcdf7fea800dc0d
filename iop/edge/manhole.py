"""
The operator console: a Twisted conch manhole over SSH, bound to loopback
(checked on the parsed endpoint, L{iop.edge.endpoints}) and open only to
the users of C{edge.yaml}'s C{manhole.users}, each by their authorized SSH
public keys. There are no passwords.

Its namespace holds the live objects (C{edge}, C{registry}, C{pool},
C{bus}, C{inflight}), so an operator can look at leases and waiters as
they are, e.g. C{pool.snapshot()} or C{[l.node_id for l in
pool.active_leases()]}. The host key is generated on first start, mode
0600 (L{iop.edge.sshkeys}).
"""

from twisted.application import strports
from twisted.conch import manhole, manhole_ssh
from twisted.conch.checkers import InMemorySSHKeyDB, SSHPublicKeyChecker
from twisted.conch.insults import insults
from twisted.conch.ssh import keys
from twisted.cred import portal

from iop.edge.sshkeys import host_key


class ConsoleSession(manhole_ssh.TerminalSession):
    """
    Conch's terminal session, finished for what an operator's client does:
    a session without a pseudo-terminal (input piped into C{ssh}) gets an
    80x24 screen instead of failing, and the end of that input closes the
    session instead of logging C{NotImplementedError}; a resized window
    is taken as it is.
    """

    width = 80
    height = 24
    protocol = None

    def openShell(self, proto):
        self.protocol = proto
        super().openShell(proto)

    def windowChanged(self, newWindowSize):
        self.height, self.width = newWindowSize[:2]

    def eofReceived(self):
        if self.protocol is not None:
            self.protocol.loseConnection()


def manhole_factory(users, namespace, host_key_path):
    """
    @param users: C{{name: (public key bytes, ...)}}.
    """
    realm = manhole_ssh.TerminalRealm()
    realm.sessionFactory = ConsoleSession
    realm.chainedProtocolFactory = lambda: insults.ServerProtocol(manhole.ColoredManhole, namespace)
    database = InMemorySSHKeyDB(
        {name.encode("utf-8"): [keys.Key.fromString(key) for key in user_keys] for name, user_keys in users.items()}
    )
    factory = manhole_ssh.ConchFactory(portal.Portal(realm, [SSHPublicKeyChecker(database)]))
    key = host_key(host_key_path)
    factory.publicKeys = {key.sshType(): key.public()}
    factory.privateKeys = {key.sshType(): key}
    return factory


def manhole_service(spec, namespace, reactor):
    """
    @param spec: the L{iop.edge.config.ManholeSpec}.
    """
    return strports.service(spec.listen, manhole_factory(spec.users, namespace, spec.host_key), reactor=reactor)
