import os
import sys

# The Spark tests start a JVM (fork + exec) from this process after other tests used gRPC here.
# With grpc's fork support on, a fork while gRPC threads are busy can leave the child crashing
# before it execs ("Java gateway process exited"); nothing in the tests uses gRPC across a fork.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# pytest-xdist's workers export COLUMNS=80 / LINES=24; the CLI honours COLUMNS (a table fits it), so
# every `chronoq` these tests start would print narrower tables under -n than in a serial run. The
# tests read the CLI as a script does: piped, no terminal size given.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)
