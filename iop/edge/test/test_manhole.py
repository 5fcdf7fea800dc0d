"""
The operator console (issue 12, finding 5): only configured users with
their authorized SSH keys get in (no passwords), it is bound to a parsed
loopback interface, and its host key file is private (0600 in a 0700
directory).
"""

import copy
import os
import shutil
import stat
import tempfile
from typing import Any, cast

from cryptography.hazmat.primitives.asymmetric import ed25519
from twisted.conch.interfaces import IConchUser
from twisted.conch.ssh import keys
from twisted.cred.credentials import SSHPrivateKey, UsernamePassword
from twisted.cred.error import UnauthorizedLogin, UnhandledCredentials
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from iop.config import ConfigError
from iop.edge.manhole import NO_COMMANDS, ConsoleSession, manhole_factory
from iop.edge.sshkeys import host_key
from iop.edge.test.test_config import parsed


def new_key():
    return keys.Key(ed25519.Ed25519PrivateKey.generate())


def signed_login(portal, user, key):
    data = b"session data to sign"
    credentials = SSHPrivateKey(user, key.sshType(), key.public().blob(), data, key.sign(data))
    return portal.login(credentials, None, IConchUser)


class ManholeTests(SynchronousTestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.key = new_key()
        users = {"ops": (self.key.public().toString("openssh"),)}
        self.key_path = os.path.join(self.dir, "console", "host_key")
        self.factory = manhole_factory(users, {"answer": 42}, self.key_path)

    def test_authorized_key(self):
        """
        The configured user logs in with its key; another key, another user
        and any password are refused.
        """
        portal = self.factory.portal
        self.successResultOf(signed_login(portal, b"ops", self.key))
        self.failureResultOf(signed_login(portal, b"ops", new_key()), UnauthorizedLogin)
        self.failureResultOf(signed_login(portal, b"root", self.key), UnauthorizedLogin)
        self.failureResultOf(portal.login(UsernamePassword(b"ops", b"pw"), None, IConchUser), UnhandledCredentials)

    def test_host_key_private(self):
        """
        The host key is generated once, mode 0600 in a 0700 directory, and
        kept across restarts.
        """
        self.assertEqual(stat.S_IMODE(os.stat(self.key_path).st_mode), 0o600)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(self.key_path)).st_mode), 0o700)
        again = manhole_factory({"ops": ()}, {}, self.key_path)
        self.assertEqual(again.publicKeys, self.factory.publicKeys)
        self.assertEqual(list(self.factory.publicKeys), [b"ssh-ed25519"])

    def test_readable_host_key_made_private(self):
        """
        An existing host key file that others could read is made 0600, with
        a warning.
        """
        os.chmod(self.key_path, 0o644)
        with capturedLogs() as events:
            key = host_key(self.key_path)
        self.assertFalse(key.isPublic())
        self.assertEqual(stat.S_IMODE(os.stat(self.key_path).st_mode), 0o600)
        self.assertTrue(any("readable by others" in e["log_format"] for e in events))


