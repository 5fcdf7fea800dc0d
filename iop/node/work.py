"""
The runs and tunnels one connection has in flight, by id.

Runs and tunnels share one id space (the Edge cancels either with
C{CancelRequest(CANCEL_RUN, run_id)}), so they share one registry. When the
connection goes, everything in it is cancelled: nothing on the Node may
outlive the session it served, or its capacity slot would leak.
"""


class Inflight:
    def __init__(self):
        self._work = {}

    def __contains__(self, work_id):
        return work_id in self._work

    def __len__(self):
        return len(self._work)

    def add(self, work_id, work):
        self._work[work_id] = work

    def discard(self, work_id, work):
        if self._work.get(work_id) is work:
            del self._work[work_id]

    def cancel(self, work_id, reason=None):
        """
        Cancel one run or tunnel. @return: whether it was in flight.
        """
        work = self._work.get(work_id)
        if work is None:
            return False
        work.cancel(reason)
        return True

    def cancelAll(self, reason=None):
        for work in list(self._work.values()):
            work.cancel(reason)
