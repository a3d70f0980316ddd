"""The gRPC port's methods by full name (`/pkg.Service/Method`): every method of the services the server adds,
read from their descriptors, so that the list cannot fall behind the services.

`--open-methods` is checked against them at start-up (settings.py): a name no service has (`.../check`) opened
nothing, and as the list replaced the defaults, the probes it meant to leave open were refused.
"""

from __future__ import annotations

from google.protobuf import descriptor_pool

from mhaserve.service.encoder_v1 import SERVICE as ENCODER_SERVICE
from mhaserve.service.health import SERVICE_NAME as HEALTH_SERVICE
from mhaserve.service.kserve.servicer import SERVICE as KSERVE_SERVICE
from mhaserve.service.rpc import reflection
from mhaserve.service.tei_v1 import SERVICES as TEI_SERVICES

# The services the server adds and reflection describes (encoder.v1 first: the first handler asked for a method);
# reflection adds itself beside them.
SERVICES = (ENCODER_SERVICE, KSERVE_SERVICE, HEALTH_SERVICE, *TEI_SERVICES)


def _methods(service: str) -> list[str]:
    # grpc.reflection.v1 is v1alpha under another name, and not in protobuf's default pool (rpc/reflection.py)
    found = descriptor_pool.Default().FindServiceByName(reflection.V1ALPHA if service == reflection.V1 else service)
    return [f"/{service}/{method.name}" for method in found.methods]


METHODS = tuple(method for service in (*SERVICES, *reflection.SERVICES) for method in _methods(service))