class ManholeConfigTests(SynchronousTestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.key = new_key()
        self.public = self.key.public().toString("openssh").decode() + " ops@laptop"

    def config(self, manhole):
        return parsed(lambda d: d.update(manhole=copy.deepcopy(manhole)))

    def refused(self, manhole, *fragments):
        error = self.assertRaises(ConfigError, self.config, manhole)
        for fragment in fragments:
            self.assertIn(fragment, str(error))

    def test_keys_inline_and_from_file(self):
        """
        A user's keys are a list of public keys or an authorized_keys file
        (comments and blank lines skipped).
        """
        path = os.path.join(self.dir, "authorized_keys")
        with open(path, "w") as f:
            f.write(f"# the ops team\n\n{self.public}\n")
        inline = self.config({"users": {"ops": {"authorized_keys": [self.public]}}}).manhole
        from_file = self.config({"users": {"ops": {"authorized_keys": path}}}).manhole
        one_line = self.config({"users": {"ops": self.public}}).manhole
        self.assertEqual(inline.users, from_file.users)
        self.assertEqual(inline.users, one_line.users)
        self.assertEqual(inline.users["ops"], (self.key.public().toString("openssh"),))
        self.assertEqual(inline.listen, "tcp:7122:interface=127.0.0.1")

    def test_bad_keys(self):
        """
        A string that is not a public key (a password, say: told what is
        expected, not about passwords), a line that is not a key, a
        private key, a missing file and an empty list are refused naming
        the user.
        """
        self.refused({"users": {"ops": "a-password"}}, "manhole.users.ops", "not a public key")
        self.refused({"users": {"ops": {"authorized_keys": ["ssh-rsa nope"]}}}, "manhole.users.ops.authorized_keys")
        private = self.key.toString("openssh").decode()
        self.refused({"users": {"ops": {"authorized_keys": [private]}}}, "private key")
        self.refused({"users": {"ops": {"authorized_keys": "/nonexistent/keys"}}}, "cannot read")
        self.refused({"users": {"ops": {"authorized_keys": []}}}, "at least one key")
        path = os.path.join(self.dir, "bad")
        with open(path, "w") as f:
            f.write(f"{self.public}\nnot a key\n")
        self.refused({"users": {"ops": {"authorized_keys": path}}}, "line 2")

    def test_listen_must_be_loopback(self):
        """
        Finding 5: every endpoint the substring test let through is now
        refused, naming manhole.listen.
        """
        users = {"ops": {"authorized_keys": [self.public]}}
        for listen in (
            "tcp:7999:interface=127.0.0.1:interface=0.0.0.0",
            "ssl:7999:interface=0.0.0.0:privateKey=/keys/127.0.0.1.pem",
            "tcp:7999:interface=localhost.example.org",
            "tcp:7999",
        ):
            self.refused({"listen": listen, "users": users}, "manhole.listen", "loopback")
        self.assertEqual(
            self.config({"listen": "tcp6:7999:interface=\\:\\:1", "users": users}).manhole.listen,
            "tcp6:7999:interface=\\:\\:1",
        )


class ConsoleSessionTests(SynchronousTestCase):
    def test_piped_input(self):
        """
        A session without a pseudo-terminal (input piped into ssh) has an
        80x24 screen, and the end of its input closes it instead of
        raising NotImplementedError; a resize is taken.
        """
        from twisted.conch.interfaces import ISession
        from twisted.python.components import Componentized

        closed = []

        class Channel:
            def loseConnection(self):
                closed.append(True)

        session = ConsoleSession(Componentized())
        self.assertEqual((session.width, session.height), (80, 24))
        session.protocol = Channel()
        session.eofReceived()
        self.assertEqual(closed, [True])
        session.windowChanged((50, 132, 0, 0))
        self.assertEqual((session.height, session.width), (50, 132))
        self.assertTrue(ISession.implementedBy(ConsoleSession))

    def test_resize_reaches_the_console(self):
        """
        A resized window is passed to the console running in the session,
        so its line editing wraps at the new width.
        """
        from twisted.python.components import Componentized

        sizes = []

        class Console:
            class terminalProtocol:
                @staticmethod
                def terminalSize(width, height):
                    sizes.append((width, height))

        session = ConsoleSession(Componentized())
        session.windowChanged((50, 132, 0, 0))
        session.console = cast(Any, Console())
        session.windowChanged((60, 200, 0, 0))
        self.assertEqual(sizes, [(200, 60)])

    def test_command_is_refused_in_one_line(self):
        """
        C{ssh host 'pool'} is answered on standard error with one line and
        exit status 1; nothing is logged as an error.
        """
        from twisted.conch.ssh import common, session

        key = new_key()
        directory = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, directory)
        factory = manhole_factory({"ops": (key.public().toString("openssh"),)}, {}, os.path.join(directory, "hk"))
        _, avatar, _ = factory.portal.realm.requestAvatar(b"ops", None, IConchUser)
        requests = []

        class Connection:
            transport = None

            def sendRequest(self, channel, kind, data, wantReply=False):
                requests.append((kind, data))

            def sendClose(self, channel):
                requests.append((b"close", b""))

        channel = session.SSHSession(avatar=avatar, conn=cast(Any, Connection()))
        with capturedLogs() as events:
            self.assertEqual(channel.request_exec(common.NS(b"pool.snapshot()")), 1)
        self.assertEqual(b"".join(data for _, data in channel.extBuf), NO_COMMANDS)
        self.assertIn((b"exit-status", b"\x00\x00\x00\x01"), requests)
        self.assertFalse([e for e in events if e.get("log_failure") is not None])
