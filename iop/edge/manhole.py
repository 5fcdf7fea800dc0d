"""
The operator console: a Twisted conch manhole over SSH, bound to loopback
and protected by the users in C{edge.yaml}'s C{manhole.users}.

Its namespace holds the live objects (C{edge}, C{registry}, C{pool},
C{bus}, C{inflight}), so an operator can look at leases and waiters as
they are, e.g. C{pool.snapshot()} or C{[l.node_id for l in
pool.active_leases()]}.
"""

from twisted.application import strports
from twisted.conch import manhole, manhole_ssh
from twisted.conch.insults import insults
from twisted.conch.ssh import keys
from twisted.cred import checkers, portal
from twisted.python import filepath

#: Where the console's SSH host key is kept (relative to the working
#: directory), generated on first start.
HOST_KEY = ".iop-manhole/host_rsa_key"


def manhole_factory(users, namespace, host_key_path=HOST_KEY):
    realm = manhole_ssh.TerminalRealm()
    realm.chainedProtocolFactory = lambda: insults.ServerProtocol(manhole.ColoredManhole, namespace)
    checker = checkers.InMemoryUsernamePasswordDatabaseDontUse(
        **{name: password.encode("utf-8") for name, password in users.items()}
    )
    factory = manhole_ssh.ConchFactory(portal.Portal(realm, [checker]))
    key = keys._getPersistentRSAKey(filepath.FilePath(host_key_path), keySize=2048)
    factory.publicKeys[b"ssh-rsa"] = key
    factory.privateKeys[b"ssh-rsa"] = key
    return factory


def manhole_service(spec, namespace, reactor):
    """
    @param spec: the L{iop.edge.config.ManholeSpec}.
    """
    return strports.service(spec.listen, manhole_factory(spec.users, namespace), reactor=reactor)
