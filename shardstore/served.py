"""Imported by shardstore's fork server before anything else (runner.PRELOAD), and by nothing else.

The server, and so every worker it forks, must end the moment its coordinator does: a worker left
running after a SIGKILL could still write into a folder the rerun is about to publish. Linux sends the
server SIGKILL when the thread that started it ends (PR_SET_PDEATHSIG; runner starts it from the main
thread only), and each worker the same when the server ends (`runner._die_with`). A coordinator gone
before this line ran has no workers yet, and the server ends by itself once nothing holds its "alive"
pipe.
"""

import ctypes

ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
