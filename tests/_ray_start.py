"""``ray start`` for a machine of the loopback cluster (tests/_cluster.py), its GCS address
kept at 127.0.0.1.

Ray's CLI replaces a 127.0.0.1 ``--address`` by the host's routable IP (``resolve_ip_for_localhost``)
unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, and with that variable it refuses to start a
worker node at all. The head and the driver use the variable; a worker machine starts through
this script, which keeps loopback addresses as they are.
"""

import sys

import ray._private.services as services
from ray.scripts.scripts import main

services.resolve_ip_for_localhost = lambda host: host

if __name__ == "__main__":
    sys.exit(main())
