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

from collections.abc import Mapping
from typing import Protocol, cast

from twisted.application import strports
from twisted.application.internet import StreamServerEndpointService
from twisted.conch import manhole, manhole_ssh
from twisted.conch.checkers import InMemorySSHKeyDB, SSHPublicKeyChecker
from twisted.conch.insults import insults
from twisted.conch.interfaces import IConchUser
from twisted.conch.ssh import keys
from twisted.cred import portal
from twisted.internet.error import ProcessTerminated
from twisted.internet.interfaces import IReactorCore
from twisted.python.failure import Failure

from iop.edge.config import ManholeSpec
from iop.edge.sshkeys import host_key


class _Shell(Protocol):
    """
    What a session keeps of the protocol its shell was opened on (conch's
    C{SSHSessionProcessProtocol}): enough to close it.
    """

    def loseConnection(self) -> None: ...


class _Command(Protocol):
    """
    What a session is given to answer a command with (conch's
    C{SSHSessionProcessProtocol}): standard error, and the command's end.
    """

    def errReceived(self, data: bytes) -> None: ...

    def processEnded(self, reason: Failure | None = None) -> None: ...


#: What C{ssh host 'command'} is told (on its standard error, exit status 1).
NO_COMMANDS = b"iop console: commands are not run this way; connect without one for the Python console\r\n"


class ConsoleSession(manhole_ssh.TerminalSession):
    """
    Conch's terminal session, finished for what an operator's client does:
    a session without a pseudo-terminal (input piped into C{ssh}) gets an
    80x24 screen instead of failing, and the end of that input closes the
    session instead of logging C{NotImplementedError}; a resized window
    reaches the running console; a command (C{ssh host 'pool'}) is
    refused with one line and exit status 1, not a logged traceback.
    """

    width = 80
    height = 24
    protocol: _Shell | None = None
    console: insults.ServerProtocol | None = None

    def openShell(self, proto: _Shell) -> None:
        self.protocol = proto
        self.console = self.chainedProtocolFactory()
        self.transportFactory(proto, self.console, IConchUser(self.original), self.width, self.height)

    def execCommand(self, proto: _Command, cmd: bytes) -> None:
        proto.errReceived(NO_COMMANDS)
        proto.processEnded(Failure(ProcessTerminated(exitCode=1)))

    def windowChanged(self, newWindowSize: tuple[int, int, int, int]) -> None:
        self.height, self.width = newWindowSize[:2]
        terminal = None if self.console is None else self.console.terminalProtocol
        if terminal is not None:
            terminal.terminalSize(self.width, self.height)

    def eofReceived(self) -> None:
        if self.protocol is not None:
            self.protocol.loseConnection()


def manhole_factory(
    users: Mapping[str, tuple[bytes, ...]], namespace: dict[str, object], host_key_path: str
) -> manhole_ssh.ConchFactory:
    """
    @param users: C{{name: (public key bytes, ...)}}.
    """
    realm = manhole_ssh.TerminalRealm()
    realm.sessionFactory = ConsoleSession

    def console() -> insults.ServerProtocol:
        return insults.ServerProtocol(manhole.ColoredManhole, namespace)

    # Conch only calls it with no argument; the attribute's type is
    # inferred from its default, the protocol class itself.
    realm.chainedProtocolFactory = cast("type[insults.ServerProtocol]", console)
    database = InMemorySSHKeyDB(
        {name.encode("utf-8"): [keys.Key.fromString(key) for key in user_keys] for name, user_keys in users.items()}
    )
    # TerminalRealm has IRealm's requestAvatar but is not declared to
    # implement it.
    factory = manhole_ssh.ConchFactory(portal.Portal(cast(portal.IRealm, realm), [SSHPublicKeyChecker(database)]))
    key = host_key(host_key_path)
    # ConchFactory declares these as bytes; its transport reads them as
    # keys.Key (SSHServerTransport._getHostKeys).
    factory.publicKeys = cast("dict[bytes, bytes]", {key.sshType(): key.public()})
    factory.privateKeys = cast("dict[bytes, bytes]", {key.sshType(): key})
    return factory


def manhole_service(
    spec: ManholeSpec, namespace: dict[str, object], reactor: IReactorCore
) -> StreamServerEndpointService:
    """
    @param spec: the L{iop.edge.config.ManholeSpec}.
    """
    return strports.service(spec.listen, manhole_factory(spec.users, namespace, spec.host_key), reactor=reactor)
