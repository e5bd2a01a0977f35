"""The name of the worker pin, one name from the HTTP header to the router's call metadata.

The router's endpoint picker (services/router/epp.py) sets it as a request header naming the
worker it picked (its registered address); the gateway relays an incoming header of that name
as Generate call metadata; the router routes the call to that worker while it is serving
(services/router/pinning.py). A routing hint: any other value routes as usual.
"""

from __future__ import annotations

WORKER_PIN_KEY = "x-llmfleet-worker"  # lower case: gRPC metadata keys and HTTP/2 header names
