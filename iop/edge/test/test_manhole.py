"""
The operator console only lets configured users in.
"""

import os
import tempfile

from twisted.conch.interfaces import IConchUser
from twisted.cred.credentials import UsernamePassword
from twisted.cred.error import UnauthorizedLogin
from twisted.trial.unittest import SynchronousTestCase

from iop.edge.manhole import manhole_factory


class ManholeTests(SynchronousTestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.factory = manhole_factory({"ops": "pw"}, {"answer": 42}, os.path.join(self.dir, "key"))

    def test_credentials(self):
        """
        The configured user logs in; a wrong password is refused.
        """
        portal = self.factory.portal
        self.successResultOf(portal.login(UsernamePassword(b"ops", b"pw"), None, IConchUser))
        self.failureResultOf(portal.login(UsernamePassword(b"ops", b"nope"), None, IConchUser), UnauthorizedLogin)

    def test_host_key_persisted(self):
        """
        The SSH host key is generated once and kept.
        """
        self.assertTrue(os.path.exists(os.path.join(self.dir, "key")))
        self.assertIn(b"ssh-rsa", self.factory.publicKeys)
